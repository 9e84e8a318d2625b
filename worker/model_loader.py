"""Read a Llama-family model from a GGUF file or a Hugging Face safetensors folder.

Both give the same thing: a transformers ``LlamaConfig``, the weights under Hugging Face names in
the compute dtype, and the tokenizer (with its chat template). Nothing is fetched from a hub.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a model hub is never reached at run time

import numpy as np  # noqa: E402
import torch  # noqa: E402

log = logging.getLogger(__name__)
SUPPORTED_ARCHITECTURES = ("llama",)


class ModelLoadError(RuntimeError):
    """The model path is not a model berth can load; the message says why and what to do."""


@dataclass
class LoadedModel:
    config: "LlamaConfig"  # noqa: F821 (transformers' class)
    weights: dict[str, torch.Tensor]
    tokenizer: object
    path: str


def load_model(path: str, dtype: torch.dtype) -> LoadedModel:
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return _load_gguf(p, dtype)
    if p.is_dir() and (p / "config.json").exists():
        return _load_safetensors_folder(p, dtype)
    if not p.exists():
        raise ModelLoadError(f"model path {path} does not exist: pass a .gguf file or a Hugging Face "
                             "folder holding config.json and *.safetensors")
    raise ModelLoadError(f"{path} is neither a .gguf file nor a folder with config.json")


def load_config(path: str):
    """The model's ``LlamaConfig`` without reading its weights (cheap: for validating requests)."""
    p = Path(path)
    if p.suffix == ".gguf":
        import gguf

        return _gguf_config(gguf.GGUFReader(str(p)))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(p))


def load_tokenizer(path: str):
    """The model's tokenizer and chat template. A GGUF file's vocabulary takes transformers
    seconds to convert, which every ``berth submit`` would pay: the converted tokenizer is saved
    once under ``cache_dir("tokenizers")``, keyed by the file and the transformers version."""
    from transformers import AutoTokenizer

    p = Path(path)
    if p.suffix != ".gguf":
        return AutoTokenizer.from_pretrained(str(p))
    cached = _tokenizer_cache(p)
    if cached.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as exc:  # noqa: BLE001 (a damaged cache entry: convert again)
            log.warning("ignoring the cached tokenizer %s (%s): converting %s again", cached, exc, p.name)
            shutil.rmtree(cached, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    tmp = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cached.parent)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cached)  # whole or absent; fails harmlessly if another process got there first
    except OSError as exc:
        if not cached.is_dir():
            log.warning("could not cache the tokenizer of %s in %s: %s", p.name, cached, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def _tokenizer_cache(gguf: Path) -> Path:
    import transformers

    from worker.config import cache_dir

    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}".encode())
    return cache_dir("tokenizers") / key.hexdigest()[:24]


# ---------------------------------------------------------------- GGUF
def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows so rotate-half rotary embeddings apply."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_config(reader):
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


def _load_gguf(path: Path, dtype: torch.dtype) -> LoadedModel:
    import gguf

    reader = gguf.GGUFReader(str(path))
    config = _gguf_config(reader)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    wanted = _hf_weight_names(config)
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
    _check_complete(weights, wanted, path)
    return LoadedModel(config, weights, load_tokenizer(str(path)), str(path))


# ---------------------------------------------------------------- safetensors
def _load_safetensors_folder(path: Path, dtype: torch.dtype) -> LoadedModel:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    raw = json.loads((path / "config.json").read_text())
    if raw.get("model_type") not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{path}/config.json has model_type {raw.get('model_type')!r}; berth runs "
                             f"{SUPPORTED_ARCHITECTURES}")
    config = AutoConfig.from_pretrained(str(path))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files (PyTorch .bin checkpoints are not read)")
    wanted = set(_hf_weight_names(config))
    weights = {}
    for f in files:
        for name, tensor in load_file(str(f)).items():
            if name in wanted:
                weights[name] = tensor.to(dtype)
    _check_complete(weights, wanted, path)
    return LoadedModel(config, weights, load_tokenizer(str(path)), str(path))


def _hf_weight_names(config) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        names += [prefix + n + ".weight" for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    return names


def _check_complete(weights: dict, wanted, path) -> None:
    missing = sorted(set(wanted) - set(weights))
    if missing:
        raise ModelLoadError(f"{path} lacks {len(missing)} weights the model needs, e.g. {missing[:3]}")
