"""``berth run`` on the embedded defaults: SQLite, the SQLite queue and a local folder in the
current directory, no server; the same job as the end-to-end test, and the example file."""

from __future__ import annotations

import json

from click.testing import CliRunner

from jobs.cli import EXIT_LINES_FAILED, main
from jobs.hosting.generate import generate_file
from tests.support.jobs_env import (
    TINY_NAME,
    choices_by_custom_id,
    read_jsonl,
    tiny_settings,
    write_requests,
)
from tests.support.paths import ROOT

EXAMPLES = ROOT / "examples" / "requests.jsonl"
TINY_FLAGS = ["--model-name", TINY_NAME, "--kv-memory", "64MiB", "--threads", "1", "--quiet"]


def _run(tiny_llama_dir, *args) -> None:
    result = CliRunner().invoke(main, ["run", *args, "--model", str(tiny_llama_dir), *TINY_FLAGS])
    assert result.exit_code == 0, result.output + repr(result.exception)


def test_berth_run_on_embedded_defaults(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.chdir(tmp_path)
    write_requests(tmp_path / "requests.jsonl", 200)
    _run(tiny_llama_dir, "requests.jsonl", "-o", "out.jsonl")
    assert {p.name for p in tmp_path.iterdir()} >= {"berth.db", "berth-queue.db", "berth-store", "out.jsonl"}
    assert not (tmp_path / "out.errors.jsonl").exists()
    lines = read_jsonl(tmp_path / "out.jsonl")
    assert [line["custom_id"] for line in lines] == [f"req-{i}" for i in range(200)]
    generate_file("requests.jsonl", "direct.jsonl", tiny_settings(tiny_llama_dir), progress=False)
    assert choices_by_custom_id("out.jsonl") == choices_by_custom_id("direct.jsonl")

    listed = CliRunner().invoke(main, ["list", "--json"])
    [job] = json.loads(listed.output)
    assert job["status"] == "completed" and job["request_counts"] == {"total": 200, "completed": 200, "failed": 0}
    shown = CliRunner().invoke(main, ["status", job["id"]])
    assert "200/200 done" in shown.output


def test_berth_run_on_the_example_file(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["run", str(EXAMPLES), "-o", "out.jsonl", "--model", str(tiny_llama_dir),
                                       "--model-name", "SmolLM2-135M-Instruct", *TINY_FLAGS[2:]])
    assert result.exit_code == 0, result.output
    expected = [json.loads(line)["custom_id"] for line in EXAMPLES.read_text().splitlines() if line.strip()]
    assert [line["custom_id"] for line in read_jsonl("out.jsonl")] == expected


def test_berth_run_exits_3_when_every_line_failed(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "table.csv").write_text("custom_id,prompt\na,hello\n")
    result = CliRunner().invoke(main, ["run", "table.csv", "-o", "out.jsonl", "--model", str(tiny_llama_dir),
                                       *TINY_FLAGS])
    assert result.exit_code == EXIT_LINES_FAILED, result.output
    assert "0 completed, 2 failed of 2" in result.output
