"""``/v1/embeddings`` lines at every door: each bad body a line error naming its field, the response
line as OpenAI's (float and base64 the same vectors, ``dimensions`` cut then normalised, usage in
tokens), and jobs through ``berth run`` on the embedded defaults (results counted in the database),
``berth serve``'s batches (``endpoint: /v1/embeddings``) and the queue door's job-submit messages."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from click.testing import CliRunner
from sqlalchemy import func, select

from jobs.cli import main
from jobs.lines.batch_format import LineError, response_line
from jobs.lines.validate import LineValidator, ModelInfo, read_lines
from jobs.records.db import open_database
from jobs.records.models import Job, Result, ResultStatus
from tests.support.jobs_env import TINY_NAME, read_jsonl, tiny_settings

URL = "/v1/embeddings"


def embed_line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": URL, "body": {"model": TINY_NAME, **body}}


def _raw(line: dict | str):
    text = line if isinstance(line, str) else json.dumps(line)
    return next(read_lines(io.BufferedReader(io.BytesIO(text.encode()))))


@pytest.fixture(scope="module")
def validator(tiny_engine):
    return LineValidator(ModelInfo.of_engine(tiny_engine))


def refused(validator, **body) -> LineError:
    with pytest.raises(LineError) as e:
        validator.check(_raw(embed_line("bad", **body)))
    return e.value


@pytest.mark.parametrize("body, param, words", [
    (dict(input=""), "body.input", "is an empty string"),
    (dict(input=["fine", ""]), "body.input[1]", "is an empty string"),
    (dict(input=[]), "body.input", "must be a non-empty string, a list of strings"),
    (dict(), "body.input", "must be a non-empty string"),
    (dict(input=5), "body.input", "got 5"),
    (dict(input={"text": "hi"}), "body.input", "must be a non-empty string"),
    (dict(input=["a", 3]), "body.input[1]", "must be a non-empty string or a list of token ids"),
    (dict(input=[[1, 2], []]), "body.input[1]", "is an empty list of token ids"),
    (dict(input=[[1, 2], ["x"]]), "body.input[1]", "must be a non-empty string or a list of token ids"),
    (dict(input=[1, 2, True]), "body.input[2]", "not a boolean"),
    (dict(input=[1, 10**9]), "body.input", "token ids must be in [0, "),
    (dict(input=[[5], [-1]]), "body.input[1]", "token ids must be in [0, "),
    (dict(input=[1] * 2049), "body.input", "over the model's context of 2048"),
    (dict(input=["x"] * 2049), "body.input", "2049 inputs, over the limit of 2048"),
    (dict(input="hi", dimensions=0), "body.dimensions", "must be an integer >= 1, got 0"),
    (dict(input="hi", dimensions=65), "body.dimensions", "65 is more than the model's 64 dimensions"),
    (dict(input="hi", dimensions=True), "body.dimensions", "got True"),
    (dict(input="hi", dimensions="8"), "body.dimensions", "got '8'"),
    (dict(input="hi", dimensions=8.5), "body.dimensions", "got 8.5"),
    (dict(input="hi", encoding_format="int8"), "body.encoding_format", 'must be "float" or "base64"'),
    (dict(input="hi", encoding_format=None, colour="red"), "body.colour", "not a request field berth knows"),
    (dict(input="hi", messages=[]), "body.messages", "is a field of /v1/chat/completions, not of /v1/embeddings"),
    (dict(input="hi", max_tokens=3), "body.max_tokens", "a field of /v1/chat/completions and /v1/completions"),
    (dict(input="hi", metadata={}), "body.metadata", "a field of /v1/chat/completions, /v1/completions and "
                                                     "/v1/responses"),
    (dict(input="hi", normalize=False), "body.normalize", "berth runs only true here"),
    (dict(input="hi", truncate_prompt_tokens=8), "body.truncate_prompt_tokens", "berth does not cut inputs"),
    (dict(input="hi", user=3), "body.user", "must be a string"),
    (dict(input="hi", model="text-embedding-3-small"), "body.model", "unknown model"),
])
def test_a_bad_embeddings_body_is_a_line_error_naming_the_field(validator, body, param, words):
    e = refused(validator, **body)
    assert (e.line, e.param) == (1, param) and words in e.message, e.message


def test_fields_of_embeddings_are_refused_elsewhere(validator):
    line = {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "hi", "input": "hi"}}
    with pytest.raises(LineError, match="body.input: is a field of /v1/embeddings and /v1/responses, not of "
                                        "/v1/completions"):
        validator.check(_raw(line))
    with pytest.raises(LineError, match="url: must be /v1/chat/completions, /v1/completions, /v1/embeddings or "
                                        "/v1/responses"):
        validator.check(_raw({**line, "url": "/v1/rerank"}))


def test_the_response_line_is_openais_embedding_list(validator, tiny_engine):
    texts = ["The sea is calm tonight.", "def f(x):\n    return x"]
    ok = dict(input=texts, user="me", normalize=True, add_special_tokens=True, priority=0, request_id="r")
    as_float = validator.check(_raw(embed_line("f", **ok)))[2]
    as_b64 = validator.check(_raw(embed_line("b", **{**ok, "encoding_format": "base64"})))[2]
    cut = validator.check(_raw(embed_line("d", input=texts, dimensions=8)))[2]
    ids = validator.check(_raw(embed_line("i", input=[as_float.inputs()[1]])))[2]
    assert as_float.params.embedding.lengths == tuple(len(tiny_engine.tokenizer(t)["input_ids"]) for t in texts)
    for request, name in ((as_float, "f"), (as_b64, "b"), (cut, "d"), (ids, "i")):
        request.request_id = name  # each was line 1 of its own file
    outputs = {o.request_id: o for o in _run(tiny_engine, [as_float, as_b64, cut, ids])}
    line = response_line(_batch_line("f"), outputs["f"], TINY_NAME, tiny_engine.tokenizer)
    body = line["response"]["body"]
    assert (line["custom_id"], line["response"]["status_code"], line["error"]) == ("f", 200, None)
    assert (body["object"], body["model"], [d["index"] for d in body["data"]]) == ("list", TINY_NAME, [0, 1])
    assert {d["object"] for d in body["data"]} == {"embedding"}
    tokens = len(as_float.prompt_token_ids)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    vectors = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    assert vectors.shape == (2, 64) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-6)
    b64 = response_line(_batch_line("b"), outputs["b"], TINY_NAME, tiny_engine.tokenizer)["response"]["body"]
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in b64["data"]])
    assert np.array_equal(decoded, vectors)  # the same float32 values, little-endian
    short = np.array([d["embedding"] for d in response_line(_batch_line("d"), outputs["d"], TINY_NAME, None)
                      ["response"]["body"]["data"]])
    want = vectors[:, :8] / np.linalg.norm(vectors[:, :8], axis=1, keepdims=True)
    assert short.shape == (2, 8) and np.allclose(short, want, atol=1e-6)
    by_ids = response_line(_batch_line("i"), outputs["i"], TINY_NAME, None)["response"]["body"]["data"]
    assert np.allclose(by_ids[0]["embedding"], vectors[1], atol=1e-6)  # token ids or their text: one vector


def _batch_line(custom_id: str):
    from jobs.lines.batch_format import BatchLine

    return BatchLine(1, custom_id, URL, {})


def _run(engine, requests):
    for r in requests:
        engine.add_request(r)
    done = []
    while engine.has_unfinished():
        done += engine.step()
    return done


def write_embedding_requests(path, n: int) -> dict[str, dict]:
    """``n`` embeddings lines of every input shape, and one bad line; the good lines by custom_id."""
    shapes = [dict(input="A short sentence."), dict(input=["one", "two words", "and three words"]),
              dict(input=[5, 6, 7, 8]), dict(input=[[9, 10], [11]], encoding_format="base64"),
              dict(input="Cut me.", dimensions=16)]
    lines = {f"emb-{i}": embed_line(f"emb-{i}", **shapes[i % len(shapes)]) for i in range(n)}
    with open(path, "w") as f:
        for line in lines.values():
            f.write(json.dumps(line) + "\n")
        f.write(json.dumps(embed_line("bad", input="")) + "\n")
    return lines


def check_embedding_output(lines: list[dict], wanted: dict[str, dict]) -> None:
    assert [line["custom_id"] for line in lines] == list(wanted)
    for line in lines:
        body, asked = line["response"]["body"], wanted[line["custom_id"]]["body"]
        inputs = asked["input"] if isinstance(asked["input"], list) and not isinstance(asked["input"][0], int) else [0]
        assert body["object"] == "list" and len(body["data"]) == len(inputs)
        first = body["data"][0]["embedding"]
        width = len(base64.b64decode(first)) // 4 if isinstance(first, str) else len(first)
        assert width == asked.get("dimensions", 64)


def test_an_embeddings_job_through_berth_run_counts_its_results(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.chdir(tmp_path)
    wanted = write_embedding_requests(tmp_path / "embed.jsonl", 12)
    result = CliRunner().invoke(main, ["run", "embed.jsonl", "-o", "out.jsonl", "--model", str(tiny_llama_dir),
                                       "--model-name", TINY_NAME, "--kv-memory", "64MiB", "--threads", "1", "--quiet"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    check_embedding_output(read_jsonl(tmp_path / "out.jsonl"), wanted)
    [error] = read_jsonl(tmp_path / "out.errors.jsonl")
    assert (error["custom_id"], error["error"]["param"], error["error"]["line"]) == ("bad", "body.input", 13)
    db = open_database(tiny_settings(tiny_llama_dir).database_url)  # sqlite:///./berth.db, here
    with db.session() as s:
        job = s.scalars(select(Job)).one()
        completed = s.scalar(select(func.count()).select_from(Result).where(Result.status == ResultStatus.COMPLETED))
    assert (completed, job.completed, job.failed, job.total, job.completion_tokens) == (12, 12, 1, 13, 0)
    assert job.prompt_tokens == sum(line["response"]["body"]["usage"]["prompt_tokens"]
                                    for line in read_jsonl(tmp_path / "out.jsonl"))


def test_an_embeddings_batch_through_berth_serve(tmp_path, tiny_llama_dir, tiny_engine):
    from tests.support.serving import client, embedded_settings, key_for, serving, upload, wait_for

    wanted = write_embedding_requests(tmp_path / "embed.jsonl", 5)
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    with serving(settings, engine=tiny_engine) as server:
        c = client(server, key_for(settings, "alice"))
        batch = c.batches.create(input_file_id=upload(c, tmp_path / "embed.jsonl").id, endpoint=URL,
                                 completion_window="24h")
        batch = wait_for(c, batch.id)
        output = c.files.content(batch.output_file_id).text
    assert batch.status == "completed" and batch.endpoint == URL
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (6, 5, 1)
    check_embedding_output([json.loads(line) for line in output.splitlines()], wanted)


def test_an_embeddings_job_through_the_queue_door(tmp_path, tiny_llama_dir, tiny_engine, pg_url, queue_prefix):
    from jobs import api
    from tests.support.jobs_env import work_until_over
    from tests.support.rabbitmq import door_settings, job_of, publish, start_door, submit_body

    settings = door_settings(tmp_path, tiny_llama_dir, pg_url, queue_prefix)
    api.allow_broker_user("guest", "alice", settings)
    wanted = write_embedding_requests(tmp_path / "embed.jsonl", 4)
    door = start_door(settings)
    try:
        publish(queue_prefix, submit_body(requests=[*wanted.values(), embed_line("bad", input=[[]])]), "embed-1")
        job = work_until_over(settings, tiny_engine, job_of(settings, "embed-1"))
    finally:
        door.stop()
    assert (job.status.value, job.total, job.completed, job.failed) == ("completed", 5, 4, 1)
    with open_database(pg_url).session() as s:
        assert s.scalar(select(func.count()).select_from(Result).where(Result.job_id == job.id)) == 4
    api.results(job.id, tmp_path / "out.jsonl", settings=settings)
    check_embedding_output(read_jsonl(tmp_path / "out.jsonl"), wanted)
    [error] = read_jsonl(tmp_path / "out.errors.jsonl")
    assert (error["custom_id"], error["error"]["param"]) == ("bad", "body.input[0]")
