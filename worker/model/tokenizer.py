"""The model's tokenizer and chat template, from a Hugging Face folder or a GGUF file.

transformers is the reference for both, but it is slow to start: importing it costs about a
second, and converting a GGUF file's vocabulary several more, at every start of a worker, of
``berth generate`` and of ``berth submit``; a worker restarted after a crash pays them again.
So a model's tokenizer goes through transformers once per machine:

1. transformers loads it (``AutoTokenizer``, from the folder or the GGUF file);
2. berth saves it under ``cache_dir("tokenizers")/<key>`` (the key names the source files, their
   sizes and times, the transformers, tokenizers and xgrammar versions and berth's reader and check
   as they are), with a manifest of the facts transformers derived (special tokens and their ids,
   chat template, decoding cleanup, what xgrammar reads of the tokenizer);
3. ``worker.model.tokenizer_check`` compares a ``FastTokenizer`` read from that save with transformers'
   own on sample texts and chats, and the manifest records the verdict.

Every later load reads the entry with ``tokenizers`` and jinja2 in a fraction of a second, or, where
the check found a difference, with transformers (logged once, when found). A damaged entry is
converted again. The entry is written whole or not at all, so concurrent first starts are safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import warnings
from importlib import metadata
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a model hub is never reached at run time

log = logging.getLogger(__name__)

FORMAT = 3  # of a cache entry; a change converts every tokenizer again
# The files of a Hugging Face folder that can change what AutoTokenizer builds (config.json names the class)
SOURCE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                "config.json")


def load_tokenizer(path: str):
    """The tokenizer of the model at ``path``: a ``FastTokenizer`` once checked against transformers,
    else transformers' own."""
    from worker.model.fast_tokenizer import MANIFEST, FastTokenizer

    source = Path(path)
    entry = _entry(source)
    manifest = _manifest(entry / MANIFEST)
    if manifest is not None:
        try:
            if manifest["verdict"] is None:
                return FastTokenizer.read(entry, manifest["facts"], _transformers_source(source, entry))
            return _transformers_tokenizer(_transformers_source(source, entry))
        except Exception as exc:  # noqa: BLE001 (a damaged entry: convert again)
            log.warning("ignoring the cached tokenizer %s (%s): converting %s again", entry, exc, source.name)
            shutil.rmtree(entry, ignore_errors=True)
    return _convert(source, entry)


def as_transformers(tokenizer):
    """transformers' tokenizer object for ``tokenizer`` (for libraries that need one, like xgrammar)."""
    from worker.model.fast_tokenizer import FastTokenizer

    return tokenizer.transformers() if isinstance(tokenizer, FastTokenizer) else tokenizer


def _convert(source: Path, entry: Path):
    from worker.model.fast_tokenizer import MANIFEST, FastTokenizer
    from worker.model.tokenizer_check import differences

    hf = _transformers_tokenizer(str(source))
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent))
        hf.save_pretrained(str(tmp))
        try:
            facts, verdict = _facts(hf)
            if verdict is None:
                verdict = differences(FastTokenizer.read(tmp, facts), hf)
        except Exception as exc:  # noqa: BLE001 (whatever berth's reader cannot take: transformers reads it)
            facts, verdict = {}, f"berth's reader failed on it: {type(exc).__name__}: {exc}"[:500]
        if verdict is not None:
            log.warning("the tokenizer of %s is read with transformers (slower to start): berth's own reader "
                        "differs from it: %s", source.name, verdict)
        (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT, "source": str(source), "verdict": verdict,
                                                "facts": facts}))
        os.replace(tmp, entry)  # whole or absent; fails harmlessly if another process got there first
    except OSError as exc:
        if not (entry / MANIFEST).is_file():
            log.warning("could not cache the tokenizer of %s in %s: %s", source.name, entry, exc)
            return hf
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    manifest = _manifest(entry / MANIFEST)
    if manifest is None or manifest["verdict"] is not None:
        return hf
    return FastTokenizer.read(entry, manifest["facts"], _transformers_source(source, entry))


def _facts(hf) -> tuple[dict, str | None]:
    """What ``FastTokenizer`` needs that transformers derives, and why it cannot be used (or None)."""
    template = getattr(hf, "chat_template", None)
    why = None
    if isinstance(template, dict):  # named templates: transformers takes "default"
        template = template.get("default")
        why = None if template is not None else "it has named chat templates and no default"
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        why = f"transformers reads it with {type(hf).__name__}, which has no tokenizers backend"
    clean = bool(getattr(hf, "clean_up_tokenization_spaces", False))
    if clean and backend is not None and type(backend.model).__name__ == "BPE" and not getattr(
            hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False):
        clean = False  # transformers skips the cleanup for BPE models
    facts = {"chat_template": template, "special_tokens_map": dict(hf.special_tokens_map),
             "bos_token_id": hf.bos_token_id, "eos_token_id": hf.eos_token_id, "pad_token_id": hf.pad_token_id,
             "all_special_ids": list(hf.all_special_ids), "clean_up_tokenization_spaces": clean,
             "grammar": _grammar_facts(hf)}
    return facts, why


def _grammar_facts(hf) -> dict | None:
    """What xgrammar derives from transformers' tokenizer beyond its vocabulary (how tokens spell
    bytes, whether a leading space is added), kept with the tokenizer so that a process reading it
    without transformers builds the same ``TokenizerInfo`` (``worker.engine.structured.grammar.tokenizer_info``);
    None where xgrammar cannot read it (structured outputs then load transformers' tokenizer on first use)."""
    try:
        import xgrammar as xgr

        with warnings.catch_warnings():  # a tokenizer without EOS: stop ids are the engine's, given later
            warnings.simplefilter("ignore")
            info = xgr.TokenizerInfo.from_huggingface(hf)
        return {"vocab_type": info.vocab_type.name, "add_prefix_space": bool(info.add_prefix_space)}
    except Exception as exc:  # noqa: BLE001 (a tokenizer xgrammar cannot read: the fallback stands)
        log.warning("structured outputs will read this tokenizer with transformers: %s", exc)
        return None


def _transformers_tokenizer(where: str):
    from transformers import AutoTokenizer

    p = Path(where)
    if p.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return AutoTokenizer.from_pretrained(str(p))


def _transformers_source(source: Path, entry: Path) -> str:
    """Where transformers reads this tokenizer fastest: the saved entry for a GGUF file (converting
    the file's vocabulary again takes seconds), the model's own folder otherwise."""
    return str(entry) if source.suffix == ".gguf" else str(source)


def _manifest(path: Path) -> dict | None:
    try:
        manifest = json.loads(path.read_text())
        return manifest if manifest.get("format") == FORMAT else None
    except (OSError, ValueError, AttributeError):
        return None


def _entry(source: Path) -> Path:
    from worker.config import cache_dir

    parts = [str(FORMAT), str(source.resolve()), _version("transformers"), _version("tokenizers"),
             _version("xgrammar"), _reader_digest()]
    files = [source] if source.suffix == ".gguf" else [source / name for name in SOURCE_FILES]
    for f in files:
        try:
            st = f.stat()
            parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            pass
    return cache_dir("tokenizers") / hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _reader_digest() -> str:
    """berth's reader and its check as they are now: a change to either checks every tokenizer again."""
    here = Path(__file__).parent
    code = b"".join((here / f).read_bytes() for f in ("fast_tokenizer.py", "chat_template.py", "tokenizer_check.py"))
    return hashlib.sha256(code).hexdigest()[:16]


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "-"
