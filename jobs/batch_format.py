"""The OpenAI Batch file format: request lines in, response and error lines out.

A request line: ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}``. Every check says which line, which field and what is wrong, so one bad line
never stops the good ones.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, replace
from typing import Any

from worker.request import Request, RequestOutput, SamplingParams

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
MAX_LINE_BYTES = 1 << 20  # a request line longer than this is refused
DEFAULT_CHAT_MAX_TOKENS = 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16  # as OpenAI's completions endpoint


class LineError(ValueError):
    """One request line is wrong: where, which field, why."""

    def __init__(self, line: int, param: str | None, message: str, custom_id: str | None = None,
                 code: str = "invalid_request"):
        super().__init__(f"line {line}: {param + ': ' if param else ''}{message}")
        self.line, self.param, self.message, self.custom_id, self.code = line, param, message, custom_id, code

    def to_error_line(self) -> dict:
        return {"id": f"batch_req_line{self.line}", "custom_id": self.custom_id, "response": None,
                "error": {"code": self.code, "message": str(self), "line": self.line, "param": self.param}}


@dataclass
class BatchLine:
    line: int  # 1-based
    custom_id: str
    url: str
    body: dict


def parse_line(raw: bytes | str, line: int, max_bytes: int = MAX_LINE_BYTES) -> BatchLine:
    """Structure only: JSON, custom_id, method, url, body. The body is checked by ``to_request``."""
    size = len(raw) if isinstance(raw, bytes) else len(raw.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise LineError(line, None, f"line is {size} bytes, over the limit of {max_bytes}", code="line_too_long")
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise LineError(line, None, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise LineError(line, None, f"not valid JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(obj, dict):
        raise LineError(line, None, f"a request line must be a JSON object, not {type(obj).__name__}")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(line, "custom_id", "missing or not a non-empty string")
    method = obj.get("method", "POST")
    if method != "POST":
        raise LineError(line, "method", f"must be POST, not {method!r}", custom_id)
    url = obj.get("url")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise LineError(line, "url", f"must be {CHAT_URL} or {COMPLETIONS_URL}, not {url!r}", custom_id)
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError(line, "body", "missing or not a JSON object", custom_id)
    return BatchLine(line, custom_id, url, body)


def _get(line: BatchLine, name: str, types, default=None, check=None, why: str = ""):
    value = line.body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise LineError(line.line, f"body.{name}", f"must be {why or types}, not a boolean", line.custom_id)
    if not isinstance(value, types) or (check is not None and not check(value)):
        raise LineError(line.line, f"body.{name}", f"must be {why}, got {value!r}"[:300], line.custom_id)
    return value


def prompt_token_ids(line: BatchLine, tokenizer) -> list[int]:
    if line.url == CHAT_URL:
        messages = line.body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise LineError(line.line, "body.messages", "must be a non-empty list of messages", line.custom_id)
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise LineError(line.line, f"body.messages[{i}]", "must be an object with a string role",
                                line.custom_id)
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise LineError(line.line, f"body.messages[{i}].content", "only text parts are supported",
                                    line.custom_id)
                m = {**m, "content": "".join(p["text"] for p in content)}
                messages = messages[:i] + [m] + messages[i + 1:]
            elif not isinstance(content, str):
                raise LineError(line.line, f"body.messages[{i}].content", "must be a string", line.custom_id)
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # the template itself refused these messages
            raise LineError(line.line, "body.messages", f"the chat template refused them: {exc}",
                            line.custom_id) from None
        return list(ids if isinstance(ids, list) else ids["input_ids"])
    prompt = line.body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if max(prompt) >= len(tokenizer) or min(prompt) < 0:
            raise LineError(line.line, "body.prompt", f"token ids must be in [0, {len(tokenizer)})", line.custom_id)
        return list(prompt)
    raise LineError(line.line, "body.prompt", "must be a non-empty string or a list of token ids", line.custom_id)


def sampling_params(line: BatchLine, request_id: str) -> SamplingParams:
    chat = line.url == CHAT_URL
    g = lambda name, types, default=None, check=None, why="": _get(line, name, types, default, check, why)  # noqa
    if g("stream", bool, False, why="false"):
        raise LineError(line.line, "body.stream", "streaming is not available in a batch", line.custom_id)
    max_tokens = g("max_tokens", int, None, lambda v: v >= 1, "an integer >= 1")
    if chat:
        max_tokens = g("max_completion_tokens", int, max_tokens, lambda v: v >= 1, "an integer >= 1")
    stop = g("stop", (str, list), [], lambda v: isinstance(v, str) or (
        len(v) <= 16 and all(isinstance(s, str) and s for s in v)), "a string or a list of up to 16 strings")
    if chat:
        want = g("logprobs", bool, False, why="true or false")
        logprobs = g("top_logprobs", int, 0, lambda v: 0 <= v <= 20, "an integer in [0, 20]") if want else None
    else:
        logprobs = g("logprobs", int, None, lambda v: 0 <= v <= 20, "an integer in [0, 20]")
    seed = g("seed", int, None, why="an integer")
    if seed is None:  # a stable seed, so that a resumed or repeated request draws the same numbers
        seed = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")
    top_k = g("top_k", int, 0, lambda v: v >= -1, "an integer >= -1 (-1 or 0 turn it off)")
    fields = dict(
        max_tokens=max_tokens or (DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_COMPLETION_MAX_TOKENS),
        temperature=float(g("temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]")),
        top_p=float(g("top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")),
        top_k=max(top_k, 0), seed=seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(g("stop_token_ids", list, [], lambda v: all(
            isinstance(t, int) and not isinstance(t, bool) for t in v), "a list of token ids")),
        n=g("n", int, 1, lambda v: 1 <= v <= 16, "an integer in [1, 16]"),
        logprobs=logprobs,
        min_tokens=g("min_tokens", int, 0, lambda v: v >= 0, "an integer >= 0"),
        ignore_eos=g("ignore_eos", bool, False, why="true or false"))
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        raise LineError(line.line, "body", str(exc), line.custom_id) from None


def to_request(line: BatchLine, tokenizer, model_name: str, max_model_len: int, request_id: str,
               priority: int = 0, tenant: str = "default") -> Request:
    """Check the body against the model and turn it into an engine request."""
    model = line.body.get("model")
    if model is not None and model != model_name:
        raise LineError(line.line, "body.model", f"unknown model {model!r}: this service runs {model_name!r}",
                        line.custom_id, code="model_not_found")
    params = sampling_params(line, request_id)
    ids = prompt_token_ids(line, tokenizer)
    explicit = line.body.get("max_tokens") or line.body.get("max_completion_tokens")
    if not explicit:  # the default shrinks to fit the context; an explicit value must fit as given
        params = replace(params, max_tokens=max(1, min(params.max_tokens, max_model_len - len(ids))))
    if len(ids) + params.max_tokens > max_model_len:
        raise LineError(line.line, "body.messages" if line.url == CHAT_URL else "body.prompt",
                        f"the prompt is {len(ids)} tokens; with max_tokens {params.max_tokens} it exceeds the "
                        f"model's context of {max_model_len} tokens", line.custom_id, code="context_length_exceeded")
    return Request(request_id, ids, params, priority=priority, tenant=tenant)


def response_line(line: BatchLine, output: RequestOutput, model_name: str, tokenizer) -> dict:
    """The OpenAI Batch output line for a finished request."""
    chat = line.url == CHAT_URL
    choices = []
    for c in output.completions:
        choice: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason,
                                  "logprobs": _logprobs(c.logprobs, tokenizer, chat)}
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        choices.append(choice)
    completion_tokens = output.num_output_tokens
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{output.request_id}",
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model_name, "choices": choices,
            "usage": {"prompt_tokens": len(output.prompt_token_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(output.prompt_token_ids) + completion_tokens}}
    return {"id": f"batch_req_{output.request_id}", "custom_id": line.custom_id,
            "response": {"status_code": 200, "request_id": output.request_id, "body": body}, "error": None}


def _logprobs(entries: list[dict] | None, tokenizer, chat: bool) -> dict | None:
    if entries is None:
        return None
    text = lambda t: tokenizer.decode([t])  # noqa: E731
    if chat:
        def item(token_id, lp):
            s = text(token_id)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return {"content": [{**item(e["token_id"], e["logprob"]),
                             "top_logprobs": [item(t, lp) for t, lp in e["top"]]} for e in entries]}
    tokens = [text(e["token_id"]) for e in entries]
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{text(t): lp for t, lp in e["top"]} for e in entries], "text_offset": offsets}
