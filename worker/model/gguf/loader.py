"""Read a model from a GGUF file: its config (``worker.model.model_config``, the fields the transformers
config class of its family would hold), its weights under the names and shapes of that family's Hugging Face checkpoint
in the compute dtype, and its tokenizer.

The families are those of llama.cpp's converter (``convert_hf_to_gguf.py``) that berth runs:
``llama`` (Llama 2 and 3.x, Mistral), ``qwen2``, ``qwen3`` and ``phi3``. What the converter did is
undone here: it interleaves the rows of Llama's Q and K projections for its own rotary layout (the
other three families use the rotate-half layout already and are written as they are); it turns
Llama 3's rope scaling into a ``rope_freqs`` tensor of per-frequency factors, from which the
``rope_scaling`` parameters are recovered and checked against transformers' own computation.
Phi-3 keeps its fused ``qkv_proj`` and ``gate_up_proj`` in both formats.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from worker.model.base import LoadedModel, ModelLoadError, check_complete
from worker.model.gguf import weights_cache
from worker.model.gguf.index import GGUFIndex, read_index
from worker.model.gguf.tensors import open_data, read_tensor
from worker.model.model_config import ModelConfig
from worker.model.tokenizer import load_tokenizer
from worker.model.torch_threads import one_thread

log = logging.getLogger(__name__)

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(frozen=True)
class GGUFFamily:
    config_class: str  # the transformers config class whose fields ModelConfig holds
    layer_weights: tuple[str, ...]  # GGUF tensors every layer has (".weight")
    biased: tuple[str, ...] = ()  # GGUF tensors that also have a ".bias" when the config says so
    bias_field: str | None = None  # the config field saying so; None: always biased
    renamed: tuple[tuple[str, str], ...] = ()  # GGUF tensor -> Hugging Face name, where it differs
    permuted_qk: bool = False  # llama.cpp interleaved the rows of Q and K


_LLAMA_LAYER = ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                "ffn_gate", "ffn_up", "ffn_down")
ARCHITECTURES = {
    "llama": GGUFFamily("LlamaConfig", _LLAMA_LAYER, ("attn_q", "attn_k", "attn_v", "attn_output"),
                        "attention_bias", permuted_qk=True),
    "qwen2": GGUFFamily("Qwen2Config", _LLAMA_LAYER, ("attn_q", "attn_k", "attn_v")),
    "qwen3": GGUFFamily("Qwen3Config", (*_LLAMA_LAYER, "attn_q_norm", "attn_k_norm"),
                        ("attn_q", "attn_k", "attn_v", "attn_output"), "attention_bias"),
    "phi3": GGUFFamily("Phi3Config", ("attn_norm", "ffn_norm", "attn_qkv", "attn_output", "ffn_up", "ffn_down"),
                       renamed=(("ffn_up", "mlp.gate_up_proj"),)),
}


def load_gguf_config(path: str | Path):
    """The config of the GGUF file at ``path``, from its header alone."""
    return gguf_config(read_index(path))


def gguf_config(index: GGUFIndex) -> ModelConfig:
    arch, family = _family(index)
    meta = _Metadata(index, arch)
    hidden, heads = meta.required("embedding_length"), meta.required("attention.head_count")
    head_dim = meta.get("attention.key_length", hidden // heads)
    vocab = meta.get("vocab_size") or len(index.metadata.get("tokenizer.ggml.tokens", ()))
    fields = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=meta.required("feed_forward_length"),
        num_hidden_layers=meta.required("block_count"), num_attention_heads=heads,
        num_key_value_heads=meta.get("attention.head_count_kv", heads),
        rms_norm_eps=meta.get("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=meta.get("rope.freq_base", 10000.0),
        max_position_embeddings=meta.get("context_length", 2048),
        tie_word_embeddings="output.weight" not in index.tensors,
        bos_token_id=index.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=index.metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=index.metadata.get("tokenizer.ggml.padding_token_id"))
    if family.bias_field:
        fields[family.bias_field] = "blk.0.attn_q.bias" in index.tensors
    fields.update(_head_dim_field(arch, head_dim, hidden // heads))
    fields.update(_phi3_fields(index, meta, head_dim) if arch == "phi3" else _rope_scaling(index, meta, head_dim))
    return ModelConfig.of(arch, **fields)


def load_gguf(path: Path, dtype: torch.dtype) -> LoadedModel:
    index = read_index(path)
    config = gguf_config(index)
    weights = gguf_weights(index, config, dtype)
    return LoadedModel(config, weights, load_tokenizer(str(path)), str(path))


def gguf_weights(index: GGUFIndex, config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every weight of the file's model under its Hugging Face name, in ``dtype`` (on one thread:
    ``worker.model.torch_threads``): mapped from the weights cache (``weights_cache``) where an earlier
    load wrote them, else computed from the file and written there for the next load."""
    _, family = _family(index)
    used = _used_tensors(index, family, config)
    entry = weights_cache.entry_for(index, dtype) if _worth_caching(index, used, dtype) else None
    shapes = {hf_name: index.tensors[gguf_name].shape for gguf_name, hf_name in used.items()}
    with one_thread():
        return weights_cache.cached(entry, shapes, lambda: _gguf_weights(index, config, dtype, family, used))


