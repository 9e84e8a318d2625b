"""Where the repository is, for tests that read its files (docs, examples) or start its processes."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
