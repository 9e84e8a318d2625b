"""berth against llama-server (llama.cpp) on the throughput benchmark's workload, in one run.

The same requests (``benchmarks/workload.py``: seeded prompts cut from the stdlib, per-request
``max_tokens``, greedy, EOS ignored) go through both systems, one after the other, on the same
model weights converted for each (berth reads SmolLM2-135M-Instruct's GGUF; llama-server gets that
GGUF requantised to F32 by llama.cpp's own ``llama-quantize --allow-requantize``), the same dtype
and the same thread count:

1. berth: the throughput benchmark's runner (``throughput.run_berth``): one ``Engine.generate`` over
   every request, model load and a two-request warm-up excluded.
2. llama-server: built from llama-cpp-python's sdist (``benchmarks/llama_cpp_build.py``), started
   with ``--parallel N`` slots (N = the requests, capped by ``--max-num-seqs``: all of them at once,
   as berth runs them), a context of ``N x`` the longest request (one KV stream per slot; ``--llama-kv
   unified`` shares one KV buffer of the requests' total length instead), ``-t``/``-tb`` = torch's
   thread count, ``--cont-batching``, ``-b`` = berth's token budget per step, KV cache in the run's
   dtype (``--llama-kv-type``). Server start and a warm-up request are excluded. Every request is
   sent at once from one thread each to ``POST /completion`` with ``n_predict = max_tokens``,
   ``temperature 0``, ``ignore_eos``, ``cache_prompt false`` and ``return_tokens``; the time is from
   the first request sent to the last response received.

Prompts go to llama-server as the workload's token ids (``--prompt-format ids``, the default: the
very tokens berth gets, no BOS added); ``--prompt-format text`` sends their decoded text instead,
which llama.cpp tokenizes itself. Both systems' prompt token totals are reported either way.

Figures: useful tokens/s (the sum of ``max_tokens`` over wall seconds), share of the matmul roof,
the ratio berth / llama-server, and checks: each request's generated token count equals its
``max_tokens``, and how many requests' greedy tokens equal berth's. Share of the roof = (prompt +
output tokens) x ``2 x`` the linear and LM-head weights (0.27 GFLOP a token for SmolLM2-135M) /
seconds, against the best plain torch matmul of the model's MLP shapes (``throughput.measure_roof``,
measured in the same run, before the systems). Goal (issue 23): float32, the full workload, berth at
75% of the roof or more and at least 1.5x llama-server F32.

    python benchmarks/llama_server.py --quick                  # 32 requests
    python benchmarks/llama_server.py                          # 256 requests, float32
    python benchmarks/llama_server.py --dtype bfloat16         # berth bf16 against a BF16 GGUF
    python benchmarks/llama_server.py --llama-kv-type f16      # llama.cpp's default KV type

The first run builds llama.cpp (minutes; cached under ``~/.cache/berth-bench/``). Writes JSON to
``--out`` (default ``benchmarks/results/llama-server-<dtype>[-quick].json``).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks import llama_cpp_build
from benchmarks.machine import machine_info, machine_line
from benchmarks.throughput import (
    WARMUP_PROMPTS,
    WARMUP_TOKENS,
    add_workload_options,
    berth_settings,
    clock,
    linear_params_per_token,
    measure,
    measure_roof,
    parse_workload_args,
    run_berth,
    save_report,
    useful_timing,
)
from benchmarks.workload import Workload, make_workload
from worker.engine.engine import DTYPES
from worker.model.loader import load_model

GGUF_TYPE = {"float32": "F32", "bfloat16": "BF16"}
KV_TYPE = {"float32": "f32", "bfloat16": "bf16"}
LLAMA_UBATCH = 512
"""llama.cpp's own default physical batch."""
SERVER_START_TIMEOUT = 600.0
GOALS = {"share_of_roof": 0.75, "ratio": 1.5}


# ---------------------------------------------------------------- llama-server
class LlamaServer:
    """``llama-server`` on 127.0.0.1 (a free port) as a context manager: started with ``args`` on
    ``model``, ready when ``GET /health`` answers 200; its log goes to ``log`` (else discarded)."""

    def __init__(self, model: str | Path, args: list[str], log: Path | None = None):
        self.model, self.args, self.log = Path(model), list(args), log
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [str(llama_cpp_build.binary("llama-server")), "-m", str(self.model),
                        "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        out = open(self.log, "w") if self.log else subprocess.DEVNULL
        self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while not self._healthy():
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.process.returncode}) while starting: "
                                   f"{self._log_tail()}")
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"llama-server not ready within {SERVER_START_TIMEOUT:.0f} s: {self._log_tail()}")
            time.sleep(0.25)
        return self

    def __exit__(self, *exc) -> None:
        stop_process(self.process, 30)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def _log_tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log and self.log.exists() else "(no log)"


