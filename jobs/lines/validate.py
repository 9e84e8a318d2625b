"""Checking a request file line by line against the model that will run it, without its weights.
``read_lines`` streams a file, skipping oversized lines; ``LineValidator`` turns each line into an
engine ``Request`` or a ``LineError`` and catches duplicate ``custom_id``s. The one validator for request
files: ``berth generate`` and a job's ingest both use it. Whole-file limits raise ``InputError``
(docs/cli.md).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import BinaryIO

from jobs.lines.batch_format import MAX_CUSTOM_ID, MAX_LINE_BYTES, LineError, parse_line, to_request
from jobs.lines.structured_outputs import DEFAULT_LIMITS, StructuredLimits
from worker.config import Settings
from worker.engine.request import Request
from worker.model.architectures import context_length

__all__ = ["MAX_CUSTOM_ID", "InputError", "LineValidator", "ModelInfo", "RawLine", "copy_checked",
           "check_file_size", "model_info", "read_lines"]

log = logging.getLogger(__name__)
DEFAULT_MAX_LINES = Settings.model_fields["max_file_lines"].default
_BOMS = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32", b"\xff\xfe": "UTF-16", b"\xfe\xff": "UTF-16"}


class InputError(ValueError):
    """The whole file is unusable (empty, not UTF-8 at all, over a limit); the message says what to do."""


@dataclass(frozen=True)
class ModelInfo:
    """What a line is checked against: the model's served name, tokenizer, context length and
    vocabulary size (its logits' width), and the limits of the settings (``max_file_lines``,
    ``structured_max_*``), which ride here so that every door building a validator from its
    settings gets them."""

    name: str
    tokenizer: object
    max_model_len: int
    vocab_size: int
    max_lines: int = DEFAULT_MAX_LINES
    structured_limits: StructuredLimits = DEFAULT_LIMITS
    hidden_size: int | None = None  # an embedding's dimensions (None: not checked)

    @classmethod
    def of_engine(cls, engine, settings: Settings | None = None) -> ModelInfo:
        """The facts of an engine already loaded (``berth generate``): no second tokenizer. The
        limits come from ``settings`` (default: the engine's)."""
        limits = settings or engine.settings
        return cls(engine.model_name, engine.tokenizer, engine.max_model_len, engine.model_config.vocab_size,
                   limits.max_file_lines, StructuredLimits.of(limits), engine.model_config.hidden_size)


_MODEL_INFOS = 4  # models whose facts are kept
_model_infos: dict[tuple[str, str, int], ModelInfo] = {}
_model_infos_lock = threading.Lock()


def _model_info(path: str, name: str, max_model_len: int) -> ModelInfo:
    """The model's facts, built once per process: the threads of a first burst wait for the one
    building them (building at once, they imported transformers at once, and it failed them)."""
    key = (path, name, max_model_len)
    info = _model_infos.get(key)
    if info is None:
        with _model_infos_lock:
            info = _model_infos.get(key)
            if info is None:
                info = _build_model_info(path, name, max_model_len)
                if len(_model_infos) >= _MODEL_INFOS:
                    _model_infos.pop(next(iter(_model_infos)))  # the oldest
                _model_infos[key] = info
    return info


def _build_model_info(path: str, name: str, max_model_len: int) -> ModelInfo:
    from worker.model.loader import load_config  # torch: paid where lines are checked, not where jobs are read
    from worker.model.tokenizer import load_tokenizer

    config = load_config(path)
    context = context_length(config)  # the model's whole context, as the engine takes it
    return ModelInfo(name, load_tokenizer(path), min(max_model_len or context, context), config.vocab_size,
                     hidden_size=config.hidden_size)


def model_info(settings: Settings) -> ModelInfo:
    info = _model_info(settings.model_path(), settings.served_model_name(), settings.max_model_len)
    return replace(info, max_lines=settings.max_file_lines, structured_limits=StructuredLimits.of(settings))


def _too_big(size: str, limit: int) -> InputError:
    return InputError(f"the file is {size} bytes, over the limit of {limit:,} bytes: split it into smaller "
                      "files, or raise the limit with BERTH_MAX_FILE_BYTES")


def _too_many_lines(line: int | None, limit: int) -> InputError:
    where = f"has a request on line {line:,}" if line else "has requests"
    return InputError(f"the file {where} beyond the limit of {limit:,} lines: split it into files of at most "
                      f"{limit:,} lines, or raise the limit with BERTH_MAX_FILE_LINES")


def check_file_size(path: str | Path, max_bytes: int) -> None:
    """Refuse a file over ``max_bytes`` before reading any of it."""
    size = os.stat(path).st_size
    if size > max_bytes:
        raise _too_big(f"{size:,}", max_bytes)


def copy_checked(src: BinaryIO, out: BinaryIO, max_bytes: int, max_lines: int) -> None:
    """Copy a request file, refusing it (``InputError``) once it passes ``max_bytes`` or holds a
    request (any line not blank) past line ``max_lines``: the rule the ingest applies, checked at
    C speed (newlines counted per megabyte) so that a submit stays quick whatever the file."""
    size = newlines = 0
    while chunk := src.read(1 << 20):
        size += len(chunk)
        if size > max_bytes:
            raise _too_big(f"more than {max_bytes:,}", max_bytes)
        if newlines >= max_lines:
            beyond = chunk
        else:
            count = chunk.count(b"\n")
            beyond = chunk.split(b"\n", max_lines - newlines)[-1] if newlines + count >= max_lines else b""
            newlines += count
        if beyond.strip():
            raise _too_many_lines(None, max_lines)
        out.write(chunk)


@dataclass
class RawLine:
    number: int  # 1-based
    data: bytes | None  # None when the line is over the limit
    size: int


def read_lines(f: BinaryIO, max_bytes: int = MAX_LINE_BYTES) -> Iterator[RawLine]:
    """Every non-blank line of ``f``; a line over ``max_bytes`` comes without its data."""
    head = f.peek(4)[:4] if hasattr(f, "peek") else b""
    for bom, encoding in _BOMS.items():
        if head.startswith(bom):
            raise InputError(f"the file is {encoding} text: save it as UTF-8 (one JSON request per line)")
    number = 0
    while chunk := f.readline(max_bytes + 1):
        number += 1
        size, end = len(chunk), chunk
        while not end.endswith(b"\n") and (end := f.readline(1 << 20)):  # over the limit: measure, skip
            size += len(end)
        size -= len(end) - len(end.rstrip(b"\r\n"))  # the line break is not part of the line
        if size > max_bytes:
            yield RawLine(number, None, size)
            continue
        data = chunk.rstrip(b"\r\n")
        if number == 1:
            data = data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark, as some editors write
        if data.strip():
            yield RawLine(number, data, size)


class LineValidator:
    def __init__(self, model: ModelInfo, max_line_bytes: int = MAX_LINE_BYTES, seen: set[str] | None = None,
                 max_lines: int | None = None, tenant: str = "default"):
        self.model = model
        self.tenant = tenant  # whose turn a line's structured-output compile waits for
        self.max_line_bytes = max_line_bytes
        self.max_lines = max_lines or model.max_lines
        self.seen = seen if seen is not None else set()  # custom_ids of the lines accepted so far

    def check(self, raw: RawLine) -> tuple[str, str, Request]:
        """(custom_id, url, request) for a good line; raises ``LineError`` for a bad one, whatever
        went wrong checking it, and ``InputError`` for a request past the file's line limit. The
        request's id is its line number, as in ``berth generate``, so the seeds drawn are the same."""
        if raw.number > self.max_lines:
            raise _too_many_lines(raw.number, self.max_lines)
        if raw.data is None:
            raise LineError(raw.number, None, f"line is {raw.size} bytes, over the limit of {self.max_line_bytes}: "
                            "shorten the prompt or split the request", code="line_too_long")
        try:
            return self._check(raw)
        except LineError:
            raise
        except Exception as exc:
            log.warning("line %d: checking it raised", raw.number, exc_info=True)
            raise LineError(raw.number, None, f"could not be checked ({type(exc).__name__}: {exc}); "
                            "fix the line or report it as a bug") from None

    def _check(self, raw: RawLine) -> tuple[str, str, Request]:
        line = parse_line(raw.data, raw.number, self.max_line_bytes)
        if line.custom_id in self.seen:
            raise LineError(raw.number, "custom_id", f"duplicate custom_id {line.custom_id[:100]!r}: each line needs "
                            "its own", line.custom_id)
        m = self.model
        request = to_request(line, m.tokenizer, m.name, m.max_model_len, request_id=str(raw.number),
                             tenant=self.tenant, vocab_size=m.vocab_size, structured_limits=m.structured_limits,
                             hidden_size=m.hidden_size)
        self.seen.add(line.custom_id)
        return line.custom_id, line.url, request


def check_output(output_path: Path) -> None:
    """``InputError`` unless the output's folder exists and takes files: said before the model loads."""
    folder = output_path.parent if str(output_path.parent) else Path(".")
    if not folder.is_dir():
        raise InputError(f"{output_path}: the folder {folder} does not exist: create it, or give -o a path in a "
                         "folder that does")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{output_path}: cannot write into {folder}: give -o a path in a folder you can write to")
