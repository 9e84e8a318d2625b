"""``/v1/responses`` lines (issue 37): a Responses body becomes the very engine request its chat twin
does (prompt tokens and sampling parameters equal, structured outputs and tools included), each bad body
is a line error naming the Responses field, and ``berth generate`` writes each good line's answer as a
Response (valid by the openai package's type) whose text and usage are the chat twin's."""

from __future__ import annotations

import io
import json

import pytest
from openai.types.responses import Response

from jobs.hosting.generate import generate_file
from jobs.lines.batch_format import LineError
from jobs.lines.validate import LineValidator, ModelInfo, read_lines
from tests.support.jobs_env import TINY_NAME, read_jsonl
from tests.support.qwen import TOOLS

URL = "/v1/responses"
CHAT = "/v1/chat/completions"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def _raw(line: dict):
    return next(read_lines(io.BufferedReader(io.BytesIO(json.dumps(line).encode()))))


def _line(url: str, **body) -> dict:
    return {"custom_id": "x", "method": "POST", "url": url, "body": {"model": TINY_NAME, **body}}


@pytest.fixture
def validator(tiny_engine):
    return LineValidator(ModelInfo.of_engine(tiny_engine))


def _same_request(validator, responses: dict, chat: dict) -> None:
    """Both lines are line 1 (the same request id, so the same seed): the requests must be equal."""
    mine = validator.check(_raw(_line(URL, **responses)))[2]
    validator.seen.clear()
    twin = validator.check(_raw(_line(CHAT, **chat)))[2]
    validator.seen.clear()
    assert mine.prompt_token_ids == twin.prompt_token_ids
    assert mine.params == twin.params