def stop_process(process: subprocess.Popen | None, wait: float) -> None:
    """SIGTERM, then SIGKILL after ``wait`` seconds."""
    if process and process.poll() is None:
        process.terminate()
        try:
            process.wait(wait)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(url: str, body: dict, timeout: float = 3600.0) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def server_args(workload: Workload, threads: int, parallel: int, batch_tokens: int, kv_type: str,
                kv: str = "per-slot", ubatch: int = LLAMA_UBATCH) -> list[str]:
    """llama-server's options for running ``parallel`` of the workload's requests at once: a context
    of ``parallel`` x the longest request, rounded up to 256 (per-slot KV streams), or one unified
    buffer of every request's length plus the warm-up's."""
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens))
    if kv == "unified":
        total = sum(len(p) + n for p, n in zip(workload.prompts, workload.output_lens))
        ctx, kv_flag = _round_up(total + len(WARMUP_PROMPTS[-1]) + WARMUP_TOKENS + parallel, 256), "--kv-unified"
    else:
        ctx, kv_flag = parallel * _round_up(longest, 256), "--no-kv-unified"
    return ["--parallel", str(parallel), "-c", str(ctx), kv_flag, "-t", str(threads), "-tb", str(threads),
            "--cont-batching", "-b", str(batch_tokens), "-ub", str(min(ubatch, batch_tokens)),
            "-ctk", kv_type, "-ctv", kv_type, "--cache-ram", "0", "--no-webui"]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def completion_body(prompt: list[int] | str, max_tokens: int) -> dict:
    return {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True,
            "cache_prompt": False, "return_tokens": True, "stream": False}


def run_llama(server: LlamaServer, workload: Workload, prompts: list) -> dict:
    """Every request at once (one client thread each), timed from the first sent to the last answered."""
    post_json(f"{server.url}/completion", completion_body(WARMUP_PROMPTS[-1], WARMUP_TOKENS))
    bodies = [completion_body(p, n) for p, n in zip(prompts, workload.output_lens)]
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        t0 = time.perf_counter()
        answers = list(pool.map(lambda b: post_json(f"{server.url}/completion", b), bodies))
        seconds = time.perf_counter() - t0
    tokens = [a.get("tokens") or [] for a in answers]
    result = useful_timing(workload, seconds, tokens)
    result["prompt_tokens"] = sum(a["tokens_evaluated"] for a in answers)
    result["tokens_predicted"] = sum(a["tokens_predicted"] for a in answers)
    result["wrong_lengths"] = sum(a["tokens_predicted"] != n or len(t) != n
                                  for a, t, n in zip(answers, tokens, workload.output_lens))
    return result


# ---------------------------------------------------------------- figures
def flops_per_token(config) -> int:
    """2 x the weights every token's forward pass multiplies by: the decoder's linears and the LM head."""
    return 2 * (linear_params_per_token(config) + config.vocab_size * config.hidden_size)


def add_share(result: dict, workload: Workload, per_token: int, roof: dict) -> None:
    """(prompt + useful output tokens) x ``per_token`` / seconds, and its share of the plain torch
    matmul rate (and of the best matmul, berth's own linear included)."""
    tokens = result["prompt_tokens"] + result["useful_tokens"]
    gflops = tokens * per_token / result["seconds"] / 1e9
    result["model_gflops"] = round(gflops, 2)
    result["share_of_roof"] = round(gflops / roof["torch_matmul_gflops"], 4)
    result["share_of_best_matmul"] = round(gflops / roof["roof_gflops"], 4)


def same_tokens(berth: list[list[int]], other: list[list[int]]) -> dict:
    """How many requests' greedy tokens are identical, and the share of tokens before the first difference."""
    prefix = 0
    for a, b in zip(berth, other):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += n
    return {"identical_requests": sum(a == b for a, b in zip(berth, other)),
            "common_prefix_share": round(prefix / max(1, sum(map(len, berth))), 4)}


# ---------------------------------------------------------------- command line and report
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_options(parser)
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default: benchmarks/results/llama-server-<dtype>[-quick].json)")
    parser.add_argument("--skip", choices=("berth", "llama"), help="leave one system out (a check of the other)")
    parser.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                        help="llama-server's prompts: the workload's token ids or their decoded text")
    parser.add_argument("--llama-type", choices=("F32", "BF16", "F16"), default=None,
                        help="the GGUF type llama-server runs (default: F32 for float32, BF16 for bfloat16)")
    parser.add_argument("--llama-kv-type", default=None,
                        help="llama-server's KV cache type (default: f32 for float32, bf16 for bfloat16)")
    parser.add_argument("--llama-kv", choices=("per-slot", "unified"), default="per-slot",
                        help="one KV stream per slot (default) or one unified buffer shared by all")
    parser.add_argument("--llama-ubatch", type=int, default=LLAMA_UBATCH,
                        help="llama-server's physical batch -ub (default: llama.cpp's %(default)s)")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs if llama.cpp must be built")
    args = parse_workload_args(parser, argv, "llama-server")
    args.llama_type = args.llama_type or GGUF_TYPE[args.dtype]
    args.llama_kv_type = args.llama_kv_type or KV_TYPE[args.dtype]
    return args


