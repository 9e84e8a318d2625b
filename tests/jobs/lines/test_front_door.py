"""The front door is the engine's contract: every line the validator accepts runs through the
engine to a result, every other line gets a line error with its number, and whole-file limits
refuse a file at once. ``berth run`` and ``berth generate`` give the same errors for the same file.

``FRONT_DOOR_EXAMPLES=1500`` runs the property test longer (120 examples by default)."""

from __future__ import annotations

import io
import json
import os
import time

import hypothesis
import pytest
from click.testing import CliRunner
from hypothesis import strategies as st

from jobs import api
from jobs.hosting.database_ledger import params_from_dict
from jobs.hosting.generate import generate_file
from jobs.lines.batch_format import CODE_CHARS, MAX_CUSTOM_ID, PARAM_CHARS, BatchLine, LineError, response_line
from jobs.lines.validate import InputError, LineValidator, ModelInfo, read_lines
from jobs.pipeline.request_messages import params_to_dict
from jobs.pipeline.submit import JobRefused, JobSpec
from jobs.records.models import JobStatus, LineErrorRow, RequestRow
from tests.support.jobs_env import AMQP_URL, TINY_NAME, read_jsonl, request_line, tiny_settings, work_until_over
from tests.support.paths import ROOT
from worker.config import Settings

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
VOCAB = 49152  # the tiny model's (and its tokenizer's)


