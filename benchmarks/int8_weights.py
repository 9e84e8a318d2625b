"""8-bit weights for the linear layers: which multiply is fastest on this CPU, per batch size.

For each of the default model's linear shapes (SmolLM2-135M: the fused q/k/v, o, the fused gate/up,
down, and the 49152-row tied LM head) and each batch size (rows of x), the time of one call of:

- ``fp32-onednn``: today's float32 path (``worker.model.linear``: oneDNN, the weight reordered once);
- ``fp32-mkl``: ``F.linear`` in float32 (MKL's sgemm), for reference;
- ``int8pack``: ``torch.ops.aten._weight_int8pack_mm(x, w_int8, scales)``, gpt-fast's weight-only
  int8 op (float activations, int8 weights dequantised inside the kernel, a float32 scale per output row);
- ``int8-c``: berth's weight-only int8 kernel (``kernels/int8_linear.c``: int8 weights widened in registers,
  float32 activations and sums), what ``--weight-dtype int8`` runs on a CPU with a C compiler;
- ``int8-dequant``: the int8 weight turned into float32 on every call, then oneDNN's ``F.linear``
  (the scale applied to the output): the plain "dequantise on the fly";
- ``fbgemm-dyn``: ``torch.ops.quantized.linear_dynamic`` (FBGEMM, the x86 engine): activations
  quantized to uint8 per call (7-bit range on CPUs without VNNI), int8 x int8 products in int32;
- ``onednn-qlinear``: ``torch.ops.onednn.qlinear_pointwise`` with the activations quantized to uint8 per
  call (per tensor) and the int8 weight prepacked once, float32 out.

All paths run interleaved in one process, each cell the best of ``--repeats`` timings, so a busy
machine slows them alike. The ratio is float32 oneDNN's time over the path's (above 1: faster). Each
shape has enough distinct weight matrices, called in turn, to fill ``--weight-mib`` of float32 (more
than the L3 cache), as a model's layers are: one matrix called again and again would sit in the cache
and hide what int8 saves, the bytes read from memory. A path more than ``SKIP_SLOWER`` times slower
than float32 (and slower than ``SKIP_FROM_MS``) at one batch size is not timed at the larger ones.

    python benchmarks/int8_weights.py                # the kernel table
    python benchmarks/int8_weights.py --engine       # also perplexity, greedy agreement and tokens/s
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks.machine import machine_info, machine_line
from benchmarks.throughput import save_report
from kernels.int8_linear import load as load_int8_kernel
from worker.config import cache_dir
from worker.model.linear import make_linear, quantize_per_channel

ROWS = (1, 4, 16, 64, 256, 1024)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
PATHS = ("fp32-onednn", "fp32-mkl", "int8-c", "int8pack", "int8-dequant", "fbgemm-dyn", "onednn-qlinear")
SKIP_SLOWER = 8
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # what PyTorch's int8 paths (fbgemm, oneDNN) multiply with
SKIP_FROM_MS = 20.0  # ... and more than this many ms: below it, a burst of load could be the difference


def _fbgemm(weight: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> Callable:
    qw = torch._make_per_channel_quantized_tensor(q, scales.double(), torch.zeros_like(scales, dtype=torch.int64), 0)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed, True)


def _onednn_qlinear(weight: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> Callable:
    packed = torch.ops.onednn.qlinear_prepack(q, None)
    zeros = torch.zeros(scales.shape, dtype=torch.int64)

    def run(x: torch.Tensor) -> torch.Tensor:
        lo, hi = torch.aminmax(x)
        lo, hi = min(lo.item(), 0.0), max(hi.item(), 0.0)
        scale = max(hi - lo, 1e-8) / 255
        zp = int(round(-lo / scale))
        qx = torch.clamp(torch.round(x / scale) + zp, 0, 255).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise(qx, scale, zp, packed, scales, zeros, None, 1.0, 0,
                                                  torch.float32, "none", [], "")
    return run


def candidates(weight: torch.Tensor) -> dict[str, Callable]:
    """Each path's function ``x -> x @ weight.T`` (approximately, for the int8 ones), prepared once."""
    q, scales = quantize_per_channel(weight)
    paths: dict[str, Callable] = {"fp32-onednn": make_linear(weight), "fp32-mkl": lambda x: F.linear(x, weight),
                                  "int8pack": lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scales),
                                  "int8-dequant": lambda x: F.linear(x, q.float()) * scales}
    kernel = load_int8_kernel(cache_dir("kernels"))
    if kernel is not None:
        paths["int8-c"] = lambda x: kernel.linear(x, q, scales)
    for name, build in (("fbgemm-dyn", _fbgemm), ("onednn-qlinear", _onednn_qlinear)):
        try:
            fn = build(weight, q, scales)
            fn(torch.randn(2, weight.shape[1]))
            paths[name] = fn
        except (RuntimeError, AttributeError) as exc:  # not in this build, or not on this CPU
            print(f"  {name}: unavailable ({str(exc).splitlines()[0][:120]})")
    return paths


