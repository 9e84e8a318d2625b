"""Structured outputs cannot stall other tenants (issue 20): a schema is bounded by its shape before
it compiles, a compile runs in a compile process killed at its deadline (which counts the compile,
never the wait for it), one tenant's compiles hold at most one of the compile processes, and one
spec asked for at once is compiled once."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid

import pytest
from sqlalchemy import select

from jobs import api
from jobs.lines.validate import model_info
from jobs.pipeline.submit import JobSpec
from jobs.records.db import open_database
from jobs.records.models import JobStatus, LineErrorRow
from tests.support.jobs_env import TINY_NAME, tiny_settings, work_until_over
from worker.engine.request import StructuredOutput
from worker.engine.structured import grammar
from worker.engine.structured.grammar_pool import compile_pool
from worker.engine.structured.schema_bounds import SchemaBounds

SLOW_PATTERN = "([a-z]{1,50}){1,50}"  # nested counted repetitions in a schema's pattern: 240 s of compile here


def slow_schema() -> dict:
    """A schema no shape bound refuses that compiles for minutes (each a new one: nothing cached)."""
    return {"type": "string", "pattern": f"{uuid.uuid4().hex[:8]}{SLOW_PATTERN}"}


def fresh_schema() -> dict:
    """A small schema never compiled before: it compiles in milliseconds."""
    return {"type": "object", "properties": {f"name_{uuid.uuid4().hex[:8]}": {"type": "string"}},
            "required": [], "additionalProperties": False}


def schema_line(custom_id: str, schema: dict) -> str:
    body = {"model": TINY_NAME, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Give me JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_schema_that_compiles_for_minutes_stalls_no_other_tenant(tmp_path, tiny_llama_dir, tiny_engine):
    """Tenant A's file holds four schemas that each compile for minutes; tenant B's one-line batch,
    submitted while A's ingest is at them, validates within seconds and completes. (Before, A's
    timed-out compiles kept both compile threads, B's compile waited behind them and its line
    failed past the deadline, which counted the wait; at the default 60 s, B sat 61 s in
    ``validating``.) A's lines each fail naming the deadline's setting, and the compile processes
    killed at it are gone. The deadline here is 3 s so that the test takes seconds, not minutes."""
    settings = tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                             storage_url=f"file://{tmp_path / 'store'}", structured_compile_seconds=3)
    grammar.check(StructuredOutput("json_schema", json.dumps(fresh_schema())), model_info(settings).tokenizer)
    killed_before = len(compile_pool().stats.killed)
    a_path, b_path = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a_path.write_text("".join(schema_line(f"slow-{i}", slow_schema()) + "\n" for i in range(4)))
    b_path.write_text(schema_line("quick", fresh_schema()) + "\n")

    a_job = {}
    a = threading.Thread(target=lambda: a_job.update(job=api.submit(a_path, settings, spec=JobSpec(tenant="team-a"))))
    a.start()
    time.sleep(5)  # A's first compile has passed its deadline, its second is under way
    assert a.is_alive(), "tenant A's ingest should still be at its slow schemas"
    started = time.monotonic()
    b = api.submit(b_path, settings, spec=JobSpec(tenant="team-b"))
    b_validating = time.monotonic() - started
    assert (b.status, b.total, b.failed) == (JobStatus.IN_PROGRESS, 1, 0), b
    assert b_validating < 15, f"tenant B's 1-line batch sat {b_validating:.1f} s in validating"
    assert a.is_alive(), "tenant B should not have waited for tenant A's compiles"
    b = work_until_over(settings, tiny_engine, b.id, timeout=120)
    b_done = time.monotonic() - started
    assert (b.status, b.completed) == (JobStatus.COMPLETED, 1)
    print(f"tenant B: {b_validating:.2f} s validating, {b_done:.2f} s to completion")

    a.join(timeout=120)
    assert not a.is_alive()
    job = api.status(a_job["job"].id, settings)
    assert (job.status, job.total, job.failed) == (JobStatus.FAILED, 4, 4)
    with open_database(settings.database_url).session() as s:
        messages = list(s.scalars(select(LineErrorRow.message).where(LineErrorRow.job_id == job.id)))
    assert len(messages) == 4
    assert all("did not compile within 3 s (BERTH_STRUCTURED_COMPILE_SECONDS)" in m for m in messages), messages
    killed = compile_pool().stats.killed[killed_before:]
    assert len(killed) == 4 and all(gone(pid) for pid in killed), killed


def the_issues_schema() -> dict:
    """Issue 20's schema: 2,500 optional properties, under the 64 KiB size limit."""
    return {"type": "object", "properties": {f"p{i:04d}": {"type": "string"} for i in range(2500)}}


