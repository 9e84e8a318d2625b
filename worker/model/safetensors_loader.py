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
from worker.model.tokenizer import load_tokenizer

log = logging.getLogger(__name__)
INDEX = "model.safetensors.index.json"


def read_config(path: Path):
    """config.json as its family's transformers config, refused unless berth runs its model_type."""
    from transformers import AutoConfig

    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}/config.json ({exc}): is this a Hugging Face model folder?") from None
    check_supported(raw.get("model_type"), f"{path} (config.json's model_type)")
    return AutoConfig.from_pretrained(str(path))


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
