"""A line's ``cache_salt`` at the door: checked, stored on its request's row, and handed to the worker
as the request's salt (namespaced apart from tenants' and groups' keys); a line without one gets its
tenant's own, or its tenant's cache group's."""

from __future__ import annotations

import json

from sqlalchemy import select

from jobs import api
from jobs.hosting.database_ledger import JobsLedger
from jobs.records.db import open_database
from jobs.records.models import LineErrorRow, RequestRow
from tests.support.jobs_env import TINY_NAME, tiny_settings


def _line(i: int, **body) -> dict:
    return {"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
            "body": {"model": TINY_NAME, "prompt": "You are a careful assistant.", "max_tokens": 2, **body}}


def test_cache_salt_reaches_the_workers_claim(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.chdir(tmp_path)
    settings = tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'jobs.records.db'}",
                             storage_url=f"file://{tmp_path / 'store'}")
    path = tmp_path / "in.jsonl"
    lines = [_line(0, cache_salt="s3cret"), _line(1), _line(2, cache_salt=""), _line(3, cache_salt=7),
             _line(4, cache_salt="x" * 257)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    alice = api.submit(path, settings, spec=api.JobSpec(tenant="alice"), eager=True)
    bob = api.submit(path, settings, spec=api.JobSpec(tenant="bob"), eager=True)
    db = open_database(settings.database_url)
    with db.session() as s:
        rows = {(r.job_id, r.custom_id): r for r in s.scalars(select(RequestRow))}
        errors = sorted((e.line, e.param)
                        for e in s.scalars(select(LineErrorRow).where(LineErrorRow.job_id == alice.id)))
    assert errors == [(3, "body.cache_salt"), (4, "body.cache_salt"), (5, "body.cache_salt")]
    assert rows[(alice.id, "q0")].cache_salt == "salt:s3cret" and rows[(alice.id, "q1")].cache_salt is None

    ledger = JobsLedger(settings, None, TINY_NAME, eager_tasks=True)
    ids = {key: row.id for key, row in rows.items()}
    claims = ledger.claim(list(ids.values()), "w:1")
    salt = {key: claims[rid].cache_salt for key, rid in ids.items()}
    assert salt[(alice.id, "q0")] == salt[(bob.id, "q0")] == "salt:s3cret"  # the same salt shares across tenants
    assert salt[(alice.id, "q1")] is None and salt[(bob.id, "q1")] is None  # each tenant's own (Request.cache_key)
    api.set_tenant_cache_group("alice", "lab", settings)
    api.set_tenant_cache_group("bob", "lab", settings)
    claims = ledger.claim([ids[(alice.id, "q1")], ids[(bob.id, "q1")], ids[(alice.id, "q0")]], "w:1")
    assert claims[ids[(alice.id, "q1")]].cache_salt == claims[ids[(bob.id, "q1")]].cache_salt == "group:lab"
    assert claims[ids[(alice.id, "q0")]].cache_salt == "salt:s3cret"  # a line's own salt wins over the group
    api.set_tenant_cache_group("bob", None, settings)
    assert ledger.claim([ids[(bob.id, "q1")]], "w:1")[ids[(bob.id, "q1")]].cache_salt is None
