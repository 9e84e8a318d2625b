"""The int8 KV cache (``--kv-cache-dtype int8``) against the model's own dtype, in one run.

Reports, for the default model (or ``--model``):

- accuracy: the perplexity of ``benchmarks/data/perplexity.txt`` computed through berth's own model
  and paged KV cache (the text in chunks of ``--chunk`` tokens, each chunk attending to the cached
  ones before it, as generation does) with each KV dtype; and on the throughput workload, the share
  of requests whose greedy output equals the exact run's, over the first 32 tokens and whole;
- speed: useful tokens/s on the throughput workload (``benchmarks/workload.py``), the two caches run
  in alternation for ``--rounds`` rounds, the order swapped each round (exact first, then int8 first,
  ...) so that neither always runs on the warmer or the cooler machine; each round's int8/exact ratio is
  printed, and their median is the figure (a machine whose speed drifts by a fifth between runs moves
  a ratio of two runs far more than a median of pairs run side by side);
- memory: KV blocks that fit in the same ``--kv-memory``, and the bytes a checkpoint writes per token.

    python benchmarks/kv_int8.py --quick          # 32 requests
    python benchmarks/kv_int8.py --requests 256 --rounds 4
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks.machine import machine_info, machine_line
from benchmarks.throughput import (
    QUICK_REQUESTS,
    greedy_params,
    kv_bytes_for,
    save_report,
    useful_timing,
    warmed_engine,
)
from benchmarks.workload import make_workload
from worker.config import Settings, default_model_path
from worker.engine.engine import DTYPES, Engine
from worker.model.decoder import StepInput
from worker.model.loader import load_model

TEXT = Path(__file__).with_name("data") / "perplexity.txt"
KV_DTYPES = ("auto", "int8")


def perplexity(engine: Engine, token_ids: list[int], chunk: int) -> float:
    """exp(mean negative log-likelihood) of ``token_ids[1:]``, through the engine's model and KV cache."""
    runner, bs = engine.runner, engine.runner.block_size
    if -(-len(token_ids) // bs) > runner.num_blocks:
        raise SystemExit(f"the text needs {-(-len(token_ids) // bs)} blocks; raise --kv-memory")
    table = list(range(-(-len(token_ids) // bs)))
    nll, count = 0.0, 0
    as_tensor = lambda a, dtype: torch.tensor(a, dtype=dtype, device=runner.device)  # noqa: E731
    for start in range(0, len(token_ids) - 1, chunk):
        end = min(start + chunk, len(token_ids) - 1)
        pos = list(range(start, end))
        step = StepInput(
            input_ids=as_tensor(token_ids[start:end], torch.int64), positions=as_tensor(pos, torch.int64),
            slot_mapping=as_tensor([table[p // bs] * bs + p % bs for p in pos], torch.int64), num_decode=0,
            decode_block_tables=as_tensor([[0]], torch.int32)[:0], decode_context_lens=as_tensor([], torch.int32),
            prefill_query_start_loc=as_tensor([0, end - start], torch.int32),
            prefill_block_tables=as_tensor([table], torch.int32), prefill_context_lens=as_tensor([end], torch.int32),
            logits_rows=as_tensor(list(range(end - start)), torch.int64))
        logits, _ = runner.execute(step)  # no embeddings inputs: the pooled rows are None
        logp = torch.log_softmax(logits.double(), dim=-1)
        targets = torch.tensor(token_ids[start + 1:end + 1])
        nll -= logp[torch.arange(end - start), targets].sum().item()
        count += end - start
    return math.exp(nll / count)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_REQUESTS} requests")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the two caches, the order swapped each round")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per prefill chunk for the perplexity")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    requests = QUICK_REQUESTS if args.quick else args.requests
    loaded = load_model(args.model or default_model_path(), DTYPES[args.dtype])
    workload = make_workload(loaded.tokenizer, requests)
    kv_memory = kv_bytes_for(workload, loaded.config, args.dtype, Settings().block_size)  # exact cache's bytes
    settings = {kv: Settings(model=args.model, dtype=args.dtype, kv_memory=kv_memory, kv_cache_dtype=kv)
                for kv in KV_DTYPES}
    machine = machine_info()
    print(f"CPU: {machine_line(machine)}; {requests} requests, dtype {args.dtype}")

    report: dict = {"machine": machine, "requests": requests, "dtype": args.dtype, "kv_memory": kv_memory}
    text_ids = loaded.tokenizer.encode(TEXT.read_text())
    for kv in KV_DTYPES:
        engine = Engine(settings[kv], loaded=loaded)
        report[kv] = {"blocks": engine.runner.num_blocks, "checkpoint_bytes_per_token":
                      engine.runner.block_bytes // engine.runner.block_size,
                      "perplexity": round(perplexity(engine, text_ids, args.chunk), 4), "tokens_per_s": []}
        del engine
    outputs: dict[str, list[list[int]]] = {}
    for round_ in range(args.rounds):
        for kv in (KV_DTYPES if round_ % 2 == 0 else KV_DTYPES[::-1]):
            engine = warmed_engine(loaded, settings[kv])
            t0 = time.perf_counter()
            results = engine.generate(workload.prompts, [greedy_params(n) for n in workload.output_lens])
            tokens = [r.completions[0].token_ids for r in results]
            report[kv]["tokens_per_s"].append(useful_timing(workload, time.perf_counter() - t0, tokens)["tokens_per_s"])
            outputs[kv] = tokens
            del engine
    exact, quant = outputs["auto"], outputs["int8"]
    report["same_first_32"] = round(sum(a[:32] == b[:32] for a, b in zip(exact, quant)) / len(exact), 3)
    report["same_whole"] = round(sum(a == b for a, b in zip(exact, quant)) / len(exact), 3)
    a, q = report["auto"], report["int8"]
    report["round_ratios"] = [round(i / e, 3) for e, i in zip(a["tokens_per_s"], q["tokens_per_s"])]
    speed = statistics.median(report["round_ratios"])
    report["ratios"] = {"tokens_per_s": round(speed, 3), "blocks": round(q["blocks"] / a["blocks"], 3),
                        "perplexity": round(q["perplexity"] / a["perplexity"], 4),
                        "checkpoint_bytes_per_token": round(q["checkpoint_bytes_per_token"]
                                                            / a["checkpoint_bytes_per_token"], 3)}
    print(f"{'':28} {'exact (' + args.dtype + ')':>18} {'int8':>12} {'int8/exact':>10}")
    for key, label in (("perplexity", "perplexity"), ("blocks", "KV blocks in the same memory"),
                       ("checkpoint_bytes_per_token", "checkpoint bytes / token")):
        print(f"{label:28} {a[key]:>18} {q[key]:>12} {report['ratios'][key]:>10}")
    for i, (e, r) in enumerate(zip(a["tokens_per_s"], q["tokens_per_s"])):
        first = "exact first" if i % 2 == 0 else "int8 first"
        print(f"{f'useful tokens/s, round {i + 1}':28} {e:>18.1f} {r:>12.1f} {r / e:>10.3f}  ({first})")
    print(f"{'useful tokens/s (median of rounds)':28} {'':>18} {'':>12} {report['ratios']['tokens_per_s']:>10}")
    print(f"greedy outputs equal to the exact run: first 32 tokens {report['same_first_32']:.1%}, "
          f"whole {report['same_whole']:.1%}")
    if args.out:
        save_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
