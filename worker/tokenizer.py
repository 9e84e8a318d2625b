"""The model's tokenizer and chat template, from a Hugging Face folder or a GGUF file.

A GGUF file's vocabulary takes transformers seconds to convert, which every ``berth submit`` would
pay: the converted tokenizer is saved once under ``cache_dir("tokenizers")``, keyed by the file and
the transformers version.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a model hub is never reached at run time

log = logging.getLogger(__name__)


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
