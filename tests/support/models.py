"""Tiny random models saved as safetensors folders, and prompts cut from real text."""

from __future__ import annotations

from pathlib import Path

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
