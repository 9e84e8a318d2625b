"""Where a job's files live: its input, output and errors under ``jobs/<job id>/`` of the store
named by ``Settings.storage_url``. Keys are made here from job ids berth generates, never from
user text. Writes are atomic (a temporary file renamed into place).

Only the local-folder store (``file://PATH``) is served here; S3 comes with ``storage/``.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

from worker.config import ConfigError


def input_key(job_id: str) -> str:
    return f"jobs/{job_id}/input.jsonl"


def output_key(job_id: str) -> str:
    return f"jobs/{job_id}/output.jsonl"


def errors_key(job_id: str) -> str:
    return f"jobs/{job_id}/errors.jsonl"


class JobFiles:
    def __init__(self, storage_url: str):
        if not storage_url.startswith("file://"):
            raise ConfigError(f"storage_url {storage_url!r}: job files need a local folder for now; set "
                              "BERTH_STORAGE_URL=file:///path/shared/by/every/worker")
        self.root = Path(storage_url.removeprefix("file://")).resolve()

    def path(self, key: str) -> Path:
        return self.root / key

    def put_file(self, key: str, source: str | Path) -> None:
        with self.writer(key) as out, open(source, "rb") as src:
            shutil.copyfileobj(src, out, 1 << 20)

    def open(self, key: str) -> BinaryIO:
        return open(self.path(key), "rb")

    @contextmanager
    def writer(self, key: str) -> Iterator[BinaryIO]:
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                yield f
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