def test_a_responses_line_is_its_chat_twins_engine_request(validator):
    _same_request(validator, dict(input="Hi there.", instructions="Be brief.", max_output_tokens=7,
                                  temperature=0.5, top_p=0.9, seed=3),
                  dict(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there."}],
                       max_tokens=7, temperature=0.5, top_p=0.9, seed=3))
    _same_request(validator, dict(input=[
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello, "},
                                                        {"type": "input_text", "text": "world."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Bonjour.", "annotations": []}],
         "id": "msg_1", "status": "completed"},
        {"role": "user", "content": "Again."}]),
        dict(messages=[{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello, world."},
                       {"role": "assistant", "content": "Bonjour."}, {"role": "user", "content": "Again."}]))
    _same_request(validator, dict(input="A number.", text={"format": {"type": "json_schema", "name": "n",
                                                                      "schema": SCHEMA, "strict": True}}),
                  dict(messages=[{"role": "user", "content": "A number."}], response_format={
                      "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}))
    _same_request(validator, dict(input="JSON.", text={"format": {"type": "json_object"}}),
                  dict(messages=[{"role": "user", "content": "JSON."}], response_format={"type": "json_object"}))
    plain = validator.check(_raw(_line(URL, input="x", text={"format": {"type": "text"}})))[2]
    validator.seen.clear()
    assert plain.params.structured is None


def test_flat_tools_and_call_items_are_chats_tools_and_tool_messages(qwen_engine):
    """On a model that calls tools: the same prompt (tools shown, the calls and their answers in it) and the
    same constraint for a required or a named call."""
    validator = LineValidator(ModelInfo.of_engine(qwen_engine))
    flat = [{"type": "function", **t["function"]} for t in TOOLS]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Oslo", "days": 2}'}}
    for choice, chat_choice in (("required", "required"),
                                ({"type": "function", "name": "lookup"},
                                 {"type": "function", "function": {"name": "lookup"}})):
        _same_request(validator, dict(input=[
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Oslo", "days": 2}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}],
            tools=flat, tool_choice=choice, parallel_tool_calls=False),
            dict(messages=[{"role": "user", "content": "Weather?"},
                           {"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
                 tools=TOOLS, tool_choice=chat_choice, parallel_tool_calls=False))


@pytest.mark.parametrize("body, param, words", [
    (dict(input="hi", previous_response_id="resp_1"), "body.previous_response_id", "send the whole conversation"),
    (dict(input="hi", conversation="conv_1"), "body.conversation", "berth keeps no conversations"),
    (dict(input="hi", prompt={"id": "p"}), "body.prompt", "berth keeps no saved prompts"),
    (dict(input="hi", store=True), "body.store", "berth keeps no response to fetch later"),
    (dict(input="hi", background=True), "body.background", "submit a batch of /v1/responses lines"),
    (dict(input="hi", truncation="auto"), "body.truncation", "berth does not cut the input"),
    (dict(input="hi", reasoning={"effort": "high"}), "body.reasoning.effort", "without a reasoning step"),
    (dict(input="hi", reasoning="high"), "body.reasoning", "must be an object"),
    (dict(input="hi", include=["message.output_text.logprobs"]), "body.include", "remove include"),
    (dict(input="hi", top_logprobs=2), "body.top_logprobs", "not supported yet"),
    (dict(input="hi", stream=True), "body.stream", "not available in a batch"),
    (dict(input="hi", n=2), "body.n", "a field of /v1/chat/completions and /v1/completions, not of /v1/responses"),
    (dict(input="hi", messages=[]), "body.messages", "is a field of /v1/chat/completions, not of /v1/responses"),
    (dict(), "body.input", "must be a non-empty string or a non-empty list of input items"),
    (dict(input=""), "body.input", "must be a non-empty string"),
    (dict(input=[]), "body.input", "non-empty list"),
    (dict(input=["hi"]), "body.input[0]", "must be an input item"),
    (dict(input=[{"role": "robot", "content": "hi"}]), "body.input[0].role", 'must be "user", "system"'),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]),
     "body.input[0].content[0].type", "read text only"),
    (dict(input=[{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]),
     "body.input[0].content[0].type", "give input_text parts"),
    (dict(input=[{"role": "user", "content": "hi", "colour": 1}]), "body.input[0].colour", "not a field of a message"),
    (dict(input=[{"type": "reasoning", "summary": []}]), "body.input[0].type", "berth reads message, function_call"),
    (dict(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]),
     "body.input[0].arguments", "JSON text of an object"),
    (dict(input=[{"type": "function_call_output", "output": "x"}]), "body.input[0].call_id", "non-empty string"),
    (dict(input="hi", instructions=""), "body.instructions", "non-empty string"),
    (dict(input="hi", max_output_tokens=0), "body.max_output_tokens", "an integer >= 1"),
    (dict(input="hi", max_output_tokens=5000), "body.input", "exceeds the model's context"),
    (dict(input="hi", text={"format": {"type": "json_schema", "name": "n"}}), "body.text.format.schema", "missing"),
    (dict(input="hi", text={"format": {"type": "json_schema", "name": "n", "schema": {"type": 5}}}),
     "body.text.format.schema", "not a valid JSON Schema"),
    (dict(input="hi", text={"format": {"type": "yaml"}}), "body.text.format.type", "must be"),
    (dict(input="hi", text={"verbosity": "low"}), "body.text.verbosity", 'only "medium"'),
    (dict(input="hi", tools=[{"type": "web_search"}]), "body.tools[0].type", "function tools only"),
    (dict(input="hi", tools=[{"type": "function", "name": "bad name"}]), "body.tools[0].name", "OpenAI's rule"),
    (dict(input="hi", tools=[{"type": "function", "name": "f", "parameters": {"type": "array"}}]),
     "body.tools[0].parameters.type", 'must be "object"'),
    (dict(input="hi", tools=[{"type": "function", "name": "f", "defer_loading": True}]),
     "body.tools[0].defer_loading", "not a field of a function tool"),
    (dict(input="hi", tools=[{"type": "function", "name": "f"}], tool_choice={"type": "function", "name": "g"}),
     "body.tool_choice.name", "is not a function of body.tools"),
    (dict(input="hi", tool_choice={"type": "file_search"}), "body.tool_choice", "function tools only"),
    (dict(input="hi", model="gpt-4.1"), "body.model", "unknown model"),
])
def test_a_bad_responses_body_is_a_line_error_naming_its_field(validator, body, param, words):
    with pytest.raises(LineError) as e:
        validator.check(_raw(_line(URL, **body)))
    assert (e.value.line, e.value.param) == (1, param) and words in e.value.message, e.value.message


def test_responses_fields_are_refused_on_chat_naming_whose_they_are(validator):
    with pytest.raises(LineError) as e:
        validator.check(_raw(_line(CHAT, messages=[{"role": "user", "content": "hi"}], instructions="x")))
    assert e.value.param == "body.instructions" and "is a field of /v1/responses" in e.value.message


def test_berth_generate_writes_responses_equal_to_their_chat_twins(tmp_path, tiny_engine):
    """Text and usage of each Response are its chat twin's; a line cut by ``max_output_tokens`` is
    "incomplete"; previous_response_id and a bad input are line errors, the other lines still run."""
    prompts = [("Say something about the number 3.", 20), ("Write one line about the sea.", 3)]
    lines = []
    for i, (prompt, cap) in enumerate(prompts):
        lines.append({"custom_id": f"r{i}", "method": "POST", "url": URL, "body": {
            "model": TINY_NAME, "instructions": "Be brief.", "input": prompt, "max_output_tokens": cap,
            "temperature": 0}})
        lines.append({"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": {
            "model": TINY_NAME, "messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": prompt}], "max_tokens": cap,
            "temperature": 0}})
    lines.append({"custom_id": "prev", "method": "POST", "url": URL,
                  "body": {"input": "Go on.", "previous_response_id": "resp_abc"}})
    lines.append({"custom_id": "bad", "method": "POST", "url": URL, "body": {"input": [{"role": "user"}]}})
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = generate_file(path, tmp_path / "out.jsonl", engine=tiny_engine, progress=False)
    assert (summary.completed, summary.failed) == (4, 2)
    out = {line["custom_id"]: line["response"]["body"] for line in read_jsonl(tmp_path / "out.jsonl")}
    for i in range(len(prompts)):
        response, chat = Response.model_validate(out[f"r{i}"]), out[f"c{i}"]
        choice = chat["choices"][0]
        assert response.output_text == out[f"r{i}"]["output_text"] == choice["message"]["content"]
        assert response.status == ("incomplete" if choice["finish_reason"] == "length" else "completed")
        usage = chat["usage"]
        assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (
            usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"])
    assert out["r1"]["status"] == "incomplete" and out["r1"]["incomplete_details"] == {"reason": "max_output_tokens"}
    errors = {e["custom_id"]: e["error"] for e in read_jsonl(tmp_path / "out.errors.jsonl")}
    assert {k: (e["line"], e["param"]) for k, e in errors.items()} == {
        "prev": (5, "body.previous_response_id"), "bad": (6, "body.input[0].content")}
