"""The commands that read or change job rows (`status`, `list`, `results`, `cancel`, `key`, `tenant`,
`--help`, ...) start in a fraction of a second because they never import the engine's packages:
torch alone takes seconds to import. Each command runs here in a fresh process, on an embedded
SQLite database, with an import hook that records who imported a forbidden package first, so a new
import chain (a door module reaching the engine for a constant) fails with the chain named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import api
from jobs.pipeline.submit import JobSpec, create_job
from jobs.records.db import open_database
from jobs.records.job_files import JobFiles
from worker.config import Settings

ROOT = Path(__file__).resolve().parents[1]  # this tree's berth, not another one installed
FORBIDDEN = ("torch", "xgrammar", "transformers", "triton", "worker.engine.engine", "worker.model.loader")
# ... and what the commands that only show jobs need neither: they read rows with SQLAlchemy's core
# (jobs.records.status), and Settings reads its BERTH_* variables without pydantic-settings.
READ_PATH = (*FORBIDDEN, "sqlalchemy.orm", "jobs.records.models", "jobs.records.lifecycle",
             "pydantic_settings", "celery", "kombu")

# Runs `berth ARGS...` in this process, then writes the exit code and, for each forbidden module that
# was imported, the stack of berth's own frames at its first import.
RUN = r"""
import json, runpy, sys, traceback

FORBIDDEN, REPORT, ARGS = json.loads(sys.argv[1])
first = {}

class Watch:
    def find_spec(self, name, path=None, target=None):
        if name in FORBIDDEN and name not in first:
            frames = [f for f in traceback.extract_stack()[:-1] if "/site-packages/" not in f.filename
                      and "<frozen" not in f.filename]
            first[name] = [f"{f.filename}:{f.lineno} {f.line}" for f in frames]
        return None  # the import itself goes on as usual

