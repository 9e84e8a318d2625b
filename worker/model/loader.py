"""Load a model from a GGUF file (``gguf.loader``) or a Hugging Face safetensors folder
(``safetensors_loader``).

Both give the same thing (``base.LoadedModel``): a config, the weights under Hugging Face names in
the compute dtype, and the tokenizer (``tokenizer``, with its chat template). Nothing is fetched
from a hub (``worker/model/__init__.py`` sets ``HF_HUB_OFFLINE``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from worker.model.base import LoadedModel, ModelLoadError
from worker.model.gguf.loader import load_gguf, load_gguf_config
from worker.model.safetensors_loader import load_safetensors_folder, read_config


def load_model(path: str, dtype: torch.dtype) -> LoadedModel:
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return load_gguf(p, dtype)
    if p.is_dir() and (p / "config.json").exists():
        return load_safetensors_folder(p, dtype)
    if not p.exists():
        raise ModelLoadError(f"model path {path} does not exist: pass a .gguf file or a Hugging Face "
                             "folder holding config.json and *.safetensors")
    raise ModelLoadError(f"{path} is neither a .gguf file nor a folder with config.json")


def load_config(path: str):
    """The model's config without reading its weights (cheap: for validating requests)."""
    p = Path(path)
    if p.suffix == ".gguf":
        return load_gguf_config(p)
    return read_config(p)
