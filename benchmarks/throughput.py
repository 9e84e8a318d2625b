"""Throughput of berth against Hugging Face transformers on one seeded bulk workload, in one run.

Systems, all with the same model, dtype and torch thread count, each timed on its generation only
(model loads and a two-request warm-up excluded):

1. berth: ``Engine.generate`` over every request at once, per-request ``max_tokens``, greedy,
   ``ignore_eos``.
2. transformers static batching: batches of 16 in arrival order, left-padded, each ``generate`` call
   running ``max_new_tokens = min_new_tokens =`` the longest output of its batch.
3. transformers continuous batching: its ``ContinuousBatchingManager``, each request added with its
   own ``max_new_tokens`` and ``eos_token_id=-1`` (no EOS), under berth's token budget per step,
   request cap and KV bytes.

Useful output tokens/s = the tokens the requests asked for (sum of their lengths) / wall seconds.
The run also measures the machine's matrix-multiply rate on the model's MLP shapes (the compute roof:
the faster of PyTorch's matmul and berth's own linear), berth's achieved model FLOP/s against it, and
berth's KV cache figures. Prints a table, writes JSON to ``--out`` and a bar plot of useful tokens/s
beside it (same name, ``.png``).

``--structured-share 0.25`` runs berth a second time with that share of the requests constrained by
a JSON schema (an array of at least ``STRUCTURED_MIN_ITEMS`` small records, which no request can
complete within its length, so both runs generate the same number of tokens) and reports both
useful tokens/s, their ratio and the grammar's cost per step (bitmask fill, mask applied, tokens
accepted): milliseconds per step with a constrained row and per constrained row.

    python benchmarks/throughput.py --quick --dtype float32      # 32 requests, a few minutes
    python benchmarks/throughput.py --dtype bfloat16             # 256 requests
    python benchmarks/throughput.py --skip static,continuous --structured-share 0.25
    python benchmarks/throughput.py --quick --skip static,continuous --penalty-rounds 3
    python benchmarks/throughput.py --quick --skip static,continuous --speculation-rounds 2

``--penalty-rounds N`` runs berth N more times without and N times with every request carrying
``PENALTIES`` (frequency, presence and repetition penalties and a logit_bias), interleaved (plain,
penalised, penalised, plain, ...) so that a loaded machine's drift falls on both alike, and reports
each run's useful tokens/s and the ratio of their medians.

``--speculation-rounds N`` likewise runs berth N times with ``speculation`` off and N times auto,
interleaved, and reports the ratio of the medians (auto / off), the draft tokens and those accepted;
with how many outputs are the same tokens as without.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks.machine import machine_info, machine_line
from benchmarks.workload import Workload, make_workload
from worker.config import Settings, default_model_path
from worker.engine.engine import DTYPES, Engine, EngineStats
from worker.engine.request import SamplingParams, StructuredOutput
from worker.model.base import LoadedModel
from worker.model.linear import make_linear
from worker.model.loader import load_model

LABELS = {"berth": "berth", "static": "transformers static (16)", "continuous": "transformers continuous"}
COLORS = {"berth": "tab:blue", "static": "tab:gray", "continuous": "tab:orange"}
STATIC_BATCH = 16
QUICK_REQUESTS = 32
WARMUP_PROMPTS = [list(range(1000, 1008)), list(range(2000, 2024))]
"""Token ids unlike any text, so the warm-up leaves nothing in berth's prefix cache for the workload."""
WARMUP_TOKENS = 4
ROOF_ROWS = (2048, 256)
ROOF_REPEATS = 5
STRUCTURED_MIN_ITEMS = 600
STRUCTURED_SCHEMA = {"type": "object", "required": ["records"], "additionalProperties": False, "properties": {
    "records": {"type": "array", "minItems": STRUCTURED_MIN_ITEMS, "items": {
        "type": "object", "required": ["name", "count"], "additionalProperties": False,
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "count": {"type": "integer", "minimum": 0, "maximum": 9999}}}}}}
"""An extraction-like schema (strings, bounded integers, nesting) no request completes early."""
PENALTIES = dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1, min_p=0.05,
                 logit_bias=((11, 2.0), (13, -1.5), (198, -3.0)))