def _gguf_weights(index: GGUFIndex, config, dtype: torch.dtype, family: GGUFFamily,
                  used: dict[str, str]) -> dict[str, torch.Tensor]:
    data = open_data(index.path)
    weights = {}
    for gguf_name, hf_name in used.items():
        tensor = read_tensor(data, index.tensors[gguf_name], dtype)
        if family.permuted_qk and gguf_name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = config.num_attention_heads if ".attn_q." in gguf_name else config.num_key_value_heads
            tensor = _unpermute_rope(tensor, heads)
        weights[hf_name] = tensor
    return weights


def _used_tensors(index: GGUFIndex, family: GGUFFamily, config) -> dict[str, str]:
    """GGUF name -> Hugging Face name of the file's tensors the model uses, in file order; the others
    are logged (but the rope factors, which are read into the config)."""
    names = _hf_names(family, config)
    used = {}
    for gguf_name in index.tensors:
        if gguf_name in names:
            used[gguf_name] = names[gguf_name]
        elif gguf_name not in _ROPE_TENSORS:
            log.warning("%s: ignoring tensor %s, which berth's %s model does not use",
                        index.path, gguf_name, family.config_class.removesuffix("Config"))
    check_complete(set(used.values()), names.values(), index.path)
    return used


_AS_STORED = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # GGML float types read without a copy


def _worth_caching(index: GGUFIndex, used: dict[str, str], dtype: torch.dtype) -> bool:
    """Whether any weight is computed (dequantised or converted): a file already in ``dtype`` is mapped
    as it lies, and a cache would only double it."""
    return any(_AS_STORED.get(index.tensors[name].ggml_type) != dtype for name in used)


def _hf_names(family: GGUFFamily, config) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, for every tensor the family's model has."""
    globals_ = [n for n in _GLOBAL_TENSORS if n != "output" or not config.tie_word_embeddings]
    names = {f"{n}.weight": f"{_GLOBAL_TENSORS[n]}.weight" for n in globals_}
    biased = family.biased if family.bias_field is None or getattr(config, family.bias_field) else ()
    renamed = {**_LAYER_TENSORS, **dict(family.renamed)}
    for i in range(config.num_hidden_layers):
        for n in family.layer_weights:
            names[f"blk.{i}.{n}.weight"] = f"model.layers.{i}.{renamed[n]}.weight"
        for n in biased:
            names[f"blk.{i}.{n}.bias"] = f"model.layers.{i}.{renamed[n]}.bias"
    return names


def _unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of Q/K rows (and biases) so rotate-half rotary embeddings apply."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _family(index: GGUFIndex) -> tuple[str, GGUFFamily]:
    arch = index.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{index.path}: GGUF architecture {arch!r} is not supported; berth reads "
                             f"{', '.join(ARCHITECTURES)} (Mistral files say llama)")
    return arch, ARCHITECTURES[arch]


class _Metadata:
    """The file's ``<architecture>.*`` keys."""

    def __init__(self, index: GGUFIndex, arch: str):
        self.index, self.arch = index, arch

    def get(self, key: str, default=None):
        value = self.index.metadata.get(f"{self.arch}.{key}", default)
        if isinstance(value, np.ndarray):
            raise ModelLoadError(f"{self.index.path}: {self.arch}.{key} varies by layer, which berth does not run")
        return value

    def required(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.index.path} lacks the metadata key {self.arch}.{key}: "
                                 "it is not a complete model file; convert it again with llama.cpp")
        return value


