"""Token budgets (issue 34, finding 4): a tenant's enqueued tokens per model (each line's prompt tokens
and max_tokens, from when its ingest stores it until it is done) are held under a limit; a batch whose
lines would pass it fails as OpenAI's does, with ``token_limit_exceeded``, and the room comes back as
lines finish. At the defaults a user gets, a limit holds."""

from __future__ import annotations

from sqlalchemy import select, update

from jobs.pipeline.ingest import ingest
from jobs.pipeline.submit import JobSpec, create_job
from jobs.records.budgets import TOKEN_LIMIT_CODE, budgets, set_token_limit
from jobs.records.db import open_database
from jobs.records.job_files import JobFiles
from jobs.records.models import Job, JobStatus, RequestRow, ResultStatus
from jobs.records.results import ResultRecord, record_outcomes
from jobs.records.status import get_job
from tests.support.jobs_env import TINY_NAME, read_jsonl, tiny_settings, write_requests
from worker.config import Settings


def _submit(settings, path, tenant="alice") -> str:
    db, files = open_database(settings.database_url), JobFiles(settings.storage_url)
    job_id = create_job(db, files, path, TINY_NAME, JobSpec(tenant=tenant), settings)
    ingest(db, files, settings, job_id)
    return job_id


def _finish_lines(settings, job_id) -> None:
    """What an engine worker does when the job's lines are done: their outcomes."""
    db = open_database(settings.database_url)
    with db.session() as s:
        ids = list(s.scalars(select(RequestRow.id).where(RequestRow.job_id == job_id)))
    record_outcomes(db, [ResultRecord(i, job_id, ResultStatus.COMPLETED, response={"status_code": 200},
                                      prompt_tokens=5, completion_tokens=4) for i in ids])


def test_a_batch_past_the_enqueued_token_limit_fails_with_token_limit_exceeded_and_room_comes_back(
        any_settings, tmp_path):
    settings = any_settings
    path = write_requests(tmp_path / "requests.jsonl", 3, max_tokens=8)
    first = _submit(settings, path)
    db = open_database(settings.database_url)
    held = get_job(db, first).enqueued_tokens
    with db.session() as s:
        lines = list(s.execute(select(RequestRow.prompt_token_ids, RequestRow.params)
                               .where(RequestRow.job_id == first)))
    assert held == sum(len(ids) + 8 for ids, _ in lines) and len(lines) == 3  # prompt tokens and max_tokens
    set_token_limit(db, "alice", held + held // 2)  # room for one such batch, not two

    second = get_job(db, _submit(settings, path))
    assert second.status is JobStatus.FAILED and second.error_code == TOKEN_LIMIT_CODE
    assert "Enqueued token limit reached" in second.error and f"{held + held // 2:,}" in second.error
    assert (second.total, second.failed, second.enqueued_tokens) == (3, 3, 0)
    JobFiles(settings.storage_url).get_file(second.errors_key, tmp_path / "errors.jsonl")
    assert [e["error"]["code"] for e in read_jsonl(tmp_path / "errors.jsonl")] == [TOKEN_LIMIT_CODE] * 3
    [budget] = budgets(db, settings.tenant_max_enqueued_tokens, "alice")
    assert budget.enqueued == {TINY_NAME: held} and budget.limit == held + held // 2 and budget.own_limit

    _finish_lines(settings, first)  # its lines are done: their tokens are given back
    assert get_job(db, first).enqueued_tokens == 0
    third = get_job(db, _submit(settings, path))
    assert third.status is JobStatus.IN_PROGRESS and third.enqueued_tokens == held
    other = get_job(db, _submit(settings, path, tenant="bob"))  # another tenant's budget is its own
    assert other.status is JobStatus.IN_PROGRESS


def test_the_default_limit_holds(tmp_path, tiny_llama_dir):
    """At the defaults a user gets, a tenant cannot queue tokens without end: with batches holding nearly
    the default limit, the next one fails with token_limit_exceeded (before: it was queued)."""
    settings = tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                             storage_url=f"file://{tmp_path / 'store'}")
    default = Settings.model_fields["tenant_max_enqueued_tokens"].default
    assert settings.tenant_max_enqueued_tokens == default > 0
    path = write_requests(tmp_path / "requests.jsonl", 2)
    first = _submit(settings, path)
    db = open_database(settings.database_url)
    with db.session() as s, s.begin():  # as if its 50,000 lines held nearly the whole default
        s.execute(update(Job).where(Job.id == first).values(enqueued_tokens=default - 5))
    refused = get_job(db, _submit(settings, path))
    assert refused.status is JobStatus.FAILED and refused.error_code == TOKEN_LIMIT_CODE


