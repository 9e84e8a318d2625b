"""The OpenAPI description of the bodies ``POST /v1/chat/completions``, ``POST /v1/completions`` and
``POST /v1/responses`` take.

It describes, and changes nothing: the routes read the raw body and check it as a batch line is
checked (``jobs.lines.batch_format.to_request``), and a body this document calls valid may still be refused
for what a schema cannot say (a prompt too long for the context, a chat template's refusal, a grammar
that does not compile). Every field berth knows for each endpoint (``jobs.lines.request_fields``) is here with
the type and bounds the door checks, from the same constants; a field berth refuses by name (the
deprecated ``functions``, vLLM's ``structural_tag``...) and any unknown field are left out, and
``additionalProperties: false`` says that berth refuses them. ``tests/jobs/http/test_http_fuzz.py`` generates
bodies from it, valid and not, against a live engine.
"""

from __future__ import annotations

from typing import Any

from jobs.lines.batch_format import (
    MAX_CACHE_SALT,
    MAX_LOGIT_BIAS,
    MAX_REPETITION,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
)
from jobs.lines.chat_messages import MAX_CALLS
from jobs.lines.request_fields import (
    CHAT_URL,
    COMPLETIONS_URL,
    IMPLEMENTED,
    NO_EFFECT,
    NO_EFFECT_ON,
    ONLY,
    RESPONSES_URL,
)
from jobs.lines.tools import MAX_TOOLS

REFUSED = {"guided_json_object", "guided_whitespace_pattern", "structural_tag"}
"""Named among the implemented fields so that berth refuses them with a reason (jobs.lines.structured_outputs)."""

_NUMBER = {"type": "number"}
_STRING = {"type": "string"}
_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}  # a function's or a schema's name
_TEXT_PART = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
              "properties": {"type": {"const": "text"}, "text": _STRING}}
_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": _STRING, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name", "arguments"], "properties": {
        "name": _NAME, "arguments": {"type": "string", "contentMediaType": "application/json",
                                     "contentSchema": {"type": "object"}, "description": "JSON text of an object"}}}}}
_CALLS = {"type": "array", "minItems": 1, "maxItems": MAX_CALLS, "items": _CALL}
_CONTENT = {"anyOf": [_STRING, {"type": "array", "items": _TEXT_PART}]}  # text parts only
_MESSAGE = {"anyOf": [  # by role: only an assistant's carries tool calls, and its content may then be null
    {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant"]}, "content": _CONTENT, "name": _STRING}},
    {"type": "object", "required": ["role", "tool_calls"], "properties": {
        "role": {"const": "assistant"}, "content": {"anyOf": [_CONTENT, {"type": "null"}]}, "name": _STRING,
        "tool_calls": _CALLS}},
    {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"const": "tool"}, "content": _CONTENT, "tool_call_id": _STRING}}]}
_SCHEMA = {"type": "object", "description": "a JSON Schema"}
_STOP = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _int(low: int | None = None, high: int | None = None, **extra) -> dict:
    return {"type": "integer", **({"minimum": low} if low is not None else {}),
            **({"maximum": high} if high is not None else {}), **extra}


def _number(low: float, high: float, exclusive_low: bool = False) -> dict:
    return {"type": "number", ("exclusiveMinimum" if exclusive_low else "minimum"): low, "maximum": high}


_FIELDS: dict[str, Any] = {  # name -> its schema (a callable of the url where it differs by endpoint)
    "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
    "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                         {"type": "array", "minItems": 1, "items": _int(0), "description": "token ids"}]},
    "max_tokens": _int(1),
    "max_completion_tokens": _int(1),
    "temperature": _number(0, 2),
    "top_p": _number(0, 1, exclusive_low=True),
    "top_k": _int(-1, description="-1 or 0: off; at most the vocabulary's size"),
    "min_p": _number(0, 1),
    "frequency_penalty": _number(-2, 2),
    "presence_penalty": _number(-2, 2),
    "repetition_penalty": _number(0, MAX_REPETITION, exclusive_low=True),
    "logit_bias": {"type": "object", "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^[0-9]{1,12}$"},
                   "additionalProperties": _number(-100, 100), "description": "token id (as a string) -> bias"},
    "n": _int(1, 16),
    "seed": _int(-(1 << 63), (1 << 64) - 1),
    "stop": {"anyOf": [_STOP, {"type": "array", "maxItems": MAX_STOP, "items": _STOP}]},
    "stop_token_ids": {"type": "array", "maxItems": MAX_STOP_TOKEN_IDS, "items": _int(0)},
    "min_tokens": _int(0),
    "ignore_eos": {"type": "boolean"},
    "logprobs": lambda url: {"type": "boolean"} if url == CHAT_URL else _int(0, 20),
    "top_logprobs": _int(0, 20, description="with logprobs: true"),
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "additionalProperties": False, "description": "with stream: true",
                       "properties": {"include_usage": {"type": "boolean"}}},
    "cache_salt": {"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT},
    "response_format": {"anyOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"},
            "json_schema": {"type": "object", "required": ["name"], "properties": {
                "name": _NAME, "description": _STRING, "schema": _SCHEMA, "strict": {"type": "boolean"}}}}}]},
    "guided_json": {"anyOf": [_SCHEMA, {"type": "string", "description": "a JSON Schema as JSON text"}]},
    "guided_regex": _STRING,
    "guided_choice": {"type": "array", "minItems": 1, "items": _STRING},
    "guided_grammar": {"type": "string", "description": "EBNF (GBNF)"},
    "structured_outputs": {"type": "object", "minProperties": 1, "maxProperties": 1, "additionalProperties": False,
                           "properties": {"json": {"anyOf": [_SCHEMA, _STRING]}, "regex": _STRING,
                                          "choice": {"type": "array", "minItems": 1, "items": _STRING},
                                          "grammar": _STRING, "json_object": {"type": "boolean"}}},
    "tools": {"type": "array", "minItems": 1, "maxItems": MAX_TOOLS, "items": {
        "type": "object", "required": ["type", "function"], "additionalProperties": False, "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
                "name": _NAME, "description": _STRING, "parameters": _SCHEMA, "strict": {"type": "boolean"}}}}}},
    "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, {
        "type": "object", "required": ["type", "function"], "properties": {
            "type": {"const": "function"},
            "function": {"type": "object", "required": ["name"], "properties": {"name": _NAME}}}}]},
    "parallel_tool_calls": {"type": "boolean"},
    # no effect (jobs.lines.request_fields.NO_EFFECT): the type the door checks
    "user": _STRING, "safety_identifier": _STRING, "prompt_cache_key": _STRING, "request_id": _STRING,
    "metadata": {"type": "object"}, "store": {"type": "boolean"}, "service_tier": _STRING,
    "prompt_cache_retention": {"enum": ["in_memory", "24h"]},
}

