"""Tool calling (issue 22): tools shown by the chat template, required and named calls held to the
family's format by the grammar, calls read back into OpenAI's ``tool_calls``, and the refusals.

A tiny random Qwen3 gets a tokenizer whose chat template renders tools as Qwen's does (written
here: no Qwen tokenizer is available offline), so ``<tool_call>`` blocks are its format; the default
model (SmolLM2, a family with no call format) answers with plain JSON calls.
"""

from __future__ import annotations

import io
import json

import jsonschema
import pytest

from jobs import api
from jobs.hosting.database_ledger import params_from_dict
from jobs.hosting.generate import generate_file
from jobs.lines.batch_format import BatchLine, LineError, response_line
from jobs.lines.tool_formats import FORMATS, format_of
from jobs.lines.validate import LineValidator, ModelInfo, read_lines
from jobs.pipeline.request_messages import params_to_dict
from jobs.records.models import JobStatus
from tests.support.jobs_env import read_jsonl, tiny_settings, work_until_over
from tests.support.qwen import CHAT, LOOKUP, QWEN_STYLE_TEMPLATE, SCHEMAS, TOOLS, tool_line
from worker.engine.engine import Engine
from worker.engine.request import Completion, Request, RequestOutput


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def _run(tmp_path, engine, lines) -> tuple[list[dict], list[dict]]:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = generate_file(src, out, engine=engine, progress=False)
    errors = [json.loads(x) for x in open(summary.errors_path)] if summary.errors_path else []
    return [json.loads(x) for x in out.read_text().splitlines()], errors


def _calls_of(answer: dict) -> list[tuple[str, str, dict]]:
    """(custom_id, finish_reason, each call's name and arguments) of every choice, the calls checked
    against their function's schema."""
    found = []
    for choice in answer["response"]["body"]["choices"]:
        message = choice["message"]
        if choice["finish_reason"] != "tool_calls":
            assert "tool_calls" not in message
            continue
        assert message["tool_calls"], answer
        for call in message["tool_calls"]:
            assert call["type"] == "function" and call["id"].startswith("call_")
            arguments = json.loads(call["function"]["arguments"])  # a JSON string, as OpenAI gives it
            jsonschema.validate(arguments, SCHEMAS[call["function"]["name"]])
            found.append((answer["custom_id"], call["function"]["name"], arguments))
    return found


def test_tiny_qwen3_required_named_and_auto_answer_valid_calls(tmp_path, qwen_engine):
    lines = [
        tool_line(0, "Weather in Oslo?", tool_choice="required", parallel_tool_calls=False),
        tool_line(1, "Convert it.", tool_choice="required", parallel_tool_calls=False),
        tool_line(2, "Look it up.", tool_choice="required"),  # one call or more
        tool_line(3, "Weather?", tool_choice=_named("get_weather"), parallel_tool_calls=False),
        tool_line(4, "Convert?", tool_choice=_named("convert")),
        tool_line(5, "Anything?", tool_choice="auto"),
        tool_line(6, "And now?"),  # "auto" is the default with tools
    ]
    answers, errors = _run(tmp_path, qwen_engine, [{**x, "body": {**x["body"], "max_tokens": 160}} for x in lines])
    assert errors == [] and len(answers) == len(lines)
    calls = {a["custom_id"]: _calls_of(a) for a in answers}
    finish = {a["custom_id"]: a["response"]["body"]["choices"][0]["finish_reason"] for a in answers}
    for cid in ("t0", "t1", "t3"):  # one call, then the grammar allows only the end
        assert finish[cid] == "tool_calls" and len(calls[cid]) == 1, answers
    assert calls["t3"][0][1] == "get_weather"
    assert all(name == "convert" for _, name, _ in calls["t4"])
    assert {finish["t5"], finish["t6"]} <= {"stop", "length", "tool_calls"}
    for a in answers:  # a call's text before its block is the content, null where there is none
        if finish[a["custom_id"]] == "tool_calls":
            assert a["response"]["body"]["choices"][0]["message"]["content"] is None


