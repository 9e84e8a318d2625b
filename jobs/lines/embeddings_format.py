"""``/v1/embeddings`` lines: the body checked into an engine request, the result as OpenAI's response.

A body is OpenAI's: ``input`` (a string, a list of strings, a list of token ids or a list of such
lists), ``encoding_format`` (``float`` or ``base64``: the float32 values little-endian, as OpenAI
sends them), ``dimensions`` (the vector cut to its first ``dimensions`` and normalised again; at most
the model's hidden size), ``model``, and the fields ``jobs.lines.request_fields`` lists. A list of k inputs
is one engine request of k sequences (``worker.engine.request.EmbeddingParams``) and one result line.

Every bound the engine needs is checked here, each error naming its field (``body.input[3]``): each
input non-empty, token ids inside the vocabulary, each input inside the model's context, at most
``MAX_INPUTS`` inputs (OpenAI's limit).
"""

from __future__ import annotations

import base64
from typing import Any

from jobs.lines.line_error import BatchLine, LineError
from jobs.lines.line_text import bad_text, shown
from jobs.lines.request_fields import unknown_field
from worker.engine.request import EmbeddingParams, Request, RequestOutput, SamplingParams

MAX_INPUTS = 2048  # inputs in one request, as OpenAI


def embedding_request(line: BatchLine, tokenizer, model_name: str, max_model_len: int, request_id: str,
                      priority: int = 0, tenant: str = "default", token_limit: int | None = None,
                      hidden_size: int | None = None) -> Request:
    """The engine request of an embeddings line; ``LineError`` naming the field for a bad one.
    ``token_limit``: token ids must be below it (default: the tokenizer's size); ``hidden_size``: the
    model's, which ``dimensions`` may not pass."""
    def error(param, why, code="invalid_request"):  # this line's error
        return LineError(line.line, param, why, line.custom_id, code)

    if (unknown := unknown_field(line.url, line.body)) is not None:
        raise error(*unknown)
    body = line.body
    model = body.get("model")
    if model is not None and model != model_name:
        raise error("body.model", f"unknown model {shown(model)}: this service runs {model_name!r}", "model_not_found")
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in EmbeddingParams.FORMATS:
        raise error("body.encoding_format", f"must be \"float\" or \"base64\", got {shown(encoding)}")
    dimensions = body.get("dimensions")
    if dimensions is not None:
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
            raise error("body.dimensions", f"must be an integer >= 1, got {shown(dimensions)}")
        if hidden_size is not None and dimensions > hidden_size:
            raise error("body.dimensions", f"{dimensions} is more than the model's {hidden_size} dimensions: give at "
                        f"most {hidden_size}, or leave it out for all of them")
    limit = len(tokenizer) if token_limit is None else token_limit
    inputs = input_token_ids(line, tokenizer, limit)
    for i, ids in enumerate(inputs):
        if len(ids) > max_model_len:
            raise error(_where(body, i), f"it is {len(ids)} tokens, over the model's context of {max_model_len}: "
                        "shorten it or split it", "context_length_exceeded")
    params = SamplingParams(max_tokens=1, embedding=EmbeddingParams(tuple(map(len, inputs)), dimensions, encoding))
    return Request(request_id, [t for ids in inputs for t in ids], params, priority=priority, tenant=tenant)


def _where(body: dict, i: int) -> str:
    return "body.input" if isinstance(body.get("input"), str) or _is_ids(body.get("input")) else f"body.input[{i}]"


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(map(_is_id, value))


def input_token_ids(line: BatchLine, tokenizer, limit: int) -> list[list[int]]:
    """``body.input`` as the token ids of each input, in order."""
    value = line.body.get("input")
    if isinstance(value, str):
        return [_text_ids(line, "body.input", value, tokenizer, limit)]
    if _is_ids(value):
        return [_checked_ids(line, "body.input", value, limit)]
    if not isinstance(value, list) or not value:
        raise LineError(line.line, "body.input", "must be a non-empty string, a list of strings, a list of token ids "
                        f"or a list of lists of token ids, got {shown(value)}", line.custom_id)
    if len(value) > MAX_INPUTS:
        raise LineError(line.line, "body.input", f"{len(value)} inputs, over the limit of {MAX_INPUTS}: split them "
                        "over several lines", line.custom_id)
    if all(isinstance(t, int) for t in value):  # token ids with a boolean among them
        i = next(i for i, t in enumerate(value) if isinstance(t, bool))
        raise LineError(line.line, f"body.input[{i}]", "must be a token id, not a boolean", line.custom_id)
    out = []
    for i, item in enumerate(value):
        where = f"body.input[{i}]"
        if isinstance(item, str):
            out.append(_text_ids(line, where, item, tokenizer, limit))
        elif isinstance(item, list) and all(map(_is_id, item)):
            out.append(_checked_ids(line, where, item, limit))
        else:
            raise LineError(line.line, where, f"must be a non-empty string or a list of token ids, got {shown(item)}",
                            line.custom_id)
    return out


def _text_ids(line: BatchLine, where: str, text: str, tokenizer, limit: int) -> list[int]:
    if not text:
        raise LineError(line.line, where, "is an empty string: give some text (OpenAI refuses it too)", line.custom_id)
    if why := bad_text(text, nul=False):
        raise LineError(line.line, where, why, line.custom_id)
    try:
        ids = list(tokenizer(text)["input_ids"])
    except Exception as exc:  # noqa: BLE001 (whatever the tokenizer raises on a user's text is the line's error)
        raise LineError(line.line, where, f"the tokenizer refused it: {exc}"[:500], line.custom_id) from None
    if not ids:
        raise LineError(line.line, where, "it has no tokens: give some text", line.custom_id)
    if max(ids) >= limit:
        raise LineError(line.line, where, f"it tokenizes to id {max(ids)}, outside the model's vocabulary of {limit} "
                        "(the tokenizer knows tokens the model has not)", line.custom_id)
    return ids


def _checked_ids(line: BatchLine, where: str, ids: list, limit: int) -> list[int]:
    if not ids:
        raise LineError(line.line, where, "is an empty list of token ids: give at least one", line.custom_id)
    if not all(0 <= t < limit for t in ids):
        raise LineError(line.line, where, f"token ids must be in [0, {limit}) (the model's vocabulary)", line.custom_id)
    return list(ids)


def embedding_body(output: RequestOutput, model_name: str) -> dict:
    """OpenAI's embeddings response for a finished request."""
    vectors = output.embeddings
    as_base64 = output.embedding.encoding_format == "base64"
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") if as_base64 else v.tolist()}
            for i, v in enumerate(vectors)]
    tokens = len(output.prompt_token_ids)
    return {"object": "list", "data": data, "model": model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

