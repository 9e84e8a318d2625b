"""Benchmark the Triton paged decode-attention kernel against PyTorch SDPA on gathered K/V (CUDA only).

Steps:
1. Correctness: the Triton kernels against ``kernels.reference`` on one mixed-length bfloat16 shape.
2. The device's copy bandwidth: a large ``copy_``, counting the bytes read and written.
3. For each batch size x context (skipping those whose KV exceeds ``--max-kv-gb``): the Triton decode
   kernel (default split heuristic, and one split when the heuristic splits) and
   ``scaled_dot_product_attention`` on K/V gathered from the paged cache, the gather included.
   Bandwidth is the bytes of K and V the step must read over its time, also as a share of the copy
   bandwidth. All sequences of a batch have the same context; block ids are shuffled.

Prints a table and writes JSON to ``--out`` (rewritten after every measurement, so a run cut short
keeps what it measured). Needs only torch and triton; exits with status 1 if correctness fails.

    python benchmarks/kernels_bench.py [--out benchmarks/results/kernels.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, without installing berth
from kernels import reference, triton_attention  # noqa: E402

BATCH_SIZES = (1, 8, 32, 64, 128, 256)
CONTEXTS = (128, 512, 2048, 4096, 8192, 16384, 32768)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
SCALE = HEAD_DIM ** -0.5
DEVICE = "cuda"
CORRECTNESS_TOLERANCE = {"atol": 2e-2, "rtol": 2e-2}
"""bfloat16 values near 2 are 1.6e-2 apart, and Triton and the reference each round their outputs to them."""
TIME_BUDGET_S = 180.0
"""Stop starting new measurements after this long, so the whole run stays under ~4 minutes."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kernels.json"),
                        help="JSON results path (default: %(default)s); its folder is created")
    parser.add_argument("--max-kv-gb", type=float, default=60.0,
                        help="skip batch x context combinations whose K+V cache exceeds this (default: %(default)s)")
    return parser.parse_args()


def kv_bytes(batch: int, context: int) -> int:
    """Bytes of K and V that one decode step over ``batch`` sequences of ``context`` tokens reads."""
    return 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize


def time_cuda_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median time of ``fn`` in milliseconds, measured with CUDA events after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbps(num_bytes: int = 4 << 30) -> float:
    """Device-to-device ``copy_`` bandwidth in GB/s, bytes read plus bytes written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = time_cuda_ms(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / ms / 1e6


def shuffled_tables(batch: int, blocks_per_seq: int, pool_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, blocks_per_seq]`` int32 of distinct block ids drawn at random from the pool."""
    ids = torch.randperm(pool_blocks, device=DEVICE, generator=gen)[:batch * blocks_per_seq]
    return ids.view(batch, blocks_per_seq).to(torch.int32)


