"""Speculation on an extraction-style job (issue 36): answers that copy spans of their prompts, so prompt
lookup drafts what the model writes. One run, on the default model, greedy, speculation ``off`` against
``auto`` (and any other setting given):

1. The job: ``--requests`` (256) chat requests, each a generated record (an order, a ticket, a booking:
   names, dates, amounts, addresses of 2 to 6 sentences) and an instruction to copy the record, or some of
   its sentences, word for word. All submitted at once, as one job (the engine requests carry its id, as
   a worker's do: the job's suffix index drafts from its earlier lines, and its tail starts the longest
   first). Reported: useful tokens/s, the
   job's seconds, the seconds of its last 10% (from the moment 90% of its requests had finished to the
   last), the draft tokens and those accepted, and whether every output is the same tokens as ``off``.
2. Small batches: the first 1, 4 and 16 requests alone, tokens/s with each setting.

    python benchmarks/speculation.py                      # 10-30 minutes on 2 cores, by their load
    python benchmarks/speculation.py --requests 64 --batches 1,4

Runs alternate (off, auto, then auto, off for ``--rounds 2``) so that a loaded machine's drift falls on
both; each reports its process's CPU seconds beside the wall's (on a shared machine the CPU time varies
less: the engine's threads are busy whenever it runs), and the best run of each setting is kept. Figures
go in benchmarks/README.md and HISTORY.md, the JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks.machine import machine_info, machine_line
from worker.config import Settings, default_model_path
from worker.engine.engine import Engine
from worker.engine.request import Request, SamplingParams
from worker.model.loader import load_model

FIRST = ["Maria", "John", "Aiko", "Pedro", "Fatima", "Lars", "Chen", "Olga", "Kwame", "Sofia", "Ravi", "Emma"]
LAST = ["Lopez", "Smith", "Tanaka", "Silva", "Haddad", "Berg", "Wei", "Ivanova", "Mensah", "Rossi", "Patel", "Brown"]
CITIES = ["Springfield", "Lisbon", "Osaka", "Nairobi", "Oslo", "Toronto", "Lyon", "Austin", "Pune", "Leeds"]
ITEMS = ["blue widgets", "steel bolts", "paper cups", "garden hoses", "desk lamps", "USB cables", "coffee beans"]
SENTENCES = [
    "Order {n} was placed by {name} on {date} for {q} units of {item}.",
    "The shipment goes to {num} {street} Street, {city}, and is due on {date2}.",
    "The total of {amount} dollars was paid by card ending in {card}.",
    "{name} asked for the {item} to be wrapped separately and left at the front desk.",
    "Support ticket {t} says the {item} arrived damaged and a refund of {refund} dollars was approved.",
    "The customer can be reached at {phone} between 9 am and 5 pm on weekdays.",
    "A second delivery of {q2} units of {item2} is booked for {date3} from the {city2} warehouse.",
]
ASKS = [
    "Copy the record above word for word.",
    "Repeat the first two sentences of the record exactly as written.",
    "Quote the sentence about the shipment and the sentence about the payment, word for word.",
    "Rewrite the record exactly, one sentence per line.",
]


def record(rng: random.Random) -> str:
    values = dict(n=rng.randint(1000, 99999), name=f"{rng.choice(FIRST)} {rng.choice(LAST)}",
                  date=f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}", q=rng.randint(2, 500),
                  item=rng.choice(ITEMS), num=rng.randint(1, 999), street=rng.choice(LAST), city=rng.choice(CITIES),
                  date2=f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
                  amount=f"{rng.randint(10, 9999)}.{rng.randint(0, 99):02d}", card=rng.randint(1000, 9999),
                  t=rng.randint(100, 9999), refund=rng.randint(5, 300),
                  phone=f"555-{rng.randint(100, 999)}-{rng.randint(1000, 9999)}", q2=rng.randint(2, 90),
                  item2=rng.choice(ITEMS), date3=f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
                  city2=rng.choice(CITIES))
    chosen = sorted(rng.sample(range(len(SENTENCES)), rng.randint(2, 6)))
    return " ".join(SENTENCES[i].format(**values) for i in chosen)


def make_prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    """ChatML (the default model's template): a record and an instruction to copy some of it."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        text = (f"<|im_start|>user\nRecord:\n{record(rng)}\n\n{rng.choice(ASKS)}<|im_end|>\n"
                "<|im_start|>assistant\n")
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def run(loaded, settings: Settings, prompts: list[list[int]], max_tokens: int) -> dict:
    """Every request at once; the time each finished, counted from the first step."""
    engine = Engine(settings, loaded=loaded)
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    engine.stats = type(engine.stats)()
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    for i, ids in enumerate(prompts):
        engine.add_request(Request(str(i), ids, params, job="extraction"))  # one job, as a worker runs it
    t0, cpu0 = time.perf_counter(), time.process_time()
    done: dict[str, tuple[float, list[int]]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = (time.perf_counter() - t0, out.completions[0].token_ids)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    times = sorted(t for t, _ in done.values())
    tail_from = times[max(0, int(0.9 * len(times)) - 1)]
    tokens = [done[str(i)][1] for i in range(len(prompts))]
    s = engine.stats
    return {"seconds": round(seconds, 2), "output_tokens": sum(map(len, tokens)),
            "tokens_per_s": round(sum(map(len, tokens)) / seconds, 2),
            "last_10pct_seconds": round(seconds - tail_from, 2), "steps": s.steps,
            "cpu_seconds": round(cpu, 2), "tokens_per_cpu_s": round(sum(map(len, tokens)) / cpu, 2),
            "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
            "acceptance": round(s.acceptance_rate, 3), "load_average_1m": round(os.getloadavg()[0], 2),
            "tokens": tokens}


def compare(loaded, base: Settings, modes: list[str], prompts, max_tokens: int, rounds: int, label: str) -> dict:
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            print(f"[{time.strftime('%H:%M:%S')}] {label}: {mode} (round {r + 1})", flush=True)
            runs[mode].append(run(loaded, base.model_copy(update={"speculation": mode}), prompts, max_tokens))
            print({k: v for k, v in runs[mode][-1].items() if k != "tokens"}, flush=True)
    reference = runs[modes[0]][0]["tokens"]
    out = {}
    for mode, results in runs.items():
        best = min(results, key=lambda x: x["seconds"])
        out[mode] = {**{k: v for k, v in best.items() if k != "tokens"},
                     "runs_seconds": [x["seconds"] for x in results],
                     "same_outputs": sum(a == b for a, b in zip(best["tokens"], reference))}
    off = out[modes[0]]
    for mode in modes[1:]:
        out[mode]["speedup_tokens_per_s"] = round(out[mode]["tokens_per_s"] / off["tokens_per_s"], 3)
        out[mode]["speedup_last_10pct"] = round(off["last_10pct_seconds"] / max(out[mode]["last_10pct_seconds"], 1e-3),
                                                3)
        out[mode]["speedup_tokens_per_cpu_s"] = round(out[mode]["tokens_per_cpu_s"] / off["tokens_per_cpu_s"], 3)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256, help="a cap the copies stay under: they end on EOS")
    parser.add_argument("--batches", default="1,4,16", help="small batches, comma-separated ('' = none)")
    parser.add_argument("--modes", default="off,auto", help="speculation settings, the first the reference")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "speculation.json")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    loaded = load_model(default_model_path(), torch.float32)
    prompts = make_prompts(loaded.tokenizer, args.requests, args.seed)
    base = Settings(threads=args.threads, kv_memory="1GiB")
    report = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "model": default_model_path(),
              "machine": machine_info(args.threads),
              "requests": args.requests, "max_tokens": args.max_tokens,
              "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1),
              "job": compare(loaded, base, modes, prompts, args.max_tokens, args.rounds, f"job of {args.requests}")}
    report["batches"] = {}
    for size in [int(b) for b in args.batches.split(",") if b]:
        report["batches"][size] = compare(loaded, base, modes, prompts[:size], args.max_tokens, args.rounds,
                                          f"batch of {size}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"CPU: {machine_line(report['machine'])}")
    print(json.dumps({k: v for k, v in report.items() if k != "machine"}, indent=1))
    return report


if __name__ == "__main__":
    main()