def test_tool_calls_are_the_same_through_every_door(tmp_path, qwen_dir, qwen_engine):
    """berth generate, berth run and the queue door answer a tools file alike (the queue's worker reads
    how to read the calls from the request row)."""
    lines = [tool_line(0, "Weather?", tool_choice="required", parallel_tool_calls=False, max_tokens=120),
             tool_line(1, "Convert?", tool_choice=_named("convert"), max_tokens=120),
             tool_line(2, "Hello", tool_choice="none", max_tokens=8)]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))

    def settings(name):
        return tiny_settings(qwen_dir, database_url=f"sqlite:///{tmp_path / name}.db",
                             storage_url=f"file://{tmp_path / name}-store")

    def choices(output_path):
        return {x["custom_id"]: x["response"]["body"]["choices"] for x in read_jsonl(output_path)}

    generate_file(path, tmp_path / "generate.jsonl", engine=qwen_engine, progress=False)
    generated = choices(tmp_path / "generate.jsonl")
    assert [c[0]["finish_reason"] for c in generated.values()] == ["tool_calls", "tool_calls", "length"]
    assert "tool_calls" not in generated["t2"][0]["message"]
    job, files = api.run(path, tmp_path / "run.jsonl", settings("run"), engine=qwen_engine)
    assert job.status == JobStatus.COMPLETED and choices(files.output) == generated
    queued = settings("queue")
    job = work_until_over(queued, qwen_engine, api.submit(path, queued).id)
    assert job.status == JobStatus.COMPLETED
    assert choices(api.results(job.id, tmp_path / "queue.jsonl", settings=queued).output) == generated


def test_the_prompt_shows_the_tools_and_auto_reads_qwen_blocks(qwen_engine):
    """The template renders the tools; the answer's <tool_call> blocks (what "auto" finds in a real
    Qwen's text) become OpenAI's tool_calls, the text before them the content."""
    validator = LineValidator(ModelInfo.of_engine(qwen_engine))
    raw = next(read_lines(io.BufferedReader(io.BytesIO(json.dumps(tool_line(1, "hi")).encode()))))
    _, _, request = validator.check(raw)
    prompt = qwen_engine.tokenizer.decode(request.prompt_token_ids)
    assert "<tools>" in prompt and json.dumps(TOOLS[0], ensure_ascii=False) in prompt
    assert request.params.tool_calls == "hermes" and request.params.structured is None
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n'
            '</tool_call>\n<tool_call>\n{"name": "lookup", "arguments": {"id": 7}}\n</tool_call>')
    answer = _answer(text, "hermes")
    assert [(n, a) for _, n, a in _calls_of(answer)] == [("get_weather", {"city": "Rome", "days": 2}),
                                                         ("lookup", {"id": 7})]
    assert answer["response"]["body"]["choices"][0]["message"]["content"] == "Let me check."


def _answer(text: str, fmt: str | None, finish: str = "stop") -> dict:
    output = RequestOutput("9", [1, 2], [Completion(0, [5], text, finish)])
    return {"custom_id": "x", **response_line(BatchLine(1, "x", CHAT, {}), output, "m", None, fmt)}


@pytest.mark.parametrize("fmt, text, expected", [
    ("llama3_json", '<|python_tag|>{"name": "lookup", "parameters": {"id": 3}}', [("lookup", {"id": 3})]),
    ("llama3_json", '{"name": "lookup", "parameters": {"id": 3}}; {"name": "convert", "parameters": '
                    '{"to": "EUR", "exact": true}}',
     [("lookup", {"id": 3}), ("convert", {"to": "EUR", "exact": True})]),
    ("mistral", '[{"name": "lookup", "arguments": {"id": 4}}]', [("lookup", {"id": 4})]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "lookup", "arguments": {"id": 5}}]', [("lookup", {"id": 5})]),
    ("json", '{"name": "lookup", "arguments": {"id": 6}}', [("lookup", {"id": 6})]),
    ("hermes", "no call here", []),
    ("hermes", '<tool_call>\n{"name": "lookup", "arguments": {"id": 1}\n</tool_call>', []),  # broken JSON: text
    ("llama3_json", "The answer is 4.", []),
])
def test_each_family_format_reads_its_calls(fmt, text, expected):
    answer = _answer(text, fmt)
    choice = answer["response"]["body"]["choices"][0]
    assert [(n, a) for _, n, a in _calls_of(answer)] == expected
    assert choice["finish_reason"] == ("tool_calls" if expected else "stop")
    if not expected:
        assert choice["message"]["content"] == text


