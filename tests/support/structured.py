"""Structured-output lines at the door: a schema, a line that asks for it, what the validator makes of it."""

from __future__ import annotations

import io
import json

from jobs.lines.validate import LineValidator, read_lines
from tests.support.jobs_env import TINY_NAME

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"]}
PERSON_TEXT = '{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer","minimum":0}},' \
              '"required":["name","age"]}'  # compact, the keys in the order written (the order outputs take)
CHAT = "/v1/chat/completions"


def structured_line(url: str = CHAT, custom_id: str = "a", **fields) -> bytes:
    """A batch line (chat or completions) with the given body fields, as bytes."""
    body = {"model": TINY_NAME, "max_tokens": 8, **fields}
    if url == CHAT:
        body["messages"] = [{"role": "user", "content": "Give me JSON."}]
    else:
        body["prompt"] = "JSON:"
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).encode()


def structured_of(model, line: bytes):
    """What the door makes of a line's structured-output fields (its ``StructuredOutput``), or its ``LineError``."""
    raw = next(read_lines(io.BufferedReader(io.BytesIO(line + b"\n"))))
    return LineValidator(model).check(raw)[2].params.structured