def check_correctness() -> dict:
    """Each Triton function against the reference on one mixed-length shape: decode (default, one and
    eight splits), chunked prefill of each sequence's last <= 200 tokens (some whole prompts, some at
    an offset) and write_kv. Returns each check's max abs error and whether all are within tolerance."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    lens = [1, 17, 300, 1000, 2049, 3000]
    blocks_per_seq = -(-max(lens) // BLOCK_SIZE)
    pool = len(lens) * blocks_per_seq
    shape = (pool, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE, generator=gen)
    v_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE, generator=gen)
    tables = shuffled_tables(len(lens), blocks_per_seq, pool, gen)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    pairs = {}  # check -> (Triton output, reference output)

    q = torch.randn(len(lens), NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
    decode_args = (q, k_cache, v_cache, tables, context_lens, SCALE)
    expected = reference.paged_decode_attention(*decode_args)
    for splits in (None, 1, 8):
        pairs[f"decode_splits_{splits or 'default'}"] = (
            triton_attention.paged_decode_attention(*decode_args, num_splits=splits), expected)

    chunks = [min(n, 200) for n in lens]
    query_start_loc = torch.tensor([0, *itertools.accumulate(chunks)], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(chunks), NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
    prefill_args = (q, k_cache, v_cache, tables, query_start_loc, context_lens, SCALE)
    pairs["prefill"] = (triton_attention.paged_prefill_attention(*prefill_args),
                        reference.paged_prefill_attention(*prefill_args))

    key = torch.randn(64, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
    slots = torch.randperm(pool * BLOCK_SIZE, device=DEVICE, generator=gen)[:64]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, -key, expected_k, expected_v, slots)
    triton_attention.write_kv(key, -key, k_cache, v_cache, slots)
    pairs["write_kv"] = (torch.stack([k_cache, v_cache]), torch.stack([expected_k, expected_v]))

    errors = {name: (actual.float() - expected.float()).abs().max().item()
              for name, (actual, expected) in pairs.items()}
    ok = all(torch.allclose(actual.float(), expected.float(), **CORRECTNESS_TOLERANCE)
             for actual, expected in pairs.values())
    return {"max_abs_error": errors, "tolerance": CORRECTNESS_TOLERANCE, "ok": ok}


def measure(batch: int, context: int, k_pool: torch.Tensor, v_pool: torch.Tensor, gen: torch.Generator) -> dict:
    """Times (ms, median) of the Triton kernel and of gather + SDPA for one decode step of ``batch`` x
    ``context``; a variant that fails (e.g. out of memory) gets ``<variant>_ms: None`` and ``<variant>_error``."""
    blocks_per_seq = context // BLOCK_SIZE
    tables = shuffled_tables(batch, blocks_per_seq, k_pool.shape[0], gen)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
    splits = triton_attention.default_num_splits(batch * NUM_KV_HEADS, context, q.device)
    row = {"batch": batch, "context": context, "kv_bytes": kv_bytes(batch, context), "splits": splits}

    def run_triton(num_splits):
        return lambda: triton_attention.paged_decode_attention(q, k_pool, v_pool, tables, context_lens, SCALE,
                                                               num_splits=num_splits)

    def run_sdpa():
        k = k_pool[tables].view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = v_pool[tables].view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=SCALE, enable_gqa=True)

    variants = {"triton": run_triton(splits), "sdpa_gather": run_sdpa}
    if splits > 1:
        variants["triton_one_split"] = run_triton(1)
    for name, fn in variants.items():
        try:
            row[f"{name}_ms"] = do_bench(fn, return_mode="median")
        except Exception as exc:  # out of memory, an SDPA without enable_gqa...: the one-shot run goes on
            row[f"{name}_ms"] = None
            row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:200]
        torch.cuda.empty_cache()
    return row


def add_bandwidth(row: dict, copy_gbps: float) -> None:
    """Add ``<variant>_gbps`` and ``<variant>_copy_share`` for every timed variant of ``row``."""
    for key in [k for k in row if k.endswith("_ms")]:
        name = key[:-3]
        ms = row[key]
        row[f"{name}_gbps"] = None if ms is None else row["kv_bytes"] / ms / 1e6
        row[f"{name}_copy_share"] = None if ms is None else row[f"{name}_gbps"] / copy_gbps


def format_row(row: dict) -> str:
    def cell(name):
        ms = row.get(f"{name}_ms")
        if ms is None:
            return f"{row.get(f'{name}_error', '-')[:27]:>27}"
        return f"{ms:9.3f} {row[f'{name}_gbps']:8.0f} {100 * row[f'{name}_copy_share']:7.1f}%"
    return (f"{row['batch']:5d} {row['context']:6d} {row['kv_bytes'] / 1e9:7.2f} {row['splits']:6d} | "
            f"{cell('triton')} | {cell('triton_one_split')} | {cell('sdpa_gather')}")


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernels_bench.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    started = time.monotonic()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "python": platform.python_version(),
               "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                         "block_size": BLOCK_SIZE, "dtype": str(DTYPE)},
               "bandwidth_note": "kernel GB/s = bytes of K and V read / time; copy GB/s = bytes read + written / time",
               "rows": [], "skipped": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        args.out.write_text(json.dumps(results, indent=2))

    try:
        results["correctness"] = check_correctness()
    except Exception as exc:  # e.g. a kernel that does not compile: still measure the copy and SDPA
        results["correctness"] = {"ok": False, "max_abs_error": None, "error": f"{type(exc).__name__}: {exc}"}
    print(f"correctness vs kernels.reference: {results['correctness']}")
    if not results["correctness"]["ok"]:
        print("!!! CORRECTNESS CHECK FAILED: the timings below are of a wrong kernel !!!")
    results["copy_gbps"] = copy_bandwidth_gbps()
    print(f"copy bandwidth: {results['copy_gbps']:.0f} GB/s (read + write)")
    save()

    combos = [(b, c) for b in BATCH_SIZES for c in CONTEXTS]
    runnable = [(b, c) for b, c in combos if kv_bytes(b, c) <= args.max_kv_gb * 1e9]
    results["skipped"] = [{"batch": b, "context": c, "reason": f"KV over {args.max_kv_gb} GB"}
                          for b, c in combos if (b, c) not in runnable]
    pool_blocks = max(b * c for b, c in runnable) // BLOCK_SIZE
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    pool_shape = (pool_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_pool = torch.randn(pool_shape, device=DEVICE, dtype=DTYPE, generator=gen)
    v_pool = torch.randn(pool_shape, device=DEVICE, dtype=DTYPE, generator=gen)

    print(f"{'batch':>5} {'ctx':>6} {'KV GB':>7} {'splits':>6} | {'triton: ms, GB/s, %copy':>27} | "
          f"{'triton, 1 split':>27} | {'gather + SDPA':>27}")
    for batch, context in runnable:
        if time.monotonic() - started > TIME_BUDGET_S:
            results["skipped"].append({"batch": batch, "context": context, "reason": "time budget"})
            continue
        row = measure(batch, context, k_pool, v_pool, gen)
        add_bandwidth(row, results["copy_gbps"])
        results["rows"].append(row)
        print(format_row(row), flush=True)
        save()
    results["elapsed_s"] = time.monotonic() - started
    save()
    print(f"wrote {args.out} in {results['elapsed_s']:.0f} s")
    return 0 if results["correctness"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
