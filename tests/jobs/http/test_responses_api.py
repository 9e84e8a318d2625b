"""Issue 37: OpenAI's Responses API on ``berth serve``, driven by the unmodified openai client:
``client.responses.create`` whole and streamed, each body and event valid by the openai package's own
types, greedy text and usage equal to the same prompt's chat completion; structured output and a required
tool call in the Responses shape; bad bodies a 400 naming the field; and a batch of ``/v1/responses``
lines through ``client.batches``, with per-line errors."""

from __future__ import annotations

import json
import urllib.request

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.support.jobs_env import TINY_NAME, tiny_settings
from tests.support.qwen import SCHEMAS
from tests.support.serving import client, embedded_settings, key_for, serving, upload, wait_for

URL = "/v1/responses"
EVENTS = TypeAdapter(ResponseStreamEvent)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}  # bounded: a random model's JSON ends
PROMPTS = ["Say something about the number 3.", "Write one line about the sea."]


def _raw_events(server, key: str, body: dict) -> list[dict]:
    """The stream's events as sent (``event:`` and ``data:`` lines), each checked against its type's name."""
    events = []
    asked = urllib.request.Request(f"{server.url}{URL}", data=json.dumps({**body, "stream": True}).encode(),
                                   method="POST", headers={"Authorization": f"Bearer {key}",
                                                           "Content-Type": "application/json"})
    with urllib.request.urlopen(asked, timeout=60) as answer:
        assert answer.status == 200 and answer.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in (raw.decode().rstrip("\n") for raw in answer):
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                assert event["type"] == name, (name, event)
                events.append(event)
    return events


def _chat(c: openai.OpenAI, prompt: str, **body):
    return c.chat.completions.create(model=TINY_NAME, messages=[{"role": "system", "content": "Be brief."},
                                                                {"role": "user", "content": prompt}],
                                     temperature=0, **body)


def test_responses_whole_and_streamed_equal_the_chat_completion(tmp_path, tiny_llama_dir, tiny_engine):
    """Greedy: the Response's text, status and usage are the chat completion's of the same prompt, the body
    validates as the openai package's ``Response``, and the stream's events, each a valid
    ``ResponseStreamEvent`` numbered from 0, put together the same text and end with that Response."""
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    key = key_for(settings, "alice")
    with serving(settings, engine=tiny_engine) as server:
        c = client(server, key)
        for prompt, cap in ((PROMPTS[0], 24), (PROMPTS[1], 3)):
            chat = _chat(c, prompt, max_tokens=cap)
            body = dict(model=TINY_NAME, instructions="Be brief.", input=prompt, max_output_tokens=cap, temperature=0)
            raw = c.responses.with_raw_response.create(**body).http_response.json()
            whole = Response.model_validate(raw)
            want = chat.choices[0].message.content
            assert (whole.object, whole.model, whole.output_text, raw["output_text"]) == ("response", TINY_NAME,
                                                                                          want, want)
            [item] = whole.output
            assert (item.type, item.role, item.content[0].type, item.id) == ("message", "assistant", "output_text",
                                                                             f"msg_{whole.id.removeprefix('resp_')}")
            cut = chat.choices[0].finish_reason == "length"
            assert (whole.status, item.status) == (("incomplete",) * 2 if cut else ("completed",) * 2)
            assert (whole.incomplete_details.reason if cut else whole.incomplete_details) == (
                "max_output_tokens" if cut else None)
            usage = whole.usage
            assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
                chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
            again = _chat(c, prompt, max_tokens=cap)  # the chat's prompt cached, as the Response found it
            cached = usage.input_tokens_details.cached_tokens
            assert cached == again.usage.prompt_tokens_details.cached_tokens and cached > 0
            assert usage.output_tokens_details.reasoning_tokens == 0
            assert (whole.instructions, whole.max_output_tokens, whole.temperature) == ("Be brief.", cap, 0.0)

            events = list(c.responses.create(**body, stream=True))  # the client's own parse
            kinds = [e.type for e in events]
            last = "response.incomplete" if cut else "response.completed"
            assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                                 "response.content_part.added"]
            assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                                  "response.output_item.done", last]
            assert set(kinds[4:-4]) == {"response.output_text.delta"}
            assert [e.sequence_number for e in events] == list(range(len(events)))
            assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
            assert events[-4].text == want and events[-1].response.output_text == want
            assert events[-1].response.usage.output_tokens == usage.output_tokens
            assert events[0].response.status == "in_progress" and events[0].response.output == []

            for event in _raw_events(server, key, body):  # as sent, valid by the openai types
                EVENTS.validate_python(event)


def test_structured_output_in_the_responses_shape(tmp_path, tiny_llama_dir, tiny_engine):
    """``text.format`` json_schema and json_object hold the output to valid JSON (a random model, so only the
    grammar makes it so)."""
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    with serving(settings, engine=tiny_engine) as server:
        c = client(server, key_for(settings, "alice"))
        person = c.responses.create(model=TINY_NAME, input="A person, as JSON.", max_output_tokens=60, temperature=0,
                                    text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                     "strict": True}})
        assert person.status == "completed", person
        jsonschema.validate(json.loads(person.output_text), PERSON)
        assert person.text.format.type == "json_schema"
        anything = c.responses.create(model=TINY_NAME, input="JSON, please.", max_output_tokens=12, temperature=0,
                                      text={"format": {"type": "json_object"}})
        free = c.responses.create(model=TINY_NAME, input="JSON, please.", max_output_tokens=12, temperature=0)
        assert anything.output_text.lstrip().startswith("{") and anything.output_text != free.output_text


