"""Bad input: each kind of bad line is reported with its line number, field and reason while the
good lines all complete; an empty file, a non-UTF-8 file and a 50 MB line break nothing."""

from __future__ import annotations

import json

import pytest

from jobs import api
from jobs.records.models import JobStatus
from tests.support.jobs_env import TINY_NAME, read_jsonl, request_line, tiny_settings


def _settings(tmp_path, tiny_llama_dir):
    return tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                         storage_url=f"file://{tmp_path / 'store'}")


def _line(i, **body):
    line = request_line(i)
    line["body"].update(body)
    return json.dumps(line)


def test_bad_lines_are_reported_and_good_lines_complete(tmp_path, tiny_llama_dir, tiny_engine):
    good = [json.dumps(request_line(i)) for i in range(4)]
    too_long_prompt = json.dumps({"custom_id": "long", "url": "/v1/completions",
                                  "body": {"model": TINY_NAME, "prompt": [5] * 3000, "max_tokens": 4}})
    bad = {  # line number -> (code, param, what the message says)
        2: ("not json {", ("invalid_request", None, "not valid JSON")),
        3: (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
            ("invalid_request", "custom_id", "missing")),
        4: (_line(10, max_tokens="ten"), ("invalid_request", "body.max_tokens", "an integer >= 1")),
        6: (_line(11, model="gpt-4o"), ("model_not_found", "body.model", "unknown model 'gpt-4o'")),
        7: (too_long_prompt, ("context_length_exceeded", "body.prompt", "exceeds the model's context of 2048")),
        8: (json.dumps(request_line(0)), ("invalid_request", "custom_id", "duplicate custom_id 'req-0'")),
        9: ("x" * (50 << 20), ("line_too_long", None, "52428800 bytes, over the limit")),
        10: ('{"custom_id": "caf\xe9"}'.encode("latin-1"), ("invalid_request", None, "not UTF-8")),
        13: (_line(12, frequency_penality=0.5), ("invalid_request", "body.frequency_penality",
                                                 "not a request field berth knows")),
    }
    lines: dict[int, bytes] = {1: good[0], 5: good[1], 11: good[2], 12: good[3], **{n: v for n, (v, _) in bad.items()}}
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(v if isinstance(v, bytes) else v.encode() for _, v in sorted(lines.items())) + b"\n")

    job, files = api.run(path, tmp_path / "out.jsonl", _settings(tmp_path, tiny_llama_dir), engine=tiny_engine)

    assert job.status is JobStatus.COMPLETED
    assert (job.total, job.completed, job.failed) == (13, 4, 9)
    assert [line["custom_id"] for line in read_jsonl(files.output)] == ["req-0", "req-1", "req-2", "req-3"]
    errors = {e["error"]["line"]: e for e in read_jsonl(files.errors)}
    assert sorted(errors) == sorted(bad)
    for number, (_, (code, param, says)) in bad.items():
        error = errors[number]["error"]
        assert (error["code"], error["param"]) == (code, param), error
        assert f"line {number}" in error["message"] and says in error["message"], error


@pytest.mark.parametrize("content, says", [
    (b"", "no request lines"),
    (b"\n  \n", "no request lines"),
    ('{"custom_id": "a"}\n'.encode("utf-16"), "the file is UTF-16 text: save it as UTF-8"),
    ("caf\xe9 1\ncaf\xe9 2\n".encode("latin-1"), "none of the 2 lines is a valid request"),
])
def test_unusable_files_fail_the_job_with_a_reason(tmp_path, tiny_llama_dir, tiny_engine, content, says):
    path = tmp_path / "input.jsonl"
    path.write_bytes(content)
    job, files = api.run(path, tmp_path / "out.jsonl", _settings(tmp_path, tiny_llama_dir), engine=tiny_engine)
    assert job.status is JobStatus.FAILED
    assert says in job.error
    assert files.output is None
    if b"caf" in content:
        assert [e["error"]["message"] for e in read_jsonl(files.errors)] == [
            "line 1: not UTF-8 text (invalid continuation byte at byte 3)",
            "line 2: not UTF-8 text (invalid continuation byte at byte 3)"]
