"""The OpenAI Batch file format: request lines in, response and error lines out. A line that passes
``parse_line`` and ``to_request`` runs through the engine without raising: every bound the engine needs
is checked here, each error names its line, field and reason, and each check but a grammar compile is
linear in the line's size (docs/cli.md).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from jobs.lines.chat_messages import template_messages
from jobs.lines.embeddings_format import embedding_body, embedding_request
from jobs.lines.line_error import CODE_CHARS, MAX_CUSTOM_ID, MESSAGE_CHARS, PARAM_CHARS, BatchLine, LineError  # noqa: F401 (imported from here by the other modules)
from jobs.lines.line_text import bad_text, shown
from jobs.lines.request_fields import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, RESPONSES_URL, URLS, unknown_field
from jobs.lines.responses_format import ChatLine, chat_line, response_body
from jobs.lines.structured_outputs import DEFAULT_LIMITS, GrammarCheck, SpecError, StructuredLimits, structured_check
from jobs.lines.tool_formats import FORMATS, call_id
from jobs.lines.tool_prompt import for_template
from jobs.lines.tools import NO_TOOLS, plan_check, tool_plan
from worker.engine.request import Request, RequestOutput, SamplingParams

MAX_LINE_BYTES = 1 << 20  # a request line longer than this is refused
MAX_STOP = 16  # stop strings a request may give
MAX_STOP_CHARS = 256  # the engine decodes ~4 tokens a character of the longest stop string every token
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 300  # token ids in one logit_bias, as OpenAI
MAX_REPETITION = 100.0  # a repetition_penalty past this is no longer a penalty but a ban: use logit_bias
GREEDY_BELOW = 1e-5  # a temperature under this is greedy, as in vLLM (logits divided by ~1e-38 overflow float32)
DEFAULT_CHAT_MAX_TOKENS = 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16  # as OpenAI's completions endpoint

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
    except RecursionError:
        raise LineError(line, None, "not valid JSON here: nested too deeply (arrays or objects "
                        "hundreds of levels deep); flatten the request") from None
    except ValueError:  # an integer of more digits than Python converts
        raise LineError(line, None, f"not valid JSON here: a number has more than {sys.get_int_max_str_digits()} "
                        "digits; send it as a string or shorten it") from None
    if not isinstance(obj, dict):
        raise LineError(line, None, f"a request line must be a JSON object, not {type(obj).__name__}")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError(line, "custom_id", "missing or not a non-empty string")
    if len(custom_id) > MAX_CUSTOM_ID:
        raise LineError(line, "custom_id", f"{len(custom_id)} characters, over the limit of {MAX_CUSTOM_ID}: "
                        "use a shorter id", custom_id)
    if why := bad_text(custom_id):
        raise LineError(line, "custom_id", why, custom_id)
    method = obj.get("method", "POST")
    if method != "POST":
        raise LineError(line, "method", f"must be POST, not {shown(method)}", custom_id)
    url = obj.get("url")
    if not isinstance(url, str) or url not in URLS:
        raise LineError(line, "url", f"must be {CHAT_URL}, {COMPLETIONS_URL}, {EMBEDDINGS_URL} or {RESPONSES_URL}, "
                        f"not {shown(url)}", custom_id)
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
        raise LineError(line.line, f"body.{name}", f"must be {why}, got {shown(value)}", line.custom_id)
    return value


def _is_token_id(t: Any, limit: int) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limit


def prompt_token_ids(line: BatchLine, tokenizer, token_limit: int | None = None,
                     tools: list[dict] | None = None) -> list[int]:
    """The prompt's token ids: the chat template applied to ``messages`` (and ``tools``), the tokenized
    ``prompt``, or ``prompt`` given as token ids, each in ``[0, token_limit)`` (default: the tokenizer's size)."""
    limit = len(tokenizer) if token_limit is None else token_limit
    if line.url == CHAT_URL:
        ids = _chat_ids(line, tokenizer, tools)
    else:
        ids = _completion_ids(line, tokenizer, limit)
    param = "body.messages" if line.url == CHAT_URL else "body.prompt"
    if not ids:
        raise LineError(line.line, param, "it has no tokens: give some text", line.custom_id)
    if max(ids) >= limit:  # a tokenizer with more tokens than the model's embedding has rows
        raise LineError(line.line, param, f"it tokenizes to id {max(ids)}, outside the model's vocabulary of "
                        f"{limit} (the tokenizer knows tokens the model has not)", line.custom_id)
    return ids


def _chat_ids(line: BatchLine, tokenizer, tools: list[dict] | None = None) -> list[int]:
    try:
        messages = template_messages(line.body.get("messages"))
    except SpecError as exc:
        raise LineError(line.line, exc.param, exc.message, line.custom_id) from None
    messages = for_template(messages, tools, getattr(tokenizer, "chat_template", None))
    extra = {"tools": tools} if tools else {}  # a tokenizer without tools support is never handed the argument
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
    except Exception as exc:  # noqa: BLE001 (the template itself refused these messages)
        raise LineError(line.line, "body.messages", f"the chat template refused them: {exc}"[:500],
                        line.custom_id) from None
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def _completion_ids(line: BatchLine, tokenizer, limit: int) -> list[int]:
    prompt = line.body.get("prompt")
    if isinstance(prompt, str) and prompt:
        if why := bad_text(prompt, nul=False):
            raise LineError(line.line, "body.prompt", why, line.custom_id)
        try:
            return list(tokenizer(prompt)["input_ids"])
        except Exception as exc:  # noqa: BLE001 (whatever the tokenizer raises on a user's text is the line's error)
            raise LineError(line.line, "body.prompt", f"the tokenizer refused it: {exc}"[:500],
                            line.custom_id) from None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < limit for t in prompt):
            raise LineError(line.line, "body.prompt", f"token ids must be in [0, {limit}) (the model's vocabulary)",
                            line.custom_id)
        return list(prompt)
    raise LineError(line.line, "body.prompt", "must be a non-empty string or a list of token ids", line.custom_id)