class Raw:
    """JSON text put into a line as it is: what ``json.dumps`` cannot write (5000-digit numbers,
    nesting deeper than Python recurses)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self):
        return f"Raw({self.text[:20]!r}...{len(self.text)})"


def encode(value) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {encode(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(encode(v) for v in value) + "]"
    return json.dumps(value)  # NaN and Infinity as Python writes them


DEEP = Raw("[" * 5000 + "]" * 5000)
DEEPISH = Raw("[" * 150 + "1" + "]" * 150)  # parses, and is shown in messages without recursion
BIG_INT = Raw("7" * 5000)
ODD_TEXT = st.sampled_from(["\ud800", "a\x00b", "\u202e\u0301", "\U0001f600" * 3, "\ufeff", "\u2028", " ", ""])

hostile_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70), st.floats(), st.text(max_size=6), ODD_TEXT,
    st.just(BIG_INT), st.just(DEEP), st.just(DEEPISH), st.just([]), st.just({}), st.just([1, "a"]))
small_int = st.integers(1, 4)
texts = st.one_of(st.text(max_size=30), ODD_TEXT)
part = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), hostile_scalar)
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), hostile_scalar),
     "content": st.one_of(texts, texts, st.lists(part, max_size=3), hostile_scalar)})
good_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                      "content": st.one_of(st.text(max_size=20), st.lists(st.fixed_dictionaries(
                                          {"type": st.just("text"), "text": st.text(max_size=8)}), max_size=2))})

# Each field: values the engine must run, and values the door must refuse (or may accept).
FIELDS = {
    "max_tokens": (st.one_of(small_int, st.none()),
                   st.one_of(st.integers(-3, 0), st.integers(100, 10 ** 30), hostile_scalar)),
    "temperature": (st.one_of(st.floats(0, 2), st.sampled_from([0, 2, 5e-324, 1e-40, 1e-6])),
                    st.one_of(st.floats(), st.integers(-3, 3), hostile_scalar)),
    "top_p": (st.one_of(st.floats(0, 1, exclude_min=True), st.just(1e-300)), st.one_of(st.floats(), hostile_scalar)),
    "top_k": (st.one_of(st.integers(-1, 60), st.sampled_from([VOCAB - 1, VOCAB])),
              st.one_of(st.integers(VOCAB + 1, VOCAB + 3), st.integers(10 ** 6, 10 ** 30), st.just(-2),
                        hostile_scalar)),
    "seed": (st.integers(-(2 ** 63), 2 ** 64 - 1), st.one_of(st.integers(2 ** 64, 2 ** 80), hostile_scalar)),
    "n": (st.integers(1, 16), st.one_of(st.integers(-1, 0), st.just(17), hostile_scalar)),
    "min_tokens": (st.integers(0, 2), st.one_of(st.integers(-1, 10 ** 6), hostile_scalar)),
    "stop": (st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=3), max_size=16),
                       st.just("a" * 256)),
             st.one_of(texts, st.lists(texts, max_size=4), st.lists(st.just("x"), min_size=17, max_size=20),
                       st.text(alphabet="ab", min_size=257, max_size=300), st.lists(st.just("y" * 3000), max_size=1),
                       hostile_scalar)),
    "stop_token_ids": (st.one_of(st.lists(st.integers(0, VOCAB - 1), max_size=4), st.just(list(range(256)))),
                       st.one_of(st.lists(st.integers(-3, VOCAB + 3), max_size=4),
                                 st.lists(st.integers(-(2 ** 70), 2 ** 70), max_size=2),
                                 st.integers(257, 300).map(lambda n: list(range(n))), st.just([BIG_INT]),
                                 st.just([True]), hostile_scalar)),
    "ignore_eos": (st.booleans(), hostile_scalar),
    "stream": (st.just(False), st.one_of(st.just(True), hostile_scalar)),
    "logprobs": (st.one_of(st.booleans(), st.integers(0, 20)), st.one_of(st.integers(-1, 21), hostile_scalar)),
    "top_logprobs": (st.integers(0, 20), st.one_of(st.integers(-1, 21), hostile_scalar)),
    "max_completion_tokens": (st.one_of(st.none(), small_int), hostile_scalar),
    "metadata": (st.dictionaries(st.text(max_size=3), st.one_of(st.integers(), st.just(DEEPISH))),
                 st.one_of(st.just(DEEP), st.just(BIG_INT), hostile_scalar)),
    "user": (st.text(max_size=5), st.one_of(st.just(DEEP), st.integers(), st.just([]))),
    "frequency_penalty": (st.floats(-2, 2), st.one_of(st.floats(), st.just(2.5), hostile_scalar)),
    "presence_penalty": (st.floats(-2, 2), st.one_of(st.floats(), st.just(-3), hostile_scalar)),
    "repetition_penalty": (st.floats(0.05, 100), st.one_of(st.floats(max_value=0), st.just(float("inf")), st.just(101),
                                                           hostile_scalar)),
    "min_p": (st.floats(0, 1), st.one_of(st.floats(), st.just(1.5), hostile_scalar)),
    "logit_bias": (st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=5),
                   st.one_of(st.dictionaries(st.one_of(st.integers(-3, VOCAB + 3).map(str), texts),
                                             st.one_of(st.floats(), st.integers(-200, 200), hostile_scalar),
                                             min_size=1, max_size=3),
                             st.just({str(i): 1 for i in range(301)}), hostile_scalar)),
    "unknown_field": (st.nothing(), st.one_of(st.integers(), st.text(max_size=3), hostile_scalar)),
    "tools": (st.nothing(), st.just([{"type": "function", "function": {"name": "f"}}])),
    "model": (st.just(TINY_NAME), hostile_scalar),
    "messages": (st.lists(good_message, min_size=1, max_size=4),
                 st.one_of(st.lists(message, min_size=1, max_size=4), st.just([]), hostile_scalar,
                           st.integers(50, 2000).map(lambda n: [{"role": "user", "content": "hi"}] * n))),
    "prompt": (st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                                       max_size=20)),
               st.one_of(texts, st.lists(st.integers(-3, VOCAB + 3), min_size=1, max_size=5), st.just([5] * 200),
                         st.lists(st.booleans(), min_size=1, max_size=3), st.just([]), hostile_scalar)),
    "custom_id": (st.text(min_size=1, max_size=8), st.one_of(st.integers(500, 700).map(lambda n: "c" * n),
                                                             ODD_TEXT, hostile_scalar)),
    "url": (st.nothing(), hostile_scalar),  # the valid one follows from the kind of line
    "method": (st.just("POST"), hostile_scalar),
    "body": (st.nothing(), hostile_scalar),
}
ONLY_HOSTILE = ("unknown_field", "tools")  # body fields no line may carry (tools: "auto" on a family with no format)
SAMPLING = [f for f in FIELDS if f not in ("model", "messages", "prompt", "custom_id", "url", "method", "body",
                                           *ONLY_HOSTILE)]


@st.composite
def request_lines(draw) -> str:
    """A line that is clean, or has one hostile field, or hostile values anywhere, or is not a
    request at all."""
    kind = draw(st.sampled_from(["clean", "one", "one", "any", "junk"]))
    if kind == "junk":
        return draw(st.one_of(st.text(max_size=40), st.just(encode(DEEP)), st.just(encode(BIG_INT)),
                              st.just("{\"custom_id\": " + BIG_INT.text + "}"), st.just("[]"), st.just("null"),
                              st.just('"\\ud800"'))).replace("\n", " ").replace("\r", " ")
    chat = draw(st.booleans())
    prompt_field = "messages" if chat else "prompt"
    bad = draw(st.sampled_from(list(FIELDS))) if kind == "one" else None

    def value(name):
        good, hostile = FIELDS[name]
        if name == bad or kind == "any" and draw(st.integers(0, 3)) == 0:
            return draw(hostile)
        return draw(good)

    body = {"model": value("model"), prompt_field: value(prompt_field)}
    for name in draw(st.lists(st.sampled_from(SAMPLING), unique=True, max_size=8)):
        body[name] = value(name)
    if (bad in SAMPLING or bad in ONLY_HOSTILE) and bad not in body:
        body[bad] = value(bad)
    line = {"custom_id": value("custom_id"), "url": CHAT if chat else COMPLETIONS, "body": body}
    for name in ("url", "body", "method"):
        if name == bad or kind == "any" and draw(st.integers(0, 5)) == 0:
            line[name] = draw(FIELDS[name][1])
    return encode(line)


def _utf8(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8")  # what an output or errors file does


def _check_error(error: LineError, number: int) -> None:
    assert error.line == number
    assert "could not be checked" not in error.message, error  # every refusal is a precise one
    assert f"line {number}" in str(error)
    assert error.custom_id is None or len(error.custom_id) <= MAX_CUSTOM_ID
    assert error.param is None or len(error.param) <= PARAM_CHARS
    assert len(error.code) <= CODE_CHARS
    _utf8(error.to_error_line())


@pytest.fixture(scope="module")
def short_engine(tiny_llama_dir):
    """The tiny model with a context of 96 tokens, so that no accepted request runs long."""
    from worker.engine.engine import Engine

    return Engine(tiny_settings(tiny_llama_dir, max_model_len=96))


@pytest.mark.slow
def test_every_accepted_line_runs_and_every_other_gets_a_line_error(short_engine):
    engine = short_engine
    model = ModelInfo.of_engine(engine)
    counts = {"accepted": 0, "refused": 0}

    @hypothesis.settings(max_examples=int(os.environ.get("FRONT_DOOR_EXAMPLES", 120)), deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(st.lists(request_lines(), min_size=1, max_size=6))
    def check(lines):
        validator = LineValidator(model)
        data = "\n".join(lines).encode("utf-8", "surrogatepass") + b"\n"
        accepted = {}
        for raw in read_lines(io.BufferedReader(io.BytesIO(data))):
            try:
                custom_id, url, request = validator.check(raw)
            except LineError as error:
                _check_error(error, raw.number)
                counts["refused"] += 1
                continue
            assert len(custom_id) <= MAX_CUSTOM_ID
            custom_id.encode("utf-8")
            assert params_from_dict(json.loads(json.dumps(params_to_dict(request.params)))) == request.params
            accepted[request.request_id] = (custom_id, url, request)
            counts["accepted"] += 1
        try:
            for _, _, request in accepted.values():
                engine.add_request(request)
            results = {}
            while engine.num_unfinished:
                for out in engine.step():
                    results[out.request_id] = out
        finally:
            for request_id in list(engine.requests):
                engine.abort(request_id)
        assert set(results) == set(accepted)
        for request_id, out in results.items():
            custom_id, url, request = accepted[request_id]
            assert len(out.completions) == request.params.n
            assert all(len(c.token_ids) <= request.params.max_tokens for c in out.completions)
            _utf8(response_line(BatchLine(int(request_id), custom_id, url, {}), out, engine.model_name,
                                engine.tokenizer))

    started = time.perf_counter()
    check()
    assert counts["accepted"] >= 20 and counts["refused"] >= 50, counts
    print(counts, f"{time.perf_counter() - started:.1f}s")


def _body(**body):
    return {"model": TINY_NAME, "prompt": "hello there", "max_tokens": 2, "temperature": 0, **body}


def _line(custom_id, url=COMPLETIONS, **body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": _body(**body)})


def _chat(custom_id, messages, **body):
    body = {"model": TINY_NAME, "messages": messages, "max_tokens": 2, "temperature": 0, **body}
    return json.dumps({"custom_id": custom_id, "url": CHAT, "body": body})


HOSTILE = {  # what each line is: (code, param, what its message says)
    "top_k": (_line("h1", top_k=10 ** 9), ("invalid_request", "body.top_k", "vocabulary")),
    "stop ids out of range": (_line("h2", stop_token_ids=[VOCAB], min_tokens=1),
                              ("invalid_request", "body.stop_token_ids", "[0, 49152)")),
    "negative stop id": (_line("h3", stop_token_ids=[-1]), ("invalid_request", "body.stop_token_ids", "token ids")),
    "300 stop ids": (_line("h4", stop_token_ids=list(range(300))), ("invalid_request", "body.stop_token_ids",
                                                                     "up to 256")),
    "long stop": (_line("h5", stop="s" * 3000), ("invalid_request", "body.stop", "1 to 256 characters")),
    "17 stops": (_line("h6", stop=["s"] * 17), ("invalid_request", "body.stop", "up to 16")),
    "deep": ('{"custom_id": "h7", "body": ' + "[" * 5000 + "]" * 5000 + "}",
             ("invalid_request", None, "nested too deeply")),
    "5000 digits": ('{"custom_id": "h8", "url": "/v1/completions", "body": {"prompt": "x", "seed": '
                    + "9" * 5000 + "}}", ("invalid_request", None, "digits")),
    "600-character custom_id": (_line("c" * 600), ("invalid_request", "custom_id", "over the limit of 512")),
    "NUL custom_id": (_line("a\x00b"), ("invalid_request", "custom_id", "NUL")),
    "surrogate custom_id": (_line("a\ud800"), ("invalid_request", "custom_id", "unpaired surrogate")),
    "surrogate prompt": (_line("h9", prompt="x\udfff"), ("invalid_request", "body.prompt", "unpaired surrogate")),
    "surrogate message": (_chat("h10", [{"role": "user", "content": "\ud800"}]),
                          ("invalid_request", "body.messages[0].content", "unpaired surrogate")),
    "prompt id past the vocabulary": (_line("h11", prompt=[1, VOCAB]), ("invalid_request", "body.prompt",
                                                                         "[0, 49152)")),
    "NaN temperature": (_line("h12").replace('"temperature": 0', '"temperature": NaN'),
                        ("invalid_request", "body.temperature", "[0, 2]")),
    "huge seed": (_line("h13", seed=2 ** 70), ("invalid_request", "body.seed", "64 bits")),
    "min_tokens over the shrunk default": (_chat("h14", [{"role": "user", "content": "hi " * 1900}], max_tokens=None,
                                                 min_tokens=900),
                                           ("context_length_exceeded", "body.messages", "min_tokens")),
    "deep model name": ('{"custom_id": "h15", "url": "/v1/completions", "body": {"prompt": "x", "model": '
                        + "[" * 150 + "]" * 150 + "}}", ("model_not_found", "body.model", "unknown model")),
    "bool max_tokens": (_line("h16", max_tokens=True), ("invalid_request", "body.max_tokens", "boolean")),
    "unknown field": (_line("h17", frequency_penality=0.5), ("invalid_request", "body.frequency_penality",
                                                             "not a request field berth knows")),
    "tools, auto on a family with no call format": (
        _chat("h18", [{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object"}}}]), ("invalid_request", "body.tool_choice", '"required"')),
    "logit_bias past the vocabulary": (_line("h19", logit_bias={str(VOCAB): 5}),
                                       ("invalid_request", "body.logit_bias", "[0, 49152)")),
    "a penalty out of range": (_line("h20", presence_penalty=2.5), ("invalid_request", "body.presence_penalty",
                                                                     "[-2, 2]")),
    "echo": (_line("h21", echo=True), ("invalid_request", "body.echo", "berth runs only false")),
}


def _mixed_file(tmp_path):
    good = [json.dumps(request_line(i)) for i in range(4)]
    lines = [good[0], *(line for line, _ in list(HOSTILE.values())[:9]), good[1], good[2],
             *(line for line, _ in list(HOSTILE.values())[9:]), good[3]]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass") + b"\n")
    expect = {i + 1: want for i, line in enumerate(lines) for hostile, want in HOSTILE.values() if line == hostile}
    return path, expect


def test_berth_run_and_generate_give_the_same_errors_for_hostile_lines(tmp_path, tiny_llama_dir, tiny_engine):
    path, expect = _mixed_file(tmp_path)
    assert len(expect) == len(HOSTILE)
    settings = tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                             storage_url=f"file://{tmp_path / 'store'}")
    job, files = api.run(path, tmp_path / "out.jsonl", settings, engine=tiny_engine)

    assert job.status is JobStatus.COMPLETED
    assert (job.total, job.completed, job.failed) == (len(HOSTILE) + 4, 4, len(HOSTILE))
    output = read_jsonl(files.output)
    assert [o["custom_id"] for o in output] == [f"req-{i}" for i in range(4)]
    assert all(o["response"]["status_code"] == 200 for o in output)
    errors = read_jsonl(files.errors)
    by_line = {e["error"]["line"]: e["error"] for e in errors}
    assert sorted(by_line) == sorted(expect)
    for number, (code, param, says) in expect.items():
        error = by_line[number]
        assert (error["code"], error["param"]) == (code, param), error
        assert error["message"].startswith(f"line {number}: ") and says in error["message"], error
    [long_id] = [e["custom_id"] for e in errors if e["custom_id"] and e["custom_id"].startswith("ccc")]
    assert long_id == "c" * 512

    summary = generate_file(path, tmp_path / "direct.jsonl", settings, engine=tiny_engine, progress=False)
    assert (summary.total, summary.completed, summary.failed) == (len(HOSTILE) + 4, 4, len(HOSTILE))
    assert read_jsonl(summary.errors_path) == errors
    assert [o["custom_id"] for o in read_jsonl(tmp_path / "direct.jsonl")] == [f"req-{i}" for i in range(4)]


def test_hostile_lines_do_not_stop_their_job_on_postgresql(tmp_path, tiny_llama_dir, tiny_engine, pg_url,
                                                           queue_prefix):
    from sqlalchemy import select

    from jobs.records.db import open_database

    settings = tiny_settings(tiny_llama_dir, database_url=pg_url, broker_url=AMQP_URL, queue_prefix=queue_prefix,
                             storage_url=f"file://{tmp_path / 'store'}")
    lines = [json.dumps(request_line(0)), HOSTILE["600-character custom_id"][0], HOSTILE["deep"][0],
             json.dumps(request_line(1)), HOSTILE["5000 digits"][0], HOSTILE["NUL custom_id"][0],
             json.dumps(request_line(2)), json.dumps({"custom_id": "d" * 600, "url": "/v1/embeddings"})]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    job = api.submit(path, settings, eager=True)
    job = work_until_over(settings, tiny_engine, job.id)
    assert job.status is JobStatus.COMPLETED
    assert (job.total, job.completed, job.failed) == (8, 3, 5)
    with open_database(pg_url).session() as s:
        stored = {e.line: (e.code, e.param, e.custom_id) for e in s.scalars(
            select(LineErrorRow).where(LineErrorRow.job_id == job.id))}
        assert len(s.scalars(select(RequestRow).where(RequestRow.job_id == job.id)).all()) == 3
    assert stored == {2: ("invalid_request", "custom_id", "c" * 512), 3: ("invalid_request", None, None),
                      5: ("invalid_request", None, None), 6: ("invalid_request", "custom_id", "a\ufffdb"),
                      8: ("invalid_request", "custom_id", "d" * 512)}
    files = api.results(job.id, tmp_path / "out.jsonl", settings=settings)
    assert [o["response"]["status_code"] for o in read_jsonl(files.output)] == [200, 200, 200]


def test_line_errors_fit_their_columns():
    columns = LineErrorRow.__table__.c
    assert (columns.custom_id.type.length, columns.param.type.length, columns.code.type.length) == (
        MAX_CUSTOM_ID, PARAM_CHARS, CODE_CHARS)
    assert RequestRow.__table__.c.custom_id.type.length == MAX_CUSTOM_ID
    e = LineError(3, "p" * 300, "m\x00", "x\ud800" + "c" * 600, "k" * 100)
    assert (len(e.custom_id), len(e.param), len(e.code)) == (MAX_CUSTOM_ID, PARAM_CHARS, CODE_CHARS)
    assert e.custom_id.startswith("x\ufffd") and "\x00" not in e.message
    _utf8(e.to_error_line())


def test_the_token_bound_is_the_smaller_of_the_model_and_the_tokenizer(tiny_engine):
    def check(model, **body):
        raw = next(read_lines(io.BufferedReader(io.BytesIO(_line("a", **body).encode()))))
        return LineValidator(model).check(raw)

    tokenizer = tiny_engine.tokenizer
    small = ModelInfo(TINY_NAME, tokenizer, 2048, vocab_size=1000)
    check(small, prompt=[999], top_k=1000, stop_token_ids=[999])
    for body, param in [({"prompt": [1000]}, "body.prompt"), ({"top_k": 1001}, "body.top_k"),
                        ({"stop_token_ids": [1000]}, "body.stop_token_ids")]:
        with pytest.raises(LineError) as e:
            check(small, **body)
        assert e.value.param == param
    with pytest.raises(LineError, match=r"tokenizes to id \d+, outside the model.s vocabulary of 1000"):
        check(small, prompt="\U0001f600 zebra crossing")
    padded = ModelInfo(TINY_NAME, tokenizer, 2048, vocab_size=len(tokenizer) + 64)  # a padded embedding
    check(padded, top_k=len(tokenizer) + 64)
    with pytest.raises(LineError, match=r"\[0, 49152\)"):
        check(padded, prompt=[len(tokenizer)])


def test_a_tiny_temperature_is_greedy(tiny_engine):
    raw = next(read_lines(io.BufferedReader(io.BytesIO(_line("a", temperature=1e-300).encode()))))
    _, _, request = LineValidator(ModelInfo.of_engine(tiny_engine)).check(raw)
    assert request.params.temperature == 0 and request.params.greedy


def test_a_line_with_many_messages_is_checked_in_linear_time(tiny_engine):
    validator = LineValidator(ModelInfo.of_engine(tiny_engine))

    def cpu_seconds(n):
        parts = [{"role": "user", "content": [{"type": "text", "text": "x"}]}] * n
        line = _chat("many", parts + [{"role": "user", "content": 5}])
        assert len(line) < 1 << 20
        raw = next(read_lines(io.BufferedReader(io.BytesIO(line.encode()))))
        best = float("inf")
        for _ in range(3):  # the best of three: a busy machine only ever adds time
            started = time.thread_time()  # this thread's CPU, not the wall clock
            with pytest.raises(LineError, match=rf"body.messages\[{n}\].content: must be a string"):
                validator.check(raw)
            best = min(best, time.thread_time() - started)
        return best

    cpu_seconds(100)  # whatever is built once (caches, lazy imports) is not counted
    small, large = cpu_seconds(1_000), cpu_seconds(16_000)
    # 16 times the messages: linear is 16 times the time, quadratic 256 (1.3 s against 0.02 s
    # when it was); the ratio, not a figure in seconds, so a slow or busy machine passes too
    assert large < 64 * max(small, 1e-3), (small, large)


def test_an_unexpected_exception_fails_only_its_line(tiny_engine):
    class Broken:  # a tokenizer that fails where no check expects it to
        def __len__(self):
            raise RuntimeError("boom")

    validator = LineValidator(ModelInfo(TINY_NAME, Broken(), 2048, VOCAB))
    data = (_line("a") + "\n" + _line("b") + "\n").encode()
    results = []
    for raw in read_lines(io.BufferedReader(io.BytesIO(data))):
        with pytest.raises(LineError) as e:
            validator.check(raw)
        assert "could not be checked (RuntimeError: boom)" in str(e.value)
        results.append((e.value.line, e.value.param))
    assert results == [(1, None), (2, None)]


# ---- whole-file and tenant limits

def test_the_default_limits_are_openais():
    defaults = {name: Settings.model_fields[name].default
                for name in ("max_file_lines", "max_file_bytes", "max_jobs_in_flight")}
    assert defaults == {"max_file_lines": 50_000, "max_file_bytes": 200 << 20, "max_jobs_in_flight": 100}
    assert Settings(max_file_bytes="1GiB").max_file_bytes == 1 << 30


def _settings(tmp_path, tiny_llama_dir, **limits):
    return tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                         storage_url=f"file://{tmp_path / 'store'}", **limits)


def test_an_oversized_file_is_refused_at_once(tmp_path, tiny_llama_dir, tiny_engine):
    from jobs.cli import main

    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(request_line(i)) + "\n" for i in range(4)) + "\n\n")
    settings = _settings(tmp_path, tiny_llama_dir, max_file_lines=3)
    for refuse in (lambda: api.submit(path, settings),
                   lambda: generate_file(path, tmp_path / "out.jsonl", settings, engine=tiny_engine, progress=False)):
        with pytest.raises(InputError, match="beyond the limit of 3 lines: .* BERTH_MAX_FILE_LINES"):
            refuse()
    small = _settings(tmp_path, tiny_llama_dir, max_file_bytes=100)
    for refuse in (lambda: api.submit(path, small),
                   lambda: generate_file(path, tmp_path / "out.jsonl", small, engine=tiny_engine, progress=False)):
        with pytest.raises(InputError, match="over the limit of 100 bytes: .* BERTH_MAX_FILE_BYTES"):
            refuse()
    assert api.list_jobs(settings) == []
    assert not list((tmp_path / "store").rglob("*.jsonl"))

    result = CliRunner().invoke(main, ["submit", str(path), "--model", str(tiny_llama_dir)],
                                env={"BERTH_MAX_FILE_LINES": "3", "BERTH_DATABASE_URL": settings.database_url,
                                     "BERTH_STORAGE_URL": settings.storage_url})
    assert result.exit_code == 1 and "BERTH_MAX_FILE_LINES" in result.output

    job = api.submit(path, _settings(tmp_path, tiny_llama_dir, max_file_lines=4))  # trailing blank lines are free
    assert job.total == 4


def test_the_ingest_never_stores_more_than_the_line_limit(tmp_path, tiny_llama_dir):
    from jobs.pipeline.ingest import ingest
    from jobs.pipeline.submit import create_job
    from jobs.records.db import open_database
    from jobs.records.job_files import JobFiles

    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(request_line(i)) + "\n" for i in range(5)))
    settings = _settings(tmp_path, tiny_llama_dir)
    db, files = open_database(settings.database_url), JobFiles(settings.storage_url)
    job_id = create_job(db, files, path, TINY_NAME, JobSpec(), settings)  # accepted under 50,000 lines
    ingest(db, files, _settings(tmp_path, tiny_llama_dir, max_file_lines=3), job_id)  # a worker set to 3
    job = api.status(job_id, settings)
    assert job.status is JobStatus.FAILED
    assert "request on line 4 beyond the limit of 3 lines" in job.error
    with db.session() as s:
        assert s.query(RequestRow).filter_by(job_id=job_id).count() <= 3


def test_a_tenant_with_too_many_jobs_in_flight_is_refused(tmp_path, tiny_llama_dir):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(request_line(0)) + "\n")
    settings = _settings(tmp_path, tiny_llama_dir, max_jobs_in_flight=2)
    first = api.submit(path, settings, spec=JobSpec(tenant="alice"))
    api.submit(path, settings, spec=JobSpec(tenant="alice"))
    assert first.status in (JobStatus.VALIDATING, JobStatus.IN_PROGRESS)
    with pytest.raises(JobRefused, match="tenant 'alice' has 2 jobs validating or in progress.*"
                                         "BERTH_MAX_JOBS_IN_FLIGHT"):
        api.submit(path, settings, spec=JobSpec(tenant="alice"))
    api.submit(path, settings, spec=JobSpec(tenant="bob"))  # another tenant's count is its own
    api.cancel(first.id, settings)
    api.submit(path, settings, spec=JobSpec(tenant="alice"))  # a cancelling job is no longer in flight
    assert len(api.list_jobs(settings, tenant="alice")) == 3



def test_every_known_body_field_is_in_the_docs_table():
    """docs/request-fields.md names every field the door knows, and the door knows every field it names."""
    import re

    from jobs.lines import request_fields as rf
    doc = ROOT.joinpath("docs", "request-fields.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| ") and not line.startswith("| Field")]
    named = {name for row in rows for cell in row.split("|")[1:3] for name in re.findall(r"`([a-z_]+)`", cell)}
    known = set().union(*rf.IMPLEMENTED.values(), rf.NO_EFFECT, rf.ONLY, rf.NOT_YET, *rf.REFUSED_ON.values())
    assert named == known, (named - known, known - named)


def test_a_line_with_an_unknown_field_is_refused_naming_it(tiny_engine):
    """On main these ran and returned 200 with the field ignored (or a generic url error)."""
    validator = LineValidator(ModelInfo.of_engine(tiny_engine))

    def refused(text):
        raw = next(read_lines(io.BufferedReader(io.BytesIO(text.encode()))))
        with pytest.raises(LineError) as e:
            validator.check(raw)
        return e.value

    e = refused(_line("u1", frequency_penality=0.5))
    assert (e.line, e.param) == (1, "body.frequency_penality") and "not a request field berth knows" in e.message
    e = refused(_chat("u2", [{"role": "user", "content": "hi"}], tool_choice="auto"))
    assert e.param == "body.tool_choice" and "needs tools to call" in e.message
    e = refused(json.dumps({"custom_id": "u3", "url": "/v1/embeddings", "body": {"input": "hi", "top_p": 1}}))
    assert e.param == "body.top_p" and "not of /v1/embeddings" in e.message  # embeddings run (test_embeddings_door.py)
    e = refused(_line("u4", top_logprobs=2))
    assert e.param == "body.top_logprobs" and "a field of /v1/chat/completions" in e.message
    raw = next(read_lines(io.BufferedReader(io.BytesIO(_line(
        "ok", user="me", metadata={"k": "v"}, store=True, echo=False, frequency_penalty=0.5, presence_penalty=-1,
        repetition_penalty=1.2, min_p=0.1, logit_bias={"7": 3, "5": -100}).encode()))))
    params = validator.check(raw)[2].params
    assert (params.frequency_penalty, params.presence_penalty, params.repetition_penalty, params.min_p,
            params.logit_bias) == (0.5, -1.0, 1.2, 0.1, ((5, -100.0), (7, 3.0)))
    assert params_from_dict(json.loads(json.dumps(params_to_dict(params)))) == params