sys.meta_path.insert(0, Watch())
sys.argv = ["berth", *ARGS]
code = 0
try:
    runpy.run_module("jobs.cli", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
with open(REPORT, "w") as f:
    json.dump({"code": code, "imported": {m: first.get(m) for m in FORBIDDEN if m in sys.modules}}, f)
"""


@pytest.fixture(scope="module")
def jobs_db(tmp_path_factory):
    """An embedded database holding a finished job (its one line failed validation: no engine ran)
    and a job still validating (created, never ingested), and the environment that points at it."""
    tmp = tmp_path_factory.mktemp("cli_imports")
    settings = Settings(database_url=f"sqlite:///{tmp / 'berth.db'}", storage_url=f"file://{tmp / 'store'}")
    bad = tmp / "bad.jsonl"
    bad.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": settings.served_model_name(), "messages": "not a list"}}) + "\n")
    finished = api.submit(bad, settings)
    assert finished.status.is_final, finished
    waiting = create_job(open_database(settings.database_url), JobFiles(settings.storage_url), bad,
                         settings.served_model_name(), JobSpec(), settings)
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERTH_") or k == "BERTH_CACHE_DIR"}
    env.update(BERTH_DATABASE_URL=settings.database_url, BERTH_STORAGE_URL=settings.storage_url,
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return {"env": env, "dir": tmp, "finished": finished.id, "waiting": waiting}


def berth(jobs_db, *args: str, forbidden=FORBIDDEN) -> dict:
    report = jobs_db["dir"] / "report.json"
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps([list(forbidden), str(report), list(args)])],
                          env=jobs_db["env"], cwd=jobs_db["dir"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(report.read_text())
    result["out"], result["err"] = done.stdout, done.stderr
    return result


def assert_light(result: dict, args) -> None:
    chains = "\n\n".join(f"{module} first imported from:\n  " + "\n  ".join(stack or ["?"])
                         for module, stack in result["imported"].items())
    assert not result["imported"], f"`berth {' '.join(args)}` imported the engine's packages:\n{chains}"


READ_ONLY = [
    ["--help"],
    ["status", "--help"],
    ["status", "{finished}"],
    ["status", "{finished}", "--json"],
    ["list"],
    ["list", "--json", "--tenant", "default"],
    ["list", "--status", "failed"],  # the finished job: its one line failed validation
    ["results", "{finished}", "-o", "{dir}/out.jsonl"],
    ["key", "list"],
    ["webhook-secret", "default"],
    ["workers", "--all"],
    ["usage", "--since", "7d", "--price-in", "0.1"],
]
# The commands that only show jobs: none of READ_PATH either (`key` and `webhook-secret` use the ORM).
SHOW_ONLY = ("--help", "status", "list", "results")


@pytest.mark.parametrize("args", READ_ONLY, ids=lambda a: " ".join(a).replace("{", "").replace("}", ""))
def test_a_command_that_reads_jobs_imports_no_engine(jobs_db, args):
    args = [a.format(**{k: str(v) for k, v in jobs_db.items() if k != "env"}) for a in args]
    result = berth(jobs_db, *args, forbidden=READ_PATH if args[0] in SHOW_ONLY else FORBIDDEN)
    assert result["code"] == 0, result["err"]
    assert_light(result, args)
    if args[0] in ("status", "list") and "--help" not in args:
        assert jobs_db["finished"] in result["out"]


def test_status_prints_without_rich(jobs_db):
    """`berth status` prints plain lines: rich (the table and the bar) is for `list` and `--watch`."""
    result = berth(jobs_db, "status", jobs_db["finished"], forbidden=(*READ_PATH, "rich"))
    assert result["code"] == 0, result["err"]
    assert_light(result, ["status"])


def test_the_read_path_shows_a_job_as_the_orm_row_does(jobs_db):
    """``jobs.records.status`` reads the columns by name with SQLAlchemy's core; the view of the ORM row (what
    the HTTP API lists) must be the same, field for field, metadata and message id included."""
    from sqlalchemy import select, update

    from jobs.records.models import Job, Tenant
    from jobs.records.status import COLUMNS, JobView, get_job, list_jobs

    db = open_database(jobs_db["env"]["BERTH_DATABASE_URL"])
    with db.session() as s, s.begin():
        s.execute(update(Job).where(Job.id == jobs_db["finished"])
                  .values(metadata_={"team": "a", "n": "1"}, submit_message_id="m-1", cached_tokens=3))
    with db.session() as s:
        job, tenant = s.execute(select(Job, Tenant.name).join(Tenant).where(Job.id == jobs_db["finished"])).one()
        orm_view = JobView.of(job, tenant)
    view = get_job(db, jobs_db["finished"])
    assert view == orm_view
    assert (view.metadata, view.message_id, view.cached_tokens) == ({"team": "a", "n": "1"}, "m-1", 3)
    assert [v.id for v in list_jobs(db, "default", view.status)] == [view.id]
    assert list_jobs(db, "no-such-tenant") == []
    fields = {f.name for f in __import__("dataclasses").fields(JobView)}
    # the tenant's name and the running requests' tokens (a sum over job_progress) come from other tables
    assert set(COLUMNS) == fields - {"tenant", "tokens_in_flight"}, \
        "a JobView field no query reads (or a column no field shows)"


def test_results_copy_the_errors_file_without_the_engine(jobs_db):
    result = berth(jobs_db, "results", jobs_db["finished"], "-o", str(jobs_db["dir"] / "got.jsonl"))
    assert result["code"] == 0, result["err"]
    assert_light(result, ["results"])
    errors = [json.loads(line) for line in (jobs_db["dir"] / "got.errors.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["a"]


def test_commands_that_change_rows_import_no_engine(jobs_db):
    for args in (["cancel", jobs_db["waiting"]], ["tenant", "default", "--weight", "2"],
                 ["key", "create", "--tenant", "default"], ["webhook-secret", "default", "--rotate"]):
        result = berth(jobs_db, *args)
        assert result["code"] == 0, (args, result["err"])
        assert_light(result, args)
    key = berth(jobs_db, "key", "list")["out"].split()[0].rstrip(".")
    result = berth(jobs_db, "key", "revoke", key)
    assert result["code"] == 0 and "revoked 1 key" in result["out"], (key, result["err"])
    assert_light(result, ["key", "revoke"])
    status = berth(jobs_db, "status", jobs_db["waiting"], "--json")
    assert json.loads(status["out"])["status"] == "cancelled"


def test_submit_to_a_broker_imports_no_engine(jobs_db, queue_prefix):
    """With a broker the ingest (which reads the model's config and tokenizer) runs on a Celery
    worker: `berth submit` stores the file, makes the job and sends the task, all without torch."""
    from tests.support.jobs_env import AMQP_URL

    result = berth(jobs_db, "submit", str(jobs_db["dir"] / "bad.jsonl"), "--broker-url", AMQP_URL,
                   "--queue-prefix", queue_prefix)
    assert result["code"] == 0, result["err"]
    assert_light(result, ["submit", "--broker-url"])
    assert result["out"].strip().startswith("batch_")


def test_an_error_of_a_module_never_imported_is_still_one_line(jobs_db):
    result = berth(jobs_db, "status", "no-such-job")
    assert result["code"] == 1 and "Traceback" not in result["err"] and "no job 'no-such-job'" in result["err"]
    assert_light(result, ["status"])


def test_the_hook_names_the_chain_of_an_import(jobs_db):
    """The check itself, on a package `status` does import: its first importer among berth's lines."""
    result = berth(jobs_db, "status", jobs_db["finished"], forbidden=("sqlalchemy",))
    stack = result["imported"]["sqlalchemy"]
    assert any("jobs/records/db.py" in line and "import" in line for line in stack), stack


def test_a_command_leaves_the_objects_to_the_system_at_exit(jobs_db):
    """The last exit handler freezes the collector's objects, so the interpreter's shutdown collection
    does not walk them (0.6 s of `berth generate` when torch is loaded): a handler registered before
    the command runs (so it runs after berth's) finds every object frozen."""
    script = ("import atexit, gc, runpy, sys\n"
              "atexit.register(lambda: print('frozen', gc.get_freeze_count(), 'left', gc.get_count()[2]))\n"
              "sys.argv = ['berth', 'list']\n"
              "runpy.run_module('jobs.cli', run_name='__main__', alter_sys=True)\n")
    done = subprocess.run([sys.executable, "-c", script], env=jobs_db["env"], cwd=jobs_db["dir"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    frozen, left = (int(x) for x in done.stdout.split("frozen", 1)[1].split()[0::2])
    assert frozen > 10_000 and left == 0, done.stdout