def print_report(report: dict) -> None:
    w = report["workload"]
    print(f"\nCPU: {machine_line(report['machine'])}, berth {report['dtype']}, "
          f"llama-server {report['llama']['gguf_type']} GGUF, KV {report['llama']['kv_type']}")
    print(f"{w['requests']} requests, {w['output_tokens']} useful output tokens; roof (plain torch matmul) "
          f"{report['roof']['torch_matmul_gflops']:.1f} GFLOP/s, {report['flops_per_token'] / 1e9:.3f} GFLOP a token")
    print(f"{'system':<24}{'seconds':>9}{'prompt tok':>12}{'useful tok':>12}{'tok/s':>9}{'of roof':>9}"
          f"{'wrong len':>11}{'same as berth':>15}")
    for name, r in report["systems"].items():
        if "error" in r:
            print(f"{name:<24}  error: {r['error']}")
            continue
        same = f"{r['same_as_berth']['identical_requests']}/{w['requests']}" if "same_as_berth" in r else ""
        print(f"{name:<24}{r['seconds']:>9.1f}{r['prompt_tokens']:>12}{r['useful_tokens']:>12}"
              f"{r['tokens_per_s']:>9.1f}{100 * r['share_of_roof']:>8.1f}%{r['wrong_lengths']:>11}{same:>15}")
    if "ratio" in report:
        print(f"berth / llama-server: {report['ratio']:.2f}x")
    for goal, met in report.get("goals", {}).items():
        print(f"goal {goal}: {'met' if met else 'NOT met'}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    build = llama_model = None
    if args.skip != "llama":
        build = llama_cpp_build.build(jobs=args.jobs)
        llama_model = llama_cpp_build.f32_gguf(args.model, out_type=args.llama_type)
    loaded = load_model(args.model, DTYPES[args.dtype])
    config = loaded.config
    workload = make_workload(loaded.tokenizer, args.requests, args.seed)
    print(f"[{clock()}] workload: {workload.summary()}", flush=True)
    per_token = flops_per_token(config)
    roof = measure_roof(config, args.dtype)
    print(f"[{clock()}] roof: {roof}", flush=True)

    results = {}
    if args.skip != "berth":
        settings = berth_settings(args, workload, config)
        berth = measure("berth", lambda: run_berth(loaded, workload, settings), guarded=False)
        berth["prompt_tokens"] = workload.prompt_tokens
        berth["wrong_lengths"] = sum(len(t) != n for t, n in zip(berth["tokens"], workload.output_lens))
        berth.pop("engine", None)
        results["berth"] = berth
    tokenizer = loaded.tokenizer
    loaded = None  # freed before the next system loads

    parallel = min(len(workload), args.max_num_seqs)
    llama_args = server_args(workload, threads, parallel, args.max_num_batched_tokens, args.llama_kv_type,
                             args.llama_kv, args.llama_ubatch)
    llama_name = f"llama-server {args.llama_type}"
    if args.skip != "llama":
        prompts = workload.prompts if args.prompt_format == "ids" else [tokenizer.decode(p) for p in workload.prompts]
        log = args.out.with_suffix(".llama-server.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"[{clock()}] starting llama-server (log: {log})", flush=True)
        with LlamaServer(llama_model, llama_args, log) as server:
            results[llama_name] = measure(llama_name, lambda: run_llama(server, workload, prompts))
        command = server.command

    for r in results.values():
        if "seconds" in r:
            add_share(r, workload, per_token, roof)
    if "berth" in results and "tokens" in results.get(llama_name, {}):
        results[llama_name]["same_as_berth"] = same_tokens(results["berth"]["tokens"], results[llama_name]["tokens"])
    for r in results.values():
        r.pop("tokens", None)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "dtype": args.dtype, "quick": args.quick,
        "model": args.model, "machine": machine_info(threads), "workload": workload.summary(), "roof": roof,
        "flops_per_token": per_token, "prompt_format": args.prompt_format,
        "llama": {"build": build, "gguf": llama_model and str(llama_model), "gguf_type": args.llama_type,
                  "kv_type": args.llama_kv_type, "kv": args.llama_kv, "args": llama_args,
                  "command": command if args.skip != "llama" else None},
        "systems": results,
    }
    if "tokens_per_s" in results.get("berth", {}) and "tokens_per_s" in results.get(llama_name, {}):
        report["ratio"] = round(results["berth"]["tokens_per_s"] / results[llama_name]["tokens_per_s"], 3)
    if "ratio" in report and args.dtype == "float32" and args.llama_type == "F32":
        report["goals"] = {"berth >= 75% of the roof": results["berth"]["share_of_roof"] >= GOALS["share_of_roof"],
                           "berth >= 1.5x llama-server F32": report["ratio"] >= GOALS["ratio"]}
    print_report(report)
    save_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
