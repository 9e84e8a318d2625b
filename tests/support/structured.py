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


def stop_running_compiles() -> None:
    """Kill this process's slot servers (and so the compiles they run, which die with them): a test
    that leaves a compile of minutes running would hold a compile process from the tests after it. The
    slots start new servers for their next jobs (the running one fails, its compile server gone)."""
    import os
    import signal

    from worker.engine.structured.grammar_pool import compile_pool

    for slot in list(compile_pool()._slots):
        link = slot.link
        if link is not None:
            slot.link = None  # an idle slot opens a new server for its next job instead of failing it
            try:
                os.kill(link.pid, signal.SIGKILL)
            except OSError:
                pass


SLOW_PATTERN = "([a-z]{1,50}){1,50}"  # nested counted repetitions in a schema's pattern: minutes of compile here


def slow_schema() -> dict:
    """A schema no shape bound refuses that compiles for minutes (each a new one: nothing cached)."""
    import uuid

    return {"type": "string", "pattern": f"{uuid.uuid4().hex[:8]}{SLOW_PATTERN}"}
