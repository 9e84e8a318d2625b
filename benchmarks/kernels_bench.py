"""Benchmark the Triton paged decode-attention kernel on plain and quantized KV caches (CUDA only).

KV caches measured (``--kv``): float16 and bfloat16 (the model's dtype), int8 and fp8_e4m3 rows of
``kernels.kv_quant`` (queries in float16; fp8 only where the GPU has compute capability 8.9+).

Steps, all printed to stdout:
1. Correctness, per KV cache: the Triton kernels against ``kernels.reference`` on one mixed-length
   shape (decode with the default, one and eight splits; chunked prefill of each sequence's last
   <= 200 tokens) and ``write_kv``. A plain cache's ``write_kv`` is compared with the reference on the
   GPU; a quantized one's bytes with the reference run on the CPU, which must be equal (on the GPU,
   PyTorch divides by the constant 127 or 448 through its reciprocal, so a scale may differ in its
   last bit).
2. The device's copy bandwidth: ``torch.empty_like(x).copy_(x)`` of 4 GiB, counting bytes read and
   written.
3. Per KV cache, for each batch size x context (skipping those whose KV exceeds ``--max-kv-gb``): the
   Triton decode kernel (default split heuristic, and one split when the heuristic splits) and, for
   plain caches, ``scaled_dot_product_attention`` on K/V gathered from the paged cache, the gather
   included. Bandwidth is the bytes of K and V the step must read (a quantized row: head_dim values
   and a 4-byte scale) over its time, also as a share of the copy bandwidth. All sequences of a batch
   have the same context; block ids are shuffled.
4. A summary of the long-context, large-batch rows (context >= 4096, batch >= 32): each KV cache's
   time, GB/s and share of the copy bandwidth, and its speed-up over the float16 cache.

Writes JSON to ``--out`` as well (rewritten after every measurement, so a run cut short keeps what it
measured). Stops starting measurements after ``TIME_BUDGET_S``: the whole run takes under ~4 minutes.
Needs only torch and triton; exits with status 1 if a correctness check fails.

    python benchmarks/kernels_bench.py [--out benchmarks/results/kernels.json]

``--smoke`` runs every step on the CPU under the Triton interpreter at tiny sizes (a check of the
script, not a measurement; about a minute).
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # triton.jit reads it when a kernel is defined: before the kernels' import
    os.environ["TRITON_INTERPRET"] = "1"

import argparse
import itertools
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, without installing berth
from kernels import kv_quant, reference, triton_attention


@dataclass(frozen=True)
class Setup:
    device: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    batch_sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    correctness_lens: tuple[int, ...]
    copy_bytes: int


GPU = Setup("cuda", num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, batch_sizes=(1, 32, 128, 256),
            contexts=(1024, 4096, 16384), correctness_lens=(1, 17, 300, 1000, 2049, 3000), copy_bytes=4 << 30)
SMOKE = Setup("cpu", num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, batch_sizes=(1, 2),
              contexts=(32, 64), correctness_lens=(1, 17, 40), copy_bytes=1 << 20)
KV_CACHES = {  # name -> (query dtype, cache: a dtype or a kv_quant format); measured in this order
    "float16": (torch.float16, torch.float16),
    "int8": (torch.float16, "int8"),
    "fp8_e4m3": (torch.float16, "fp8_e4m3"),
    "bfloat16": (torch.bfloat16, torch.bfloat16),
}
CORRECTNESS_TOLERANCE = {"atol": 2e-2, "rtol": 2e-2}
"""bfloat16 values near 2 are 1.6e-2 apart, and Triton and the reference each round their outputs to them."""
TIME_BUDGET_S = 180.0
"""Stop starting new measurements after this long, so the whole run stays under ~4 minutes."""
LONG = {"context": 4096, "batch": 32}
"""The summary's rows: contexts and batches at least this large."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kernels.json"),
                        help="JSON results path (default: %(default)s); its folder is created")
    parser.add_argument("--max-kv-gb", type=float, default=40.0,
                        help="skip batch x context combinations whose K+V cache exceeds this (default: %(default)s)")
    parser.add_argument("--kv", default=",".join(KV_CACHES),
                        help="KV caches to measure, comma-separated (default: %(default)s)")
    parser.add_argument("--time-budget", type=float, default=TIME_BUDGET_S,
                        help="stop starting measurements after this many seconds (default: %(default)s)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on the CPU under the Triton interpreter: checks the script, measures nothing")
    return parser.parse_args()


