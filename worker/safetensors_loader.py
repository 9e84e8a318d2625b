"""Read a model from a Hugging Face folder: config.json, *.safetensors, and the tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from worker.model_loader import SUPPORTED_ARCHITECTURES, LoadedModel, ModelLoadError, check_complete, hf_weight_names
from worker.tokenizer import load_tokenizer


def load_safetensors_folder(path: Path, dtype: torch.dtype) -> LoadedModel:
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
    wanted = set(hf_weight_names(config))
    weights = {}
    for f in files:
        for name, tensor in load_file(str(f)).items():
            if name in wanted:
                weights[name] = tensor.to(dtype)
    check_complete(weights, wanted, path)
    return LoadedModel(config, weights, load_tokenizer(str(path)), str(path))