"""What every request of a penalised run carries (min_p is free for greedy rows, as in vLLM)."""


# ---------------------------------------------------------------- command line
def add_workload_options(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark here shares: the model, its dtype, the threads, the workload and
    the engine settings ``berth_settings`` reads. Parse with ``parse_workload_args``."""
    parser.add_argument("--model", default="", help="GGUF file or safetensors folder (default: SmolLM2-135M)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads for every system (default: all cores, %(default)s)")
    parser.add_argument("--requests", type=int, default=256, help="number of requests (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_REQUESTS} requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-memory", default="auto", help="berth's KV cache (bytes with a unit, e.g. 4GiB); "
                        "auto = enough for every request at once (default: %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="token budget of one engine step (default: %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="cap on running requests (default: %(default)s)")


def parse_workload_args(parser: argparse.ArgumentParser, argv: list[str] | None, name: str) -> argparse.Namespace:
    """``parser``'s arguments with the shared ones resolved: ``--quick`` sets the number of requests,
    ``--model`` defaults to SmolLM2-135M, ``--out`` to ``benchmarks/results/<name>-<dtype>[-quick].json``."""
    args = parser.parse_args(argv)
    if args.quick:
        args.requests = QUICK_REQUESTS
    if args.out is None:
        args.out = Path("benchmarks/results") / f"{name}-{args.dtype}{'-quick' if args.quick else ''}.json"
    args.model = args.model or default_model_path()
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_options(parser)
    parser.add_argument("--skip", default="", help="comma-separated systems to skip: static, continuous")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: "
                        "benchmarks/results/throughput-<dtype>[-quick].json); the plot goes beside it")
    parser.add_argument("--structured-share", type=float, default=0.0,
                        help="also run berth with this share of requests constrained by a JSON schema (0 = not)")
    parser.add_argument("--penalty-rounds", type=int, default=0,
                        help="also run berth this many times without and with penalties on every request, "
                             "interleaved (0 = not)")
    parser.add_argument("--speculation-rounds", type=int, default=0,
                        help="also run berth this many times with speculation off and auto, interleaved (0 = not)")
    args = parse_workload_args(parser, argv, "throughput")
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.skip - {"static", "continuous"}:
        parser.error(f"--skip takes static and/or continuous, not {sorted(args.skip - {'static', 'continuous'})}")
    if not 0 <= args.structured_share <= 1:
        parser.error("--structured-share is a share of the requests, between 0 and 1")
    return args


# ---------------------------------------------------------------- berth
def berth_settings(args, workload: Workload, config) -> Settings:
    """The engine's settings from the command line, ``--kv-memory auto`` resolved to bytes."""
    block_size = Settings().block_size
    kv_memory = kv_bytes_for(workload, config, args.dtype, block_size) if args.kv_memory == "auto" else args.kv_memory
    return Settings(model=args.model, dtype=args.dtype, threads=args.threads, kv_memory=kv_memory,
                    block_size=block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                    max_num_seqs=args.max_num_seqs)


def kv_bytes_for(workload: Workload, config, dtype: str, block_size: int) -> int:
    """KV bytes whose blocks hold every request's prompt and output at once, plus the warm-up's."""
    lengths = [len(p) + n for p, n in zip(workload.prompts, workload.output_lens)]
    lengths += [len(p) + WARMUP_TOKENS for p in WARMUP_PROMPTS]
    blocks = sum(-(-n // block_size) for n in lengths)
    block_bytes = 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * head_dim(config)
    return blocks * block_bytes * DTYPES[dtype].itemsize


def run_berth(loaded: LoadedModel, workload: Workload, settings: Settings, structured_share: float = 0.0,
              penalized: bool = False, speculation: str | None = None) -> dict:
    """Time ``Engine.generate`` over the workload; add the engine's counters and KV figures. With
    ``structured_share``, that share of the requests (spread evenly) is constrained by
    ``STRUCTURED_SCHEMA``, and the grammar's own time is measured too."""
    if speculation is not None:
        settings = settings.model_copy(update={"speculation": speculation})
    engine = warmed_engine(loaded, settings)
    peak = track_peak_blocks(engine)
    spec = StructuredOutput("json_schema", json.dumps(STRUCTURED_SCHEMA))
    params = [greedy_params(n, spec if int((i + 1) * structured_share) > int(i * structured_share) else None)
              for i, n in enumerate(workload.output_lens)]
    if penalized:
        params = [replace(p, **PENALTIES) for p in params]
        penalty_time = track_penalty_time()
    grammar_time = track_grammar_time() if structured_share else None
    t0 = time.perf_counter()
    outputs = engine.generate(workload.prompts, params)
    seconds = time.perf_counter() - t0
    tokens = [out.completions[0].token_ids for out in outputs]
    result = useful_timing(workload, seconds, tokens)
    result["engine"] = _engine_figures(engine, peak["blocks_used"])
    if grammar_time is not None:
        result["grammar"] = grammar_time.figures(sum(p.structured is not None for p in params))
    if penalized:
        result["penalty_seconds"] = penalty_time.stop()
    return result


class track_penalty_time:
    """Wall time in ``worker.engine.penalties.process`` (the bias and penalties of a step's rows)
    until ``stop`` puts it back and returns the seconds."""

    def __init__(self):
        import worker.engine.penalties

        self.module, self.original, self.seconds = worker.engine.penalties, worker.engine.penalties.process, 0.0

        def timed(*args):
            t0 = time.perf_counter()
            try:
                return self.original(*args)
            finally:
                self.seconds += time.perf_counter() - t0
        self.module.process = timed

    def stop(self) -> float:
        self.module.process = self.original
        return round(self.seconds, 3)


class track_grammar_time:
    """Wall time in the grammar's three per-step calls (bitmask fill, mask applied, token accepted),
    and how many steps and rows were constrained, until ``figures`` puts the calls back."""

    def __init__(self):
        import worker.engine.sampler
        import worker.engine.structured.grammar

        self.seconds = {"fill": 0.0, "apply": 0.0, "accept": 0.0}
        self.steps = self.rows = 0
        self._restore = [(worker.engine.structured.grammar, "fill_bitmask"), (worker.engine.sampler, "apply_bitmask"),
                         (worker.engine.structured.grammar, "accept")]
        self._originals = [getattr(module, name) for module, name in self._restore]
        for (module, name), key, original in zip(self._restore, self.seconds, self._originals):
            setattr(module, name, self._timed(key, original))

    def _timed(self, key: str, original: Callable) -> Callable:
        def timed(*args):
            if key == "fill":
                self.steps += 1
                self.rows += len(args[0])
            t0 = time.perf_counter()
            try:
                return original(*args)
            finally:
                self.seconds[key] += time.perf_counter() - t0
        return timed

    def figures(self, requests: int) -> dict:
        for (module, name), original in zip(self._restore, self._originals):
            setattr(module, name, original)
        total = sum(self.seconds.values())
        return {"constrained_requests": requests, "constrained_steps": self.steps, "constrained_rows": self.rows,
                "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "ms_per_step": round(1000 * total / max(self.steps, 1), 3),
                "ms_per_row": round(1000 * total / max(self.rows, 1), 4)}


def warmed_engine(loaded: LoadedModel, settings: Settings) -> Engine:
    """A new engine on ``loaded``'s weights (its own KV cache and prefix cache), warmed up by a
    two-request generation, its counters reset."""
    engine = Engine(settings, loaded=loaded)
    engine.generate(WARMUP_PROMPTS, greedy_params(WARMUP_TOKENS))
    engine.stats = EngineStats()
    return engine


def greedy_params(max_tokens: int, structured: StructuredOutput | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, structured=structured)


def track_peak_blocks(engine: Engine) -> dict:
    """Record the most KV blocks in use at any forward pass (one counter read per step)."""
    peak = {"blocks_used": 0}
    execute = engine.runner.execute

    def counting_execute(step_input):
        peak["blocks_used"] = max(peak["blocks_used"], engine.block_manager.num_used_blocks)
        return execute(step_input)

    engine.runner.execute = counting_execute
    return peak


def _engine_figures(engine: Engine, peak_blocks: int) -> dict:
    s = engine.stats
    usage = engine.kv_usage()
    return {
        "steps": s.steps, "preemptions": s.preemptions, "output_tokens": s.output_tokens,
        "prompt_tokens_computed": s.prompt_tokens_computed, "prompt_tokens_cached": s.prompt_tokens_cached,
        "recomputed_tokens": s.recomputed_tokens, "forward_seconds": round(s.forward_seconds, 3),
        "mean_slot_utilization": round(s.mean_slot_utilization, 4),
        "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
        "kv": {"block_size": engine.block_manager.block_size, "blocks_total": usage["blocks_total"],
               "peak_blocks_used": peak_blocks, "peak_share": round(peak_blocks / usage["blocks_total"], 4),
               "kv_bytes": usage["kv_bytes"]},
    }


# ---------------------------------------------------------------- transformers
def load_hf_model(path: str, dtype: str):
    """transformers' own reading of the model file (GGUF or safetensors folder), in eval mode."""
    from transformers import AutoModelForCausalLM

    p = Path(path)
    kwargs = {"gguf_file": p.name} if p.suffix == ".gguf" else {}
    folder = p.parent if p.suffix == ".gguf" else p
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=DTYPES[dtype], **kwargs).eval()


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids padded on the left to the longest prompt, and the attention mask that hides the pad."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def static_generate(model, prompts: list[list[int]], lengths: list[int], pad_id: int) -> list[list[int]]:
    """Greedy tokens of one static batch, each row cut to the length its request asked for."""
    ids, mask = left_pad(prompts, pad_id)
    n = max(lengths)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=pad_id)
    return [row[ids.shape[1]:ids.shape[1] + k].tolist() for row, k in zip(out, lengths)]


def run_static(model, workload: Workload, pad_id: int) -> dict:
    """Batches of ``STATIC_BATCH`` requests in arrival order, each run to its longest output."""
    with torch.inference_mode():
        static_generate(model, WARMUP_PROMPTS, [WARMUP_TOKENS] * len(WARMUP_PROMPTS), pad_id)
        tokens: list[list[int]] = []
        t0 = time.perf_counter()
        for i in range(0, len(workload), STATIC_BATCH):
            tokens += static_generate(model, workload.prompts[i:i + STATIC_BATCH],
                                      workload.output_lens[i:i + STATIC_BATCH], pad_id)
        seconds = time.perf_counter() - t0
    result = useful_timing(workload, seconds, tokens)
    result["batch_size"] = STATIC_BATCH
    result["tokens_run"] = _static_tokens_run(workload)
    return result


def _static_tokens_run(workload: Workload) -> int:
    """Positions the static batches push through the model, padding and overrun included."""
    total = 0
    for i in range(0, len(workload), STATIC_BATCH):
        prompts = workload.prompts[i:i + STATIC_BATCH]
        total += len(prompts) * (max(map(len, prompts)) + max(workload.output_lens[i:i + STATIC_BATCH]))
    return total


def continuous_generate(manager, prompts: list[list[int]], lengths: list[int], tag: str) -> list[list[int]]:
    """Add every request with its own ``max_new_tokens`` and no EOS; wait for all; tokens in input order."""
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for request_id, prompt, n in zip(ids, prompts, lengths):
        manager.add_request(prompt, request_id=request_id, max_new_tokens=n, eos_token_id=-1)
    done = {}
    while len(done) < len(ids):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(f"the generation thread stopped with {len(ids) - len(done)} requests unfinished")
            continue
        if result.error is not None:
            raise RuntimeError(f"request {result.request_id} failed: {result.error}")
        if result.is_finished():
            done[result.request_id] = result.generated_tokens
    return [done[request_id] for request_id in ids]


def run_continuous(model, workload: Workload, settings: Settings, kv: dict, pad_id: int) -> dict:
    """transformers' continuous batching with berth's step budget, request cap and KV blocks (``kv``:
    berth's ``block_size`` and ``blocks_total``)."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    cb_config = ContinuousBatchingConfig(page_size=kv["block_size"], num_blocks=kv["blocks_total"],
                                         max_batch_tokens=settings.max_num_batched_tokens,
                                         max_requests_per_batch=settings.max_num_seqs)
    generation_config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.output_lens),
                                         eos_token_id=-1, pad_token_id=pad_id)
    with torch.inference_mode(), model.continuous_batching_context_manager(
            generation_config=generation_config, continuous_batching_config=cb_config, block=True,
            timeout=30) as manager:
        continuous_generate(manager, WARMUP_PROMPTS, [WARMUP_TOKENS] * len(WARMUP_PROMPTS), "warmup")
        t0 = time.perf_counter()
        tokens = continuous_generate(manager, workload.prompts, workload.output_lens, "r")
        seconds = time.perf_counter() - t0
        resolved = manager.continuous_batching_config
        attention = model.config._attn_implementation
    result = useful_timing(workload, seconds, tokens)
    result["config"] = {"page_size": resolved.page_size, "num_blocks": resolved.num_blocks,
                        "max_batch_tokens": resolved.max_batch_tokens,
                        "max_requests_per_batch": resolved.max_requests_per_batch, "attn_implementation": attention}
    return result


# ---------------------------------------------------------------- shared measurement helpers
def useful_timing(workload: Workload, seconds: float, tokens: list[list[int]]) -> dict:
    """Seconds, useful tokens (what the requests asked for, if produced) and useful tokens/s."""
    useful = sum(min(len(t), n) for t, n in zip(tokens, workload.output_lens))
    return {"seconds": round(seconds, 3), "useful_tokens": useful, "tokens_per_s": round(useful / seconds, 2),
            "short_requests": sum(len(t) < n for t, n in zip(tokens, workload.output_lens)),
            "tokens": tokens}


def measure(name: str, fn: Callable[[], dict], guarded: bool = True) -> dict:
    """Run one system, noting the load average around it. If ``guarded``, an exception becomes
    ``{"error": ...}`` so the other systems still report (a failure of berth itself is raised)."""
    label = LABELS.get(name, name)
    print(f"[{clock()}] {label}: running", flush=True)
    load_before = os.getloadavg()[0]
    try:
        result = fn()
    except Exception as exc:
        if not guarded:
            raise
        result = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"[{clock()}] {label}: FAILED: {result['error']}", flush=True)
    else:
        print(f"[{clock()}] {label}: {result['seconds']:.1f} s, {result['tokens_per_s']:.1f} useful tok/s",
              flush=True)
    result["load_average_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return result


def agreement(results: dict) -> None:
    """Per baseline, how many requests' greedy tokens equal berth's (a check that all ran the same work)."""
    berth = results["berth"]["tokens"]
    for name, r in results.items():
        if name != "berth" and "tokens" in r:
            r["same_tokens_as_berth"] = sum(a == b for a, b in zip(berth, r["tokens"]))


def clock() -> str:
    return datetime.now().strftime("%H:%M:%S")


# ---------------------------------------------------------------- compute roof and model FLOPs
def measure_roof(config, dtype: str) -> dict:
    """The machine's best matmul rate (GFLOP/s) on the model's MLP shapes, best of ``ROOF_REPEATS``:
    PyTorch's ``a @ b`` (MKL, what transformers runs) and berth's own linear (oneDNN with the weight
    reordered once, ``worker.model.linear``), which is the faster on AMD CPUs, where MKL runs AVX2 code."""
    h, m = config.hidden_size, config.intermediate_size
    shapes = [(rows, k, n) for rows in ROOF_ROWS for k, n in ((h, m), (m, h))]
    rates = {}
    for rows, k, n in shapes:
        a = torch.randn(rows, k, dtype=DTYPES[dtype])
        b = torch.randn(k, n, dtype=DTYPES[dtype])
        linear = make_linear(b.t().contiguous())
        flops = 2 * rows * k * n
        rates[f"torch [{rows},{k}]x[{k},{n}]"] = round(_best_rate(lambda: a @ b, flops) / 1e9, 2)
        rates[f"berth [{rows},{k}]x[{k},{n}]"] = round(_best_rate(lambda: linear(a), flops) / 1e9, 2)
    torch_best = max(v for key, v in rates.items() if key.startswith("torch"))
    return {"gflops_by_shape": rates, "torch_matmul_gflops": torch_best, "roof_gflops": max(rates.values())}


def _best_rate(product: Callable[[], object], flops: int) -> float:
    """FLOP/s of ``product()``: the best of ``ROOF_REPEATS`` timings of enough calls to take ~0.1 s."""
    product()  # warm-up
    t0 = time.perf_counter()
    product()
    iters = max(1, int(0.1 / max(time.perf_counter() - t0, 1e-6)))
    best = float("inf")
    for _ in range(ROOF_REPEATS):
        t0 = time.perf_counter()
        for _ in range(iters):
            product()
        best = min(best, (time.perf_counter() - t0) / iters)
    return flops / best


def head_dim(config) -> int:
    """The attention head size (configs without ``head_dim`` imply hidden / heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def linear_params_per_token(config) -> int:
    """Weights of the decoder's linear layers (embedding and LM head excluded): FLOPs/2 per token."""
    h, m = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = head_dim(config)
    per_layer = h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * m
    return config.num_hidden_layers * per_layer


def berth_model_flops(config, workload: Workload, engine: dict) -> dict:
    """FLOPs berth's forward passes did, by part.

    Linear: 2 x linear weights x tokens run through the model (prompt tokens computed, tokens
    recomputed after preemption, and every output token but each request's last). LM head:
    2 x vocab x hidden per sampled token. Attention: 4 x layers x heads x head_dim x the context
    each token attends to, counting every position of every request once (so approximately:
    prefix-cache hits and recomputation are ignored here).
    """
    tokens_run = (engine["prompt_tokens_computed"] + engine["recomputed_tokens"]
                  + engine["output_tokens"] - len(workload))
    contexts = sum((len(p) + n - 1) * (len(p) + n) // 2 for p, n in zip(workload.prompts, workload.output_lens))
    flops = {
        "linear": 2 * linear_params_per_token(config) * tokens_run,
        "lm_head": 2 * config.vocab_size * config.hidden_size * engine["output_tokens"],
        "attention": 4 * config.num_hidden_layers * config.num_attention_heads * head_dim(config) * contexts,
    }
    return {"tokens_run": tokens_run, "gflop": {k: round(v / 1e9, 2) for k, v in flops.items()},
            "total_gflop": round(sum(flops.values()) / 1e9, 2)}


def compute_share(flops: dict, roof: dict, berth: dict) -> dict:
    """The roof, berth's FLOPs, and what they make over berth's wall time: GFLOP/s and share of the roof."""
    achieved = flops["total_gflop"] / berth["seconds"]
    return {**roof, **flops, "achieved_gflops": round(achieved, 2),
            "share_of_roof": round(achieved / roof["roof_gflops"], 4)}


# ---------------------------------------------------------------- report
def structured_figures(free: dict, constrained: dict, share: float) -> dict:
    """Unconstrained against ``share``-constrained useful tokens/s, their ratio, the grammar's cost."""
    return {"share": share, "tokens_per_s_unconstrained": free["tokens_per_s"],
            "tokens_per_s_constrained": constrained["tokens_per_s"],
            "ratio": round(constrained["tokens_per_s"] / free["tokens_per_s"], 3),
            "short_requests_constrained": constrained["short_requests"],
            "load_average_1m": constrained["load_average_1m"], **constrained["grammar"]}


def penalty_figures(plain: list[dict], penalized: list[dict]) -> dict:
    """Each interleaved run's useful tokens/s, without and with penalties, and the ratio of the medians."""
    a = sorted(r["tokens_per_s"] for r in plain)
    b = sorted(r["tokens_per_s"] for r in penalized)
    median = lambda v: (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2  # noqa: E731
    return {"penalties": {k: list(v) if isinstance(v, tuple) else v for k, v in PENALTIES.items()},
            "tokens_per_s_plain": [r["tokens_per_s"] for r in plain],
            "tokens_per_s_penalized": [r["tokens_per_s"] for r in penalized],
            "load_average_1m": [r["load_average_1m"] for r in plain + penalized],
            "penalty_seconds": [r["penalty_seconds"] for r in penalized],
            "penalty_share_of_run": [round(r["penalty_seconds"] / r["seconds"], 4) for r in penalized],
            "ratio_of_medians": round(median(b) / median(a), 3)}


def speculation_figures(off: list[dict], auto: list[dict]) -> dict:
    """Each interleaved run's useful tokens/s with speculation off and auto, the ratio of the medians and of
    each round's pair; and how many requests' outputs in each auto run are the first off run's, token for token."""
    median = lambda v: (sorted(v)[(len(v) - 1) // 2] + sorted(v)[len(v) // 2]) / 2  # noqa: E731
    a, b = [r["tokens_per_s"] for r in off], [r["tokens_per_s"] for r in auto]
    return {"tokens_per_s_off": a, "tokens_per_s_auto": b,
            "load_average_1m": [r["load_average_1m"] for r in off + auto],
            "round_ratios": [round(y / x, 3) for x, y in zip(a, b)],
            "ratio_of_medians": round(median(b) / median(a), 3),
            "draft_tokens": [r["engine"]["draft_tokens"] for r in auto],
            "accepted_tokens": [r["engine"]["accepted_tokens"] for r in auto],
            "same_outputs": [sum(x == y for x, y in zip(r["tokens"], off[0]["tokens"])) for r in auto],
            "requests": len(off[0]["tokens"])}


def ratios(results: dict) -> dict:
    """berth's useful tokens/s over each baseline's that ran."""
    berth = results["berth"]["tokens_per_s"]
    return {f"berth/{name}": round(berth / r["tokens_per_s"], 2)
            for name, r in results.items() if name != "berth" and "tokens_per_s" in r}


def print_report(report: dict) -> None:
    print(f"\n{report['workload']['requests']} requests, {report['workload']['prompt_tokens']} prompt tokens, "
          f"{report['workload']['output_tokens']} useful output tokens; {report['dtype']}, "
          f"{machine_line(report['machine'])}")
    print(f"{'system':<26}{'seconds':>10}{'useful tok':>12}{'tok/s':>10}{'same as berth':>15}")
    for name, r in report["systems"].items():
        if "error" in r:
            print(f"{LABELS[name]:<26}  error: {r['error']}")
            continue
        same = f"{r['same_tokens_as_berth']}/{report['workload']['requests']}" if "same_tokens_as_berth" in r else ""
        print(f"{LABELS[name]:<26}{r['seconds']:>10.1f}{r['useful_tokens']:>12}{r['tokens_per_s']:>10.1f}{same:>15}")
    for key, value in report["ratios"].items():
        print(f"{key}: {value:.2f}x")
    c = report["compute"]
    print(f"\nroof (best matmul): {c['roof_gflops']:.1f} GFLOP/s (PyTorch's matmul alone: "
          f"{c['torch_matmul_gflops']:.1f})  {c['gflops_by_shape']}")
    print(f"berth model FLOPs: {c['total_gflop']:.1f} GFLOP {c['gflop']} -> {c['achieved_gflops']:.1f} GFLOP/s, "
          f"{100 * c['share_of_roof']:.1f}% of the roof, {c['achieved_gflops'] / c['torch_matmul_gflops']:.2f}x "
          "PyTorch's matmul rate")
    e = report["systems"]["berth"]["engine"]
    kv = e["kv"]
    print(f"berth KV: peak {kv['peak_blocks_used']}/{kv['blocks_total']} blocks of {kv['block_size']} tokens "
          f"({100 * kv['peak_share']:.1f}%), mean slot utilization {100 * e['mean_slot_utilization']:.1f}%; "
          f"prompt tokens computed {e['prompt_tokens_computed']}, cached {e['prompt_tokens_cached']}; "
          f"{e['steps']} steps ({e['forward_seconds']:.1f} s in forward), {e['preemptions']} preemptions")
    if "structured" in report:
        st = report["structured"]
        print(f"structured outputs: {st['tokens_per_s_constrained']:.1f} useful tok/s with {100 * st['share']:.0f}% "
              f"of requests constrained against {st['tokens_per_s_unconstrained']:.1f} unconstrained: ratio "
              f"{st['ratio']:.3f}; grammar {st['ms_per_step']:.2f} ms per constrained step, "
              f"{st['ms_per_row']:.3f} ms per constrained row ({st['seconds']})")


def plot(report: dict, path: Path) -> None:
    """Bar plot of useful output tokens/s per system that ran (skipped, saying so, without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        print(f"no plot: matplotlib is not installed (pip install -e '.[bench]'); "
              f"the figures are in {path.with_suffix('.json')}")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [name for name, r in report["systems"].items() if "tokens_per_s" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar([LABELS[n] for n in ran], [report["systems"][n]["tokens_per_s"] for n in ran],
                  color=[COLORS[n] for n in ran])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("useful output tokens / s")
    w = report["workload"]
    ax.set_title(f"{w['requests']} requests, {report['dtype']}, threads={report['machine']['threads']} "
                 f"({report['date'][:10]})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def save_report(report: dict, out: Path) -> None:
    """The report as JSON at ``out`` (folders made as needed)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")


def write_report(report: dict, out: Path) -> None:
    save_report(report, out)
    plot(report, out.with_suffix(".png"))


# ---------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, DTYPES[args.dtype])
    config = loaded.config
    workload = make_workload(loaded.tokenizer, args.requests, args.seed)
    pad_id = loaded.tokenizer.pad_token_id
    pad_id = config.eos_token_id if pad_id is None else pad_id
    print(f"[{clock()}] workload: {workload.summary()}", flush=True)

    settings = berth_settings(args, workload, config)
    roof = measure_roof(config, args.dtype)
    results = {"berth": measure("berth", lambda: run_berth(loaded, workload, settings), guarded=False)}
    structured = None
    if args.structured_share:
        constrained = measure("berth", lambda: run_berth(loaded, workload, settings, args.structured_share),
                              guarded=False)
        structured = structured_figures(results["berth"], constrained, args.structured_share)
    penalties = None
    if args.penalty_rounds:
        plain, penalized = [results["berth"]], []
        for i in range(args.penalty_rounds):  # plain, P, P, plain, plain, P, ...: drift falls on both alike
            order = (True, False) if i % 2 == 0 else (False, True)
            for with_penalties in order:
                run = measure("berth", lambda: run_berth(loaded, workload, settings, penalized=with_penalties),
                              guarded=False)
                (penalized if with_penalties else plain).append(run)
        penalties = penalty_figures(plain, penalized)
    speculation = None
    if args.speculation_rounds:
        runs: dict[str, list[dict]] = {"off": [], "auto": []}
        for i in range(args.speculation_rounds):  # off, auto, auto, off, ...: drift falls on both alike
            for mode in (("off", "auto") if i % 2 == 0 else ("auto", "off")):
                runs[mode].append(measure("berth", lambda: run_berth(loaded, workload, settings, speculation=mode),
                                          guarded=False))
        speculation = speculation_figures(runs["off"], runs["auto"])
    loaded = None  # the engine's copy of the weights went with run_berth; free these before transformers loads
    gc.collect()
    if {"static", "continuous"} - args.skip:
        model = load_hf_model(args.model, args.dtype)
        if "static" not in args.skip:
            results["static"] = measure("static", lambda: run_static(model, workload, pad_id))
        if "continuous" not in args.skip:
            kv = results["berth"]["engine"]["kv"]
            results["continuous"] = measure("continuous",
                                            lambda: run_continuous(model, workload, settings, kv, pad_id))

    agreement(results)
    for r in results.values():
        r.pop("tokens", None)
    flops = berth_model_flops(config, workload, results["berth"]["engine"])
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "dtype": args.dtype,
        "quick": args.quick, "model": args.model,
        "settings": {"kv_memory": args.kv_memory, "block_size": settings.block_size,
                     "max_num_batched_tokens": settings.max_num_batched_tokens, "max_num_seqs": settings.max_num_seqs},
        "machine": machine_info(args.threads), "workload": workload.summary(), "systems": results,
        "ratios": ratios(results), "compute": compute_share(flops, roof, results["berth"]),
    }
    if structured:
        report["structured"] = structured
    if speculation:
        report["speculation"] = speculation
        print(f"speculation: useful tok/s off {speculation['tokens_per_s_off']}, auto "
              f"{speculation['tokens_per_s_auto']}: ratio of medians {speculation['ratio_of_medians']:.3f}, "
              f"same-round ratios {speculation['round_ratios']}")
    if penalties:
        report["penalties"] = penalties
        print(f"penalties: useful tok/s plain {penalties['tokens_per_s_plain']}, penalised "
              f"{penalties['tokens_per_s_penalized']}: ratio of medians {penalties['ratio_of_medians']:.3f}")
    print_report(report)
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
