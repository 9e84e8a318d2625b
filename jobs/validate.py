"""Checking a request file line by line against the model that will run it, without its weights.

``read_lines`` streams a file and never holds more than the size limit of a line: an oversized
line is measured and skipped. ``LineValidator`` turns each line into an engine ``Request`` or a
``LineError`` (line number, field, reason) with ``jobs.batch_format``, and catches duplicate
``custom_id``s across the file.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import BinaryIO, Iterator

from jobs.batch_format import MAX_LINE_BYTES, LineError, parse_line, to_request
from worker.config import Settings
from worker.model_loader import load_config, load_tokenizer
from worker.request import Request

MAX_CUSTOM_ID = 512  # characters; the database column's size
_BOMS = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32", b"\xff\xfe": "UTF-16", b"\xfe\xff": "UTF-16"}


class InputError(ValueError):
    """The whole file is unusable (empty, or not UTF-8 at all); the message says what to do."""


@dataclass(frozen=True)
class ModelInfo:
    """What validation needs from the model: its served name, tokenizer and context length."""

    name: str
    tokenizer: object
    max_model_len: int


@functools.lru_cache(maxsize=4)
def _model_info(path: str, name: str, max_model_len: int) -> ModelInfo:
    context = load_config(path).max_position_embeddings
    return ModelInfo(name, load_tokenizer(path), min(max_model_len or context, context))


def model_info(settings: Settings) -> ModelInfo:
    return _model_info(settings.model_path(), settings.served_model_name(), settings.max_model_len)


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
    def __init__(self, model: ModelInfo, max_line_bytes: int = MAX_LINE_BYTES, seen: set[str] | None = None):
        self.model = model
        self.max_line_bytes = max_line_bytes
        self.seen = seen if seen is not None else set()  # custom_ids of the lines accepted so far

    def check(self, raw: RawLine) -> tuple[str, str, Request]:
        """(custom_id, url, request) for a good line; raises ``LineError`` for a bad one. The request's
        id is its line number, as in ``berth generate``, so the seeds drawn are the same."""
        if raw.data is None:
            raise LineError(raw.number, None, f"line is {raw.size} bytes, over the limit of {self.max_line_bytes}: "
                            "shorten the prompt or split the request", code="line_too_long")
        line = parse_line(raw.data, raw.number, self.max_line_bytes)
        if len(line.custom_id) > MAX_CUSTOM_ID:
            raise LineError(raw.number, "custom_id", f"longer than {MAX_CUSTOM_ID} characters", line.custom_id[:64])
        if line.custom_id in self.seen:
            raise LineError(raw.number, "custom_id", f"duplicate custom_id {line.custom_id!r}: each line needs its own",
                            line.custom_id)
        request = to_request(line, self.model.tokenizer, self.model.name, self.model.max_model_len,
                             request_id=str(raw.number))
        self.seen.add(line.custom_id)
        return line.custom_id, line.url, request
