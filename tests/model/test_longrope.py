"""LongRoPE (Phi-3's long-context models) against transformers' generate.

transformers rotates a prompt longer than ``original_max_position_embeddings`` with the long
factors throughout, and a shorter sequence with the short ones until its generated tokens pass that
length, then the long ones for those tokens alone. A tiny random Phi-3 with a threshold of 48
tokens runs a prompt that stays short, one whose generation crosses the threshold, and long prompts
that share their first blocks with a short one (which must not reuse the short one's KV blocks,
rotated otherwise), with chunked prefill and the prefix cache: greedy tokens must be transformers'
and float32 logits within 1e-3 of those its generate computed.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.models import cut_prompts, save_tiny_model
from worker.engine.engine import Engine
from worker.engine.request import SamplingParams
from worker.model.loader import load_model
from worker.model.rotary import inv_freq_and_scaling, rotary_tables

THRESHOLD = 48
ROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
        "short_factor": [1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0],
        "long_factor": [1.0, 2.0, 3.5, 5.0, 8.0, 12.0, 16.0, 24.0]}


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory, smol_tokenizer):
    from transformers import Phi3Config, Phi3ForCausalLM

    return save_tiny_model(Phi3Config, Phi3ForCausalLM, smol_tokenizer, tmp_path_factory.mktemp("phi3-longrope"),
                           seed=0, random_vectors=True, tie_word_embeddings=False, pad_token_id=0,
                           max_position_embeddings=256, original_max_position_embeddings=THRESHOLD,
                           rope_parameters=ROPE)


def test_both_tables_match_transformers(phi3_longrope):
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = AutoConfig.from_pretrained(str(phi3_longrope))
    hf = Phi3RotaryEmbedding(config)
    inv_freq, scaling = inv_freq_and_scaling(config, 16)
    assert torch.equal(inv_freq, hf.inv_freq) and scaling == hf.attention_scaling > 1
    cos, sin = rotary_tables(config, 16, torch.device("cpu"), torch.float32)
    assert cos.shape[0] == 2 * 256
    short, long = torch.tensor([[0, 5, THRESHOLD - 1]]), torch.tensor([[0, 5, THRESHOLD - 1, THRESHOLD, 255]])
    for positions, row in ((short, 0), (long, 256)):
        hf_cos, hf_sin = hf(torch.zeros(1), positions)  # transformers picks the table by the largest position
        assert torch.equal(cos[positions[0] + row], hf_cos[0]) and torch.equal(sin[positions[0] + row], hf_sin[0])


def test_generation_matches_transformers_on_both_sides_of_the_threshold(phi3_longrope, text_ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(phi3_longrope), dtype=torch.float32).eval()
    engine = Engine(loaded=load_model(str(phi3_longrope), torch.float32), kv_memory="16MiB",
                    max_num_batched_tokens=24, block_size=16)
    shared = cut_prompts(text_ids, [120], stride=977)[0]
    # short and staying short; short and crossing while generating; long; long sharing 2 blocks with the first
    elsewhere = text_ids[len(text_ids) // 2:][:40]
    prompts = [shared[:20], elsewhere, shared[:100], shared[:32] + shared[60:120]]
    new_tokens = [20, 24, 16, 16]
    captured = {}
    original = engine._sampling_rows

    def spy(logits, samplers, scheduler):
        for row, seq in zip(logits, samplers):
            captured[(seq.request.request_id, seq.num_tokens)] = row.clone()
        return original(logits, samplers, scheduler)

    engine._sampling_rows = spy
    assert len(prompts[1]) + new_tokens[1] > THRESHOLD > len(prompts[1])
    for i, (prompt, n) in enumerate(zip(prompts, new_tokens)):  # in turn: later prompts find earlier blocks
        captured.clear()
        [out] = engine.generate([prompt], SamplingParams(max_tokens=n, min_tokens=n, temperature=0))
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        assert out.completions[0].token_ids == ref.sequences[0, len(prompt):].tolist(), f"prompt {i}"
        [request_id] = {key[0] for key in captured}
        ours = torch.stack([captured[(request_id, len(prompt) + j)] for j in range(n)])
        assert (ours - torch.cat(ref.logits)).abs().max().item() < 1e-3, f"prompt {i}"
    # the last prompt found the two blocks it shares with the long one before it; the long one found
    # nothing of the short first prompt, whose blocks are rotated with the short factors
    assert engine.stats.prompt_tokens_cached == 32