_INPUT_TEXT = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"enum": ["input_text", "output_text"]}, "text": _STRING}}
_RESPONSES_FIELDS: dict[str, Any] = {  # where a Responses field is not chat's (jobs.lines.responses_format)
    "input": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "required": ["role", "content"], "properties": {
            "type": {"const": "message"}, "role": {"enum": ["user", "system", "developer", "assistant"]},
            "content": {"anyOf": [_STRING, {"type": "array", "minItems": 1, "items": _INPUT_TEXT}]}}},
        {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
            "type": {"const": "function_call"}, "call_id": _STRING, "name": _NAME, "arguments": _STRING}},
        {"type": "object", "required": ["type", "call_id", "output"], "properties": {
            "type": {"const": "function_call_output"}, "call_id": _STRING,
            "output": {"anyOf": [_STRING, {"type": "array", "minItems": 1, "items": _INPUT_TEXT}]}}}]}}]},
    "instructions": {"type": "string", "minLength": 1},
    "max_output_tokens": _int(1),
    "text": {"type": "object", "additionalProperties": False, "properties": {
        "verbosity": {"const": "medium"},
        "format": {"anyOf": [
            {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "name", "schema"], "properties": {
                "type": {"const": "json_schema"}, "name": _NAME, "description": _STRING, "schema": _SCHEMA,
                "strict": {"type": "boolean"}}}]}}},
    "tools": {"type": "array", "minItems": 1, "maxItems": MAX_TOOLS, "items": {
        "type": "object", "required": ["type", "name"], "additionalProperties": False, "properties": {
            "type": {"const": "function"}, "name": _NAME, "description": _STRING, "parameters": _SCHEMA,
            "strict": {"type": "boolean"}}}},
    "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, {
        "type": "object", "required": ["type", "name"], "properties": {"type": {"const": "function"}, "name": _NAME}}]},
    "reasoning": {"type": "object", "description": "only asking for nothing: its fields null, or effort \"none\""},
    "include": {"type": "array", "maxItems": 0},
    "stream_options": {"type": "object", "additionalProperties": False, "description": "with stream: true",
                       "properties": {"include_obfuscation": {"type": "boolean"}}},
}


def _field(name: str, url: str, model: str | None) -> dict:
    if name == "model":
        return {"type": "string", **({"enum": [model]} if model else {}), "description": "the served model"}
    if url == RESPONSES_URL and name in _RESPONSES_FIELDS:
        return _RESPONSES_FIELDS[name]
    if name in _FIELDS:
        schema = _FIELDS[name]
        return schema(url) if callable(schema) else schema
    values, why = ONLY[name]
    if name == "best_of":
        return {**_int(1, 16), "description": f"equal to n ({why})"}
    return {"enum": [values[url]], "description": f"only this value ({why})"}


def body_schema(url: str, model: str | None = None) -> dict:
    """The JSON Schema of a body of ``url`` (chat, completions or responses); ``model``: the served model's name."""
    names = [n for n in sorted(IMPLEMENTED[url]) if n not in REFUSED]
    names += sorted(n for n in NO_EFFECT if n in NO_EFFECT_ON.get(url, NO_EFFECT) and n not in names)
    names += sorted(n for n, (values, _) in ONLY.items() if url in values)
    properties = {}
    for name in names:
        schema = _field(name, url, model)
        properties[name] = schema if name in _REQUIRED.values() else _nullable(schema)  # null: as absent
    return {"type": "object", "additionalProperties": False, "properties": properties, "required": [_REQUIRED[url]]}


_REQUIRED = {CHAT_URL: "messages", COMPLETIONS_URL: "prompt", RESPONSES_URL: "input"}


def openapi_body(url: str, model: str | None = None) -> dict:
    """``openapi_extra`` for the route of ``url``: its request body, as JSON."""
    assert url in _REQUIRED
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": body_schema(url, model)}}}}
