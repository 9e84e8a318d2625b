"""A database or broker that does not answer, as a user meets it: one line naming the address and what
to do, never a traceback; a refused submission leaves no job behind; a worker whose broker is down says
so, tries again with a backoff, and stops within 5 s of SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from jobs.cli import main
from tests.support.jobs_env import tiny_env, tiny_settings, write_requests
from tests.support.processes import free_port


def _embedded(tmp_path: Path) -> list[str]:
    return ["--database-url", f"sqlite:///{tmp_path / 'berth.db'}", "--storage-url", f"file://{tmp_path / 'store'}"]


def test_a_submission_the_broker_cannot_take_is_one_line_and_leaves_no_job(tmp_path, tiny_llama_dir):
    port = free_port()  # nothing listens there
    src = write_requests(tmp_path / "in.jsonl", 3)
    args = ["submit", str(src), "--model", str(tiny_llama_dir), *_embedded(tmp_path),
            "--broker-url", f"amqp://guest:secret@127.0.0.1:{port}//"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [
        f"Error: the broker at amqp://guest:**@127.0.0.1:{port}// does not answer ([Errno 111] Connection refused); "
        "check that RabbitMQ runs there, or set BERTH_BROKER_URL (--broker-url; empty: the embedded queue)"]
    listed = CliRunner().invoke(main, ["list", "--json", *_embedded(tmp_path)])
    assert listed.exit_code == 0 and listed.output.strip() == "[]", listed.output
    assert not list((tmp_path / "store").rglob("*.jsonl"))  # nor its input


def test_commands_whose_database_does_not_answer_say_so_in_one_line(tmp_path, tiny_llama_dir):
    port = free_port()
    url = f"postgresql+psycopg://berth:secret@127.0.0.1:{port}/berth"
    src = write_requests(tmp_path / "in.jsonl", 1)
    for args in (["submit", str(src), "--model", str(tiny_llama_dir)], ["status", "batch_x"], ["list"],
                 ["usage"], ["workers"]):
        result = CliRunner().invoke(main, [*args, "--database-url", url])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 1 and len(lines) == 1, (args, result.output)
        assert lines[0].startswith(f"Error: the database at postgresql+psycopg://berth:***@127.0.0.1:{port}/berth: "
                                   "connection failed:"), lines
        assert lines[0].endswith("check that it runs and takes connections there, or set BERTH_DATABASE_URL "
                                 "(--database-url)"), lines


def test_a_worker_whose_broker_is_down_says_so_retries_and_stops_on_sigterm(tmp_path, tiny_llama_dir):
    port = free_port()
    settings = tiny_settings(tiny_llama_dir, database_url=f"sqlite:///{tmp_path / 'berth.db'}",
                             storage_url=f"file://{tmp_path / 'store'}", broker_url=f"amqp://guest:guest@127.0.0.1:{port}//")
    log = tmp_path / "worker.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", "worker"], env={**os.environ, **tiny_env(settings)},
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "still does not answer" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        text = log.read_text()
        assert f"the broker at amqp://guest:**@127.0.0.1:{port}// does not answer" in text, text[-3000:]
        assert "still does not answer after" in text, text[-3000:]  # tried again
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code = proc.wait(timeout=30)
        assert time.monotonic() - started < 5 and code == 0, log.read_text()[-3000:]
        assert "Traceback" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_store_that_does_not_answer_is_one_line_and_leaves_no_job(tmp_path, tiny_llama_dir, monkeypatch):
    port = free_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "berth")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    database = ["--database-url", f"sqlite:///{tmp_path / 'berth.db'}"]
    src = write_requests(tmp_path / "in.jsonl", 1)
    result = CliRunner().invoke(main, ["submit", str(src), "--model", str(tiny_llama_dir), *database,
                                       "--storage-url", "s3://bucket/jobs"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert lines[0].startswith("Error: the store s3://bucket/jobs/: ") and "Could not connect" in lines[0], lines
    assert lines[0].endswith("check BERTH_STORAGE_URL (--storage-url) and, for S3, its credentials "
                             "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY; AWS_ENDPOINT_URL for MinIO)"), lines
    listed = CliRunner().invoke(main, ["list", "--json", *database])
    assert listed.exit_code == 0 and listed.output.strip() == "[]", listed.output
