"""How a model folder says its hidden states become one embedding: sentence-transformers' files.

A sentence-transformers model (Qwen3-Embedding, gte-Qwen2, e5-mistral) lists its modules in
``modules.json``; the ``sentence_transformers.models.Pooling`` one has a folder (``1_Pooling``)
whose ``config.json`` sets one ``pooling_mode_*`` flag. berth pools by the last token
(``pooling_mode_lasttoken``, the decoder embedding models') or by the mean over the tokens
(``pooling_mode_mean_tokens``); a folder without those files, and a GGUF file, gets the mean, as
sentence-transformers gives a plain transformers model. Any other mode is refused when the model
loads, naming the file, rather than pooled in a way the model was not trained for.
"""

from __future__ import annotations

import json
from pathlib import Path

from worker.model.base import ModelLoadError

LAST, MEAN = "last", "mean"
_MODES = {"pooling_mode_lasttoken": LAST, "pooling_mode_mean_tokens": MEAN}
_POOLING_MODULE = "sentence_transformers.models.Pooling"


def model_pooling(path: str | Path) -> str:
    """``"last"`` or ``"mean"``: the pooling the model at ``path`` (a folder or a GGUF file) asks for."""
    folder = Path(path)
    modules = folder / "modules.json"
    if not folder.is_dir() or not modules.is_file():
        return MEAN
    listed = _read(modules)
    pooling = [m for m in listed if isinstance(m, dict) and m.get("type") == _POOLING_MODULE] \
        if isinstance(listed, list) else None
    if pooling is None:
        raise ModelLoadError(f"{modules}: must be a list of modules (sentence-transformers' format); fix or "
                             "remove it")
    if not pooling:
        return MEAN
    where = str(pooling[0].get("path", ""))
    config = (folder / where / "config.json").resolve()
    if not where or not config.is_relative_to(folder.resolve()) or not config.is_file():
        raise ModelLoadError(f"{modules}: its Pooling module's folder {where!r} has no config.json inside the "
                             "model folder; restore it (e.g. 1_Pooling/config.json) or remove modules.json")
    flags = _read(config)
    on = sorted(k for k, v in flags.items() if k.startswith("pooling_mode_") and v is True) \
        if isinstance(flags, dict) else []
    if len(on) != 1 or on[0] not in _MODES:
        raise ModelLoadError(f"{config}: pooling modes {on or 'none'} are set; berth pools by exactly one of "
                             f"{sorted(_MODES)}: set one of them true and the others false")
    return _MODES[on[0]]


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}, line {exc.lineno}: not valid JSON ({exc.msg}); fix the file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot be read ({exc})") from None