# --------------------------------------------------------------------------------------------------
# caches
# --------------------------------------------------------------------------------------------------

def row_bytes(setup: Setup, kv: str) -> int:
    """Bytes of one (token, kv head) row of the cache ``kv``."""
    cache = KV_CACHES[kv][1]
    return kv_quant.row_bytes(setup.head_dim) if isinstance(cache, str) else setup.head_dim * cache.itemsize


def kv_bytes(setup: Setup, kv: str, batch: int, context: int) -> int:
    """Bytes of K and V that one decode step over ``batch`` sequences of ``context`` tokens reads."""
    return 2 * batch * context * setup.num_kv_heads * row_bytes(setup, kv)


def random_cache(setup: Setup, kv: str, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """``[num_blocks, block_size, num_kv_heads, row]`` of random rows (quantized in chunks: the float32
    copy of a whole pool would not fit beside it)."""
    q_dtype, cache = KV_CACHES[kv]
    shape = (setup.block_size, setup.num_kv_heads, setup.head_dim)
    if not isinstance(cache, str):
        return torch.randn((num_blocks, *shape), device=setup.device, dtype=cache, generator=gen)
    out = torch.empty((num_blocks, *shape[:2], kv_quant.row_bytes(setup.head_dim)),
                      dtype=kv_quant.FORMATS[cache].storage_dtype, device=setup.device)
    chunk = 4096
    for start in range(0, num_blocks, chunk):
        n = min(chunk, num_blocks - start)
        values = torch.randn((n, *shape), device=setup.device, dtype=q_dtype, generator=gen)
        out[start:start + n] = kv_quant.quantize(values, cache)
    return out


def fp8_supported(setup: Setup) -> bool:
    return setup.device != "cuda" or torch.cuda.get_device_capability() >= (8, 9)


# --------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------

def time_ms(setup: Setup, fn) -> float:
    """Median milliseconds of ``fn``: ``triton.testing.do_bench`` on CUDA; on the CPU (smoke) a wall clock."""
    if setup.device == "cuda":
        return do_bench(fn, return_mode="median")
    fn()
    times = []
    for _ in range(2):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_bandwidth_gbps(setup: Setup) -> float:
    """``torch.empty_like(x).copy_(x)`` bandwidth in GB/s, bytes read plus bytes written."""
    src = torch.empty(setup.copy_bytes, dtype=torch.uint8, device=setup.device)
    dst = torch.empty_like(src)
    ms = time_ms(setup, lambda: dst.copy_(src))
    src = dst = None  # freed before the cache is emptied
    if setup.device == "cuda":
        torch.cuda.empty_cache()
    return 2 * setup.copy_bytes / ms / 1e6


def shuffled_tables(setup: Setup, batch: int, blocks_per_seq: int, pool_blocks: int,
                    gen: torch.Generator) -> torch.Tensor:
    """``[batch, blocks_per_seq]`` int32 of distinct block ids drawn at random from the pool."""
    ids = torch.randperm(pool_blocks, device=setup.device, generator=gen)[:batch * blocks_per_seq]
    return ids.view(batch, blocks_per_seq).to(torch.int32)


# --------------------------------------------------------------------------------------------------
# correctness
# --------------------------------------------------------------------------------------------------

def check_correctness(setup: Setup, kv: str) -> dict:
    """Each Triton function against the reference on one mixed-length shape for the cache ``kv``:
    decode (default, one and eight splits), chunked prefill of each sequence's last <= 200 tokens
    (some whole prompts, some at an offset) and write_kv. Returns each check's max abs error (for a
    quantized write_kv, the count of bytes unlike the CPU reference's) and whether all pass."""
    q_dtype = KV_CACHES[kv][0]
    gen = torch.Generator(device=setup.device).manual_seed(0)
    lens = list(setup.correctness_lens)
    blocks_per_seq = -(-max(lens) // setup.block_size)
    pool = len(lens) * blocks_per_seq
    k_cache, v_cache = random_cache(setup, kv, pool, gen), random_cache(setup, kv, pool, gen)
    tables = shuffled_tables(setup, len(lens), blocks_per_seq, pool, gen)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=setup.device)
    pairs = {}  # check -> (Triton output, reference output)
    heads, dim = setup.num_heads, setup.head_dim
    scale = dim ** -0.5

    q = torch.randn(len(lens), heads, dim, device=setup.device, dtype=q_dtype, generator=gen)
    decode_args = (q, k_cache, v_cache, tables, context_lens, scale)
    expected = reference.paged_decode_attention(*decode_args)
    for splits in (None, 1, 8):
        pairs[f"decode_splits_{splits or 'default'}"] = (
            triton_attention.paged_decode_attention(*decode_args, num_splits=splits), expected)

    chunks = [min(n, 200) for n in lens]
    query_start_loc = torch.tensor([0, *itertools.accumulate(chunks)], dtype=torch.int32, device=setup.device)
    q = torch.randn(sum(chunks), heads, dim, device=setup.device, dtype=q_dtype, generator=gen)
    prefill_args = (q, k_cache, v_cache, tables, query_start_loc, context_lens, scale)
    pairs["prefill"] = (triton_attention.paged_prefill_attention(*prefill_args),
                        reference.paged_prefill_attention(*prefill_args))

    key = torch.randn(64, setup.num_kv_heads, dim, device=setup.device, dtype=q_dtype, generator=gen)
    slots = torch.randperm(pool * setup.block_size, device=setup.device, generator=gen)[:64]
    on = "cpu" if kv_quant.is_quantized(k_cache) else setup.device
    expected_k, expected_v = k_cache.to(on, copy=True), v_cache.to(on, copy=True)
    reference.write_kv(key.to(on), -key.to(on), expected_k, expected_v, slots.to(on))
    triton_attention.write_kv(key, -key, k_cache, v_cache, slots)

    errors = {name: (actual.float() - expected.float()).abs().max().item()
              for name, (actual, expected) in pairs.items()}
    ok = all(torch.allclose(actual.float(), expected.float(), **CORRECTNESS_TOLERANCE)
             for actual, expected in pairs.values())
    if kv_quant.is_quantized(k_cache):
        written = torch.stack([k_cache, v_cache]).cpu().view(torch.uint8)
        unequal = int((written != torch.stack([expected_k, expected_v]).view(torch.uint8)).sum())
        errors["write_kv_bytes_unlike_cpu_reference"] = unequal
        ok = ok and unequal == 0
    else:
        actual, expected = torch.stack([k_cache, v_cache]), torch.stack([expected_k, expected_v])
        errors["write_kv"] = (actual.float() - expected.float()).abs().max().item()
        ok = ok and torch.allclose(actual.float(), expected.float(), **CORRECTNESS_TOLERANCE)
    return {"max_abs_error": errors, "tolerance": CORRECTNESS_TOLERANCE, "ok": ok}


# --------------------------------------------------------------------------------------------------
# measurements
# --------------------------------------------------------------------------------------------------

def measure(setup: Setup, kv: str, batch: int, context: int, k_pool: torch.Tensor, v_pool: torch.Tensor,
            gen: torch.Generator) -> dict:
    """Times (ms, median) of the Triton kernel (and, on a plain cache, of gather + SDPA) for one decode
    step of ``batch`` x ``context``; a variant that fails (e.g. out of memory) gets ``<variant>_ms: None``
    and ``<variant>_error``."""
    q_dtype = KV_CACHES[kv][0]
    heads, kv_heads, dim = setup.num_heads, setup.num_kv_heads, setup.head_dim
    blocks_per_seq = context // setup.block_size
    tables = shuffled_tables(setup, batch, blocks_per_seq, k_pool.shape[0], gen)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=setup.device)
    q = torch.randn(batch, heads, dim, device=setup.device, dtype=q_dtype, generator=gen)
    splits = triton_attention.default_num_splits(batch * kv_heads, context, q.device)
    scale = dim ** -0.5
    row = {"kv": kv, "batch": batch, "context": context, "kv_bytes": kv_bytes(setup, kv, batch, context),
           "splits": splits}

    def run_triton(num_splits):
        return lambda: triton_attention.paged_decode_attention(q, k_pool, v_pool, tables, context_lens, scale,
                                                               num_splits=num_splits)

    def run_sdpa():
        k = k_pool[tables].view(batch, context, kv_heads, dim).transpose(1, 2)
        v = v_pool[tables].view(batch, context, kv_heads, dim).transpose(1, 2)
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)

    variants = {"triton": run_triton(splits)}
    if splits > 1:
        variants["triton_one_split"] = run_triton(1)
    if not kv_quant.is_quantized(k_pool):
        variants["sdpa_gather"] = run_sdpa
    for name, fn in variants.items():
        try:
            row[f"{name}_ms"] = time_ms(setup, fn)
        except Exception as exc:  # noqa: BLE001 (out of memory, an SDPA without enable_gqa...: the run goes on)
            row[f"{name}_ms"] = None
            row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:200]
        if setup.device == "cuda":
            torch.cuda.empty_cache()
    return row


