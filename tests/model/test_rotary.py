"""berth's rotary tables against transformers' rotary modules, for every rope type berth computes, and
the types it refuses."""

from __future__ import annotations

import importlib

import pytest
import torch

from worker.model.base import ModelLoadError
from worker.model.rotary import inv_freq_and_scaling, rotary_tables

SHAPE = dict(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=4096)
CASES = {
    "llama-default": ("llama", {"rope_theta": 10000.0}),
    "llama-linear": ("llama", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "llama3": ("llama", {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 512}),
    "qwen2-theta": ("qwen2", {"rope_theta": 1000000.0}),
    "qwen3-yarn": ("qwen3", {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                             "original_max_position_embeddings": 1024}),
    "mistral-yarn-attention-factor": ("mistral", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                  "original_max_position_embeddings": 512, "beta_fast": 16.0,
                                                  "attention_factor": 0.9}),
    "phi3-partial": ("phi3", {"rope_theta": 10000.0, "partial_rotary_factor": 0.75}),
}


def hf_config_and_rotary(model_type: str, rope: dict):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **SHAPE, rope_parameters={"rope_type": "default", **rope})
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    rotary_class = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
    return config, rotary_class(config)


@pytest.mark.parametrize("case", list(CASES))
def test_tables_match_transformers(case):
    config, hf = hf_config_and_rotary(*CASES[case])
    inv_freq, scaling = inv_freq_and_scaling(config, 64)
    assert torch.equal(inv_freq, hf.inv_freq), "inverse frequencies differ"
    assert scaling == hf.attention_scaling
    cos, sin = rotary_tables(config, 64, torch.device("cpu"), torch.float32)
    positions = torch.tensor([[0, 1, 100, 1023, 4095]])
    hf_cos, hf_sin = hf(torch.zeros(1, dtype=torch.float32), positions)
    assert torch.equal(cos[positions[0]], hf_cos[0]) and torch.equal(sin[positions[0]], hf_sin[0])


def test_dynamic_rope_is_refused_with_the_reason():
    config, _ = hf_config_and_rotary("llama", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ModelLoadError, match="'dynamic'.*sequence's length.*llama3"):
        inv_freq_and_scaling(config, 64)
