"""A plain Llama folder's config.json read without transformers (``plain_llama_config``): the same fields
as transformers' LlamaConfig makes of it, defaults included; anything more than a plain Llama goes to
transformers' class."""

from __future__ import annotations

import json

import pytest

from tests.support.models import assert_config_equal
from worker.model.model_config import ModelConfig
from worker.model.safetensors_loader import plain_llama_config, read_config

SHAPE = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4}

PLAIN = {
    "transformers 5, rope_parameters": {**SHAPE, "num_key_value_heads": 2, "head_dim": 16,
                                         "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
                                         "tie_word_embeddings": False, "dtype": "float32", "use_cache": True},
    "older, rope_theta and defaults": {**SHAPE, "rope_theta": 500000.0, "rope_scaling": None,
                                       "rms_norm_eps": 1e-5, "architectures": ["LlamaForCausalLM"],
                                       "torch_dtype": "bfloat16", "max_position_embeddings": 8192,
                                       "bos_token_id": 128000, "eos_token_id": [128001, 128009]},
    "tied, biased, nothing but the shape": {**SHAPE, "tie_word_embeddings": True, "attention_bias": True},
}

NOT_PLAIN = {
    "llama3 rope scaling": {**SHAPE, "rope_theta": 500000.0,
                            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "scaled rope_parameters": {**SHAPE, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
    "a key it does not know": {**SHAPE, "sliding_window": 4096},
    "another family": {**SHAPE, "model_type": "qwen2"},
    "no shape": {"model_type": "llama"},
}


def _transformers(tmp_path, raw):
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(raw))
    return AutoConfig.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("case", list(PLAIN))
def test_a_plain_llama_reads_as_transformers_reads_it(tmp_path, case):
    raw = PLAIN[case]
    ours = plain_llama_config(raw)
    assert isinstance(ours, ModelConfig)
    theirs = _transformers(tmp_path, raw)
    assert_config_equal(ours, theirs)
    assert (ours.mlp_bias, ours.hidden_act) == (theirs.mlp_bias, theirs.hidden_act)
    assert isinstance(read_config(tmp_path), ModelConfig)  # the loader takes this way


@pytest.mark.parametrize("case", list(NOT_PLAIN))
def test_anything_more_goes_to_transformers_class(tmp_path, case):
    assert plain_llama_config(NOT_PLAIN[case]) is None
    if NOT_PLAIN[case].get("vocab_size"):
        (tmp_path / "config.json").write_text(json.dumps(NOT_PLAIN[case]))
        assert not isinstance(read_config(tmp_path), ModelConfig)
