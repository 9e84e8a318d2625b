"""ruff, configured in pyproject.toml, finds nothing in the repository: CI runs it through this test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")


def test_ruff_check_is_clean():
    result = subprocess.run([str(RUFF), "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_names_a_broken_rule(tmp_path):
    """The configuration is the one read: an unused import and a stale noqa marker in a copy of a module fail."""
    bad = tmp_path / "worker" / "bad.py"
    bad.parent.mkdir()
    bad.write_text("import os\nx = 1  # noqa: E501\n")
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    result = subprocess.run([str(RUFF), "check", "--no-cache", "--output-format", "concise", "."], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "F401" in result.stdout and "RUF100" in result.stdout, result.stdout
