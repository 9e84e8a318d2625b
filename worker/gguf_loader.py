"""Read a model from a GGUF file: its config as transformers' config class, its weights dequantised
under Hugging Face names in the compute dtype, and its tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from worker.model_loader import SUPPORTED_ARCHITECTURES, LoadedModel, ModelLoadError, check_complete, hf_weight_names
from worker.tokenizer import load_tokenizer


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows so rotate-half rotary embeddings apply."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader):
    from transformers import LlamaConfig

    arch = _gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (berth runs {SUPPORTED_ARCHITECTURES})")
    g = lambda key, default=None: _gguf_field(reader, f"{arch}.{key}", default)  # noqa: E731
    scaling = g("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling {scaling!r} is not supported yet")
    hidden, heads = g("embedding_length"), g("attention.head_count")
    tensor_names = {t.name for t in reader.tensors}
    vocab = g("vocab_size") or len(_gguf_field(reader, "tokenizer.ggml.tokens"))
    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=g("feed_forward_length"),
        num_hidden_layers=g("block_count"), num_attention_heads=heads,
        num_key_value_heads=g("attention.head_count_kv", heads),
        head_dim=g("attention.key_length", hidden // heads),
        rms_norm_eps=g("attention.layer_norm_rms_epsilon", 1e-5), rope_theta=g("rope.freq_base", 10000.0),
        max_position_embeddings=g("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_gguf_field(reader, "tokenizer.ggml.eos_token_id"))


def load_gguf(path: Path, dtype: torch.dtype) -> LoadedModel:
    import gguf

    reader = gguf.GGUFReader(str(path))
    config = gguf_config(reader)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    wanted = hf_weight_names(config)
    by_gguf = {name_map.get_name(n.removesuffix(".weight")) + ".weight": n for n in wanted}
    weights = {}
    for tensor in reader.tensors:
        hf_name = by_gguf.get(tensor.name)
        if hf_name is None:
            continue  # e.g. rope_freqs: computed from the config instead
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = array.reshape([int(d) for d in reversed(tensor.shape)])
        if hf_name.endswith("q_proj.weight"):
            array = _unpermute_rope(array, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            array = _unpermute_rope(array, config.num_key_value_heads)
        weights[hf_name] = torch.from_numpy(np.array(array, dtype=np.float32)).to(dtype)
    check_complete(weights, wanted, path)
    return LoadedModel(config, weights, load_tokenizer(str(path)), str(path))
