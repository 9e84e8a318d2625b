"""The HTTP API fuzzed from its own OpenAPI document (schemathesis): whatever a client sends to any
route, with a valid key or without, the answer is never a 500, and every answer is what the
document says (status codes, and bodies against their schemas).

The chat and completions routes are fuzzed twice: with the other routes, on an app without an engine
(they check the body, then answer 503), and against ``berth serve`` with its engine worker running on
the tiny model, where a valid body runs: every answer is a 200 (a whole answer, or server-sent events
ending in ``[DONE]`` or an error event) or a 4xx with OpenAI's error body, and afterwards the worker
answers a plain request as before, with every KV block back on the free list."""

from __future__ import annotations

import json
import time

import openai
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from jobs.http.app import create_app
from jobs.http.background import Tasks
from tests.support.jobs_env import TINY_NAME, tiny_settings, write_requests
from tests.support.serving import client, embedded_settings, key_for, serving

pytestmark = pytest.mark.slow  # tests of tens of seconds: the suite starts them first

MAX_EXAMPLES = 25
LIVE_EXAMPLES = 30  # per route and mode, against the live engine
LIVE_CONTEXT = 128  # the live engine's context: no request it runs is longer, whatever its max_tokens
LIVE_MAX_TOKENS = 8  # explicit max_tokens and min_tokens over this are cut to it: the answers stay quick
ROUTES = ("/v1/chat/completions", "/v1/completions")
ANSWERED_NOW = (*ROUTES, "/v1/responses")  # the routes an engine answers at once (503 without one)
ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("fuzz")
    s = embedded_settings(tiny_llama_dir, tmp, max_file_bytes="256KiB")
    key = key_for(s, "fuzzer")
    tasks = Tasks(s)
    app = create_app(s, tasks=tasks)
    from starlette.testclient import TestClient

    with TestClient(app, raise_server_exceptions=False) as c:  # a real file and batch for the ids to find
        auth = {"Authorization": f"Bearer {key}"}
        body = write_requests(tmp / "r.jsonl", 2).read_bytes()
        file_id = c.post("/v1/files", headers=auth, files={"file": ("r.jsonl", body)},
                         data={"purpose": "batch"}).json()["id"]
        batch = c.post("/v1/batches", headers=auth, json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                          "completion_window": "24h"})
    known = {"file_id": file_id, "batch_id": batch.json()["id"], "model_id": "tiny-llama"}
    yield app, key, known
    tasks.close()


@pytest.fixture(scope="module")
def operations(fuzzed):
    app, _, _ = fuzzed
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    found = [result.ok() for result in schema.get_all_operations()]
    assert len(found) >= 12, [f"{op.method} {op.path}" for op in found]
    return found


def _fuzz(operation, mode: GenerationMode, examples: int, headers: dict, check, known: dict | None = None) -> None:
    """Run ``examples`` cases of the operation; with ``known``, half of them name ids that exist."""
    @given(case=operation.as_strategy(generation_mode=mode), real=st.booleans())
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case, real):
        if known and real and case.path_parameters:
            case.path_parameters = {k: known.get(k, v) for k, v in case.path_parameters.items()}
        response = case.call(headers=headers)
        assert response.status_code < 500 or _unserved(case, response), (
            case.method, case.formatted_path, case.query, case.body, response.status_code, response.text[:500])
        check(case, response)

    run()


def _unserved(case, response) -> bool:
    """The documented 503 of a chat, completions or responses body that passed its checks, on an app
    without an engine."""
    return (case.path in ANSWERED_NOW and response.status_code == 503
            and response.json()["error"]["code"] == "engine_unavailable")


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_no_answer_is_a_server_error(operations, fuzzed, mode):
    """Valid and invalid requests (schemathesis's positive and negative modes) with a valid key, to
    every operation: never a 500 (the chat and completions routes' 503 of a valid body aside: this app
    runs no engine), and a valid request's answer conforms to the document."""
    _, key, known = fuzzed

    def conforms(case, response):
        if mode is GenerationMode.POSITIVE:
            checks = [status_code_conformance, content_type_conformance, response_schema_conformance]
            case.validate_response(response, checks=checks if _unserved(case, response) else
                                   [not_a_server_error, *checks])

    for operation in operations:
        _fuzz(operation, mode, MAX_EXAMPLES, {"Authorization": f"Bearer {key}"}, conforms, known)


