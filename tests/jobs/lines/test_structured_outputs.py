"""Structured outputs end to end, on the default model: extraction prompts with a JSON schema run
through ``berth generate``, and every output that finishes "stop" parses and validates against its
schema. A constrained request body also gives the same
output through ``berth generate``, ``berth run`` and the queue with a worker."""

from __future__ import annotations

import json
import re

import pytest

from benchmarks.extraction import SCHEMAS, invalid, run_extractions
from jobs import api
from jobs.hosting.generate import generate_file
from jobs.records.models import JobStatus
from tests.support.jobs_env import TINY_NAME, read_jsonl, tiny_settings, work_until_over
from worker.config import Settings
from worker.engine.engine import Engine


@pytest.mark.slow  # 30 requests on the default model
def test_every_constrained_extraction_that_stops_is_valid(tmp_path):
    """Every other case of the benchmark's 60, which covers each schema six times. The contrast, the same
    prompts without the constraint (0 of 60 valid), is a measure of the model, not of berth:
    ``python benchmarks/extraction.py`` prints it."""
    engine = Engine(Settings())  # the defaults a user gets: the default model, float32, every core
    constrained = run_extractions(tmp_path, engine, "constrained", constrained=True, every=2)
    stopped = [(kind, text) for kind, reason, text in constrained if reason == "stop"]
    for kind, text in stopped:
        assert invalid(kind, text) is None, (kind, text, invalid(kind, text))
    assert len(stopped) >= 0.8 * len(constrained), [r for _, r, _ in constrained]


BODIES = {  # one request of each kind of constraint, greedy
    "schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "person",
                                                                          "schema": SCHEMAS["person"]}}},
    "object": {"response_format": {"type": "json_object"}},
    "regex": {"guided_regex": "[A-Z][a-z]{2,8} [0-9]{1,3}"},
    "choice": {"guided_choice": ["positive", "negative", "neutral"]},
    "grammar": {"structured_outputs": {"grammar": 'root ::= "yes" | "no" | "maybe " [0-9]'}},
}


def test_a_constrained_body_gives_one_output_through_every_door(tmp_path, tiny_llama_dir, tiny_engine):
    lines = []
    for i, (name, extra) in enumerate(BODIES.items()):
        url, prompt = ("/v1/completions", {"prompt": "Answer:"}) if i % 2 else \
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Answer, please."}]})
        body = {"model": TINY_NAME, "max_tokens": 24, "temperature": 0, **prompt, **extra}
        lines.append(json.dumps({"custom_id": name, "method": "POST", "url": url, "body": body}))
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")

    def settings(name):
        return tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / name}.db",
                             storage_url=f"file://{tmp_path / name}-store")

    def choices(output_path):
        return {line["custom_id"]: line["response"]["body"]["choices"] for line in read_jsonl(output_path)}

    summary = generate_file(path, tmp_path / "generate.jsonl", settings("generate"), engine=tiny_engine,
                            progress=False)
    assert (summary.completed, summary.failed) == (len(BODIES), 0)
    generated = choices(tmp_path / "generate.jsonl")

    job, files = api.run(path, tmp_path / "run.jsonl", settings("run"), engine=tiny_engine)
    assert (job.status, job.completed) == (JobStatus.COMPLETED, len(BODIES))
    assert choices(files.output) == generated

    queued = settings("queue")
    job = api.submit(path, queued)  # the embedded queue: ingest here, a worker consumes the messages
    job = work_until_over(queued, tiny_engine, job.id)
    assert (job.status, job.completed) == (JobStatus.COMPLETED, len(BODIES))
    assert choices(api.results(job.id, tmp_path / "queue.jsonl", settings=queued).output) == generated

    texts = {name: (c["message"]["content"] if "message" in c else c["text"], c["finish_reason"])
             for name, [c] in generated.items()}
    for name, (text, reason) in texts.items():  # a random tiny model, yet each output keeps its constraint
        if reason != "stop":
            continue
        if name == "schema":
            assert invalid("person", text) is None, text
        elif name == "object":
            assert isinstance(json.loads(text), dict), text
        elif name == "choice":
            assert text in ("positive", "negative", "neutral")
        elif name == "grammar":
            assert text in ("yes", "no") or (text[:-1] == "maybe " and text[-1].isdigit()), text
        else:
            assert re.fullmatch("[A-Z][a-z]{2,8} [0-9]{1,3}", text), text
    assert sum(reason == "stop" for _, reason in texts.values()) >= 3, texts
