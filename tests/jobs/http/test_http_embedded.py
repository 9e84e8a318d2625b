"""``berth serve`` on the embedded defaults (SQLite, the SQLite queue, a local folder, the engine
worker in the server's process), driven by the unmodified openai client: a 200-line batch equal to
``berth generate`` of the same file, a running batch cancelled, the lines finished so far, and a
retry of the failed lines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from click.testing import CliRunner

from jobs.cli import main
from jobs.hosting.generate import generate_file
from tests.support.jobs_env import (
    choices_by_custom_id,
    kill_if_running,
    read_jsonl,
    request_line,
    tiny_env,
    tiny_settings,
    write_requests,
)
from tests.support.paths import ROOT
from tests.support.processes import free_port
from tests.support.serving import client, embedded_settings, key_for, serving, upload, wait_for

N = 200


def _jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_a_200_line_batch_equals_berth_generate(tmp_path, tiny_llama_dir, tiny_engine):
    requests = write_requests(tmp_path / "requests.jsonl", N)
    lines = requests.read_text().splitlines()
    lines[49] = "not json"  # two bad lines: the error file
    lines[119] = json.dumps({**request_line(119), "body": {**request_line(119)["body"], "model": "gpt-4o"}})
    requests.write_text("\n".join(lines) + "\n")
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    key = key_for(settings, "alice")
    with serving(settings, engine=tiny_engine) as server:
        assert server.run_worker  # no broker: the server runs the engine worker
        c = client(server, key)
        batch = c.batches.create(input_file_id=upload(c, requests).id, endpoint="/v1/chat/completions",
                                 completion_window="24h", metadata={"run": "e2e"})
        assert batch.status == "validating"
        batch = wait_for(c, batch.id)
        output = c.files.content(batch.output_file_id).text
        errors = c.files.content(batch.error_file_id).text
        assert {f.id for f in c.files.list()} >= {batch.input_file_id, batch.output_file_id, batch.error_file_id}
        assert c.files.retrieve(batch.output_file_id).purpose == "batch_output"
        used = c.get("/usage", cast_to=object)["data"]  # the caller's own tokens, per model
        other = client(server, key_for(settings, "bob")).get("/usage", cast_to=object)["data"]

    assert batch.status == "completed" and batch.metadata == {"run": "e2e"}
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (N, N - 2, 2)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    (tmp_path / "out.jsonl").write_text(output)
    generate_file(requests, tmp_path / "direct.jsonl", tiny_settings(tiny_llama_dir), progress=False)
    assert choices_by_custom_id(tmp_path / "out.jsonl") == choices_by_custom_id(tmp_path / "direct.jsonl")
    assert [line["custom_id"] for line in _jsonl(output)] == [
        line["custom_id"] for line in read_jsonl(tmp_path / "direct.jsonl")]
    assert [(e["error"]["line"], e["error"]["code"]) for e in _jsonl(errors)] == [
        (e["error"]["line"], e["error"]["code"]) for e in read_jsonl(tmp_path / "direct.errors.jsonl")]
    usage = [line["response"]["body"]["usage"] for line in _jsonl(output)]
    assert batch.usage.input_tokens == sum(u["prompt_tokens"] for u in usage)
    assert batch.usage.output_tokens == sum(u["completion_tokens"] for u in usage)
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
    assert [(u["tenant"], u["requests"], u["prompt_tokens"], u["completion_tokens"]) for u in used] == [
        ("alice", N - 2, batch.usage.input_tokens, batch.usage.output_tokens)]
    assert other == []  # bob sees none of alice's


def _long(i: int) -> dict:
    line = request_line(i)
    line["body"].update(max_tokens=1800, ignore_eos=True)
    return line


@pytest.mark.slow
def test_a_running_batch_cancelled_keeps_the_lines_finished_before(tmp_path, tiny_llama_dir, tiny_engine):
    """6 short lines finish at once, 4 long ones run for seconds: cancelled between the two, the batch
    goes cancelling then cancelled, its output holds the 6, its errors the 4 as batch_cancelled; the
    results extension shows the 6 while it runs; a retry runs the 4 again (and `berth retry` too)."""
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(_long(i) if i % 3 == 0 and i < 12 else request_line(i)) + "\n"
                                for i in range(10)))
    long_ids = {f"req-{i}" for i in (0, 3, 6, 9)}
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    key = key_for(settings, "alice")
    with serving(settings, engine=tiny_engine) as server:
        c = client(server, key)
        batch = c.batches.create(input_file_id=upload(c, requests).id, endpoint="/v1/chat/completions",
                                 completion_window="24h")
        deadline = time.monotonic() + 60
        while (batch := c.batches.retrieve(batch.id)).request_counts.completed < 6:
            assert batch.status in ("validating", "in_progress") and time.monotonic() < deadline, batch
            time.sleep(0.05)
        so_far = _jsonl(c.get(f"/batches/{batch.id}/results", cast_to=str))  # berth's extension
        assert {line["custom_id"] for line in so_far} == {f"req-{i}" for i in range(10)} - long_ids

        cancelled = c.batches.cancel(batch.id)
        assert cancelled.status == "cancelling" and cancelled.cancelling_at
        seen = ["cancelling"]
        batch = wait_for(c, batch.id, seen=seen)
        assert seen == ["cancelling", "cancelled"] and batch.cancelled_at
        assert (batch.request_counts.completed, batch.request_counts.failed) == (6, 4)
        output = _jsonl(c.files.content(batch.output_file_id).text)
        errors = _jsonl(c.files.content(batch.error_file_id).text)
        assert [line["custom_id"] for line in output] == [line["custom_id"] for line in so_far]
        assert {e["custom_id"] for e in errors} == long_ids
        assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}

        retried = c.post(f"/batches/{batch.id}/retry", cast_to=object)  # berth's extension
        assert retried["id"] != batch.id and retried["status"] == "validating"
        retried = wait_for(c, retried["id"], timeout=120)
        assert retried.status == "completed" and retried.request_counts.completed == 4
        redone = _jsonl(c.files.content(retried.output_file_id).text)
        assert {line["custom_id"] for line in redone} == long_ids
        assert all(line["response"]["body"]["usage"]["completion_tokens"] == 1800 for line in redone)

    shown = CliRunner().invoke(main, ["retry", retried.id, "--database-url", settings.database_url,
                                      "--storage-url", settings.storage_url])
    assert shown.exit_code != 0 and "no failed request" in shown.output
    again = CliRunner().invoke(main, ["retry", batch.id, "--json", "--database-url", settings.database_url,
                                      "--storage-url", settings.storage_url, "--model", str(tiny_llama_dir),
                                      "--model-name", "tiny-llama"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["request_counts"]["total"] == 4


def test_berth_serve_open_runs_a_worker_and_stops_on_sigterm(tmp_path, tiny_llama_dir):
    """The command itself, in a process of its own: --open says so loudly, answers any key as tenant
    'default', runs a batch with its own engine worker, and exits cleanly on SIGTERM."""
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    env = {**os.environ, **tiny_env(settings)}
    port = free_port()
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", "serve", "--open", "--port", str(port)], env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/openapi.json", timeout=5).close()
                break
            except OSError:
                time.sleep(0.3)
        c = client(type("S", (), {"url": f"http://127.0.0.1:{port}"}), "anything")
        batch = c.batches.create(input_file_id=upload(c, write_requests(tmp_path / "r.jsonl", 6)).id,
                                 endpoint="/v1/completions", completion_window="24h")
        assert wait_for(c, batch.id).status == "completed"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        kill_if_running(proc)
    text = log.read_text()
    assert "WARNING: --open" in text and "tenant 'default'" in text and "with an engine worker" in text


def test_the_readme_quick_start_talks_to_berth_serve(tmp_path, tiny_llama_dir, capsys, monkeypatch):
    """The Quick start's Python, as written, against a server of the tiny model under the default name."""

    from worker.config import DEFAULT_MODEL_NAME, Settings

    root = ROOT
    section = root.joinpath("README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    snippet = section.split("```python\n", 1)[1].split("\n```", 1)[0]
    settings = Settings(model=str(tiny_llama_dir), model_name=DEFAULT_MODEL_NAME, kv_memory="64MiB", threads=1,
                        database_url=f"sqlite:///{tmp_path / 'berth.db'}", storage_url=f"file://{tmp_path / 's'}")
    key = key_for(settings, "me")
    monkeypatch.chdir(root)
    with serving(settings) as server:
        exec(snippet.replace("http://127.0.0.1:8000", server.url).replace("berth-...", key), {})
    lines = _jsonl(capsys.readouterr().out)
    example = (root / "examples" / "requests.jsonl").read_text()
    expected = [json.loads(line)["custom_id"] for line in example.splitlines() if line.strip()]
    assert [line["custom_id"] for line in lines] == expected
