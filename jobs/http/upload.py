"""Reading a ``multipart/form-data`` upload as it streams in, within a size limit.

The file part goes to a temporary file (hashed on the way, for ``Idempotency-Key``), never to memory;
the other fields are few (``http_max_form_fields``) and small (``MAX_FIELD_BYTES``), and
python-multipart bounds each part's headers (8 of at most 4 KiB): what one upload holds in memory is
bounded. A file over the limit stops being written at the limit, and a form refused half-way (too
many fields, one too long) stops being parsed; the rest of the body is read and dropped, so the
client, which sends its whole body before it reads the answer, gets the 413 or 400 rather than a
broken connection. A body far beyond the limit (``DRAIN_BYTES`` more) is cut off there, and one that
says so in its Content-Length is refused before it is read (``jobs.http.guard``, ``body_limit``).
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass, field
from typing import BinaryIO

from fastapi import Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from jobs.http.errors import ApiError

MAX_FIELD_BYTES = 64 << 10
DRAIN_BYTES = 64 << 20


@dataclass
class Upload:
    fields: dict[str, str] = field(default_factory=dict)
    file: BinaryIO | None = None  # at its start once read
    filename: str | None = None
    size: int = 0
    sha256: str = ""

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def body_limit(max_file_bytes: int) -> int:
    """The most of an upload's body that is read: the largest file, and the slack a 413 is drained with."""
    return max_file_bytes + DRAIN_BYTES


class _Parts:
    """python-multipart's callbacks: headers of each part, then its data to a field or the file. Once
    ``refused`` is set, every callback does nothing: the rest of the body is dropped."""

    def __init__(self, upload: Upload, limit: int, max_fields: int):
        self.upload, self.limit, self.max_fields = upload, limit, max_fields
        self.refused: ApiError | None = None
        self._fields = 0
        self._hash = hashlib.sha256()
        self._header_field = self._header_value = b""
        self._headers: dict[bytes, bytes] = {}
        self._name: str | None = None
        self._to_file = False
        self._value = bytearray()

    def callbacks(self) -> dict:
        return {"on_part_begin": self._begin, "on_header_field": self._field, "on_header_value": self._hvalue,
                "on_header_end": self._header_end, "on_headers_finished": self._headers_done,
                "on_part_data": self._data, "on_part_end": self._end}

    def _begin(self) -> None:
        self._headers, self._name, self._to_file, self._value = {}, None, False, bytearray()
        self._header_field = self._header_value = b""

    def _field(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def _hvalue(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._header_field.lower()] = self._header_value
        self._header_field = self._header_value = b""

    def _headers_done(self) -> None:
        if self.refused:
            return
        _, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = params.get(b"name", b"").decode("utf-8", "replace")
        if self._name == "file" and self.upload.file is None:
            self._to_file = True
            self.upload.file = tempfile.TemporaryFile()
            self.upload.filename = params.get(b"filename", b"").decode("utf-8", "replace") or None
            return
        self._fields += 1
        if self._fields > self.max_fields:
            self.refused = ApiError(400, f"the form has over {self.max_fields} fields besides the file: send 'file', "
                                    "'purpose' and, if you like, 'expires_after'", None, "too_many_fields")

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self.refused:
            return
        chunk = data[start:end]
        if self._to_file:
            self.upload.size += len(chunk)
            if self.upload.size > self.limit:
                self.refused = ApiError(413, f"the file is over the limit of {self.limit:,} bytes: split it into "
                                        "smaller files, or raise the limit with BERTH_MAX_FILE_BYTES", "file",
                                        "file_too_large")
                return
            self.upload.file.write(chunk)
            self._hash.update(chunk)
        elif self._name is not None:
            if len(self._value) + len(chunk) > MAX_FIELD_BYTES:
                self.refused = ApiError(400, f"form field {self._name[:64]!r} is over {MAX_FIELD_BYTES} bytes",
                                        self._name[:64], "field_too_long")
                return
            self._value += chunk

    def _end(self) -> None:
        if self.refused:
            return
        if self._to_file:
            self._to_file = False
        elif self._name and self._name != "file":
            self.upload.fields.setdefault(self._name, self._value.decode("utf-8", "replace"))

    def finish(self) -> None:
        self.upload.sha256 = self._hash.hexdigest()
        if self.upload.file is not None:
            self.upload.file.seek(0)


async def read_upload(request: Request, limit: int, max_fields: int) -> Upload:
    """The form of an upload; ``ApiError`` 400 for a body that is not multipart or a form of over
    ``max_fields`` fields besides the file, 413 for a file over ``limit``."""
    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data" or not params.get(b"boundary"):
        raise ApiError(400, "send the file as multipart/form-data with fields 'file' and 'purpose'", "file")
    upload = Upload()
    parts = _Parts(upload, limit, max_fields)
    parser = MultipartParser(params[b"boundary"], parts.callbacks())
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if parts.refused:
                if received > limit + DRAIN_BYTES:
                    break
                continue
            parser.write(chunk)
        if not parts.refused:
            parser.finalize()
    except MultipartParseError as exc:
        upload.close()
        raise ApiError(400, f"the multipart body is malformed ({exc}): send the file as multipart/form-data",
                       "file") from None
    except BaseException:
        upload.close()
        raise
    if parts.refused:
        upload.close()
        raise parts.refused
    parts.finish()
    return upload