def test_the_issues_schema_of_2500_optional_properties_is_refused_before_it_compiles(tmp_path, tiny_llama_dir):
    """With the defaults a user gets: a line error naming the limit and its setting, at once, and no
    compile tried (it took 144.6 s and 530 MB)."""
    settings = tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                             storage_url=f"file://{tmp_path / 'store'}")
    schema = the_issues_schema()
    assert 60_000 < len(json.dumps(schema, separators=(",", ":"))) < settings.structured_max_schema_bytes
    path = tmp_path / "in.jsonl"
    path.write_text(schema_line("wide", schema) + "\n" + schema_line("fine", fresh_schema()) + "\n")
    trials = compile_pool().stats.trials
    job = api.submit(path, settings)
    assert (job.status, job.total, job.failed) == (JobStatus.IN_PROGRESS, 2, 1)
    with open_database(settings.database_url).session() as s:
        [error] = s.scalars(select(LineErrorRow).where(LineErrorRow.job_id == job.id)).all()
    assert (error.custom_id, error.param) == ("wide", "body.response_format.json_schema.schema")
    assert "the schema has 2,500 properties, over the limit of 2,000 (BERTH_STRUCTURED_MAX_PROPERTIES)" \
        in error.message, error.message
    assert compile_pool().stats.trials == trials + 1  # the fine line's compile only


@pytest.mark.parametrize("schema, bounds, says", [
    ({"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(30)}},
     SchemaBounds(properties=40, optional_properties=20),
     ('the object at $ has 30 optional properties (not in its "required"), over the limit of 20 '
      "(BERTH_STRUCTURED_MAX_OPTIONAL_PROPERTIES)")),
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {
        f"k{i}": {"type": "integer"} for i in range(30)}, "required": ["k0"]}}, "required": ["a"]},
     SchemaBounds(optional_properties=20), "the object at $.properties.a has 29 optional properties"),
    ({"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(30)},
      "required": [f"k{i}" for i in range(30)]},
     SchemaBounds(properties=20),
     "the schema has 30 properties, over the limit of 20 (BERTH_STRUCTURED_MAX_PROPERTIES)"),
    ({"$defs": {"n": {"anyOf": [{"type": "array", "items": {"type": "array", "items": {"type": "string"}}}]}},
      "$ref": "#/$defs/n"},
     SchemaBounds(depth=3), "the schema nests schemas 5 deep, over the limit of 3 (BERTH_STRUCTURED_MAX_DEPTH)"),
    ({"type": "object", "properties": {"a": {"enum": list(range(8))}, "b": {"const": "x"}}},
     SchemaBounds(enum_values=8),
     "the schema has 9 enum and const values, over the limit of 8 (BERTH_STRUCTURED_MAX_ENUM_VALUES)"),
])
def test_each_bound_of_a_schemas_shape_names_its_setting(tiny_llama_dir, schema, bounds, says, monkeypatch):
    """At the door (a line error) and in the engine's compiler (the request's error), before any compile."""
    from jobs.lines.batch_format import LineError
    from tests.support.structured import structured_line, structured_of

    for name, value in (("PROPERTIES", bounds.properties), ("OPTIONAL_PROPERTIES", bounds.optional_properties),
                        ("DEPTH", bounds.depth), ("ENUM_VALUES", bounds.enum_values)):
        monkeypatch.setenv(f"BERTH_STRUCTURED_MAX_{name}", str(value))
    model = model_info(tiny_settings(tiny_llama_dir))
    with pytest.raises(LineError) as e:
        structured_of(model, structured_line(guided_json=schema))
    assert says in e.value.to_error_line()["error"]["message"]

    trials = compile_pool().stats.trials
    spec = StructuredOutput("json_schema", json.dumps(schema))
    future = grammar.compiler_for(model.tokenizer).submit(spec, "t", grammar.CompileRules(bounds=bounds))
    with pytest.raises(grammar.GrammarError, match=says.replace("(", r"\(").replace(")", r"\)").replace("$", r"\$")):
        future.result(timeout=5)
    assert compile_pool().stats.trials == trials
    assert grammar.compiler_for(model.tokenizer).submit(spec).result(timeout=60) is not None  # within the defaults


