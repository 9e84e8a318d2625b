"""An embeddings job through ``berth run`` against transformers' forward pass at the same batch size.

The job: ``--lines`` (10,000 by default) ``/v1/embeddings`` lines, each one text of 16 to 128 tokens
cut from real prose and code (the standard library's ``argparse`` module, seed 0), run by
``berth run`` as a user runs it: a subprocess on the embedded defaults (SQLite, the embedded queue,
a local folder) in a fresh directory, from the command's start (the model's load included) to its
exit, with every output line written. Throughput = the inputs' tokens (the output's
``usage.prompt_tokens``) / wall seconds.

The baseline: transformers' ``AutoModel`` on the same model file (the GGUF read by transformers) in
the same dtype and thread count, over the first ``--baseline-lines`` inputs in batches of as many
inputs as one berth step holds (the token budget over the mean input length), padded, mean-pooled
under the attention mask and normalised: the loop a user writes with transformers. It runs before
and after the job and its two rates are averaged, so a busy machine slows both arms alike; the
report gives the ratio berth / transformers and the CPU.

    python benchmarks/embeddings.py                      # 10,000 lines
    python benchmarks/embeddings.py --lines 1000 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks.machine import machine_info
from worker.config import Settings, default_model_path
from worker.model.tokenizer import load_tokenizer


def make_inputs(tokenizer, lines: int, seed: int = 0) -> list[list[int]]:
    """Token ids of ``lines`` passages of 16 to 128 tokens, each decoded to text for its line."""
    ids = tokenizer(Path(argparse.__file__).read_text(), add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(16, 128)
        at = rng.randrange(len(ids) - n)
        out.append(ids[at:at + n])
    return out


def write_job(path: Path, texts: list[str], model_name: str) -> None:
    with open(path, "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                                "body": {"model": model_name, "input": text}}) + "\n")


def berth_run(folder: Path, dtype: str, threads: int) -> dict:
    """``berth run`` in ``folder``; its wall seconds and the tokens its output counts."""
    root = str(Path(__file__).resolve().parents[1])  # this checkout's berth, whatever is installed
    env = {**os.environ, "BERTH_DTYPE": dtype, "BERTH_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    berth = [sys.executable, "-c", "import sys; from jobs.cli import main; sys.exit(main())"]
    start = time.perf_counter()
    subprocess.run([*berth, "run", "job.jsonl", "-o", "out.jsonl", "--quiet"], cwd=folder, env=env, check=True)
    seconds = time.perf_counter() - start
    lines = [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]
    tokens = sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in lines)
    return {"lines": len(lines), "tokens": tokens, "seconds": round(seconds, 1),
            "tokens_per_s": round(tokens / seconds, 1)}


def transformers_rate(hf, texts: list[str], tokenizer, batch: int) -> dict:
    """The user's transformers loop over ``texts``: tokenize, pad, forward, mean-pool, normalise."""
    tokens = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for at in range(0, len(texts), batch):
            enc = tokenizer(texts[at:at + batch], padding=True, return_tensors="pt")
            hidden = hf(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
            tokens += int(enc["attention_mask"].sum())
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": round(seconds, 1), "tokens_per_s": round(tokens / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--baseline-lines", type=int, default=1000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--report", type=Path, help="write the figures here as JSON too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = Path(default_model_path())
    settings = Settings()
    ours = load_tokenizer(str(model))
    texts = [ours.decode(ids) for ids in make_inputs(ours, args.lines)]

    from transformers import AutoModel, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    hf = AutoModel.from_pretrained(str(model.parent), gguf_file=model.name, dtype=dtype).eval()
    hf_tok = AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)
    hf_tok.pad_token = hf_tok.pad_token or hf_tok.eos_token
    mean_len = sum(len(ours(t)["input_ids"]) for t in texts[:1000]) / min(1000, len(texts))
    batch = max(1, round(settings.max_num_batched_tokens / mean_len))  # the inputs of one berth step
    sample = texts[:args.baseline_lines]
    before = transformers_rate(hf, sample, hf_tok, batch)
    with tempfile.TemporaryDirectory() as tmp:
        write_job(Path(tmp) / "job.jsonl", texts, settings.served_model_name())
        berth = berth_run(Path(tmp), args.dtype, args.threads)
    after = transformers_rate(hf, sample, hf_tok, batch)
    baseline = (before["tokens_per_s"] + after["tokens_per_s"]) / 2
    report = {"machine": machine_info(args.threads), "dtype": args.dtype, "batch_size": batch,
              "mean_input_tokens": round(mean_len, 1), "berth_run": berth,
              "transformers_before": before, "transformers_after": after,
              "ratio_berth_over_transformers": round(berth["tokens_per_s"] / baseline, 2)}
    print(json.dumps(report, indent=2))
    if args.report:
        args.report.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
