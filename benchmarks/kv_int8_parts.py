"""Where a step's time goes with each KV cache dtype: the throughput workload run once per dtype with
the model's attention operations (KV write, decode attention, prefill attention) timed call by call,
beside the whole forward pass and the whole run.

    python benchmarks/kv_int8_parts.py --requests 128
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks.kv_int8 import KV_DTYPES
from benchmarks.machine import machine_line
from benchmarks.throughput import greedy_params, kv_bytes_for, useful_timing, warmed_engine
from benchmarks.workload import make_workload
from worker.config import Settings, default_model_path
from worker.engine.engine import DTYPES
from worker.model.loader import load_model


def timed(fn, seconds: dict, name: str):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - t0
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    loaded = load_model(default_model_path(), DTYPES[args.dtype])
    workload = make_workload(loaded.tokenizer, args.requests)
    kv_memory = kv_bytes_for(workload, loaded.config, args.dtype, Settings().block_size)
    print(f"CPU: {machine_line()}; {args.requests} requests, dtype {args.dtype}")
    print(f"{'kv':6} {'tok/s':>7} {'wall s':>7} {'forward':>8} {'write_kv':>9} {'decode':>8} {'prefill':>8} "
          f"{'rest of fwd':>11} {'outside fwd':>11}")
    for kv in KV_DTYPES:
        engine = warmed_engine(loaded, Settings(dtype=args.dtype, kv_memory=kv_memory, kv_cache_dtype=kv))
        seconds: dict = defaultdict(float)
        model = engine.runner.model
        ops = model.ops
        model.ops = dataclasses.replace(ops, write_kv=timed(ops.write_kv, seconds, "write_kv"),
                                        decode=timed(ops.decode, seconds, "decode"),
                                        prefill=timed(ops.prefill, seconds, "prefill"))
        engine.runner.execute = timed(engine.runner.execute, seconds, "forward")
        t0 = time.perf_counter()
        results = engine.generate(workload.prompts, [greedy_params(n) for n in workload.output_lens])
        wall = time.perf_counter() - t0
        rate = useful_timing(workload, wall, [r.completions[0].token_ids for r in results])["tokens_per_s"]
        attn = seconds["write_kv"] + seconds["decode"] + seconds["prefill"]
        print(f"{kv:6} {rate:7.1f} {wall:7.1f} {seconds['forward']:8.2f} {seconds['write_kv']:9.2f} "
              f"{seconds['decode']:8.2f} {seconds['prefill']:8.2f} {seconds['forward'] - attn:11.2f} "
              f"{wall - seconds['forward']:11.2f}", flush=True)
        del engine


if __name__ == "__main__":
    main()