def test_one_spec_asked_for_at_once_compiles_once(smol_loaded, monkeypatch):
    tokenizer = smol_loaded.tokenizer
    compiler = grammar.compiler_for(tokenizer)
    original, here = grammar.Compiler.compile, []
    monkeypatch.setattr(grammar.Compiler, "compile", lambda self, spec: here.append(spec) or original(self, spec))
    spec = StructuredOutput("json_schema", json.dumps(fresh_schema()))
    trials = compile_pool().stats.trials
    start = threading.Barrier(4)
    results = []

    def ask(tenant):
        start.wait()
        results.append(compiler.submit(spec, tenant).result(timeout=120))

    threads = [threading.Thread(target=ask, args=(f"t{i % 2}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r is results[0] for r in results)
    assert compile_pool().stats.trials == trials + 1 and here == [spec]


def test_the_deadline_counts_the_compile_not_the_wait_and_kills_its_process(smol_loaded):
    """One tenant's two slow compiles and then a quick one: the tenant has one compile process at a
    time, so the quick one waits for both to be stopped at their deadline (2 s each), longer than
    its own deadline, and still compiles. Each stopped compile's process is gone."""
    compiler = grammar.compiler_for(smol_loaded.tokenizer)
    rules = grammar.CompileRules(seconds=2)
    killed_before = len(compile_pool().stats.killed)
    started = time.monotonic()
    slow = [compiler.submit(StructuredOutput("json_schema", json.dumps(slow_schema())), "solo", rules)
            for _ in range(2)]
    quick = compiler.submit(StructuredOutput("json_schema", json.dumps(fresh_schema())), "solo", rules)
    assert quick.result(timeout=120) is not None
    waited = time.monotonic() - started
    assert waited >= 2 * rules.seconds, f"the quick compile did not wait for the slow ones ({waited:.1f} s)"
    for future in slow:
        with pytest.raises(grammar.CompileTimeout, match="did not compile within 2 s"):
            future.result(timeout=0)
    killed = compile_pool().stats.killed[killed_before:]
    assert len(killed) == 2 and all(gone(pid) for pid in killed), killed


def test_one_tenants_compiles_hold_one_compile_process(smol_loaded):
    """While tenant A's slow compiles run one after the other, tenant B's compile takes the other
    process: it is done before A's first is stopped."""
    compiler = grammar.compiler_for(smol_loaded.tokenizer)
    rules = grammar.CompileRules(seconds=8)
    slow = [compiler.submit(StructuredOutput("json_schema", json.dumps(slow_schema())), "team-a", rules)
            for _ in range(2)]
    quick = compiler.submit(StructuredOutput("json_schema", json.dumps(fresh_schema())), "team-b", rules)
    assert quick.result(timeout=60) is not None
    assert not slow[0].done(), "tenant B waited for tenant A's compile"
    for future in slow:
        with pytest.raises(grammar.CompileTimeout):
            future.result(timeout=120)
