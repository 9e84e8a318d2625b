"""OpenAI's ``POST /v1/chat/completions``, ``POST /v1/completions`` and ``POST /v1/responses`` on ``berth
serve``: one request answered now, whole (``stream: false``) or as server-sent events (``stream: true``;
the Responses API's events are ``jobs.http.response_events``'). The body is checked as a batch line is
(``jobs.lines.batch_format.to_request``: a Responses body as the chat line it means); the request runs through an
``InteractiveChannel``, ahead of batch work; a caller that disconnects aborts it (docs/http-api.md). A tenant's
requests running at once and their tokens a minute are bounded (``jobs.http.interactive_limits``).
"""

import asyncio
import json
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from jobs.http.completion_bodies import openapi_body
from jobs.http.errors import ApiError, error_response
from jobs.http.interactive_channel import InteractiveChannel, Subscription
from jobs.http.interactive_limits import Held, InteractiveLimiter, LimitsCache
from jobs.http.response_events import ResponsesReply
from jobs.http.schemas import ErrorBody
from jobs.lines.batch_format import BatchLine, CheckedRequest, LineError, check_request, response_line
from jobs.lines.batch_format import _logprobs as logprobs_object
from jobs.lines.line_text import shown
from jobs.lines.request_fields import CHAT_URL, COMPLETIONS_URL, RESPONSES_URL
from jobs.lines.structured_outputs import GrammarCheck
from jobs.lines.validate import ModelInfo
from worker.config import Settings
from worker.consumer.interactive_inbox import Delta, Done, Failed
from worker.engine.structured.grammar_compile import GrammarError

log = logging.getLogger("berth.http")

_FAILED_STATUS = {"request_rejected": 400, "invalid_request": 400, "server_unavailable": 503}
_ANSWERS = {200: {"content": {"application/json": {"schema": {"type": "object"}},
                              "text/event-stream": {"schema": {"type": "string"}}}}}


