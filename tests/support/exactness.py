"""Checks of the engine against Hugging Face transformers, shared by test_exactness.py and
test_architectures.py: prompts that chunked prefill splits and the prefix cache shares, greedy tokens
against transformers' argmax and ``generate``, and float32 logits against its forward pass."""

from __future__ import annotations

import torch

from tests.support.models import cut_prompts
from worker.engine.engine import Engine
from worker.engine.request import SamplingParams
from worker.engine.speculative.verifier import row_offsets

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
        kept = logits.clone()
        # a sequence verifying drafts has a row for each (speculation): the j-th is position num_tokens + j;
        # a row past a rejected draft is written again by the step that samples its position
        for row, seq, offset in zip(kept, samplers, row_offsets(samplers)):
            captured[(seq.request.request_id, seq.num_tokens + offset)] = row
        return original(logits, samplers, scheduler)

    engine._sampling_rows = spy
    return engine.generate(prompts, params), captured


def hf_greedy(hf, prompt, n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                      do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check_against_hf(hf, engine, prompts, generate_every: int = 1, new_tokens: int = NEW_TOKENS):
    """Our greedy tokens must be transformers' argmax at every position given the same prefix (its
    forward pass over prompt + our tokens), which by induction is what its greedy ``generate``
    yields; ``generate`` itself runs one prompt at a time on every ``generate_every``-th prompt.
    Our sampled logits must be within 1e-3 of that forward pass."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, min_tokens=new_tokens)
    outputs, captured = run_capturing_logits(engine, prompts, params)
    eos = list(engine.eos_token_ids)
    worst = 0.0
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        ours = out.completions[0].token_ids
        assert len(ours) == new_tokens
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + ours[:-1]]), logits_to_keep=new_tokens).logits[0]  # positions sampled
        sampled = torch.stack([captured[(str(i), len(prompt) + j)] for j in range(new_tokens)])
        worst = max(worst, (sampled - ref).abs().max().item())
        ref[:, eos] = float("-inf")  # min_tokens: EOS is not a candidate, in either system
        assert ours == ref.argmax(-1).tolist(), f"prompt {i} ({len(prompt)} tokens): greedy tokens differ"
        if i % generate_every == 0:
            assert ours == hf_greedy(hf, prompt, new_tokens), f"prompt {i}: transformers' generate differs"
    assert worst < 1e-3, f"logits differ from transformers by {worst}"
    return worst


def greedy_with(loaded, setting: str, values, texts, max_tokens: int = 24):
    """An engine of ``loaded`` per value of ``setting`` and the greedy tokens of ``texts`` through each:
    ``(engines, tokens)``, both keyed by the value."""
    engines, tokens = {}, {}
    for value in values:
        engine = Engine(loaded=loaded, kv_memory="64MiB", threads=2, **{setting: value})
        prompts = [engine.tokenizer.encode(t) for t in texts]
        outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        engines[value], tokens[value] = engine, [o.completions[0].token_ids for o in outs]
    return engines, tokens
