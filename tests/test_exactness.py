"""Greedy tokens and float32 logits of the engine against Hugging Face transformers.

All prompts are submitted at once, the token budget forces chunked prefill to split them, and half
the prompts are prefixes of one another so the prefix cache serves blocks to later ones.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import cut_prompts
from worker.engine import Engine
from worker.request import SamplingParams

NEW_TOKENS = 64
LENGTHS = [1, 2, 7, 15, 16, 17, 31, 33, 64, 100, 129, 200, 255, 300, 450, 600]


def make_prompts(text_ids):
    """16 prompts of 1..600 tokens; the last eight are prefixes of one 600-token text."""
    distinct = cut_prompts(text_ids, LENGTHS[:8])
    base = cut_prompts(text_ids, [600], stride=4321)[0]
    return distinct + [base[:n] for n in LENGTHS[8:]]


def run_capturing_logits(engine: Engine, prompts, params):
    """Generate, keeping each sampled row's logits keyed by (request id, position sampled)."""
    captured = {}
    original = engine._sampling_rows

    def spy(logits, samplers, scheduler):
        for row, seq in zip(logits, samplers):
            captured[(seq.request.request_id, seq.num_tokens)] = row.clone()
        return original(logits, samplers, scheduler)

    engine._sampling_rows = spy
    return engine.generate(prompts, params), captured


def hf_greedy(hf, prompt, n=NEW_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check_against_hf(hf, engine, prompts, generate_every: int = 1):
    """Our greedy tokens must be transformers' argmax at every position given the same prefix (its
    forward pass over prompt + our tokens), which by induction is what its greedy ``generate``
    yields; ``generate`` itself runs one prompt at a time on every ``generate_every``-th prompt.
    Our sampled logits must be within 1e-3 of that forward pass."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, min_tokens=NEW_TOKENS)
    outputs, captured = run_capturing_logits(engine, prompts, params)
    eos = list(engine.eos_token_ids)
    worst = 0.0
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        ours = out.completions[0].token_ids
        assert len(ours) == NEW_TOKENS
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + ours[:-1]])).logits[0, len(prompt) - 1:]
        candidates = ref.clone()
        candidates[:, eos] = float("-inf")  # min_tokens: EOS is not a candidate, in either system
        assert ours == candidates.argmax(-1).tolist(), f"prompt {i} ({len(prompt)} tokens): greedy tokens differ"
        if i % generate_every == 0:
            assert ours == hf_greedy(hf, prompt), f"prompt {i}: transformers' generate differs"
        for j in range(NEW_TOKENS):
            worst = max(worst, (captured[(str(i), len(prompt) + j)] - ref[j]).abs().max().item())
    assert worst < 1e-3, f"logits differ from transformers by {worst}"
    return worst


def test_default_model_matches_transformers(smol_loaded, hf_smol, text_ids):
    engine = Engine(loaded=smol_loaded, kv_memory="512MiB", max_num_batched_tokens=128, block_size=16)
    prompts = make_prompts(text_ids)
    check_against_hf(hf_smol, engine, prompts, generate_every=4)
    assert engine.stats.prompt_tokens_cached > 0, "the shared prefixes never hit the prefix cache"
    assert engine.stats.prompt_tokens_computed + engine.stats.prompt_tokens_cached == sum(map(len, prompts))


@pytest.mark.parametrize("block_size,backend", [(16, "auto"), (32, "torch")])
def test_tiny_gqa_untied_llama_matches_transformers(tiny_loaded, hf_tiny, text_ids, block_size, backend):
    engine = Engine(loaded=tiny_loaded, kv_memory="64MiB", max_num_batched_tokens=96, block_size=block_size,
                    attention_backend=backend)
    check_against_hf(hf_tiny, engine, make_prompts(text_ids))
    assert engine.stats.prompt_tokens_cached > 0