def add_bandwidth(row: dict, copy_gbps: float) -> None:
    """Add ``<variant>_gbps`` and ``<variant>_copy_share`` for every timed variant of ``row``."""
    for key in [k for k in row if k.endswith("_ms")]:
        name = key[:-3]
        ms = row[key]
        row[f"{name}_gbps"] = None if ms is None else row["kv_bytes"] / ms / 1e6
        row[f"{name}_copy_share"] = None if ms is None else row[f"{name}_gbps"] / copy_gbps


def cell(row: dict, name: str) -> str:
    """``ms GB/s %copy`` of a variant, its error, or ``-`` where it was not run."""
    if f"{name}_ms" not in row:
        return f"{'-':>27}"
    ms = row[f"{name}_ms"]
    if ms is None:
        return f"{row.get(f'{name}_error', '-')[:27]:>27}"
    return f"{ms:9.3f} {row[f'{name}_gbps']:8.0f} {100 * row[f'{name}_copy_share']:7.1f}%"


HEADER = (f"{'kv':>8} {'batch':>5} {'ctx':>6} {'KV GB':>7} {'splits':>6} | {'triton: ms, GB/s, %copy':>27} | "
          f"{'triton, 1 split':>27} | {'gather + SDPA':>27}")


def format_row(row: dict) -> str:
    return (f"{row['kv']:>8} {row['batch']:5d} {row['context']:6d} {row['kv_bytes'] / 1e9:7.2f} {row['splits']:6d} | "
            f"{cell(row, 'triton')} | {cell(row, 'triton_one_split')} | {cell(row, 'sdpa_gather')}")