def test_without_a_key_every_route_is_401(operations):
    def unauthorized(case, response):
        if case.path != "/openapi.json":
            assert response.status_code == 401, (case.method, case.formatted_path, response.text[:300])
            assert response.json()["error"]["code"] == "invalid_api_key"

    for operation in operations:
        _fuzz(operation, GenerationMode.POSITIVE, 5, {}, unauthorized)


# ---- the chat and completions routes, against a live engine
def test_the_documented_bodies_are_the_fields_berth_takes():
    """Every field berth reads or accepts for each route is in its schema (and none it refuses); bodies
    with many of them, as clients write them, are valid by it, and one with an unknown field is not."""
    import jsonschema

    from jobs.http.completion_bodies import REFUSED, body_schema
    from jobs.lines.request_fields import IMPLEMENTED, NO_EFFECT, NOT_YET, ONLY
    from tests.support.structured import PERSON

    for url in ROUTES:
        schema = body_schema(url, TINY_NAME)
        jsonschema.Draft202012Validator.check_schema(schema)
        taken = (IMPLEMENTED[url] - REFUSED) | set(NO_EFFECT) | {n for n, (values, _) in ONLY.items() if url in values}
        assert set(schema["properties"]) == taken and not taken & (REFUSED | set(NOT_YET))
    chat = {"model": TINY_NAME, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"}],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}],
        "tool_choice": "auto", "max_completion_tokens": 5, "n": 2, "logprobs": True, "top_logprobs": 3, "seed": 7,
        "stop": ["\n"], "stream": True, "stream_options": {"include_usage": True}, "user": "u", "metadata": {},
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}
    completion = {"model": TINY_NAME, "prompt": [1, 2, 3], "max_tokens": 4, "logprobs": 2, "echo": False,
                  "suffix": None, "best_of": 1, "guided_choice": ["a", "b"], "logit_bias": {"42": -5}, "top_k": -1}
    for url, body in ((ROUTES[0], chat), (ROUTES[1], completion)):
        validator = jsonschema.Draft202012Validator(body_schema(url, TINY_NAME))
        assert not list(validator.iter_errors(body)), [e.message for e in validator.iter_errors(body)]
        assert list(validator.iter_errors({**body, "frobnicate": 1}))


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_llama_dir):
    """``berth serve`` with its engine worker; a plain request's greedy answer and the idle free-block
    count, taken before the server starts."""
    from worker.engine.engine import Engine
    from worker.engine.request import SamplingParams

    tmp = tmp_path_factory.mktemp("live")
    s = embedded_settings(tiny_llama_dir, tmp, max_model_len=LIVE_CONTEXT)
    engine = Engine(tiny_settings(tiny_llama_dir, max_model_len=LIVE_CONTEXT))
    prompt = list(range(300, 312))
    plain = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].completions[0]
    idle = engine.block_manager.num_free_blocks
    with serving(s, engine=engine) as server:
        yield server, engine, key_for(s, "fuzzer"), (prompt, plain.text, idle)


def _bounded(body, stream: bool):
    """Cut a body's explicit output lengths to ``LIVE_MAX_TOKENS`` (LIVE_CONTEXT bounds the rest); ``stream``:
    ask for a stream (half the cases: among fifty optional fields the document's own ``stream`` seldom is)."""
    if isinstance(body, dict):
        if stream:
            body["stream"] = True
            if "max_tokens" not in body and "max_completion_tokens" not in body:  # one that ends: [DONE]
                body["max_tokens"] = LIVE_MAX_TOKENS
        for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > LIVE_MAX_TOKENS:
                body[name] = 1 + value % LIVE_MAX_TOKENS
    return body


def _openai_error(response) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS and isinstance(error["message"], str), error


def _events(text: str, cut_short: bool) -> list:
    """The data of each server-sent event of a stream: chunks, then [DONE] or an error event. ``cut_short``:
    the client stopped reading (schemathesis leaves a stream after 20 events, which aborts the request),
    so the stream is complete chunks so far."""
    assert text.endswith("\n\n"), text[-300:]
    events = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: "), block[:300]
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    last = events[-1]
    if not cut_short:
        assert last == "[DONE]" or set(last) == {"error"} and set(last["error"]) == ERROR_FIELDS, text[-500:]
    assert all(isinstance(e, dict) and "choices" in e for e in (events if cut_short else events[:-1])), text[:500]
    return events


