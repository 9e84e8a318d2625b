"""The CPU decode-attention kernel (``kernels/cpu_decode.c``) without a window, against a baseline
checkout's kernel in the same run, and with a sliding window against without one.

A change to the kernel must not slow the default model's path (no window): ``--baseline DIR`` loads
``DIR/kernels/cpu_attention.py`` (which builds ``DIR/kernels/cpu_decode.c``) beside this tree's and
times the two in alternation on the same inputs, so a machine busy with other jobs slows both
alike. It also times this tree's kernel with a window over the same contexts: its cost should follow
the window, not the context. Shapes are the default model's (9 query heads, 3 kv heads, head_dim 64,
blocks of 16), with block ids shuffled over a cache larger than the CPU's caches.

On a CPU with AVX-512 it also times the AVX2 + FMA path (``load(folder, isa="avx2")``, what AMD Zen
2/3 and older Xeons run) on the same inputs, and prints each path's rate in GB/s of cache read, so
the two can be compared per byte on one machine (an int8 cache's bytes are its values and scales, 68 a
row against float32's 256); with a baseline that has the path, the baseline's
AVX2 path too (``base avx2`` ms, ``avx2/base``).

    git archive main kernels | tar -x -C /tmp/berth-baseline
    python benchmarks/cpu_decode_bench.py --baseline /tmp/berth-baseline

``--prefill`` times the C prefill (``paged_prefill_attention``) against the reference's (PyTorch's
``scaled_dot_product_attention`` a sequence) instead, in alternation on the same inputs: whole prompts
of ``PROMPT`` tokens (the default model's ~136), as many as one step's default token budget (2048)
holds and more, each sequence's blocks shuffled over the cache; float32 and bfloat16, and float32
queries over an int8 cache. GFLOP/s count the causal product's multiply-adds (queries times the keys
each sees, twice: scores and values); on an AVX-512 CPU the AVX2 path too.

    python benchmarks/cpu_decode_bench.py --prefill
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, without installing berth
from benchmarks.machine import machine_line
from kernels import cpu_attention, kv_quant
from worker.config import cache_dir

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
INT8 = "int8"  # float32 queries over an int8 KV cache (kernels/kv_quant.py: 64 values and a float32 scale a row)
CASES = [(torch.float32, 192, 512), (torch.float32, 64, 2048), (torch.bfloat16, 192, 512),
         (torch.bfloat16, 64, 2048), (INT8, 192, 512), (INT8, 64, 2048)]  # dtype, sequences, context
WINDOW = 256
PROMPT = 136
PREFILL_CASES = [(dtype, seqs) for dtype in (torch.float32, torch.bfloat16, INT8) for seqs in (15, 64, 256)]


def load_baseline_module(folder: Path):
    path = folder / "kernels" / "cpu_attention.py"
    spec = importlib.util.spec_from_file_location("baseline_cpu_attention", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there while the class is made
    spec.loader.exec_module(module)
    if decode_of(module) is None:
        raise SystemExit(f"the baseline kernel in {path.parent} did not build")
    return module


def decode_of(module):
    """The module's decode function, built into the worker's kernel folder: ``load(folder)`` since
    the kernels take their folder from the worker, ``available()`` and a module function before."""
    if hasattr(module, "load"):
        kernel = module.load(cache_dir("kernels"))
        return kernel.paged_decode_attention if kernel is not None else None
    return module.paged_decode_attention if module.available() else None


def inputs(dtype: torch.dtype | str, seqs: int, context: int, gen: torch.Generator) -> tuple:
    """The kernel's arguments; ``INT8``: float32 queries, the caches quantized as the engine writes them."""
    blocks = -(-context // BLOCK_SIZE)
    pool = seqs * blocks + 1
    k = torch.randn(pool, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(pool, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    k, v = (kv_quant.quantize(k), kv_quant.quantize(v)) if dtype == INT8 else (k.to(dtype), v.to(dtype))
    tables = torch.randperm(pool, generator=gen)[:seqs * blocks].view(seqs, blocks).to(torch.int32)
    q = torch.randn(seqs, HEADS, HEAD_DIM, generator=gen).to(torch.float32 if dtype == INT8 else dtype)
    return q, k, v, tables, torch.full((seqs,), context, dtype=torch.int32), HEAD_DIM ** -0.5


def prefill_inputs(dtype: torch.dtype | str, seqs: int, prompt: int, gen: torch.Generator) -> tuple:
    """``paged_prefill_attention``'s arguments for ``seqs`` whole prompts of ``prompt`` tokens."""
    q, k, v, tables, lens, scale = inputs(dtype, seqs, prompt, gen)
    q = torch.randn(seqs * prompt, HEADS, HEAD_DIM, generator=gen).to(q.dtype)
    starts = torch.arange(seqs + 1, dtype=torch.int32) * prompt
    return q, k, v, tables, starts, lens, scale


def prefill(args) -> int:
    from kernels import reference

    native = cpu_attention.load(cache_dir("kernels"))
    if native is None:
        raise SystemExit("no C compiler built kernels/cpu_decode.c")
    avx2 = cpu_attention.load(cache_dir("kernels"), isa="avx2") if native.isa == "avx512" else None
    print(f"CPU: {machine_line()}, this tree's path: {native.isa}; prompts of "
          f"{PROMPT} tokens, {HEADS} heads, {KV_HEADS} kv heads, head_dim {HEAD_DIM}, blocks of {BLOCK_SIZE}")
    print(f"{'dtype':9} {'seqs':>4} {'ref ms':>8} {'GFLOP/s':>7} {'C ms':>8} {'GFLOP/s':>7} {'ref/C':>6}"
          + (f" {'avx2 ms':>8} {'GFLOP/s':>7} {'ref/avx2':>8}" if avx2 else ""))
    gen = torch.Generator().manual_seed(0)
    for dtype, seqs in [c for c in PREFILL_CASES if str(c[0]).removeprefix("torch.") in args.dtypes.split(",")]:
        case = prefill_inputs(dtype, seqs, PROMPT, gen)
        tol = 1.6e-2 if dtype == torch.bfloat16 else 1e-5  # bfloat16: one rounding of the output
        torch.testing.assert_close(native.paged_prefill_attention(*case), reference.paged_prefill_attention(*case),
                                   atol=tol, rtol=tol)
        ref, ours, narrow = [], [], []
        reps = max(2, args.reps * 15 // seqs)
        for _ in range(args.rounds):
            ref.append(time_ms(lambda: reference.paged_prefill_attention(*case), reps))
            ours.append(time_ms(lambda: native.paged_prefill_attention(*case), reps))
            if avx2:
                narrow.append(time_ms(lambda: avx2.paged_prefill_attention(*case), reps))
        gflop = 2 * 2 * HEAD_DIM * HEADS * seqs * PROMPT * (PROMPT + 1) / 2 / 1e9
        r, t = statistics.median(ref), statistics.median(ours)
        line = f"{str(dtype).removeprefix('torch.'):9} {seqs:4d} {r:8.2f} {gflop / r * 1e3:7.1f} {t:8.2f} " \
               f"{gflop / t * 1e3:7.1f} {r / t:6.2f}"
        if narrow:
            a = statistics.median(narrow)
            line += f" {a:8.2f} {gflop / a * 1e3:7.1f} {r / a:8.2f}"
        print(line)
    return 0


def time_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="a checkout (or `git archive` of kernels/) to compare with")
    parser.add_argument("--rounds", type=int, default=5, help="alternations of baseline and this tree per case")
    parser.add_argument("--reps", type=int, default=20, help="calls timed per round (the median is kept)")
    parser.add_argument("--dtypes", default="float32,bfloat16,int8", help="the cases' KV dtypes, comma-separated")
    parser.add_argument("--prefill", action="store_true", help="time the C prefill against the reference instead")
    args = parser.parse_args()
    if args.prefill:
        return prefill(args)
    decode = decode_of(cpu_attention)
    if decode is None:
        raise SystemExit("no C compiler built kernels/cpu_decode.c")
    base_module = load_baseline_module(args.baseline) if args.baseline else None
    baseline = decode_of(base_module) if base_module else None
    windowed = "window" in inspect.signature(decode).parameters
    native = cpu_attention.load(cache_dir("kernels"))
    avx2 = cpu_attention.load(cache_dir("kernels"), isa="avx2") if native.isa == "avx512" else None
    # the baseline's AVX2 path too, where it has one to force (kernels from before load(isa=) have not)
    base_avx2 = None
    if avx2 and base_module and "isa" in inspect.signature(getattr(base_module, "load", lambda: None)).parameters:
        built = base_module.load(cache_dir("kernels"), isa="avx2")
        base_avx2 = built.paged_decode_attention if built else None
    print(f"CPU: {machine_line()}, this tree's path: {native.isa}")
    print(f"{'dtype':9} {'seqs':>4} {'ctx':>5} {'this ms':>8} {'GB/s':>6} {'base ms':>8} {'this/base':>9} "
          f"{'win ' + str(WINDOW) + ' ms':>11} {'win/full':>8}" + (f" {'avx2 ms':>8} {'GB/s':>6} {'avx2/this':>9}"
                                                                     if avx2 else "")
          + (f" {'base avx2':>9} {'avx2/base':>9}" if base_avx2 else ""))
    gen = torch.Generator().manual_seed(0)
    for dtype, seqs, context in [c for c in CASES if str(c[0]).removeprefix("torch.") in args.dtypes.split(",")]:
        case = inputs(dtype, seqs, context, gen)
        ours, base, window, narrow, base_narrow = [], [], [], [], []
        for _ in range(args.rounds):
            ours.append(time_ms(lambda: decode(*case), args.reps))
            if avx2:
                narrow.append(time_ms(lambda: avx2.paged_decode_attention(*case), args.reps))
            if baseline:
                base.append(time_ms(lambda: baseline(*case), args.reps))
            if base_avx2:
                base_narrow.append(time_ms(lambda: base_avx2(*case), args.reps))
            if windowed:
                window.append(time_ms(lambda: decode(*case, window=WINDOW), args.reps))
        if baseline:
            # the dtype's default tolerances: a baseline from before a CPU's vector path (the plain C
            # loops an AVX2 CPU ran before the AVX2 path) sums in another order, equal only to rounding
            torch.testing.assert_close(decode(*case), baseline(*case))
        t = statistics.median(ours)
        b = f"{statistics.median(base):8.3f} {t / statistics.median(base):9.3f}" if base else f"{'-':>8} {'-':>9}"
        w = f"{statistics.median(window):11.3f} {statistics.median(window) / t:8.3f}" if window else ""
        # keys and values (with int8, their scales too), once each
        gigabytes = 2 * seqs * context * KV_HEADS * case[1].shape[-1] * case[1].element_size() / 1e9
        n = ""
        if narrow:
            a = statistics.median(narrow)
            n = f" {a:8.3f} {gigabytes / a * 1e3:6.1f} {a / t:9.3f}"
            if base_narrow:
                n += f" {statistics.median(base_narrow):9.3f} {a / statistics.median(base_narrow):9.3f}"
        print(f"{str(dtype).removeprefix('torch.'):9} {seqs:4d} {context:5d} {t:8.3f} "
              f"{gigabytes / t * 1e3:6.1f} {b} {w}{n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
