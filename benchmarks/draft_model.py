"""Speculation with a draft model (issue 36, must-show 5): a random Llama-3.2-1B-shaped target
(``random_model.py``) verified against a much smaller random draft model of the same tokenizer and
vocabulary (``DRAFT``: 2 layers, hidden 512, untied, 137M parameters, nearly all of them its embedding and
output matrices), greedy, EOS ignored. Random weights agree on little, so nearly every draft is refused: the
figure is the cost of speculating when drafts fail (the draft model's own steps, the verified rows thrown
away), not a speedup.

``--requests`` (4) requests cut from the Python standard library's source, run together with speculation
``off`` and with ``draft:K`` (``--k``, 4), alternating for ``--rounds`` (the best run of each kept).
Printed: the draft tokens and those accepted (acceptance), tokens/s of each, their ratio, whether every
output is the same tokens, and the CPU's model name; the JSON goes to ``--out``.

    python benchmarks/draft_model.py                 # writes the two models (2.5 GB, once) under --models
    python benchmarks/draft_model.py --quick         # toy models (the near-free tiny shape): seconds

The models are written once under ``--models`` (default ``benchmarks/results/models``) and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks.machine import machine_info, machine_line
from benchmarks.random_model import LLAMA_3_2_1B, TINY, write
from worker.config import Settings
from worker.engine.engine import Engine
from worker.engine.request import SamplingParams
from worker.model.loader import load_model

DRAFT = {**LLAMA_3_2_1B, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": False}
"""The draft: Llama 3.2 1B's vocabulary (128,256), rope and heads of 64, 2 layers of hidden 512, its own
output matrix. Untied on purpose: a random model with tied embeddings (as the target is) predicts its input
token again (its logits are the dot products of the embeddings with the input's, near its own, the layers'
small random updates aside), so two tied random models agree on nearly every token; an untied one's argmax is
unrelated to the target's, and its drafts fail as a poor draft model's do. ``--tied-draft`` shows the other
end: the draft tied too, drafts accepted nearly always."""
TINY_TARGET = {**TINY, "num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "head_dim": 32}
TINY_DRAFT = {**TINY, "tie_word_embeddings": False}  # one layer, hidden 64: --quick's draft


def ensure_model(folder: Path, config: dict, dtype: torch.dtype, seed: int) -> Path:
    """``folder`` holding a random model of ``config``: written unless one of that config is there."""
    written = folder / "config.json"
    if written.exists():
        saved = json.loads(written.read_text())
        if all(saved.get(k) == v for k, v in config.items()) and saved.get("torch_dtype") == str(dtype)[6:]:
            return folder
    write(folder, config, dtype, seed)
    return folder


def prompts_of(tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens from different places of argparse's source."""
    ids = tokenizer(Path(argparse.__file__).read_text(), add_special_tokens=False)["input_ids"]
    return [ids[997 * i % (len(ids) - length):][:length] for i in range(count)]