def test_a_call_cut_short_by_max_tokens_stays_text():
    text = '<tool_call>\n{"name": "lookup", "arguments": {"id": 1}}\n</tool_call>'
    choice = _answer(text, "hermes", finish="length")["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"] == {"role": "assistant", "content": text}


def test_the_family_is_read_from_the_chat_template(smol_tokenizer):
    assert format_of(QWEN_STYLE_TEMPLATE).name == "hermes"
    assert format_of("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert format_of("{{ '<|python_tag|>' }}{% if tools %}ipython{% endif %}").name == "llama3_json"
    assert format_of(smol_tokenizer.chat_template) is FORMATS["json"]
    assert format_of(None) is FORMATS["json"]


def test_tool_history_is_rendered_and_a_resumed_call_ends_the_same(qwen_engine):
    """An assistant call and a tool's answer in the history reach the template; a required call
    resumed from its first tokens (as from a checkpoint) ends as it did, and its reading survives the
    request row's round trip."""
    history = [{"role": "user", "content": "Weather in Rome?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
               {"role": "user", "content": "And convert?"}]
    line = {**tool_line(1, ""), "body": {**tool_line(1, "")["body"], "messages": history, "max_tokens": 120,
                                     "tool_choice": _named("convert"), "parallel_tool_calls": False}}
    validator = LineValidator(ModelInfo.of_engine(qwen_engine))
    _, _, request = validator.check(next(read_lines(io.BufferedReader(io.BytesIO(json.dumps(line).encode())))))
    prompt = qwen_engine.tokenizer.decode(request.prompt_token_ids)
    assert '{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    params = params_from_dict(json.loads(json.dumps(params_to_dict(request.params))))
    assert params == request.params and params.tool_calls == "hermes" and params.structured.kind == "structural_tag"

    def run(req):
        qwen_engine.add_request(req)
        while True:
            for out in qwen_engine.step():
                return out

    whole = run(Request("whole", request.prompt_token_ids, params))
    first = whole.completions[0]
    resumed = run(Request("resumed", request.prompt_token_ids, params,
                          resume_output_ids=[first.token_ids[:len(first.token_ids) // 2]]))
    assert resumed.completions[0].token_ids == first.token_ids
    answer = {"custom_id": "r", **response_line(BatchLine(1, "r", CHAT, {}), resumed, "m", qwen_engine.tokenizer,
                                                params.tool_calls)}
    assert [n for _, n, _ in _calls_of(answer)] == ["convert"]


def test_the_default_model_answers_required_and_named_calls_that_validate(tmp_path, smol_path):
    """SmolLM2, a family with no call format: plain JSON calls, over several tools and lines."""
    from worker.config import Settings

    engine = Engine(Settings(model=smol_path, kv_memory="64MiB", threads=1))
    lines = [tool_line(0, "What's the weather in Paris for the next 3 days?", tool_choice="required"),
             tool_line(1, "Convert 20 dollars to euros, exactly.", tool_choice="required"),
             tool_line(2, "Look up record 42.", tool_choice=_named("lookup")),
             tool_line(3, "Is it raining in Oslo today?", tool_choice=_named("get_weather")),
             tool_line(4, "Convert to NOK.", tool_choice=_named("convert"), parallel_tool_calls=False)]
    answers, errors = _run(tmp_path, engine, [{**x, "body": {**x["body"], "max_tokens": 64}} for x in lines])
    assert errors == [] and len(answers) == len(lines)
    names = {}
    for a in answers:
        assert a["response"]["body"]["choices"][0]["finish_reason"] == "tool_calls", a
        (call,) = _calls_of(a)
        names[a["custom_id"]] = call[1]
    assert (names["t2"], names["t3"], names["t4"]) == ("lookup", "get_weather", "convert")


def test_a_template_without_tools_is_shown_them_and_its_history_calls_as_json(smol_tokenizer):
    """SmolLM2's template reads neither tools nor tool_calls: the tools are described in the system
    message with the JSON call asked for, and a call in the history is that JSON as the assistant's text."""
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Rome?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, {"role": "user", "content": "More?"}]
    line = {**tool_line(1, ""), "body": {**tool_line(1, "")["body"], "messages": history, "tool_choice": "required"}}
    validator = LineValidator(ModelInfo("m", smol_tokenizer, 2048, len(smol_tokenizer)))
    _, _, request = validator.check(next(read_lines(io.BufferedReader(io.BytesIO(json.dumps(line).encode())))))
    prompt = smol_tokenizer.decode(request.prompt_token_ids)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nYou can call these functions")
    assert json.dumps(TOOLS[2]["function"]) in prompt and '{"name": <function name>' in prompt
    call = '{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in prompt
    assert "<|im_start|>tool\nsunny<|im_end|>" in prompt
    assert request.params.tool_calls == "json" and request.params.structured.kind == "structural_tag"


def test_a_checkpoint_from_before_tools_still_names_its_request():
    """tool_calls left at None stays out of the request's digest, so checkpoints written before the
    field existed still apply; a request whose calls are read is another request."""
    import hashlib
    from dataclasses import asdict, replace

    from worker.checkpoint.format import request_digest
    from worker.engine.request import SamplingParams

    params = SamplingParams(max_tokens=8, seed=3)
    before = {k: v for k, v in asdict(params).items()
              if k not in ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_p",
                           "tool_calls", "embedding")}  # embedding: None is left out as well
    old = hashlib.sha256(json.dumps([[1, 2], before], sort_keys=True).encode()).hexdigest()[:32]
    assert request_digest([1, 2], params) == old
    assert request_digest([1, 2], replace(params, tool_calls="hermes")) != old


def test_a_call_grammar_is_bounded_like_a_schema():
    """The engine's own check of a spec's shape (for rows it did not see through the door) finds the
    schemas inside a structural tag."""
    from worker.engine.request import StructuredOutput
    from worker.engine.structured.grammar import DEFAULT_RULES, too_costly

    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}
    tag = FORMATS["hermes"].constraint([("wide", wide)], parallel=True)
    assert "optional properties" in too_costly(StructuredOutput("structural_tag", json.dumps(tag)), DEFAULT_RULES)
    tag = FORMATS["hermes"].constraint([("lookup", LOOKUP)], parallel=True)
    assert too_costly(StructuredOutput("structural_tag", json.dumps(tag)), DEFAULT_RULES) is None


def _refusal(tokenizer, **body) -> LineError:
    line = json.dumps({**tool_line(1, "hi"), "body": {**tool_line(1, "hi")["body"], **body}})
    validator = LineValidator(ModelInfo("m", tokenizer, 2048, len(tokenizer)))
    with pytest.raises(LineError) as e:
        validator.check(next(read_lines(io.BufferedReader(io.BytesIO(line.encode())))))
    return e.value


def test_refusals_name_the_field(smol_tokenizer):
    e = _refusal(smol_tokenizer, tool_choice="auto")
    assert e.param == "body.tool_choice" and '"required"' in e.message and "no" in e.message
    e = _refusal(smol_tokenizer)  # auto by default
    assert e.param == "body.tool_choice" and '"auto"' in e.message
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}]
    e = _refusal(smol_tokenizer, tools=bad, tool_choice="required")
    assert e.param == "body.tools[0].function.parameters" and "not a valid JSON Schema" in e.message
    e = _refusal(smol_tokenizer, tool_choice=_named("send_mail"))
    assert e.param == "body.tool_choice.function.name" and "'get_weather'" in e.message
    e = _refusal(smol_tokenizer, tools=[TOOLS[0], TOOLS[0]], tool_choice="required")
    assert e.param == "body.tools[1].function.name" and "earlier tool" in e.message
    e = _refusal(smol_tokenizer, tools=[{"type": "function", "function": {"name": "bad name!"}}],
                 tool_choice="required")
    assert e.param == "body.tools[0].function.name"
    e = _refusal(smol_tokenizer, tool_choice="required", response_format={"type": "json_object"})
    assert e.param == "body.tool_choice" and "keep one" in e.message
    e = _refusal(smol_tokenizer, tool_choice="required", functions=[{"name": "f"}])
    assert e.param == "body.functions" and "tools" in e.message
    history = [{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
        "name": "lookup", "arguments": "{not json"}}]}, {"role": "user", "content": "hi"}]
    e = _refusal(smol_tokenizer, messages=history, tool_choice="required")
    assert e.param == "body.messages[0].tool_calls[0].function.arguments" and "JSON" in e.message
    e = _refusal(smol_tokenizer, tools=None, tool_choice="required")
    assert e.param == "body.tool_choice" and "needs tools" in e.message
