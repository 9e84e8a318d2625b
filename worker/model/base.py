"""What every model loader gives and raises: ``LoadedModel`` and ``ModelLoadError``.

A file of their own, below the loaders (``gguf.loader``, ``safetensors_loader``) and the dispatcher
(``loader``) that picks one, so each imports them from here and none imports another's dispatcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only named in an annotation: the CLI's error handling imports this file without torch
    import torch


class ModelLoadError(RuntimeError):
    """The model path is not a model berth can load; the message says why and what to do."""


@dataclass
class LoadedModel:
    config: PretrainedConfig  # noqa: F821 (transformers' config class of the family, model_type set)
    weights: dict[str, torch.Tensor]
    tokenizer: object
    path: str


def check_complete(weights: dict, wanted, path) -> None:
    missing = sorted(set(wanted) - set(weights))
    if missing:
        raise ModelLoadError(f"{path} lacks {len(missing)} weights the model needs, e.g. {missing[:3]}")
