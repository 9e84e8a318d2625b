"""Showing and vetting text taken from a request line, for every check of a line's fields.

A value from a line is shown in an error through a bounded ``reprlib`` view, never a full
``repr`` (a value nested a thousand deep or a megabyte long costs nothing to report); text that a
database cannot store (NUL) or a tokenizer cannot read (an unpaired surrogate) is found here.
"""

from __future__ import annotations

import re
import reprlib
from typing import Any

UNSTORABLE = re.compile("[\x00\ud800-\udfff]")  # NUL (PostgreSQL text refuses it) and unpaired surrogates
_SHOW = reprlib.Repr()
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlong, _SHOW.maxlevel = 60, 60, 40, 2


def shown(value: Any) -> str:
    """A short ``repr`` of a value from a request line, whatever its size or depth."""
    return _SHOW.repr(value)


def bad_text(text: str, nul: bool = True) -> str | None:
    """Why ``text`` cannot be stored (a NUL, with ``nul``) or tokenized (an unpaired surrogate), or None."""
    if text.isascii() and (not nul or "\x00" not in text):
        return None
    for m in UNSTORABLE.finditer(text):
        if m.group() != "\x00":
            return f"holds an unpaired surrogate ({m.group()!r}) at character {m.start()}: send valid Unicode text"
        if nul:
            return f"holds a NUL character at character {m.start()}: remove it"
    return None