def _answers_as_openai(case, response) -> None:
    if response.status_code != 200:
        _openai_error(response)
    elif "text/event-stream" in str(response.headers.get("content-type")):  # schemathesis: a list of values
        assert isinstance(case.body, dict) and case.body.get("stream") is True
        _events(response.text, response.stream_cut_short)
    else:
        body = response.json()
        assert body["object"] in ("chat.completion", "text_completion") and body["choices"], body


def _well_after(server, engine, key, prompt, text, idle) -> None:
    """The worker answers a plain request as before the fuzz, and holds no KV block once idle."""
    answer = client(server, key, timeout=120).completions.create(model=TINY_NAME, prompt=prompt, max_tokens=8,
                                                                  temperature=0, extra_body={"ignore_eos": True})
    assert answer.choices[0].text == text and answer.usage.completion_tokens == 8
    deadline = time.monotonic() + 60
    while engine.has_unfinished() or engine.block_manager.num_free_blocks != idle:
        assert time.monotonic() < deadline, (engine.num_unfinished, engine.block_manager.num_free_blocks, idle)
        time.sleep(0.05)


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_chat_and_completions_against_a_live_engine(live, mode):
    """Valid and invalid bodies (streamed or not, n, logprobs, stop, structured outputs, tools, ...) from
    the document's schemas, with a valid key: a 200 or OpenAI's 4xx error, never a 500; the worker
    unharmed after."""
    server, engine, key, (prompt, text, idle) = live
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [op for op in operations if op.method.upper() == "POST" and op.path in ROUTES]
    assert len(operations) == 2
    headers = {"Authorization": f"Bearer {key}"}
    seen = []
    for operation in operations:
        @given(case=operation.as_strategy(generation_mode=mode), stream=st.booleans())
        @settings(max_examples=LIVE_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def run(case, stream):
            case.body = _bounded(case.body, stream and mode is GenerationMode.POSITIVE)  # negative: stream as made
            response = case.call(headers=headers, timeout=120)
            streamed = "text/event-stream" in str(response.headers.get("content-type"))
            seen.append((case.path, response.status_code, streamed and not response.stream_cut_short))
            assert response.status_code < 500, (case.path, case.body, response.status_code, response.text[:500])
            _answers_as_openai(case, response)

        run()
    if mode is GenerationMode.POSITIVE:  # the fuzz reaches the engine: on both routes, whole and streamed to the end
        ran = [(path, streamed) for path, status, streamed in seen if status == 200]
        assert {path for path, _ in ran} == set(ROUTES) and {streamed for _, streamed in ran} == {False, True}, seen
    _well_after(server, engine, key, prompt, text, idle)


def test_a_structured_output_that_leads_nowhere_is_the_callers_error(live):
    """Once 500s (found by probing around the fuzz): a regular expression that matches nothing compiled,
    and the engine then failed the request as its own fault; one that matches something but has a branch
    that leads nowhere did the same when a sample took that branch. Now the first is a 400 naming the
    field, the second a 400 (or, once streaming, an error event) saying the output cannot be completed."""
    server, engine, key, (prompt, text, idle) = live
    c = client(server, key, timeout=120)
    b = engine.tokenizer("b", add_special_tokens=False)["input_ids"][0]
    with pytest.raises(openai.BadRequestError) as raised:
        c.completions.create(model=TINY_NAME, prompt="Hi", max_tokens=4,
                             extra_body={"guided_regex": "[^\\x00-\\U0010FFFF]"})
    assert raised.value.body["param"] == "guided_regex" and "matches no output" in raised.value.body["message"]
    nowhere = {"guided_regex": "a[^\\x00-\\U0010FFFF]|b", "logit_bias": {str(b): -100}}  # "a", then nothing
    with pytest.raises(openai.BadRequestError) as raised:
        c.completions.create(model=TINY_NAME, prompt="Hi", max_tokens=4, extra_body=nowhere)
    assert raised.value.body["code"] == "request_rejected" and "cannot be completed" in raised.value.body["message"]
    response = requests.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                          json={"model": TINY_NAME, "prompt": "Hi", "max_tokens": 4, "stream": True, **nowhere})
    assert response.status_code == 200
    error = _events(response.text, cut_short=False)[-1]
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["code"] == "request_rejected"
    _well_after(server, engine, key, prompt, text, idle)