def add_completion_routes(app: FastAPI, channel: InteractiveChannel | None, model: Callable[[], ModelInfo],
                          tenant_dependency, limiter: InteractiveLimiter, limits: LimitsCache,
                          model_name: str | None = None, settings: Settings | None = None) -> None:
    """The three routes; ``model()`` gives what bodies are checked against when ``channel`` has no engine's;
    ``limiter`` counts each tenant's requests against its ``limits``; ``model_name``, the served model's, is the
    one the OpenAPI document names (``jobs.http.completion_bodies``). ``app.state.stopping``, set when the
    server stops, ends the waits for compiles (503)."""
    settings = settings or Settings.model_construct()
    compiling = _TenantCounts(settings.http_tenant_compiles)
    stopping = app.state.stopping = asyncio.Event()

    def check(line: BatchLine, info: ModelInfo, request_id: str, tenant: str) -> tuple[CheckedRequest, list]:
        """The body checked (on a pool thread: tokenizing is work), its compiles asked for, not waited for."""
        try:
            checked = check_request(line, info.tokenizer, info.name, info.max_model_len, request_id=request_id,
                                    tenant=tenant, vocab_size=info.vocab_size,
                                    structured_limits=info.structured_limits, hidden_size=info.hidden_size)
        except LineError as exc:
            raise ApiError(400, exc.message, _param(exc.param), exc.code) from None
        _within_answer_limit(checked.request.params, settings.http_max_answer_tokens,
                             "max_output_tokens" if line.url == RESPONSES_URL else "max_tokens")
        if not checked.grammars:
            return checked, []
        from worker.engine.structured.grammar import (
            compiler_for,  # torch: paid by the first constraint, not by every server's import
        )

        waits: list[_Compile] = []
        try:
            for grammar in checked.grammars:
                wait = compiler_for(info.tokenizer).wait(grammar.spec, tenant, info.structured_limits.compile)
                waits.append(_Compile(grammar, wait))
                if not wait.future.done():
                    if not compiling.enter(tenant):
                        raise ApiError(429, f"this tenant has {compiling.limit} requests waiting for the compile of "
                                       "their structured outputs (BERTH_HTTP_TENANT_COMPILES): retry once one is "
                                       "answered", None, "rate_limit_exceeded")
                    waits[-1].counted = tenant
        except BaseException:
            _leave(waits, compiling)
            raise
        return checked, waits

    async def answer(request: Request, tenant: str, url: str) -> Response:
        """The tenant's place taken before its body is read, and given back unless its answer holds it."""
        own = limits.cached(tenant) or await run_in_threadpool(limits.read, tenant)
        held = limiter.enter(tenant, own)
        try:
            response = await checked_answer(request, tenant, url, held)
        except BaseException:
            held.end(0)
            raise
        if not isinstance(response, _Answer):
            held.end(0)
        return response

    async def checked_answer(request: Request, tenant: str, url: str, held: Held) -> Response:
        body = _json_object(await request.body())
        stream, include_usage = _stream_fields(body, url)
        info = (channel.model() if channel is not None else None) or await run_in_threadpool(model)
        line = BatchLine(1, "request", url, {k: v for k, v in body.items() if k not in ("stream", "stream_options")})
        request_id = f"i-{uuid.uuid4().hex[:24]}"
        try:
            checked, waits = await run_in_threadpool(check, line, info, request_id, tenant)
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 (whatever the check raises: this request's 400, logged)
            raise _unchecked(url, exc) from None
        params = checked.request.params
        prompt_tokens = len(checked.request.prompt_token_ids)
        try:  # the compiles awaited here, no thread held; a caller that leaves withdraws its own
            held.reserve(prompt_tokens + params.n * params.max_tokens)  # before the compile: no work for a 429
            if (why := await _compiled(request.receive, waits, stopping)) == "left":
                log.info("chat or completions request %s: its caller left while its grammar compiled", request_id)
                return Response(status_code=499)  # nobody reads it
            if why == "stopping":
                raise ApiError(503, "this server is stopping: try again once it is back", None, "server_stopping")
            for compile_ in waits:
                _compile_result(checked, compile_, url)
        finally:
            _leave(waits, compiling)
        engine_request = checked.request
        if channel is None or not channel.ready():
            raise ApiError(503, "no engine takes requests answered at once now: with a broker, run a `berth worker` "
                           "with --interactive-prefetch above 0 (the default) for this model; on the embedded "
                           "defaults, wait for this server's engine to load", None, "engine_unavailable")
        tool_calls = engine_request.params.tool_calls
        reply = (ResponsesReply(line, tool_calls, info, stream) if url == RESPONSES_URL
                 else _Reply(line, tool_calls, info, engine_request.params.n, stream, include_usage))
        return _Answer(channel.open(engine_request, checked.engine_line), reply, held, prompt_tokens)

    def extra(url: str) -> dict:
        return {"openapi_extra": openapi_body(url, model_name), "responses": {**_ANSWERS, 503: {"model": ErrorBody}}}

    @app.post("/v1/chat/completions", summary="OpenAI's chat completions, answered now (stream or not)",
              **extra(CHAT_URL))
    async def chat_completions(request: Request, tenant: tenant_dependency) -> Response:
        return await answer(request, tenant, CHAT_URL)

    @app.post("/v1/completions", summary="OpenAI's completions, answered now (stream or not)", **extra(COMPLETIONS_URL))
    async def completions(request: Request, tenant: tenant_dependency) -> Response:
        return await answer(request, tenant, COMPLETIONS_URL)

    @app.post("/v1/responses", summary="OpenAI's Responses API, answered now (stream or not)", **extra(RESPONSES_URL))
    async def responses(request: Request, tenant: tenant_dependency) -> Response:
        return await answer(request, tenant, RESPONSES_URL)


class _TenantCounts:
    """Per tenant, how many of its requests wait for a compile; at most ``limit`` each."""

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def enter(self, tenant: str) -> bool:
        with self._lock:
            if self._counts[tenant] >= self.limit:
                return False
            self._counts[tenant] += 1
            return True

    def exit(self, tenant: str) -> None:
        with self._lock:
            self._counts[tenant] -= 1
            if self._counts[tenant] <= 0:
                del self._counts[tenant]


@dataclass
class _Compile:
    grammar: GrammarCheck
    wait: Any  # worker.engine.structured.grammar.Wait
    counted: str | None = None  # the tenant it counts for in _TenantCounts


def _leave(waits: list[_Compile], counts: _TenantCounts) -> None:
    for compile_ in waits:
        compile_.wait.leave()
        if compile_.counted is not None:
            counts.exit(compile_.counted)
            compile_.counted = None


async def _compiled(receive: Receive, waits: list[_Compile], stopping: asyncio.Event) -> str | None:
    """None once every compile is done; "left" if the caller left first, "stopping" if the server stops."""
    pending = [_on_loop(c.wait.future) for c in waits if not c.wait.future.done()]
    if not pending:
        return None
    tasks = {asyncio.ensure_future(asyncio.gather(*pending)): None,
             asyncio.ensure_future(_disconnect(receive)): "left", asyncio.ensure_future(stopping.wait()): "stopping"}
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
    whys = [tasks[task] for task in done]
    return "left" if "left" in whys else "stopping" if "stopping" in whys else None


def _on_loop(future: Future) -> asyncio.Future:
    """An asyncio future done once ``future`` is; cancelling it leaves ``future`` alone (others may wait on it)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def finished(_) -> None:
        try:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
        except RuntimeError:  # the loop has closed: nobody waits
            pass

    future.add_done_callback(finished)
    return done


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _compile_result(checked: CheckedRequest, compile_: _Compile, url: str) -> None:
    """``ApiError`` unless the compile succeeded."""
    future = compile_.wait.future
    if future.cancelled():
        raise ApiError(503, "the compile of the structured output was cancelled: try again", None,
                       "server_unavailable")
    exc = future.exception()
    if isinstance(exc, GrammarError):
        error = checked.refused(compile_.grammar.refusal(exc))
        raise ApiError(400, error.message, _param(error.param), error.code)
    if exc is not None:
        raise _unchecked(url, exc)


def _unchecked(url: str, exc: BaseException) -> ApiError:
    log.warning("checking a %s body raised", url, exc_info=exc)
    return ApiError(400, f"the request could not be checked ({type(exc).__name__}); fix it or report it as a bug",
                    None, "invalid_request")


def _within_answer_limit(params, limit: int, field: str = "max_tokens") -> None:
    """400 naming ``field`` (max_tokens, or what stands for it) when the answer could hold more than ``limit``
    tokens and logprobs entries."""
    per_token = 1 + (0 if params.logprobs is None else 1 + params.logprobs)
    size = params.n * params.max_tokens * per_token
    if size > limit:
        raise ApiError(400, f"{field}: n {params.n} x {field} {params.max_tokens} x {per_token} (a token and "
                       f"its logprobs entries) is {size:,}, over the {limit:,} one answer may hold "
                       "(BERTH_HTTP_MAX_ANSWER_TOKENS): ask for fewer tokens, samples or top_logprobs",
                       field, "answer_too_large")


def _json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise ApiError(400, "the body is not valid JSON: send one JSON object", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, not {type(body).__name__}", None, "invalid_request")
    return body


def _stream_fields(body: dict, url: str) -> tuple[bool, bool]:
    """(stream, include_usage); the Responses API's one option, include_obfuscation, changes nothing here
    (berth pads no event), and its usage comes in response.completed anyway."""
    stream, options = body.get("stream"), body.get("stream_options")
    known = "include_obfuscation" if url == RESPONSES_URL else "include_usage"
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, f"stream: must be true or false, got {shown(stream)}", "stream", "invalid_type")
    if options is None:
        return bool(stream), False
    if not isinstance(options, dict):
        raise ApiError(400, f"stream_options: must be an object, got {shown(options)}", "stream_options",
                       "invalid_type")
    if not stream:
        raise ApiError(400, "stream_options: only with stream true", "stream_options", "invalid_value")
    for name, value in options.items():
        if name != known:
            raise ApiError(400, f"stream_options.{shown(name)}: not an option berth knows ({known} is)",
                           "stream_options", "invalid_value")
        if value is not None and not isinstance(value, bool):
            raise ApiError(400, f"stream_options.{known}: must be true or false, got {shown(value)}",
                           f"stream_options.{known}", "invalid_type")
    return True, bool(options.get("include_usage"))


def _param(param: str | None) -> str | None:
    return param.removeprefix("body.") if param else param


class _Reply:
    """One request's answer, as OpenAI writes it: the whole object, or its chunks."""

    def __init__(self, line: BatchLine, tool_calls: str | None, info: ModelInfo, n: int, stream: bool,
                 include_usage: bool):
        self.line, self.tool_calls, self.info, self.n = line, tool_calls, info, n
        self.stream, self.include_usage = stream, include_usage
        self.chat = line.url == CHAT_URL
        self.created = int(time.time())
        self.id: str | None = None

    def body(self, output) -> dict:
        line = response_line(self.line, output, self.info.name, self.info.tokenizer, self.tool_calls)
        return line["response"]["body"]

    def _chunk(self, choices: list[dict], **extra) -> bytes:
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.info.name, "choices": choices, **extra}
        if self.include_usage and "usage" not in chunk:
            chunk["usage"] = None
        return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"

    def first(self, request_id: str) -> list[bytes]:
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{request_id}"
        if not self.chat:
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(self.n)]

    def deltas(self, d: Delta) -> list[bytes]:
        """A sample's new text, and its end; a request with tools says all at ``done``."""
        if self.tool_calls is not None:
            return []
        out = []
        if d.text or d.logprobs:
            out.append(self._choice(d.index, d.text, self._logprobs(d.logprobs), None))
        if d.finish_reason is not None:
            out.append(self._choice(d.index, None, None, d.finish_reason))
        return out

    def done(self, output) -> list[bytes]:
        body = self.body(output)
        out = []
        if self.tool_calls is not None:  # the whole answer, read for calls, in one chunk a choice
            for choice in body["choices"]:
                message = choice["message"]
                delta: dict[str, Any] = {"content": message["content"]}
                if "tool_calls" in message:
                    delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
                out.append(self._chunk([{"index": choice["index"], "delta": delta, "logprobs": choice["logprobs"],
                                         "finish_reason": choice["finish_reason"]}]))
        if self.include_usage:
            out.append(self._chunk([], usage=body["usage"]))
        return out + [b"data: [DONE]\n\n"]

    def failed(self, failed: Failed) -> list[bytes]:
        """A failure after the stream began, as OpenAI's streams carry one."""
        kind = "invalid_request_error" if _FAILED_STATUS.get(failed.code) == 400 else "server_error"
        error = {"error": {"message": failed.reason, "type": kind, "param": None, "code": failed.code}}
        return [b"data: " + json.dumps(error, ensure_ascii=False).encode() + b"\n\n"]

    def _choice(self, index: int, text: str | None, logprobs, finish_reason: str | None) -> bytes:
        if self.chat:
            choice = {"index": index, "delta": {} if text is None else {"content": text}, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return self._chunk([choice])

    def _logprobs(self, entries) -> dict | None:
        return None if entries is None else logprobs_object(list(entries), self.info.tokenizer, self.chat)


class _Answer(Response):
    """The answer to one request, sent as its events come; a disconnect aborts the request at once. Its
    tenant's place is given back when it ends, its tokens corrected to those it used."""

    def __init__(self, subscription: Subscription, reply: "_Reply | ResponsesReply", held: Held, prompt_tokens: int):
        super().__init__()
        self.subscription, self.reply, self.held = subscription, reply, held
        self.used = prompt_tokens  # and the tokens made so far; all of them, once Done says

    async def _next(self) -> list:
        events = await self.subscription.next()
        for event in events:
            if isinstance(event, Delta):
                self.used += len(event.token_ids)
            elif isinstance(event, Done):
                self.used = len(event.output.prompt_token_ids) + event.output.num_output_tokens
        return events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:
            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.subscription.abort()  # the caller left: the engine drops it before its next step
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:
                await (self._stream(send) if self.reply.stream else self._whole(send))
            except OSError:  # the caller left while we wrote
                pass
            finally:
                self.subscription.abort()
                self.held.end(self.used)
                group.cancel_scope.cancel()

    async def _whole(self, send: Send) -> None:
        while True:
            for event in await self._next():
                if isinstance(event, Done):
                    body = json.dumps(self.reply.body(event.output), ensure_ascii=False).encode()
                    await _send_bytes(send, 200, "application/json", body)
                    return
                if isinstance(event, Failed):
                    await self._error(send, event)
                    return

    async def _stream(self, send: Send) -> None:
        events = await self._next()  # the first token, or an error told as an HTTP status
        if isinstance(events[0], Failed):
            await self._error(send, events[0])
            return
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})
        chunks = self.reply.first(self.subscription.request_id)
        while True:
            for event in events:
                if isinstance(event, Delta):
                    chunks += self.reply.deltas(event)
                elif isinstance(event, Done):
                    chunks += self.reply.done(event.output)
                elif isinstance(event, Failed):
                    chunks += self.reply.failed(event)
            if chunks:
                await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": True})
                chunks = []
            if self.subscription.over:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            events = await self._next()

    async def _error(self, send: Send, failed: Failed) -> None:
        status = _FAILED_STATUS.get(failed.code, 500)
        response = error_response(status, failed.reason, None, failed.code)
        await _send_bytes(send, status, "application/json", response.body)


async def _send_bytes(send: Send, status: int, content_type: str, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
