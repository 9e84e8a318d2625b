"""A request line as read, and what is wrong with one: ``BatchLine`` and ``LineError``.

A module below the readers of every endpoint: ``jobs.lines.batch_format`` reads chat and completions lines
and hands embeddings lines to ``jobs.lines.embeddings_format``, which raises the same errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from jobs.lines.line_text import UNSTORABLE

MAX_CUSTOM_ID = 512  # characters: the size of the custom_id columns

# The line_errors columns (jobs.records.models.LineErrorRow); a LineError's fields always fit them.
PARAM_CHARS, CODE_CHARS, MESSAGE_CHARS = 200, 64, 4000


def _fit(text: str | None, size: int) -> str | None:
    """``text`` as any column of ``size`` characters and any UTF-8 file can hold it."""
    if text is None:
        return None
    text = str(text)[:size]
    return UNSTORABLE.sub("\ufffd", text) if "\x00" in text or not text.isascii() else text


class LineError(ValueError):
    """One request line is wrong: where, which field, why. Every field fits its ``line_errors``
    column (a 600-character custom_id is kept as its first 512), so any caller can store one."""

    def __init__(self, line: int, param: str | None, message: str, custom_id: str | None = None,
                 code: str = "invalid_request"):
        self.line = line
        self.param, self.code = _fit(param, PARAM_CHARS), _fit(code, CODE_CHARS)
        self.message, self.custom_id = _fit(message, MESSAGE_CHARS), _fit(custom_id, MAX_CUSTOM_ID)
        super().__init__(f"line {line}: {self.param + ': ' if self.param else ''}{self.message}")

    def to_error_line(self) -> dict:
        return {"id": f"batch_req_line{self.line}", "custom_id": self.custom_id, "response": None,
                "error": {"code": self.code, "message": str(self), "line": self.line, "param": self.param}}


@dataclass
class BatchLine:
    line: int  # 1-based
    custom_id: str
    url: str
    body: dict
