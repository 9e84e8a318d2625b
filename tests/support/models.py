"""Tiny random models saved as safetensors folders, and prompts cut from real text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# The shape of every tiny test model: 2 layers, GQA 4:2, weights scaled up (initializer_range) so
# that greedy choices are not near-ties.
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, initializer_range=0.2,
                  bos_token_id=1, eos_token_id=2)


def save_tiny_model(config_class, model_class, tokenizer, path: Path, *, disk_dtype: torch.dtype | None = None,
                    max_shard_size: str | None = None, generation: dict | None = None, seed: int = 1234,
                    random_vectors: bool = False, **config_fields) -> Path:
    """A random model of ``TINY_SHAPE`` (and ``config_fields``) saved as a safetensors folder with
    the default model's tokenizer: in ``disk_dtype``, sharded past ``max_shard_size``, with
    ``generation`` set in its generation_config.json. ``random_vectors`` draws biases and norm
    weights too, which transformers starts at zeros and ones, where a bias left out or a norm's
    weight applied in the wrong place would change nothing."""
    torch.manual_seed(seed)
    model = model_class(config_class(**{"vocab_size": len(tokenizer), **TINY_SHAPE, **config_fields}))
    if random_vectors:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, 0.2)
                elif param.dim() == 1:
                    param.uniform_(0.5, 1.5)
    for key, value in (generation or {}).items():
        setattr(model.generation_config, key, value)
    if disk_dtype is not None:
        model = model.to(disk_dtype)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer.save_pretrained(path)
    return path


def cut_prompts(text_ids: list[int], lengths: list[int], stride: int = 997) -> list[list[int]]:
    """Prompts of the given lengths from different places of the text."""
    return [text_ids[(i * stride) % (len(text_ids) - n): (i * stride) % (len(text_ids) - n) + n]
            for i, n in enumerate(lengths)]


def assert_config_equal(ours, theirs):
    """berth's ``ModelConfig`` holds what transformers' config class of the family holds."""
    assert ours.model_type == theirs.model_type  # berth's ModelConfig against transformers' class
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "rope_parameters",
                  "bos_token_id", "eos_token_id", "pad_token_id",
                  "sliding_window", "original_max_position_embeddings"):
        assert getattr(ours, field, None) == getattr(theirs, field, None), field
    assert bool(ours.attention_bias) == bool(getattr(theirs, "attention_bias", False))  # absent: no biases
    heads = theirs.hidden_size // theirs.num_attention_heads  # what the model takes where a class has no head_dim
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or heads)
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)  # float32 in the file
