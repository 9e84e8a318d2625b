"""Tool calls in a model family's own words: how it writes a call, the grammar that holds the output
to one, and how calls are read back out of the text.

A model calls tools in the format its training taught it, and its chat template says which (the
tools' prompt there is written for it). So the family is read from the template:

- ``hermes`` (Qwen2.5, Qwen3, Hermes): one ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  block per call, after any text;
- ``llama3_json`` (Llama 3.1 and later): the message is one JSON object ``{"name": ..., "parameters": {...}}``,
  perhaps after ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects (``[TOOL_CALLS]``
  is a special token, which berth's text leaves out, so the list alone is read as well);
- ``json``, a family with no call format of its own (the default SmolLM2): a plain JSON object
  ``{"name": ..., "arguments": {...}}``. Nothing such a model writes unasked can be read as a call, so it
  takes only the constrained choices ("required", a named function), never "auto".

The constraint is one of xgrammar's structural tags: the family's fixed text around a JSON value whose
schema is the call's (the name as a ``const``, the arguments as the function's ``parameters``; an
``anyOf`` over the functions where any may be called). Whitespace between JSON tokens is bounded to one
character, for the reason ``worker/engine/structured/grammar.py`` gives for JSON schemas.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

MAX_WHITESPACE = 1  # characters of free whitespace between two JSON tokens of a constrained call


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict


@dataclass(frozen=True)
class Parsed:
    content: str | None  # the text before the first call (None when there is none)
    calls: tuple[Call, ...]


@dataclass(frozen=True)
class ToolFormat:
    name: str
    args_key: str  # what the family calls a call's arguments
    reads_free_text: bool  # "auto" can find its calls in text the model wrote unconstrained

    def constraint(self, functions: list[tuple[str, dict]], parallel: bool) -> dict:
        """The structural tag of a call to one of ``functions`` ((name, parameters) pairs), or of one
        or more such calls where ``parallel`` and the family writes several."""
        call = {"type": "json_schema", "json_schema": call_schema(functions, self.args_key),
                "max_whitespace_cnt": MAX_WHITESPACE}
        if self.name == "hermes":
            block = {"type": "tag", "begin": "<tool_call>\n", "content": call, "end": "\n</tool_call>"}
            fmt = block if not parallel else {"type": "tags_with_separator", "tags": [block], "separator": "\n",
                                              "at_least_one": True, "stop_after_first": False}
        elif self.name == "mistral":
            items = {"type": "array", "items": call["json_schema"], "minItems": 1}
            items = items if parallel else {**items, "maxItems": 1}
            fmt = {**call, "json_schema": items}
        else:  # llama3_json and json: one object, the whole message
            fmt = call
        return {"type": "structural_tag", "format": fmt}

    def parse(self, text: str) -> Parsed | None:
        """The calls in ``text``; None where it holds none, or one that does not read as a call (the
        text is then the answer's content)."""
        return _PARSERS[self.name](text)


def call_schema(functions: list[tuple[str, dict]], args_key: str) -> dict:
    one = [{"type": "object", "properties": {"name": {"const": name}, args_key: parameters},
            "required": ["name", args_key], "additionalProperties": False} for name, parameters in functions]
    return one[0] if len(one) == 1 else {"anyOf": one}


HERMES = ToolFormat("hermes", "arguments", True)
LLAMA3_JSON = ToolFormat("llama3_json", "parameters", True)
MISTRAL = ToolFormat("mistral", "arguments", True)
PLAIN_JSON = ToolFormat("json", "arguments", False)
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, PLAIN_JSON)}


def format_of(chat_template) -> ToolFormat:
    """The call format of the family whose chat template this is (transformers' named templates:
    the one it renders tools with)."""
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("tool_use") or chat_template.get("default")
    if not isinstance(chat_template, str):
        return PLAIN_JSON
    if "<tool_call>" in chat_template:
        return HERMES
    if "[TOOL_CALLS]" in chat_template:
        return MISTRAL
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return LLAMA3_JSON
    return PLAIN_JSON


def call_id(request_id: str, choice: int, number: int, call: Call) -> str:
    """A call's id: the same each time the request runs and makes this call (a resumed or repeated
    request keeps it), another for another call."""
    what = json.dumps([request_id, choice, number, call.name, call.arguments], sort_keys=True, ensure_ascii=False)
    return f"call_{hashlib.blake2b(what.encode(), digest_size=12).hexdigest()}"


def _call(obj, args_key: str) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters")))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return Call(obj["name"], args) if isinstance(args, dict) else None


def _json_values(text: str) -> list | None:
    """The JSON values ``text`` is made of, one after another (separated by whitespace or ';')."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            return None
        values.append(value)


def _calls(values, args_key: str) -> tuple[Call, ...] | None:
    calls = tuple(_call(v, args_key) for v in values)
    return calls if calls and all(c is not None for c in calls) else None


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _hermes(text: str) -> Parsed | None:
    blocks = _HERMES_BLOCK.findall(text)
    if not blocks:
        return None
    values = [_json_values(b) for b in blocks]
    if any(v is None or len(v) != 1 for v in values):
        return None
    calls = _calls([v[0] for v in values], "arguments")
    if calls is None:
        return None
    return Parsed(text[:text.index("<tool_call>")].strip() or None, calls)


def _llama3_json(text: str) -> Parsed | None:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return None
    values = _json_values(body)
    calls = _calls(values, "parameters") if values else None
    return Parsed(None, calls) if calls else None


def _mistral(text: str) -> Parsed | None:
    content, marker, rest = text.partition("[TOOL_CALLS]")
    if not marker:
        content, rest = "", text
    rest = rest.strip()
    if not rest.startswith("["):
        return None
    values = _json_values(rest)
    calls = _calls(values[0], "arguments") if values and len(values) == 1 and isinstance(values[0], list) else None
    return Parsed(content.strip() or None, calls) if calls else None


def _plain_json(text: str) -> Parsed | None:
    values = _json_values(text.strip())
    if not values:
        return None
    if len(values) == 1 and isinstance(values[0], list):
        values = values[0]
    calls = _calls(values, "arguments")
    return Parsed(None, calls) if calls else None


_PARSERS = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral, "json": _plain_json}
