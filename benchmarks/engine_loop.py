"""The engine loop at GPU speed: how much of the time a simulated H200 running an 8B-shaped model is busy,
and the host's microseconds per sequence per step, with the overlap (``async_scheduling``) on and off.

The device is ``worker/engine/simulated_device.py`` (a roofline of the named model on the named GPU, the
CPU free while it "runs"); the host's work is berth's own: scheduling, preparing the step's tensors,
finishing rows, detokenizing, stop checks. The workload is decode-heavy: ``--requests`` (256) requests of
``--prompt`` (128) distinct prompt tokens and ``--output`` (512) output tokens, greedy, ``ignore_eos``,
all admitted at once, so 256 sequences run together for nearly every step.

Figures, per mode, median of ``--rounds`` (2), the modes alternating:
- busy share: the device's busy seconds / the wall seconds of ``Engine.generate`` (goal: 0.9 or more);
- host us/seq/step: the process's CPU seconds (the simulated device sleeps, so this is the host's work
  alone) / steps / mean running sequences;
- output tokens/s, and the same against the device's own bound (its busy seconds).

    python benchmarks/engine_loop.py                 # the figures of issue 35's must-show 1
    python benchmarks/engine_loop.py --quick         # 64 requests of 64 tokens
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks.machine import machine_info, machine_line
from worker.config import Settings
from worker.engine.engine import Engine
from worker.engine.request import SamplingParams
from worker.model.loader import load_model


def run_once(loaded, device: str, overlap: str, args) -> dict:
    engine = Engine(loaded=loaded, simulated_device=device, async_scheduling=overlap, max_num_seqs=256,
                    max_num_batched_tokens=args.budget)
    prompts = [[1 + (i * 131 + j * 7) % 40000 for j in range(args.prompt)] for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    running = []
    step = engine.step

    def counted_step():
        running.append(engine.num_running)
        return step()

    engine.step = counted_step
    cpu0, t0 = time.process_time(), time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = sum(o.num_output_tokens for o in outputs)
    assert tokens == args.requests * args.output
    busy = engine.runner.timeline.busy_seconds
    seqs = statistics.fmean(running)
    return {"wall_s": wall, "busy_s": busy, "busy_share": busy / wall, "steps": engine.stats.steps,
            "mean_running": seqs, "host_us_per_seq_step": cpu / len(running) / seqs * 1e6,
            "host_ms_per_step": cpu / len(running) * 1e3, "tokens_per_s": tokens / wall,
            "device_bound_tokens_per_s": tokens / busy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="h200:llama-3-8b", help="the simulated device, GPU:SHAPE")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=512)
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.output, args.rounds = 64, 64, 1
    loaded = load_model(Settings().model_path(), __import__("torch").float32)  # its tokenizer and config
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            runs[mode].append(run_once(loaded, args.device, mode, args))
    machine = machine_info()  # the threads the engines ran on
    print(f"{args.device}, {args.requests} requests x {args.prompt} prompt + {args.output} output tokens, "
          f"budget {args.budget}; host: {machine_line(machine)}; median of {args.rounds}")
    summary = {}
    for mode, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        summary[mode] = med
        print(f"  overlap {mode:3}: busy share {med['busy_share']:.3f}, "
              f"host {med['host_us_per_seq_step']:.1f} us/seq/step "
              f"({med['host_ms_per_step']:.2f} ms/step at {med['mean_running']:.0f} running), "
              f"{med['tokens_per_s']:,.0f} tok/s of the device's {med['device_bound_tokens_per_s']:,.0f}, "
              f"{med['steps']:.0f} steps")
    print(f"  overlap on / off: tokens/s {summary['on']['tokens_per_s'] / summary['off']['tokens_per_s']:.3f}x")
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "machine": machine, "runs": runs,
                                         "median": summary}, indent=1))


if __name__ == "__main__":
    main()
