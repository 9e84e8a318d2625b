"""Load a model from a GGUF file (``gguf_loader``) or a Hugging Face safetensors folder
(``safetensors_loader``).

Both give the same thing: a transformers config, the weights under Hugging Face names in the
compute dtype, and the tokenizer (``tokenizer``, with its chat template). Nothing is fetched from a hub.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a model hub is never reached at run time

import torch  # noqa: E402

from worker.architectures import ModelLoadError  # noqa: E402,F401 (raised by every loader; callers catch it from here)

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    config: "PretrainedConfig"  # noqa: F821 (transformers' config class of the family, model_type set)
    weights: dict[str, torch.Tensor]
    tokenizer: object
    path: str


def load_model(path: str, dtype: torch.dtype) -> LoadedModel:
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        from worker.gguf_loader import load_gguf

        return load_gguf(p, dtype)
    if p.is_dir() and (p / "config.json").exists():
        from worker.safetensors_loader import load_safetensors_folder

        return load_safetensors_folder(p, dtype)
    if not p.exists():
        raise ModelLoadError(f"model path {path} does not exist: pass a .gguf file or a Hugging Face "
                             "folder holding config.json and *.safetensors")
    raise ModelLoadError(f"{path} is neither a .gguf file nor a folder with config.json")


def load_config(path: str):
    """The model's transformers config without reading its weights (cheap: for validating requests)."""
    p = Path(path)
    if p.suffix == ".gguf":
        from worker.gguf_loader import load_gguf_config

        return load_gguf_config(p)
    from worker.safetensors_loader import read_config

    return read_config(p)


def check_complete(weights: dict, wanted, path) -> None:
    missing = sorted(set(wanted) - set(weights))
    if missing:
        raise ModelLoadError(f"{path} lacks {len(missing)} weights the model needs, e.g. {missing[:3]}")
