"""A batch job's tokens/s beside another tenant's streams at the interactive limit (issue 34), one engine,
one run, ratios against batch alone measured in the same run.

The default model (SmolLM2-135M, ``--dtype``, ``--threads``) in one ``Engine``, driven step by step in
this process (no queue, no HTTP: the scheduler's shares are what is measured). Phases of
``--duration`` seconds each, each after ``--warmup`` seconds:

1. **batch alone**: ``--batch`` requests of tenant ``batch`` (16-token prompts, ``--batch-tokens``
   output tokens, greedy, EOS ignored), kept that many (a finished one is replaced); its output
   tokens/s is the baseline.
2. **beside streams, floor = the default** (``Settings.interactive_batch_floor``): the same batch
   load, and tenant ``live``'s streams at a worker's interactive limit: ``interactive_prefetch`` (8)
   interactive requests of n=8 each, kept that many.
3. **beside streams, floor 0** (the behaviour before the floor): the same.
4. **batch alone** again: the baseline is the mean of 1 and 4 (the machine is shared: it drifts).

Printed: the CPU, each phase's batch tokens/s and stream tokens/s, the batch ratio to batch alone
(issue 34's goal: at least the floor) and batch's share of the phase's output tokens (what the floor
sets, and what a shared machine's drift between phases does not move). The floor is a share of a
step's tokens: the ratio to batch alone also carries how much a step of the streams and the floor
costs beside a step of batch work alone.

    python benchmarks/interactive_floor.py --duration 20
    python benchmarks/interactive_floor.py --step-seconds 0.05   # the bound under the streams' 64 decodes
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks.machine import machine_line
from worker.config import Settings, default_model_path
from worker.engine.engine import Engine
from worker.engine.request import Request, SamplingParams


class Load:
    """Requests of one tenant kept ``count`` in the engine; their output tokens counted."""

    def __init__(self, engine: Engine, tenant: str, count: int, params: SamplingParams, interactive: bool):
        self.engine, self.tenant, self.count, self.params, self.interactive = engine, tenant, count, params, interactive
        self.ids = itertools.count()
        self.live: dict[str, Request] = {}
        self.done_tokens = 0

    def top_up(self) -> None:
        for rid, r in list(self.live.items()):
            if rid not in self.engine.requests:  # finished
                self.done_tokens += sum(s.num_output_tokens for s in r.sequences)
                del self.live[rid]
        while len(self.live) < self.count:
            i = next(self.ids)
            r = Request(f"{self.tenant}-{i}", [100 + (i * 7 + j) % 5000 for j in range(16)], self.params,
                        tenant=self.tenant)
            r.interactive = self.interactive
            self.engine.add_request(r)
            self.live[r.request_id] = r

    def tokens(self) -> int:
        return self.done_tokens + sum(s.num_output_tokens for r in self.live.values() for s in r.sequences)

    def stop(self) -> None:
        for rid in list(self.live):
            self.engine.abort(rid)
        self.live.clear()


def phase(engine: Engine, streams: bool, warmup: float, duration: float, args) -> tuple[float, float, int, int]:
    """Batch and stream output tokens/s, preemptions over the phase, and the step bound at its end."""
    batch = Load(engine, "batch", args.batch, SamplingParams(max_tokens=args.batch_tokens, temperature=0,
                                                             ignore_eos=True), False)
    live = Load(engine, "live", Settings().interactive_prefetch if streams else 0,
                SamplingParams(max_tokens=args.stream_tokens, temperature=0, ignore_eos=True, n=8), True)
    end_warmup = time.perf_counter() + warmup
    marks = None
    while True:
        batch.top_up()
        live.top_up()
        engine.step()
        now = time.perf_counter()
        if marks is None and now >= end_warmup:
            marks = (now, batch.tokens(), live.tokens(), engine.scheduler.num_preemptions)
        elif marks is not None and now >= marks[0] + duration:
            t = now - marks[0]
            rates = ((batch.tokens() - marks[1]) / t, (live.tokens() - marks[2]) / t,
                     engine.scheduler.num_preemptions - marks[3], engine.scheduler.interactive_step_tokens)
            break
    batch.stop()
    live.stop()
    while engine.has_unfinished():
        engine.step()
    return rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=8.0)
    p.add_argument("--batch", type=int, default=64, help="batch requests kept in the engine")
    p.add_argument("--batch-tokens", type=int, default=256)
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--step-seconds", type=float, default=Settings().interactive_step_seconds,
                   help="interactive_step_seconds: below the default, the step bound falls under the streams' "
                   "64 decodes on a fast machine, as it does at the default for a larger model")
    p.add_argument("--kv-memory", default="2GiB", help="room for every sequence: no preemption, the shares alone")
    p.add_argument("--simulated-device", default="", help="e.g. h200:llama-3-8b: steps of a GPU's pace by a "
                   "roofline (worker/engine/simulated_device.py), free of this machine's drift between phases")
    args = p.parse_args()
    settings = Settings(model=default_model_path(), threads=args.threads, dtype=args.dtype, kv_memory=args.kv_memory,
                        interactive_step_seconds=args.step_seconds, simulated_device=args.simulated_device)
    engine = Engine(settings)
    floor = settings.interactive_batch_floor
    print(f"{'simulated ' + args.simulated_device + '; ' if args.simulated_device else ''}"
          f"CPU: {machine_line()}, {args.dtype}; batch: {args.batch} requests "
          f"of 16 + {args.batch_tokens} tokens; streams: {Settings().interactive_prefetch} requests of n=8; "
          f"{args.duration:.0f} s a phase after {args.warmup:.0f} s; interactive_step_seconds {args.step_seconds}")
    first, *_ = phase(engine, False, args.warmup, args.duration, args)
    print(f"batch alone:                 batch {first:7.1f} tok/s")
    results = []
    for f in (floor, 0.0):
        engine.scheduler.batch_floor = f
        results.append((f, *phase(engine, True, args.warmup, args.duration, args)))
    engine.scheduler.batch_floor = floor
    last, *_ = phase(engine, False, args.warmup, args.duration, args)
    alone = (first + last) / 2
    print(f"batch alone again:           batch {last:7.1f} tok/s; the baseline: their mean, {alone:.1f} tok/s")
    for f, b, s, preempted, bound in results:
        print(f"beside streams, floor {f:.2f}:  batch {b:7.1f} tok/s, streams {s:7.1f} tok/s; "
              f"batch / batch alone = {b / alone:.3f}, batch / all tokens of the phase = {b / (b + s):.3f} "
              f"(the floor: {f:.2f}); step bound {bound} tokens, {preempted} preemptions")


if __name__ == "__main__":
    main()