def sampling_params(line: BatchLine, request_id: str, vocab_size: int | None = None,
                    token_limit: int | None = None) -> SamplingParams:
    """The body's sampling fields, each checked against the engine's bounds: ``top_k`` at most
    ``vocab_size`` (the logits' width) and stop token ids in ``[0, token_limit)``."""
    chat = line.url == CHAT_URL
    vocab = vocab_size if vocab_size is not None else 1 << 62
    limit = token_limit if token_limit is not None else vocab
    def g(name, types, default=None, check=None, why=""):  # one field of this line's body, checked
        return _get(line, name, types, default, check, why)

    if g("stream", bool, False, why="false"):
        raise LineError(line.line, "body.stream", "streaming is not available in a batch", line.custom_id)
    max_tokens = g("max_tokens", int, None, lambda v: v >= 1, "an integer >= 1")
    if chat:
        max_tokens = g("max_completion_tokens", int, max_tokens, lambda v: v >= 1, "an integer >= 1")
    stop = g("stop", (str, list), [], lambda v: (
        (1 if isinstance(v, str) else len(v)) <= MAX_STOP
        and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in ([v] if isinstance(v, str) else v))),
        f"a string or a list of up to {MAX_STOP} strings, each of 1 to {MAX_STOP_CHARS} characters")
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in stop:
        if why := bad_text(s, nul=False):
            raise LineError(line.line, "body.stop", why, line.custom_id)
    stop_token_ids = g("stop_token_ids", list, [], lambda v: len(v) <= MAX_STOP_TOKEN_IDS and all(
        _is_token_id(t, limit) for t in v), f"a list of up to {MAX_STOP_TOKEN_IDS} token ids, each in [0, {limit})")
    if chat:
        want = g("logprobs", bool, False, why="true or false")
        logprobs = g("top_logprobs", int, 0, lambda v: 0 <= v <= 20, "an integer in [0, 20]") if want else None
    else:
        logprobs = g("logprobs", int, None, lambda v: 0 <= v <= 20, "an integer in [0, 20]")
    seed = g("seed", int, None, lambda v: -(1 << 63) <= v < 1 << 64, "an integer of at most 64 bits")
    if seed is None:  # a stable seed, so that a resumed or repeated request draws the same numbers
        seed = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")
    top_k = g("top_k", int, 0, lambda v: -1 <= v <= vocab,
              "an integer from -1 to the vocabulary's size" + (f" {vocab_size}" if vocab_size is not None else "")
              + " (-1 or 0 turn it off)")
    temperature = float(g("temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]"))
    fields = dict(
        max_tokens=max_tokens or (DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_COMPLETION_MAX_TOKENS),
        temperature=temperature if temperature >= GREEDY_BELOW else 0.0,
        top_p=float(g("top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")),
        top_k=max(top_k, 0), seed=seed, stop=stop, stop_token_ids=tuple(stop_token_ids),
        n=g("n", int, 1, lambda v: 1 <= v <= 16, "an integer in [1, 16]"),
        logprobs=logprobs,
        min_tokens=g("min_tokens", int, 0, lambda v: v >= 0, "an integer >= 0"),
        ignore_eos=g("ignore_eos", bool, False, why="true or false"),
        frequency_penalty=float(g("frequency_penalty", (int, float), 0.0, lambda v: -2 <= v <= 2,
                                  "a number in [-2, 2]")),
        presence_penalty=float(g("presence_penalty", (int, float), 0.0, lambda v: -2 <= v <= 2,
                                 "a number in [-2, 2]")),
        repetition_penalty=float(g("repetition_penalty", (int, float), 1.0, lambda v: 0 < v <= MAX_REPETITION,
                                   f"a number in (0, {MAX_REPETITION}] (1 turns it off)")),
        min_p=float(g("min_p", (int, float), 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1]")),
        logit_bias=_logit_bias(line, limit))
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        raise LineError(line.line, "body", str(exc), line.custom_id) from None


def _logit_bias(line: BatchLine, limit: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` as sorted (id, bias) pairs, each id in ``[0, limit)``."""
    bias = _get(line, "logit_bias", dict, {}, lambda v: len(v) <= MAX_LOGIT_BIAS,
                f"an object of up to {MAX_LOGIT_BIAS} token ids (as strings) to numbers in [-100, 100]")
    pairs = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12 else -1
        if not 0 <= token < limit:
            raise LineError(line.line, "body.logit_bias", f"keys must be token ids in [0, {limit}) written as "
                            f"strings, got {shown(key)}", line.custom_id)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise LineError(line.line, f"body.logit_bias.{token}", f"must be a number in [-100, 100], "
                            f"got {shown(value)}", line.custom_id)
        pairs[token] = float(value)
    return tuple(sorted(pairs.items()))


MAX_CACHE_SALT = 256  # characters of a line's cache_salt


def cache_salt(line: BatchLine) -> str | None:
    """The line's ``cache_salt`` (vLLM's) as the engine keys it: requests that give the same one share
    cached prompt prefixes, whatever their tenant; None (absent): the tenant's own, or its group's."""
    salt = line.body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT or bad_text(salt):
        raise LineError(line.line, "body.cache_salt", f"must be a string of 1 to {MAX_CACHE_SALT} characters, "
                        f"got {shown(salt)}", line.custom_id)
    return f"salt:{salt}"


def to_request(line: BatchLine, tokenizer, model_name: str, max_model_len: int, request_id: str,
               priority: int = 0, tenant: str = "default", vocab_size: int | None = None,
               structured_limits: StructuredLimits = DEFAULT_LIMITS, hidden_size: int | None = None) -> Request:
    """Check the body against the model and turn it into an engine request. ``vocab_size`` is the
    model's (its logits' width; default the tokenizer's size): token ids must be below it and the
    tokenizer's size both. A structured-output constraint is checked and compiled last, once the
    cheaper checks passed, waiting on this thread (``check_request`` leaves the compile to its caller).
    An embeddings line is ``jobs.lines.embeddings_format``'s (``hidden_size``: the model's, the most
    ``dimensions`` it may ask for); a Responses line is checked as the chat line it means
    (``jobs.lines.responses_format``), its errors naming its own fields."""
    checked = check_request(line, tokenizer, model_name, max_model_len, request_id, priority, tenant, vocab_size,
                            structured_limits, hidden_size)
    for grammar in checked.grammars:
        try:
            grammar.compile(tokenizer, structured_limits, tenant)
        except SpecError as exc:
            raise checked.refused(exc) from None
    return checked.request


@dataclass(frozen=True)
class CheckedRequest:
    """A request the door accepted but for the compiles of its constraints (``grammars``):
    ``to_request`` waits for them on its thread, ``berth serve`` awaits them (``jobs.http.completions``)."""

    line: BatchLine
    request: Request
    grammars: tuple[GrammarCheck, ...]
    chat: ChatLine | None = None  # a Responses line's chat line: what the request was made from

    @property
    def engine_line(self) -> BatchLine:
        """The line the request was made from, as a worker's door checks it again: a Responses line's chat line."""
        return self.chat.line if self.chat is not None else self.line

    def refused(self, exc: SpecError) -> LineError:
        """The line's error for a grammar's refusal (``GrammarCheck.refusal``)."""
        param = self.chat.param(exc.param) if self.chat is not None else exc.param
        return LineError(self.line.line, param, exc.message, self.line.custom_id)


def check_request(line: BatchLine, tokenizer, model_name: str, max_model_len: int, request_id: str,
                  priority: int = 0, tenant: str = "default", vocab_size: int | None = None,
                  structured_limits: StructuredLimits = DEFAULT_LIMITS,
                  hidden_size: int | None = None) -> CheckedRequest:
    """``to_request`` but for the compiles: every check of the body, and the constraints left to compile."""
    if line.url == EMBEDDINGS_URL:
        limit = len(tokenizer) if vocab_size is None else min(vocab_size, len(tokenizer))
        return CheckedRequest(line, embedding_request(line, tokenizer, model_name, max_model_len, request_id,
                                                      priority, tenant, limit, hidden_size), ())
    if (unknown := unknown_field(line.url, line.body)) is not None:
        raise LineError(line.line, *unknown, line.custom_id)
    if line.url == RESPONSES_URL:
        chat = chat_line(line)
        try:
            checked = check_request(chat.line, tokenizer, model_name, max_model_len, request_id, priority, tenant,
                                    vocab_size, structured_limits, hidden_size)
        except LineError as exc:
            raise chat.error(exc) from None
        return CheckedRequest(line, checked.request, checked.grammars, chat)
    model = line.body.get("model")
    if model is not None and model != model_name:
        raise LineError(line.line, "body.model", f"unknown model {shown(model)}: this service runs {model_name!r}",
                        line.custom_id, code="model_not_found")
    token_limit = len(tokenizer) if vocab_size is None else min(vocab_size, len(tokenizer))
    params = sampling_params(line, request_id, vocab_size if vocab_size is not None else token_limit, token_limit)
    try:  # the tools first: a bad one is named before the prompt that shows them is built
        tools = tool_plan(line.body, tokenizer, structured_limits) if line.url == CHAT_URL else NO_TOOLS
    except SpecError as exc:
        raise LineError(line.line, exc.param, exc.message, line.custom_id) from None
    ids = prompt_token_ids(line, tokenizer, token_limit, tools.template_tools)
    prompt_param = "body.messages" if line.url == CHAT_URL else "body.prompt"
    explicit = line.body.get("max_tokens") is not None or (
        line.url == CHAT_URL and line.body.get("max_completion_tokens") is not None)
    if not explicit:  # the default shrinks to fit the context; an explicit value must fit as given
        fit = max(1, min(params.max_tokens, max_model_len - len(ids)))
        if fit < params.min_tokens:
            raise LineError(line.line, prompt_param, f"the prompt is {len(ids)} tokens: the model's context of "
                            f"{max_model_len} leaves {fit} for the output, under min_tokens {params.min_tokens}",
                            line.custom_id, code="context_length_exceeded")
        params = replace(params, max_tokens=fit)
    if len(ids) + params.max_tokens > max_model_len:
        raise LineError(line.line, prompt_param,
                        f"the prompt is {len(ids)} tokens; with max_tokens {shown(params.max_tokens)} it exceeds the "
                        f"model's context of {max_model_len} tokens", line.custom_id, code="context_length_exceeded")
    try:
        structured = structured_check(line.body, structured_limits)
        if structured is not None and tools.structured is not None:
            raise SpecError("body.tool_choice", "a required tool call is a constraint on the output, and so is "
                            "the structured output asked for: keep one of them")
    except SpecError as exc:
        raise LineError(line.line, exc.param, exc.message, line.custom_id) from None
    grammar = structured or plan_check(tools)
    params = replace(params, structured=grammar and grammar.spec, tool_calls=tools.tool_calls)
    request = Request(request_id, ids, params, priority=priority, tenant=tenant, cache_salt=cache_salt(line))
    return CheckedRequest(line, request, (grammar,) if grammar is not None else ())


def response_line(line: BatchLine, output: RequestOutput, model_name: str, tokenizer,
                  tool_calls: str | None = None) -> dict:
    """The OpenAI Batch output line for a finished request; ``tool_calls`` names the format its
    calls are read in (``SamplingParams.tool_calls``). A Responses line's body is its chat completion
    written as a Response (echoing what ``line.body`` holds of the request)."""
    if output.embedding is not None:
        return _line_of(line, output, embedding_body(output, model_name))
    if line.url == RESPONSES_URL:
        chat_body = response_line(replace(line, url=CHAT_URL), output, model_name, tokenizer, tool_calls)
        body = response_body(chat_body["response"]["body"], line.body, output.request_id, model_name)
        return _line_of(line, output, body)
    chat = line.url == CHAT_URL
    choices = []
    for c in output.completions:
        choice: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason,
                                  "logprobs": _logprobs(c.logprobs, tokenizer, chat)}
        text = c.text_of(tokenizer)
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            if tool_calls is not None:
                _read_calls(choice, text, FORMATS[tool_calls], output.request_id)
        else:
            choice["text"] = text
        choices.append(choice)
    completion_tokens = output.num_output_tokens
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{output.request_id}",
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model_name, "choices": choices,
            "usage": {"prompt_tokens": len(output.prompt_token_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(output.prompt_token_ids) + completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": output.num_cached_prompt_tokens}}}
    return _line_of(line, output, body)


def _line_of(line: BatchLine, output: RequestOutput, body: dict) -> dict:
    return {"id": f"batch_req_{output.request_id}", "custom_id": line.custom_id,
            "response": {"status_code": 200, "request_id": output.request_id, "body": body}, "error": None}


def _read_calls(choice: dict, text: str, fmt, request_id: str) -> None:
    """The choice in OpenAI's form of a call where its text holds calls and ended where it meant to
    (a call cut short by max_tokens stays text, with finish_reason "length")."""
    parsed = fmt.parse(text) if choice["finish_reason"] == "stop" else None
    if parsed is None:
        return
    choice["finish_reason"] = "tool_calls"
    choice["message"] = {"role": "assistant", "content": parsed.content, "tool_calls": [
        {"id": call_id(request_id, choice["index"], i, call), "type": "function",
         "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
        for i, call in enumerate(parsed.calls)]}


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