def _head_dim_field(arch: str, head_dim: int, default: int) -> dict:
    if arch in ("llama", "qwen3"):
        return {"head_dim": head_dim}
    if head_dim != default:
        raise ModelLoadError(f"a {arch} model's heads are hidden_size / head_count wide, "
                             f"but this file says {head_dim} instead of {default}")
    return {}


def _rope_scaling(index: GGUFIndex, meta: _Metadata, head_dim: int) -> dict:
    kind = meta.get("rope.scaling.type", "none")
    if "rope_freqs.weight" in index.tensors:
        if kind != "none":
            raise ModelLoadError(f"{index.path} has both rope_freqs and rope scaling {kind!r}")
        return {"rope_scaling": _llama3_scaling(index, meta, head_dim)}
    if kind == "none":
        return {}
    if kind == "linear":
        return {"rope_scaling": {"rope_type": "linear", "factor": float(meta.required("rope.scaling.factor"))}}
    raise ModelLoadError(f"{index.path}: rope scaling {kind!r} is not supported yet (berth reads linear, "
                         "and Llama 3's rope_freqs)")


def _llama3_scaling(index: GGUFIndex, meta: _Metadata, head_dim: int) -> dict:
    """Llama 3's rope_scaling parameters from llama.cpp's ``rope_freqs`` factors (the converter keeps
    no other trace of them). The factors fix ``factor`` and the two wavelengths where smoothing
    starts and ends, ``original / low_freq_factor`` and ``original / high_freq_factor``: with
    ``low_freq_factor`` 1, as in every Llama 3.x, those give the rest. Candidates are Llama 3.1's
    values and the fitted ones; the first whose frequencies transformers computes as the file's
    factors say is the answer."""
    factors = read_tensor(open_data(index.path), index.tensors["rope_freqs.weight"], torch.float64).numpy()
    theta = float(meta.get("rope.freq_base", 10000.0))
    original = meta.get("rope.scaling.original_context_length")
    factor = float(factors.max())
    candidates = [dict(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=original or 8192)]
    wavelength = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if smooth.sum() >= 2:  # s = (1/f - 1/factor) / (1 - 1/factor) is linear in 1/wavelength
        s = (1 / factors[smooth] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelength[smooth], s, 1)
        low_wavelength, high_wavelength = -slope / intercept, slope / (1 - intercept)
        original = original or round(low_wavelength)
        candidates.append(dict(factor=factor, low_freq_factor=round(original / low_wavelength, 4),
                               high_freq_factor=round(original / high_wavelength, 4),
                               original_max_position_embeddings=int(original)))
    for candidate in candidates:
        scaling = {"rope_type": "llama3", **candidate}
        if np.allclose(_llama3_factors(scaling, theta, head_dim, meta.get("context_length")), factors, rtol=1e-5):
            return scaling
    raise ModelLoadError(f"{index.path}: its rope_freqs factors are not a Llama 3 rope scaling berth "
                         f"can recognise (tried {candidates})")


def _llama3_factors(scaling: dict, theta: float, head_dim: int, context: int | None) -> np.ndarray:
    """The per-frequency factors llama.cpp would write for ``scaling``, from the scaled frequencies
    the model will use (``worker.model.rotary``, bit for bit transformers' computation)."""
    from worker.model.rotary import ROPE_TYPES

    scaled, _ = ROPE_TYPES["llama3"]({**scaling, "rope_theta": theta}, head_dim, context or 2 ** 20)
    plain = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return (plain / scaled).double().numpy()


def _phi3_fields(index: GGUFIndex, meta: _Metadata, head_dim: int) -> dict:
    """Phi-3's partial rotary embedding, sliding window and, for the long-context models, its
    ``longrope`` factors (which llama.cpp keeps as two tensors; transformers derives the attention
    factor from the two context lengths as llama.cpp's converter did)."""
    window = meta.get("attention.sliding_window", 0)
    fields = dict(partial_rotary_factor=meta.get("rope.dimension_count", head_dim) / head_dim,
                  sliding_window=window or None,
                  original_max_position_embeddings=meta.get("rope.scaling.original_context_length",
                                                            meta.get("context_length", 4096)))
    if "rope_factors_long.weight" in index.tensors:
        data = open_data(index.path)
        long, short = (read_tensor(data, index.tensors[f"rope_factors_{n}.weight"], torch.float32).tolist()
                       for n in ("long", "short"))
        fields["rope_scaling"] = {"rope_type": "longrope", "long_factor": long, "short_factor": short}
    return fields