def test_a_required_tool_call_in_the_responses_shape(tmp_path, qwen_dir, qwen_engine):
    """Flat function tools and ``tool_choice: required``: the answer is ``function_call`` items (the chat
    completion's calls), whole and streamed, and the call's output sent back as items runs."""
    tools = [{"type": "function", "name": name, "description": f"the {name} tool", "parameters": schema}
             for name, schema in SCHEMAS.items()]
    settings = tiny_settings(qwen_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                             storage_url=f"file://{tmp_path / 'store'}")
    body = dict(model=TINY_NAME, input="Weather in Oslo?", tools=tools, tool_choice="required",
                parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    with serving(settings, engine=qwen_engine) as server:
        c = client(server, key_for(settings, "alice"))
        chat = c.chat.completions.create(
            model=TINY_NAME, messages=[{"role": "user", "content": "Weather in Oslo?"}], tool_choice="required",
            tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools],
            parallel_tool_calls=False, max_tokens=120, temperature=0)
        raw = c.responses.with_raw_response.create(**body).http_response.json()
        whole = Response.model_validate(raw)
        calls = [item for item in whole.output if item.type == "function_call"]
        assert whole.status == "completed" and calls, whole
        assert [(call.name, json.loads(call.arguments)) for call in calls] == [
            (t.function.name, json.loads(t.function.arguments)) for t in chat.choices[0].message.tool_calls]
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        assert [t["type"] for t in raw["tools"]] == ["function"] * 3 and raw["tool_choice"] == "required"

        events = list(c.responses.create(**body, stream=True))
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [e.arguments for e in done] == [call.arguments for call in calls]
        assert events[-1].type == "response.completed"
        assert [i.type for i in events[-1].response.output] == [i.type for i in whole.output]

        follow = c.responses.create(model=TINY_NAME, max_output_tokens=8, temperature=0, tools=tools, input=[
            {"role": "user", "content": "Weather in Oslo?"},
            *({"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}
              for call in calls),
            *({"type": "function_call_output", "call_id": call.call_id, "output": "sunny"} for call in calls)],
            tool_choice="none")
        assert follow.status in ("completed", "incomplete") and follow.output[0].type == "message"


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": "hi", "store": True}, "store"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "p"}}}, "text.format.schema"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "messages": []}, "messages"),
    ({"input": "hi", "stream": True, "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_responses_bodies_are_a_400_naming_the_field(tmp_path, tiny_llama_dir, tiny_engine, body, param):
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    with serving(settings, engine=tiny_engine) as server:
        c = client(server, key_for(settings, "alice"))
        with pytest.raises(openai.BadRequestError) as raised:
            c.post(URL.removeprefix("/v1"), body={"model": TINY_NAME, **body}, cast_to=object)
    error = raised.value.body
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def test_a_batch_of_responses_lines_through_client_batches(tmp_path, tiny_llama_dir, tiny_engine):
    """``endpoint="/v1/responses"``: each good line's body a valid Response whose greedy text and usage are
    the live chat completion's of the same prompt; ``previous_response_id`` and a bad ``input`` are the
    job's per-line errors, naming the field."""
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": URL, "body": {
        "model": TINY_NAME, "instructions": "Be brief.", "input": [{"role": "user", "content": [
            {"type": "input_text", "text": prompt}]}], "max_output_tokens": 16, "temperature": 0}}
        for i, prompt in enumerate(PROMPTS)]
    lines.append({"custom_id": "prev", "method": "POST", "url": URL,
                  "body": {"model": TINY_NAME, "input": "Go on.", "previous_response_id": "resp_abc"}})
    lines.append({"custom_id": "bad-input", "method": "POST", "url": URL, "body": {"model": TINY_NAME, "input": []}})
    path = tmp_path / "responses.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    with serving(settings, engine=tiny_engine) as server:
        c = client(server, key_for(settings, "alice"))
        batch = c.batches.create(input_file_id=upload(c, path).id, endpoint=URL, completion_window="24h")
        batch = wait_for(c, batch.id)
        output = [json.loads(line) for line in c.files.content(batch.output_file_id).text.splitlines()]
        errors = [json.loads(line) for line in c.files.content(batch.error_file_id).text.splitlines()]
        chats = [_chat(c, prompt, max_tokens=16) for prompt in PROMPTS]
    assert (batch.status, batch.endpoint) == ("completed", URL)
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 2, 2)
    assert [line["custom_id"] for line in output] == ["r0", "r1"]
    for line, chat in zip(output, chats):
        response = Response.model_validate(line["response"]["body"])
        assert response.output_text == chat.choices[0].message.content
        assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                               chat.usage.completion_tokens)
    assert {e["custom_id"]: e["error"]["param"] for e in errors} == {"prev": "body.previous_response_id",
                                                                     "bad-input": "body.input"}
    assert "send the whole conversation in input" in errors[0]["error"]["message"]
