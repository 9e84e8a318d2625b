"""`berth usage`: two tenants' jobs counted from the database, each tenant's tokens equal to the sums of
its result lines' usage; `berth workers` and `berth status` say whether a worker serves a job."""

from __future__ import annotations

import json

from click.testing import CliRunner

from jobs import api
from jobs.cli import main
from jobs.pipeline.submit import JobSpec
from tests.support.jobs_env import read_jsonl, tiny_settings, write_requests


def test_usage_per_tenant_is_the_sum_of_its_result_lines(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.chdir(tmp_path)
    settings = tiny_settings(tiny_llama_dir)
    sums = {}
    for tenant, n in (("acme", 7), ("zeta", 4)):
        write_requests(tmp_path / f"{tenant}.jsonl", n)
        view, files = api.run(tmp_path / f"{tenant}.jsonl", tmp_path / f"{tenant}.out.jsonl", settings,
                              spec=JobSpec(tenant=tenant))
        assert view.completed == n
        usage = [line["response"]["body"]["usage"] for line in read_jsonl(files.output)]
        sums[tenant] = (n, sum(u["prompt_tokens"] for u in usage), sum(u["completion_tokens"] for u in usage))
    rows = {r.tenant: r for r in api.usage(settings)}
    assert {t: (r.requests, r.prompt_tokens, r.completion_tokens) for t, r in rows.items()} == sums
    assert api.usage(settings, "zeta")[0].completion_tokens == sums["zeta"][2]
    assert api.usage(settings, since=9e12) == []  # nothing written in the future
    result = CliRunner().invoke(main, ["usage", "--json", "--price-out", "2", "--database-url", settings.database_url])
    assert result.exit_code == 0, result.output
    shown = {r["tenant"]: r for r in json.loads(result.output)}
    assert shown["acme"]["completion_tokens"] == sums["acme"][2]
    assert shown["acme"]["cost"] == sums["acme"][2] * 2 / 1e6
    wrong = CliRunner().invoke(main, ["usage", "--since", "last week", "--database-url", settings.database_url])
    assert wrong.exit_code == 2 and "--since 'last week': give a span" in wrong.output


def test_status_says_when_no_worker_serves_the_jobs_model(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.chdir(tmp_path)
    settings = tiny_settings(tiny_llama_dir)
    write_requests(tmp_path / "in.jsonl", 2)
    job = api.submit(tmp_path / "in.jsonl", settings, eager=True)
    shown = CliRunner().invoke(main, ["status", job.id, "--database-url", settings.database_url])
    assert f"none live serves model {job.model}" in shown.output
    listed = CliRunner().invoke(main, ["workers", "--database-url", settings.database_url])
    assert listed.exit_code == 0 and "no engine worker is live" in listed.output


def test_results_partial_gives_a_running_jobs_lines_so_far(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.chdir(tmp_path)
    settings = tiny_settings(tiny_llama_dir)
    src = write_requests(tmp_path / "in.jsonl", 2)
    src.write_text(src.read_text() + "not json\n")
    job = api.submit(src, settings, eager=True)  # no worker: the two good lines wait
    flags = ["--database-url", settings.database_url, "--storage-url", settings.storage_url]
    refused = CliRunner().invoke(main, ["results", job.id, "-o", "out.jsonl", *flags])
    assert refused.exit_code == 1 and "--watch" in refused.output
    partial = CliRunner().invoke(main, ["results", job.id, "-o", "out.jsonl", "--partial", *flags])
    assert partial.exit_code == 0, partial.output
    assert "no request completed" in partial.output and not (tmp_path / "out.jsonl").exists()
    [error] = read_jsonl(tmp_path / "out.errors.jsonl")
    assert error["error"]["line"] == 3
