"""Where a job's files live: its input, output and errors under ``jobs/<job id>/`` of the store
named by ``Settings.storage_url`` (a local folder or S3). Keys are made here from job ids berth
generates, never from user text. Writes are atomic: a file appears whole or not at all.
"""

from __future__ import annotations

import shutil
from contextlib import AbstractContextManager
from pathlib import Path
from typing import BinaryIO

from storage import open_store


def input_key(job_id: str) -> str:
    return f"jobs/{job_id}/input.jsonl"


def output_key(job_id: str) -> str:
    return f"jobs/{job_id}/output.jsonl"


def errors_key(job_id: str) -> str:
    return f"jobs/{job_id}/errors.jsonl"


class JobFiles:
    def __init__(self, storage_url: str):
        self.store = open_store(storage_url)

    def put_file(self, key: str, source: str | Path) -> None:
        with self.writer(key) as out, open(source, "rb") as src:
            shutil.copyfileobj(src, out, 1 << 20)

    def get_file(self, key: str, target: str | Path) -> None:
        with self.open(key) as src, open(target, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)

    def open(self, key: str) -> BinaryIO:
        return self.store.open(key)

    def writer(self, key: str) -> AbstractContextManager[BinaryIO]:
        return self.store.writer(key)