def run(loaded, settings: Settings, prompts: list[list[int]], max_tokens: int) -> dict:
    engine = Engine(settings, loaded=loaded)
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    engine.stats = type(engine.stats)()
    t0, cpu0 = time.perf_counter(), time.process_time()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = [o.completions[0].token_ids for o in outputs]
    s = engine.stats
    return {"seconds": round(seconds, 3), "output_tokens": sum(map(len, tokens)),
            "tokens_per_s": round(sum(map(len, tokens)) / seconds, 2), "cpu_seconds": round(cpu, 2),
            "steps": s.steps, "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
            "acceptance": round(s.acceptance_rate, 4), "load_average_1m": round(os.getloadavg()[0], 2),
            "tokens": tokens}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="toy models and sizes: seconds")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=None, help="each prompt's length (128; 32 quick)")
    parser.add_argument("--max-tokens", type=int, default=None, help="output tokens a request (64; 16 quick)")
    parser.add_argument("--k", type=int, default=4, help="draft tokens a step (speculation draft:K)")
    parser.add_argument("--rounds", type=int, default=None, help="runs of each setting, alternating (2; 1 quick)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="(bfloat16; float32 quick)")
    parser.add_argument("--tied-draft", action="store_true",
                        help="the draft's output matrix tied to its embedding: drafts agree with the target")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--models", type=Path, default=Path(__file__).parent / "results" / "models")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default: benchmarks/results/draft_model[-quick].json)")
    args = parser.parse_args(argv)
    quick = args.quick
    prompt_tokens = args.prompt_tokens or (32 if quick else 128)
    max_tokens = args.max_tokens or (16 if quick else 64)
    rounds = args.rounds or (1 if quick else 2)
    dtype_name = args.dtype or ("float32" if quick else "bfloat16")
    dtype = getattr(torch, dtype_name)
    out = args.out or Path(__file__).parent / "results" / f"draft_model{'-quick' if quick else ''}.json"
    target_shape, draft_shape = (TINY_TARGET, TINY_DRAFT) if quick else (LLAMA_3_2_1B, DRAFT)
    if args.tied_draft:
        draft_shape = {**draft_shape, "tie_word_embeddings": True}
    tag = "tiny" if quick else "llama-3.2-1b"
    target = ensure_model(args.models / f"target-{tag}-{dtype_name}", target_shape, dtype, seed=0)
    draft = ensure_model(args.models / f"draft-{tag}-{dtype_name}{'-tied' if args.tied_draft else ''}", draft_shape,
                         dtype, seed=1)
    loaded = load_model(str(target), dtype)
    prompts = prompts_of(loaded.tokenizer, args.requests, prompt_tokens)
    base = Settings(model=str(target), dtype=dtype_name, threads=args.threads, kv_memory="512MiB",
                    speculative_model=str(draft))
    modes = ["off", f"draft:{args.k}"]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            print(f"[{time.strftime('%H:%M:%S')}] {mode} (round {r + 1})", flush=True)
            runs[mode].append(run(loaded, base.model_copy(update={"speculation": mode}), prompts, max_tokens))
            print({k: v for k, v in runs[mode][-1].items() if k != "tokens"}, flush=True)
    best = {m: min(results, key=lambda x: x["seconds"]) for m, results in runs.items()}
    off, on = best["off"], best[modes[1]]
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "quick": quick,
        "machine": machine_info(args.threads),
        "target_model": {"path": str(target), **_shape(target_shape)},
        "draft_model": {"path": str(draft), **_shape(draft_shape)},
        "dtype": dtype_name, "requests": args.requests, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
        "k": args.k, "rounds": rounds,
        "off": {k: v for k, v in off.items() if k != "tokens"},
        "drafted": {k: v for k, v in on.items() if k != "tokens"} | {"speculation": modes[1]},
        "acceptance": on["acceptance"], "ratio_tokens_per_s": round(on["tokens_per_s"] / off["tokens_per_s"], 3),
        "same_outputs": on["tokens"] == off["tokens"],
        "runs_seconds": {m: [x["seconds"] for x in results] for m, results in runs.items()},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"CPU: {machine_line(report['machine'])}, {dtype_name}")
    print(f"target {report['target_model']['parameters'] / 1e9:.3g}B parameters, draft "
          f"{report['draft_model']['parameters'] / 1e6:.3g}M; {args.requests} requests x {max_tokens} tokens, "
          f"draft:{args.k}")
    print(f"off:       {off['tokens_per_s']:.2f} tok/s ({off['steps']} steps)")
    print(f"draft:{args.k}:   {on['tokens_per_s']:.2f} tok/s ({on['steps']} steps), acceptance {on['acceptance']:.3f} "
          f"({on['accepted_tokens']}/{on['draft_tokens']} draft tokens)")
    print(f"ratio draft/off: {report['ratio_tokens_per_s']:.3f}; same outputs: {report['same_outputs']}")
    return report


def _shape(config: dict) -> dict:
    h, layers, vocab, inter = (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"],
                               config["intermediate_size"])
    d, heads, kv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    per_layer = h * d * (2 * heads + 2 * kv) + 3 * h * inter + 2 * h
    params = vocab * h * (1 if config["tie_word_embeddings"] else 2) + layers * per_layer + h
    return {"layers": layers, "hidden_size": h, "vocab_size": vocab, "parameters": params}


if __name__ == "__main__":
    main()
