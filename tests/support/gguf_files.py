"""Write a transformers model as a GGUF file the way llama.cpp's ``convert_hf_to_gguf.py`` does, so
berth's reader can be checked against the model it came from.

Written with the ``gguf`` package's ``GGUFWriter`` and its own HF-to-GGUF tensor name map; the
metadata keys, llama's Q/K row permutation and the Llama 3 ``rope_freqs`` factors follow the
converter. Returns what berth must read back for every weight (Hugging Face name -> float32 array):
the model's own weight for F32, and the dequantised stored bytes for the quantised types.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType
# the K-quants gguf cannot quantise: random blocks, with sane float16 scales at these byte offsets
RANDOM_BLOCKS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


def tokenizer_fields(path: str) -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """The ``tokenizer.*`` keys of the GGUF file at ``path``, to copy into another file (read with
    berth's index: GGUFReader takes seconds over the vocabulary; a wrong string shows up as the
    copied tokenizer encoding differently)."""
    from worker.model.gguf.index import StringArray, read_index, read_strings

    V = gguf.GGUFValueType
    fields = []
    for key, value in read_index(path).metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, StringArray):
            fields.append((key, read_strings(path, value), V.ARRAY, V.STRING))
        elif isinstance(value, np.ndarray):
            fields.append((key, value.tolist(), V.ARRAY, V.get_type(value[0].item())))
        else:
            fields.append((key, value, V.get_type(value), None))
    return fields


def write_gguf(path: Path, model, arch: str, qtype=Q.F32, tokenizer=(), seed: int = 0,
               qtypes: dict[str, Q] | None = None) -> dict[str, np.ndarray]:
    """``qtype`` for every 2-D weight but those ``qtypes`` names (Hugging Face name -> type); F32 for the rest."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    write_metadata(writer, config, arch)
    for key, value, vtype, sub_type in tokenizer:
        writer.add_key_value(key, value, vtype, sub_type)
    tied = config.tie_word_embeddings
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    rng = np.random.default_rng(seed)
    expected = {}
    rope = config.rope_parameters
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    if rope.get("rope_type") == "longrope":  # Phi3MiniModel.generate_extra_tensors
        scale = config.max_position_embeddings / config.original_max_position_embeddings
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale)
                                                       / math.log(config.original_max_position_embeddings)))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        weight = tensor.detach().float().numpy()
        rows = _llama_row_order(name, weight.shape[0], config) if arch == "llama" else np.arange(weight.shape[0])
        tensor_qtype = (qtypes or {}).get(name, qtype) if weight.ndim == 2 else Q.F32
        stored, back = _store(weight[rows], tensor_qtype, rng)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        writer.add_tensor(gguf_name, stored, raw_dtype=None if stored.dtype == np.float32 else tensor_qtype)
        expected[name] = np.empty_like(back)
        expected[name][rows] = back  # undo the permutation: what a Hugging Face model would hold
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def write_metadata(writer, config, arch: str) -> None:
    hidden, heads = config.hidden_size, config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    if arch in ("llama", "qwen3"):  # their configs carry head_dim
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(config.head_dim)
    if arch == "phi3":
        writer.add_rope_dimension_count(int(config.rope_parameters["partial_rotary_factor"] * hidden) // heads)
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_sliding_window(config.sliding_window or 0)


def _llama_row_order(name: str, n_rows: int, config) -> np.ndarray:
    """llama.cpp's permutation of Q and K rows (``LlamaModel.permute``) as a row order."""
    if not name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
        return np.arange(n_rows)
    heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
    return np.arange(n_rows).reshape(heads, 2, n_rows // heads // 2).swapaxes(1, 2).reshape(n_rows)


def _store(weight: np.ndarray, qtype, rng) -> tuple[np.ndarray, np.ndarray]:
    """(what the file holds, what reading it gives back as float32)."""
    if qtype == Q.F32:
        return weight, weight
    if qtype in RANDOM_BLOCKS:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (weight.size // block_size, type_size), dtype=np.uint8)
        for at in RANDOM_BLOCKS[qtype]:
            scales = rng.uniform(1e-3, 1e-2, blocks.shape[0]).astype(np.float16)
            blocks[:, at:at + 2] = scales.view(np.uint8).reshape(-1, 2)
        stored = blocks.reshape(weight.shape[0], -1)
    else:
        stored = gguf.quants.quantize(weight, qtype)
    return stored, gguf.quants.dequantize(stored, qtype).reshape(weight.shape)


def llama3_rope_factors(config) -> np.ndarray:
    """``LlamaModel.generate_extra_tensors`` of the converter, loop and all."""
    rope = config.rope_parameters
    dim = config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    old_context = rope["original_max_position_embeddings"]
    low_wavelength, high_wavelength = old_context / rope["low_freq_factor"], old_context / rope["high_freq_factor"]
    factors = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < high_wavelength:
            factors.append(1)
        elif wavelength > low_wavelength:
            factors.append(rope["factor"])
        else:
            smooth = ((old_context / wavelength - rope["low_freq_factor"])
                      / (rope["high_freq_factor"] - rope["low_freq_factor"]))
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


# Tiny random models of each family berth reads, as transformers builds them.
VOCAB = 49152  # the default model's tokenizer, copied into the files
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16384, rms_norm_eps=1e-5,
             bos_token_id=1, eos_token_id=2, pad_token_id=2)
# case -> (GGUF architecture, transformers class, config fields)
FAMILIES = {
    "llama": ("llama", "LlamaForCausalLM", dict(head_dim=16, tie_word_embeddings=False, rope_theta=10000.0,
                                                rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                                  high_freq_factor=4.0,
                                                                  original_max_position_embeddings=2048))),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False, rope_theta=1000000.0)),
    "phi3": ("phi3", "Phi3ForCausalLM", dict(tie_word_embeddings=False, partial_rotary_factor=0.5, sliding_window=32,
                                             original_max_position_embeddings=1024)),
    "phi3-longrope": ("phi3", "Phi3ForCausalLM", dict(
        tie_word_embeddings=True, original_max_position_embeddings=1024, rope_scaling=dict(  # float32 factors
            rope_type="longrope", long_factor=[1.0, 1.5, 2.25, 4.0, 6.5, 8.0, 12.0, 16.0],
            short_factor=[1.0, 1.0, 1.125, 1.25, 1.5, 1.75, 2.0, 2.5]))),
}


def random_model(case: str, **fields):
    import transformers

    _, class_name, extra = FAMILIES[case]
    model_class = getattr(transformers, class_name)
    torch.manual_seed(sum(map(ord, case)))
    model = model_class(model_class.config_class(**{**SMALL, "vocab_size": VOCAB, **extra, **fields}))
    with torch.no_grad():
        for p in model.parameters():  # norms and biases too, so that none is 1 or 0 everywhere
            p.normal_(0, 0.2)
    return model
