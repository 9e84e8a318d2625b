"""Read a model from a Hugging Face folder: config.json, its *.safetensors (one file, or shards
listed by model.safetensors.index.json), and the tokenizer files.

Tensors come memory-mapped from the files (``safe_open``), and only the ones the model reads. A
tensor already in the compute dtype is used where it lies, not copied: the page cache holds the
weights once, however many processes read them; other dtypes are converted, one tensor at a time.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

import torch

from worker.model.architectures import check_supported, hf_weight_names
from worker.model.base import LoadedModel, ModelLoadError, check_complete
from worker.model.model_config import ModelConfig
from worker.model.tokenizer import load_tokenizer

log = logging.getLogger(__name__)
INDEX = "model.safetensors.index.json"


# The keys of a plain Llama's config.json: those ``ModelConfig`` holds, and those that change nothing
# berth runs (training and generation switches, provenance). Any other key, or a rope other than the
# default, sends the folder to transformers' own config class.
_PLAIN_LLAMA_KEYS = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling",
    "rope_parameters", "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act", "bos_token_id",
    "eos_token_id", "pad_token_id", "architectures", "attention_dropout", "initializer_range", "pretraining_tp",
    "use_cache", "dtype", "torch_dtype", "transformers_version"}
_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def read_config(path: Path):
    """config.json as the decoder reads it, refused unless berth runs its model_type: a plain Llama's as
    a ``ModelConfig`` (``plain_llama_config``), anything else as its family's transformers config."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}/config.json ({exc}): is this a Hugging Face model folder?") from None
    check_supported(raw.get("model_type"), f"{path} (config.json's model_type)")
    plain = plain_llama_config(raw)
    if plain is not None:
        return plain
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def plain_llama_config(raw: dict) -> ModelConfig | None:
    """The ``ModelConfig`` transformers' LlamaConfig would make of ``raw`` (its defaults where a key is
    missing), for a Llama with the default rope and no key beyond ``_PLAIN_LLAMA_KEYS``; None otherwise.
    Importing a transformers config class costs ~2.5 s of every worker's start (see ``model_config``);
    ``tests/model/test_safetensors_config.py`` compares the two field by field."""
    if raw.get("model_type") != "llama" or set(raw) - _PLAIN_LLAMA_KEYS or any(raw.get(k) is None for k in _SHAPE_KEYS):
        return None
    rope = raw.get("rope_parameters") or {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
    if raw.get("rope_scaling") or set(rope) != {"rope_type", "rope_theta"} or rope["rope_type"] != "default":
        return None
    heads = raw["num_attention_heads"]
    fields = {k: raw[k] for k in _SHAPE_KEYS}
    return ModelConfig.of(
        "llama", rope_theta=float(rope["rope_theta"]), **fields,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6), max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=raw.get("tie_word_embeddings", False), attention_bias=raw.get("attention_bias", False),
        mlp_bias=raw.get("mlp_bias", False), hidden_act=raw.get("hidden_act", "silu"),
        bos_token_id=raw.get("bos_token_id", 1), eos_token_id=raw.get("eos_token_id", 2),
        pad_token_id=raw.get("pad_token_id"))


def weight_files(path: Path, wanted: set[str]) -> dict[Path, list[str]]:
    """Which file holds each wanted tensor: from the shard index if there is one, else by opening each file."""
    from safetensors import safe_open

    index = path / INDEX
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        by_file = defaultdict(list)
        for name in sorted(wanted & weight_map.keys()):
            by_file[path / weight_map[name]].append(name)
        missing = [str(f) for f in by_file if not f.exists()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are not there: {missing[:3]}")
        return by_file
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files (PyTorch .bin checkpoints are not read)")
    by_file = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            by_file[f] = sorted(wanted & set(handle.keys()))
    return by_file


def load_safetensors_folder(path: Path, dtype: torch.dtype) -> LoadedModel:
    from safetensors import safe_open

    config = read_config(path)
    wanted = set(hf_weight_names(config))
    weights = {}
    for f, names in weight_files(path, wanted).items():
        with safe_open(str(f), framework="pt") as handle:
            for name in names:
                weights[name] = handle.get_tensor(name).to(dtype)  # no copy when already ``dtype``
    check_complete(weights, wanted, path)
    return LoadedModel(config, weights, load_tokenizer(str(path)), str(path))
