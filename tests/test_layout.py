"""The folders' import rules (pyproject.toml's import-linter contracts, docs/layout.md) hold, and
each one fails `lint-imports` with the offending import chain named when a change breaks it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("worker", "jobs", "kernels", "storage", "migrations")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}  # the copy's packages, not the installed checkout's
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_layout_contracts_hold():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 kept, 0 broken" in result.stdout


# (file, import added to it, the contract it breaks, the chain lint-imports must name)
BREAKS = [
    ("kernels/reference.py", "from worker.config import cache_dir", "kernels and storage are leaves",
     "kernels.reference -> worker.config"),
    ("worker/engine/scheduler.py", "from jobs.records.models import Job", "worker imports nothing of jobs",
     "worker.engine.scheduler -> jobs.records.models"),
    ("worker/engine/scheduler.py", "from worker.consumer.loop import EngineWorker", "worker's wings in layers",
     "worker.engine.scheduler -> worker.consumer.loop"),
    ("worker/model/tokenizer.py", "from worker.engine.structured.grammar import compiler_for",
     "worker's wings in layers", "worker.model.tokenizer -> worker.engine.structured.grammar"),
    ("jobs/http/app.py", "from jobs.queue_door.events import EventRelay", "jobs: the CLI over three independent doors",
     "jobs.http.app -> jobs.queue_door.events"),
    ("jobs/pipeline/celery_tasks.py", "from jobs.queue_door.events import EventRelay",
     "jobs: the CLI over three independent doors", "jobs.pipeline.celery_tasks -> jobs.queue_door.events"),
    ("jobs/lines/validate.py", "from jobs.records.models import RequestRow",
     "jobs: the CLI over three independent doors", "jobs.lines.validate -> jobs.records.models"),
    ("jobs/pipeline/retry.py", "from jobs.hosting.engine_worker import engine_worker",
     "jobs: the CLI over three independent doors", "jobs.pipeline.retry -> jobs.hosting.engine_worker"),
    ("worker/messaging/topology.py", "from worker.consumer.loop import EngineWorker", "worker's wings in layers",
     "worker.messaging.topology -> worker.consumer.loop"),
    ("jobs/records/job_errors.py", "from jobs.records.status import JobView", "no import circle",
     "No cycles are allowed in jobs.records.\nIt could be made acyclic by removing 1 dependency:\n\n"
     "- .status -> .job_errors"),
]


@pytest.mark.parametrize("path,line,contract,chain", BREAKS, ids=[b[0] + ":" + b[1].split()[1] for b in BREAKS])
def test_a_forbidden_import_fails_lint_imports_with_its_chain(tmp_path, path, line, contract, chain):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    target = tmp_path / path
    target.write_text(target.read_text() + f"\n{line}  # noqa: E402\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    broken = result.stdout.partition("Broken contracts")[2]
    assert contract in broken, result.stdout
    if "->" in chain and "cycles" not in chain:
        chain += " (l."  # the chain with its line number
    assert chain in broken, result.stdout


def test_no_installed_distribution_but_berth_ships_our_top_level_packages():
    """berth's folders are top-level packages (`kernels`, `worker`, ...). Installed beside a distribution that
    ships one of those names, one shadows the other: transformers 5.25 began to require Hugging Face's `kernels`,
    and `import transformers` then imported berth's kernels/ and failed. pyproject.toml caps transformers below
    it; this names the culprit if any dependency pulls such a distribution in again."""
    from importlib.metadata import distributions

    clashes = []
    for dist in distributions():
        name = dist.metadata["Name"]
        if name is None or name.lower() == "berth":
            continue
        top = {(f.parts[0].removesuffix(".py")) for f in (dist.files or ()) if f.parts
               and not f.parts[0].endswith((".dist-info", ".data", ".pth"))}
        for package in PACKAGES:
            if package in top:
                clashes.append(f"{name} {dist.version} installs a top-level `{package}`")
    assert not clashes, ("; ".join(clashes) + ": it shadows berth's folder of that name (or is shadowed by it). "
                         "Cap the dependency that requires it in pyproject.toml")


def test_tests_share_code_through_support_and_conftest_only():
    """A test module imports nothing of another test module (helpers live in tests/support/, fixtures in
    conftest.py), and no private name of a support module."""
    import ast

    offences = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests."):
                last = node.module.rsplit(".", 1)[-1]
                private = [a.name for a in node.names if a.name.startswith("_")]
                if last.startswith("test_") or last == "conftest" or private:
                    offences.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import "
                                    + ", ".join(a.name for a in node.names))
    assert not offences, "\n".join(offences)