def test_the_cli_sets_the_limit_refuses_past_it_and_shows_it(tmp_path, tiny_llama_dir, monkeypatch):
    """`berth tenant NAME --enqueued-token-limit N` sets it and shows it; `berth submit` of a batch past it
    makes a job that fails with token_limit_exceeded; `berth status` says why and shows the budget."""
    from click.testing import CliRunner

    from jobs.cli import main
    from tests.support.jobs_env import tiny_env

    settings = tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                             storage_url=f"file://{tmp_path / 'store'}")
    for name, value in tiny_env(settings).items():
        if value != "None":
            monkeypatch.setenv(name, value)
    runner = CliRunner()
    path = write_requests(tmp_path / "requests.jsonl", 3, max_tokens=8)

    shown = runner.invoke(main, ["tenant", "carol", "--enqueued-token-limit", "20"])
    assert shown.exit_code == 0, shown.output
    assert "tenant carol: enqueued tokens none; limit 20 per model" in shown.output

    submitted = runner.invoke(main, ["submit", str(path), "--tenant", "carol"])
    assert submitted.exit_code == 0, submitted.output
    job_id = submitted.output.strip().splitlines()[-1]
    status = runner.invoke(main, ["status", job_id])
    assert status.exit_code == 0, status.output
    assert "failed" in status.output and "Enqueued token limit reached for tiny-llama" in status.output
    assert "budget    tenant carol: enqueued tokens 0 of tiny-llama; limit 20 per model" in status.output
    as_json = runner.invoke(main, ["status", job_id, "--json"])
    assert '"code": "token_limit_exceeded"' in as_json.output

    again = runner.invoke(main, ["tenant", "carol", "--enqueued-token-limit", "default"])
    assert f"limit {settings.tenant_max_enqueued_tokens:,} per model (BERTH_TENANT_MAX_ENQUEUED_TOKENS)" in again.output
    accepted = runner.invoke(main, ["submit", str(path), "--tenant", "carol"])
    job_id = accepted.output.strip().splitlines()[-1]
    status = runner.invoke(main, ["status", job_id])
    assert "in_progress" in status.output and "limit 200,000,000 per model" in status.output


def test_the_engine_workers_metrics_show_each_tenants_enqueued_tokens_and_limit(tmp_path, tiny_llama_dir):
    from prometheus_client import generate_latest

    from jobs.hosting.database_ledger import JobsLedger
    from worker.metrics import WorkerMetrics

    settings = tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                             storage_url=f"file://{tmp_path / 'store'}")
    job_id = _submit(settings, write_requests(tmp_path / "requests.jsonl", 2))
    db = open_database(settings.database_url)
    set_token_limit(db, "bob", 0)  # a tenant without live jobs is not shown
    held = get_job(db, job_id).enqueued_tokens
    ledger = JobsLedger(settings, None, TINY_NAME, eager_tasks=True)
    assert ledger.token_budgets(TINY_NAME) == {"alice": (held, settings.tenant_max_enqueued_tokens)}
    metrics = WorkerMetrics()
    metrics.set_budgets(ledger.token_budgets(TINY_NAME))
    page = generate_latest(metrics.registry).decode()
    assert f'berth_tenant_enqueued_tokens{{tenant="alice"}} {float(held)}' in page
    assert 'berth_tenant_enqueued_token_limit{tenant="alice"} 2e+08' in page  # 200,000,000 by default
