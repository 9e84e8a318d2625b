"""Greedy tokens and float32 logits of the engine against Hugging Face transformers, on the default
model and a tiny Llama (the other architectures: test_architectures.py).

All prompts are submitted at once, the token budget forces chunked prefill to split them, and half
the prompts are prefixes of one another so the prefix cache serves blocks to later ones.
"""

from __future__ import annotations

import pytest

from tests.support.exactness import check_against_hf, make_prompts
from worker.engine.engine import Engine


@pytest.mark.slow
def test_default_model_matches_transformers(smol_loaded, hf_smol, text_ids):
    engine = Engine(loaded=smol_loaded, kv_memory="512MiB", max_num_batched_tokens=128, block_size=16)
    prompts = make_prompts(text_ids)
    # transformers' own generate on the first prompt only (seconds of CPU a prompt; the tiny models run it on all)
    check_against_hf(hf_smol, engine, prompts, generate_every=len(prompts))
    assert engine.stats.prompt_tokens_cached > 0, "the shared prefixes never hit the prefix cache"
    assert engine.stats.prompt_tokens_computed + engine.stats.prompt_tokens_cached == sum(map(len, prompts))


@pytest.mark.parametrize("block_size,backend", [(16, "auto"), (32, "torch")])
def test_tiny_gqa_untied_llama_matches_transformers(tiny_loaded, hf_tiny, text_ids, block_size, backend):
    engine = Engine(loaded=tiny_loaded, kv_memory="64MiB", max_num_batched_tokens=96, block_size=block_size,
                    attention_backend=backend)
    check_against_hf(hf_tiny, engine, make_prompts(text_ids))
    assert engine.stats.prompt_tokens_cached > 0