def cell_ms(paths: dict[str, list[Callable]], x: torch.Tensor, budget_s: float, repeats: int) -> dict[str, float]:
    """ms per call of each path: the best of ``repeats`` windows of about ``budget_s / repeats`` seconds each,
    the paths' windows interleaved (a burst of load hits one window of one path, not a path's every window).
    Each window calls the path's matrices in turn."""
    iters = {}
    for name, fns in paths.items():
        for fn in fns:
            fn(x)
        t0 = time.perf_counter()
        fns[0](x)
        iters[name] = max(1, int(budget_s / repeats / max(time.perf_counter() - t0, 1e-6)))
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(repeats):
        for name, fns in paths.items():
            t0 = time.perf_counter()
            for i in range(iters[name]):
                fns[i % len(fns)](x)
            best[name] = min(best[name], (time.perf_counter() - t0) / iters[name])
    return {name: ms * 1e3 for name, ms in best.items()}


def kernel_table(shapes: dict, rows: tuple[int, ...], budget_s: float, repeats: int, max_lm_rows: int,
                 weight_mib: int) -> dict:
    table: dict = {}
    g = torch.Generator().manual_seed(0)
    for shape_name, (n, k) in shapes.items():
        copies = max(1, -(-(weight_mib << 20) // (4 * n * k)))
        built = [candidates(torch.randn(n, k, generator=g) * 0.05) for _ in range(copies)]
        paths = {name: [c[name] for c in built] for name in built[0]}
        slow: set[str] = set()
        for m in rows:
            if shape_name == "lm_head" and m > max_lm_rows:
                continue
            x = torch.randn(m, k, generator=g)
            cell = cell_ms({name: fns for name, fns in paths.items() if name not in slow}, x, budget_s, repeats)
            table[f"{shape_name} {n}x{k}", m] = cell
            base = cell["fp32-onednn"]
            slow |= {name for name, ms in cell.items() if ms > SKIP_SLOWER * base and ms > SKIP_FROM_MS}
            print(f"{shape_name + f' {n}x{k}':20} {m:>5} " + " ".join(
                f"{cell[p]:>9.3f} ({base / cell[p]:4.2f})" if p in cell else f"{'-':>16}" for p in PATHS), flush=True)
    return table


def engine_figures(args) -> dict:
    """Perplexity (float32, int8 projections, int8 projections + LM head), greedy agreement and
    useful tokens/s on the quick workload (float32 against int8), interleaved rounds."""
    from benchmarks.kv_int8 import TEXT, perplexity
    from benchmarks.throughput import greedy_params, kv_bytes_for, useful_timing, warmed_engine
    from benchmarks.workload import make_workload
    from worker.config import Settings, default_model_path
    from worker.engine.engine import DTYPES, Engine
    from worker.model import decoder, linear
    from worker.model.loader import load_model

    loaded = load_model(args.model or default_model_path(), DTYPES["float32"])
    workload = make_workload(loaded.tokenizer, args.requests)
    kv_memory = kv_bytes_for(workload, loaded.config, "float32", Settings().block_size)
    settings = {w: Settings(model=args.model, kv_memory=kv_memory, weight_dtype=w) for w in ("auto", "int8")}
    text_ids = loaded.tokenizer.encode(TEXT.read_text())
    report: dict = {"requests": args.requests, "perplexity": {}}
    berth_int8 = decoder.make_int8_linear

    def fbgemm_linear(weight, bias=None):  # weights and activations in int8, one activation scale per batch
        q, scales = quantize_per_channel(weight)
        run = _fbgemm(weight, q, scales)
        return run if bias is None else (lambda x: run(x) + bias)

    variants = (("float32", "auto", False, berth_int8), ("int8", "int8", False, berth_int8),
                ("int8 + int8 lm_head", "int8", True, berth_int8),
                ("FBGEMM int8 weights + activations", "int8", False, fbgemm_linear))
    for label, weight_dtype, lm_head, make in variants:
        decoder.QUANTIZE_LM_HEAD, decoder.make_int8_linear = lm_head, make
        try:
            engine = Engine(settings[weight_dtype], loaded=loaded)
            report["perplexity"][label] = round(perplexity(engine, text_ids, args.chunk), 4)
            print(f"perplexity {label}: {report['perplexity'][label]}", flush=True)
            del engine
        finally:
            decoder.QUANTIZE_LM_HEAD, decoder.make_int8_linear = False, berth_int8
    runs = {"float32": ("auto", linear.FLOAT_FROM_ROWS),
            f"int8 (float32 from {linear.FLOAT_FROM_ROWS} rows)": ("int8", linear.FLOAT_FROM_ROWS)}
    if args.int8_only:
        runs["int8 only"] = ("int8", None)
    tps: dict[str, list[float]] = {name: [] for name in runs}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name, (w, float_from) in runs.items():
            default, linear.FLOAT_FROM_ROWS = linear.FLOAT_FROM_ROWS, float_from
            try:
                engine = warmed_engine(loaded, settings[w])
            finally:
                linear.FLOAT_FROM_ROWS = default
            t0 = time.perf_counter()
            results = engine.generate(workload.prompts, [greedy_params(n) for n in workload.output_lens])
            tokens = [r.completions[0].token_ids for r in results]
            tps[name].append(useful_timing(workload, time.perf_counter() - t0, tokens)["tokens_per_s"])
            print(f"{name}: {tps[name][-1]} useful tokens/s, load average {os.getloadavg()[0]:.2f}", flush=True)
            outputs[name] = tokens
            del engine
    exact, quant = outputs["float32"], outputs[list(runs)[1]]  # what --weight-dtype int8 runs
    report["same_first_32"] = round(sum(a[:32] == b[:32] for a, b in zip(exact, quant)) / len(exact), 3)
    report["same_whole"] = round(sum(a == b for a, b in zip(exact, quant)) / len(exact), 3)
    report["tokens_per_s"] = tps
    base = report["perplexity"]["float32"]
    for label, value in report["perplexity"].items():
        print(f"perplexity {label:22} {value:>9.4f} ({value / base - 1:+.2%})")
    print(f"greedy outputs equal to float32's ({args.requests} requests): first 32 tokens "
          f"{report['same_first_32']:.1%}, whole {report['same_whole']:.1%}")
    a = statistics.median(tps["float32"])
    for name, each in tps.items():
        q = statistics.median(each)
        print(f"useful tokens/s, {name:28} median of {args.rounds}: {q:7.1f} ({q / a:.3f} of float32's); runs {each}")
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="batch sizes (default: %(default)s)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="which shapes (default: %(default)s)")
    parser.add_argument("--budget", type=float, default=0.2, help="seconds per cell and path")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-lm-rows", type=int, default=256, help="largest batch for the LM head")
    parser.add_argument("--weight-mib", type=int, default=96, help="float32 MiB of distinct weights per shape")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    parser.add_argument("--engine", action="store_true", help="also perplexity, agreement and tokens/s")
    parser.add_argument("--no-kernels", action="store_true", help="skip the kernel table")
    parser.add_argument("--model", default="")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--int8-only", action="store_true",
                        help="also run int8 keeping only the int8 weights (FLOAT_FROM_ROWS None)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=256, help="tokens per prefill chunk for the perplexity")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = machine_info()
    int8_dots = ", ".join(f for f in INT8_DOT_FLAGS if f in machine["cpu_flags"]) or "no VNNI, no AMX int8"
    print(f"CPU: {machine_line(machine)}; int8 dot products: {int8_dots}")
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
          f"load average {os.getloadavg()[0]:.2f}")
    report: dict = {"machine": machine, "load_average_1m": [round(os.getloadavg()[0], 2)]}
    if not args.no_kernels:
        print("ms per call (float32 oneDNN's time / this path's)")
        print(f"{'shape':20} {'rows':>5} " + " ".join(f"{p:>16}" for p in PATHS), flush=True)
        shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
        table = kernel_table(shapes, tuple(int(r) for r in args.rows.split(",")), args.budget, args.repeats,
                             args.max_lm_rows, args.weight_mib)
        report["kernels_ms"] = {f"{shape} rows={m}": cell for (shape, m), cell in table.items()}
    if args.engine:
        report["engine"] = engine_figures(args)
    report["load_average_1m"].append(round(os.getloadavg()[0], 2))
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    if args.out:
        save_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
