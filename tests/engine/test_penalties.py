"""Penalties, logit_bias and min_p: the processed logits against transformers' own processors and
OpenAI's formula, and the engine's tokens against a reference loop over the model's logits, in
mixed batches (every row its own parameters), also after a resume from generated tokens."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from tests.support.models import cut_prompts
from worker.engine.engine import Engine
from worker.engine.penalties import TokenCounts, process
from worker.engine.request import Request, SamplingParams
from worker.engine.sampler import SampleRow, apply_min_p, sample, uniform

VOCAB = 1000

MIXED = [  # every row different; the first takes none of it, as a neighbour must not change it
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, repetition_penalty=0.8, frequency_penalty=0.4),
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, frequency_penalty=1.5, presence_penalty=-0.7),
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, presence_penalty=2.0,
                   logit_bias=((13, 3.5), (260, -100.0), (900, 7.25))),
    SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, frequency_penalty=-2.0, repetition_penalty=1.1,
                   logit_bias=((42, 100.0),)),
]


def reference_process(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row as the references have it: OpenAI's bias, transformers' RepetitionPenaltyLogitsProcessor
    over prompt and output, then OpenAI's frequency/presence formula over the output."""
    x = logits.clone()[None]
    for t, b in p.logit_bias:
        x[0, t] += b
    if p.repetition_penalty != 1:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([prompt + output]), x)
    c = torch.zeros(x.shape[-1])
    for t in output:
        c[t] += 1
    return x[0] - (c * p.frequency_penalty + (c > 0).float() * p.presence_penalty)


def test_processed_logits_match_transformers_and_openai():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(MIXED), VOCAB, generator=gen) * 4
    histories = [(torch.randint(0, VOCAB, (20,), generator=gen).tolist(),
                  torch.randint(0, 40, (30 + i,), generator=gen).tolist()) for i in range(len(MIXED))]
    counts = [TokenCounts.of(prompt + out, len(prompt)) for prompt, out in histories]
    got = process(logits.clone(), MIXED, counts)
    for i, (p, (prompt, out)) in enumerate(zip(MIXED, histories)):
        torch.testing.assert_close(got[i], reference_process(logits[i], p, prompt, out), atol=1e-5, rtol=0)
    # kept incrementally: a token added equals counts rebuilt from the longer history
    counts[3].add(7)
    counts[3].add(histories[3][1][0])
    rebuilt = TokenCounts.of(histories[3][0] + histories[3][1] + [7, histories[3][1][0]], len(histories[3][0]))
    assert (counts[3].slot, counts[3].ids, counts[3].output) == (rebuilt.slot, rebuilt.ids, rebuilt.output)


def test_min_p_matches_transformers_per_row():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, VOCAB, generator=gen) * 3
    min_p = [0.0, 0.05, 0.3, 1.0]
    got = apply_min_p(x.clone(), min_p)
    for i, m in enumerate(min_p):
        want = MinPLogitsWarper(m)(None, x[i:i + 1].clone())[0] if m else x[i]
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want))
        torch.testing.assert_close(got[i][~torch.isinf(got[i])], want[~torch.isinf(want)], atol=1e-5, rtol=0)


def test_a_grammar_mask_holds_against_a_bias_and_rows_without_processing_are_untouched():
    """A bias of +100 on a token the grammar forbids does not get it sampled; the unprocessed
    neighbour row samples what it samples alone."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, VOCAB, generator=gen)
    allowed = np.zeros(VOCAB + (-VOCAB % 32), dtype=np.bool_)
    allowed[[5, 6, 7]] = True
    bitmask = torch.from_numpy(np.packbits(allowed, bitorder="little").view(np.int32)[None].copy())
    biased = SamplingParams(temperature=0, logit_bias=((900, 100.0), (6, 5.0)), frequency_penalty=1.0)
    rows = [SampleRow(biased, 0, 10, 3, (), TokenCounts.of([1, 2, 900, 900, 6], 2)),
            SampleRow(SamplingParams(temperature=0), 0, 10, 3, ())]
    out = sample(logits.clone(), rows, ([0], bitmask))
    assert out.token_ids[0] in (5, 6, 7)
    assert out.token_ids[1] == int(logits[1].argmax())


# ---------------------------------------------------------------- the engine on the default model
@pytest.fixture(scope="module")
def engine(smol_loaded):
    return Engine(loaded=smol_loaded, kv_memory="1GiB", max_num_batched_tokens=512)


def run(engine, prompts, params, resume=None):
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(Request(f"r{i}", prompt, p, resume_output_ids=[resume[i]] if resume else []))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[int(out.request_id[1:])] = out
    return [done[i].completions[0] for i in range(len(prompts))]


def reference_tokens(hf_model, prompt: list[int], p: SamplingParams) -> list[int]:
    """The model's logits step by step, processed by the references, then argmax, or berth's draw
    (the same uniform number inverting the CDF) after temperature and transformers' MinPLogitsWarper."""
    out: list[int] = []
    past, step_ids = None, prompt
    with torch.no_grad():
        for _ in range(p.max_tokens):
            result = hf_model(torch.tensor([step_ids]), past_key_values=past, use_cache=True)
            past, logits = result.past_key_values, result.logits[0, -1].float()
            x = reference_process(logits, p, prompt, out)
            if p.greedy:
                out.append(int(x.argmax()))
                step_ids = out[-1:]
                continue
            x = x / p.temperature
            if p.min_p:
                x = MinPLogitsWarper(p.min_p)(None, x[None])[0]
            cdf = torch.softmax(x, -1).cumsum(-1)
            u = uniform(p.seed, 0, len(prompt) + len(out))
            out.append(min(int(torch.searchsorted(cdf, torch.tensor([u]) * cdf[-1], right=True)), len(cdf) - 1))
            step_ids = out[-1:]
    return out


def sampled_mix() -> list[SamplingParams]:
    return [replace(p, temperature=0.8 + 0.1 * i, seed=100 + i, min_p=(0.0, 0.05, 0.1, 0.2, 0.02, 0.3)[i])
            for i, p in enumerate(MIXED)]


@pytest.mark.slow
@pytest.mark.parametrize("mix", ["greedy", "sampled"])
def test_engine_tokens_match_a_reference_loop_also_after_a_resume(engine, hf_smol, text_ids, mix):
    params = MIXED if mix == "greedy" else sampled_mix()
    prompts = cut_prompts(text_ids, [12, 30, 19, 25, 8, 40])
    got = run(engine, prompts, params)
    for prompt, p, c in zip(prompts, params, got):
        assert c.token_ids == reference_tokens(hf_smol, prompt, p), p
    resumed = run(engine, prompts, params, resume=[c.token_ids[:5 + i] for i, c in enumerate(got)])
    assert [c.token_ids for c in resumed] == [c.token_ids for c in got]


def test_penalties_change_the_output(engine, text_ids):
    """Not a no-op: a strong presence penalty makes a looping greedy output use new tokens."""
    prompt = cut_prompts(text_ids, [30])[0]
    plain, penalized = run(engine, [prompt, prompt], [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                                                      SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                                     presence_penalty=2.0)])
    assert plain.token_ids != penalized.token_ids
    assert len(set(penalized.token_ids)) > len(set(plain.token_ids))
