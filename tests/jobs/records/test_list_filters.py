"""`berth list` narrowed by time and by a job's metadata labels, on SQLite and on PostgreSQL (each
reads a JSON column its own way)."""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner
from sqlalchemy import update

from jobs.cli import main
from jobs.pipeline.submit import JobSpec, create_job
from jobs.records.db import open_database
from jobs.records.job_files import JobFiles
from jobs.records.models import Job
from tests.support.jobs_env import TINY_NAME, tiny_settings, write_requests

DAY = 86400


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_list_by_creation_time_and_metadata(backend, tmp_path, tiny_llama_dir, request):
    url = request.getfixturevalue("pg_url") if backend == "postgresql" else f"sqlite:///{tmp_path / 'berth.db'}"
    settings = tiny_settings(tiny_llama_dir, database_url=url, storage_url=f"file://{tmp_path / 'store'}")
    db, files = open_database(url), JobFiles(settings.storage_url)
    src = write_requests(tmp_path / "in.jsonl", 1)
    made = {}
    for name, labels, age_days in [("old-a", {"team": "a"}, 10), ("new-a", {"team": "a", "run": "7"}, 0.2),
                                   ("new-b", {"team": "b"}, 0.1), ("dotted", {"x.y": 'q"z'}, 2)]:
        job_id = create_job(db, files, src, TINY_NAME, JobSpec(tenant="alice", metadata=labels), settings)
        with db.session() as s, s.begin():
            s.execute(update(Job).where(Job.id == job_id).values(created_at=time.time() - age_days * DAY))
        made[job_id] = name

    def listed(*args: str) -> list[str]:
        result = CliRunner().invoke(main, ["list", "--json", "--database-url", url, *args])
        assert result.exit_code == 0, result.output
        return [made[v["id"]] for v in json.loads(result.output)]

    assert listed() == ["new-b", "new-a", "dotted", "old-a"]  # the newest first
    assert listed("--metadata", "team=a") == ["new-a", "old-a"]
    assert listed("--metadata", "team=a", "--metadata", "run=7") == ["new-a"]
    assert listed("--metadata", "team=c") == []
    assert listed("--metadata", 'x.y=q"z') == ["dotted"]
    assert listed("--since", "1d") == ["new-b", "new-a"]
    assert listed("--until", "1d") == ["dotted", "old-a"]
    assert listed("--since", "5d", "--until", "1d", "--tenant", "alice") == ["dotted"]
    result = CliRunner().invoke(main, ["list", "--metadata", "team", "--database-url", url])
    assert result.exit_code == 2 and "give KEY=VALUE" in result.output