def summary(rows: list[dict], long: dict) -> list[str]:
    """Lines comparing the KV caches on the rows with context and batch at least ``long``'s: the Triton
    kernel's (default splits) ms, GB/s, share of the copy bandwidth, and speed-up over float16."""
    by_shape: dict[tuple[int, int], dict[str, dict]] = {}
    for row in rows:
        if row["context"] >= long["context"] and row["batch"] >= long["batch"] and row.get("triton_ms"):
            by_shape.setdefault((row["batch"], row["context"]), {})[row["kv"]] = row
    lines = [f"summary: Triton decode, context >= {long['context']}, batch >= {long['batch']} "
             "(ms, GB/s of K/V read, % of copy bandwidth, speed-up over the float16 cache)"]
    for (batch, context), by_kv in sorted(by_shape.items()):
        base = by_kv.get("float16")
        cells = []
        for kv, row in by_kv.items():
            speedup = f" x{base['triton_ms'] / row['triton_ms']:.2f}" if base else ""
            cells.append(f"{kv} {row['triton_ms']:.3f} ms {row['triton_gbps']:.0f} GB/s "
                         f"{100 * row['triton_copy_share']:.0f}%{speedup}")
        lines.append(f"  batch {batch:4d} ctx {context:6d}: " + " | ".join(cells))
    if len(lines) == 1:
        lines.append("  (no row measured)")
    return lines


def main() -> int:
    args = parse_args()
    setup = SMOKE if args.smoke else GPU
    long = {"context": min(setup.contexts[-1], LONG["context"]), "batch": min(setup.batch_sizes[-1], LONG["batch"])}
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("kernels_bench.py needs a CUDA GPU (torch.cuda.is_available() is False); --smoke checks it on the CPU")
    kvs = [kv for kv in args.kv.split(",") if kv]
    unknown = [kv for kv in kvs if kv not in KV_CACHES]
    if unknown:
        sys.exit(f"--kv: unknown {unknown}; known: {','.join(KV_CACHES)}")
    started = time.monotonic()
    results = {"device": torch.cuda.get_device_name() if setup.device == "cuda" else "cpu (smoke: interpreter)",
               "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
               "setup": asdict(setup), "bandwidth_note": "kernel GB/s = bytes of K and V read / time; "
               "copy GB/s = bytes read + written / time", "correctness": {}, "rows": [], "skipped": []}
    if "fp8_e4m3" in kvs and not fp8_supported(setup):
        kvs.remove("fp8_e4m3")
        results["skipped"].append({"kv": "fp8_e4m3", "reason": "compute capability below 8.9"})
        print("fp8_e4m3: skipped, this GPU's compute capability is below 8.9")
    print(f"{results['device']}, torch {results['torch']}, triton {results['triton']}; "
          f"{setup.num_heads} heads, {setup.num_kv_heads} kv heads, head_dim {setup.head_dim}, "
          f"block {setup.block_size}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        args.out.write_text(json.dumps(results, indent=2))

    for kv in kvs:
        try:
            check = check_correctness(setup, kv)
        except Exception as exc:  # noqa: BLE001 (e.g. a kernel that does not compile: still measure the rest)
            check = {"ok": False, "max_abs_error": None, "error": f"{type(exc).__name__}: {exc}"[:500]}
        results["correctness"][kv] = check
        print(f"correctness vs kernels.reference, {kv} cache: {'ok' if check['ok'] else 'FAILED'} {check}",
              flush=True)
    if not all(c["ok"] for c in results["correctness"].values()):
        print("!!! CORRECTNESS CHECK FAILED: the timings of that cache below are of a wrong kernel !!!")
    results["copy_gbps"] = copy_bandwidth_gbps(setup)
    print(f"copy bandwidth (torch.empty_like(x).copy_(x), {setup.copy_bytes >> 20} MiB): "
          f"{results['copy_gbps']:.0f} GB/s (read + write)", flush=True)
    save()

    print(HEADER)
    gen = torch.Generator(device=setup.device).manual_seed(0)
    for kv in kvs:
        combos = [(b, c) for b in setup.batch_sizes for c in setup.contexts]
        runnable = [(b, c) for b, c in combos if kv_bytes(setup, kv, b, c) <= args.max_kv_gb * 1e9]
        results["skipped"] += [{"kv": kv, "batch": b, "context": c, "reason": f"KV over {args.max_kv_gb} GB"}
                               for b, c in combos if (b, c) not in runnable]
        if not runnable:
            continue
        pool_blocks = max(b * c for b, c in runnable) // setup.block_size
        try:
            k_pool, v_pool = random_cache(setup, kv, pool_blocks, gen), random_cache(setup, kv, pool_blocks, gen)
        except Exception as exc:  # noqa: BLE001 (out of memory: the other caches still run)
            results["skipped"].append({"kv": kv, "reason": f"pool: {type(exc).__name__}: {exc}"[:300]})
            print(f"{kv}: no pool of {pool_blocks} blocks ({type(exc).__name__}); skipped", flush=True)
            continue
        for batch, context in runnable:
            if time.monotonic() - started > args.time_budget:
                results["skipped"].append({"kv": kv, "batch": batch, "context": context, "reason": "time budget"})
                continue
            row = measure(setup, kv, batch, context, k_pool, v_pool, gen)
            add_bandwidth(row, results["copy_gbps"])
            results["rows"].append(row)
            print(format_row(row), flush=True)
            save()
        del k_pool, v_pool
        if setup.device == "cuda":
            torch.cuda.empty_cache()
    for line in summary(results["rows"], long):
        print(line)
    budget = [s for s in results["skipped"] if s.get("reason") == "time budget"]
    if budget:
        print(f"{len(budget)} measurements skipped for the time budget of {args.time_budget:.0f} s")
    results["elapsed_s"] = time.monotonic() - started
    save()
    print(f"wrote {args.out} in {results['elapsed_s']:.0f} s")
    return 0 if all(c["ok"] for c in results["correctness"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
