"""``berth serve``'s limits on what one request sends and one tenant keeps: the key is checked and a
body's size judged before a byte of it is read (the server's memory, measured in a process of its
own, does not move under a 200 MB body without a key, nor under 3,000 form fields of 64 KiB with
one); a body over its route's limit is a 413 in OpenAI's error body; a tenant's files are bounded
in bytes and number; and files expire, an upload's ``expires_after`` and a batch's
``output_expires_after`` honoured."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from starlette.testclient import TestClient

from jobs.records.db import open_database
from tests.support.jobs_env import kill_if_running, tiny_env, write_requests
from tests.support.processes import free_port
from tests.support.serving import client, embedded_settings, key_for, serving, upload, wait_for

MB = 1 << 20
HOUR = 3600


# ---- a raw HTTP/1.1 client: it sends a body only while the server has not answered yet

def _response(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    sock.settimeout(60)
    while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _length(data):
        try:
            more = sock.recv(65536)
        except ConnectionResetError:
            break
        if not more:
            break
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    assert head, "no answer"
    return int(head.split(b" ", 2)[1]), json.loads(body[:_length(data)] or b"null")


def _length(data: bytes) -> int:
    head = data.partition(b"\r\n\r\n")[0].lower()
    for line in head.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def raw_post(port: int, path: str, headers: dict, body, length: int | None = None,
             early: float = 5.0) -> tuple[int, dict, int]:
    """POST ``body`` (an iterable of byte strings) with ``Content-Length: length`` (None: chunked);
    (status, JSON body, bytes of the body sent before the answer came). The body is sent after
    ``early`` seconds without an answer: a request answered before its body is read answers then."""
    sock = socket.create_connection(("127.0.0.1", port))
    framing = {"Content-Length": str(length)} if length is not None else {"Transfer-Encoding": "chunked"}
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": f"127.0.0.1:{port}", **headers, **framing}.items())
    sock.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode())
    sent = 0
    try:
        readable, _, _ = select.select([sock], [], [], early)  # a server that answers before reading does it now
        if not readable:
            for chunk in body:
                if select.select([sock], [], [], 0)[0]:
                    break
                sock.sendall(chunk if length is not None else b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
            else:
                if length is None:
                    sock.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed: its answer is read below
    try:
        status, answer = _response(sock)
    finally:
        sock.close()
    return status, answer, sent


def _zeros(total: int, chunk: int = MB):
    piece = b"0" * chunk
    for start in range(0, total, chunk):
        yield piece[:min(chunk, total - start)]


def _form_of_fields(boundary: str, count: int, size: int) -> tuple[Iterator[bytes], int]:
    """A multipart body of ``count`` fields of ``size`` bytes (as parts, made lazily) and its length."""
    value = b"x" * size

    def part(i: int) -> bytes:
        return f"--{boundary}\r\nContent-Disposition: form-data; name=\"field{i}\"\r\n\r\n".encode() + value + b"\r\n"

    end = f"--{boundary}--\r\n".encode()
    length = sum(len(part(i)) for i in range(count)) + len(end)
    return (b"".join(part(j) for j in range(i, min(i + 16, count))) if i < count else end
            for i in range(0, count + 16, 16)), length


# ---- the server in a process of its own, for its memory

SERVE = """
import sys
from jobs.http.server import Server
from worker.config import Settings
Server(Settings(), port=int(sys.argv[1]), worker=False, log_level="warning").serve_forever()
"""


def _memory_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmHWM", "VmRSS"):
            fields[name] = int(value.split()[0])
    return fields


@pytest.fixture
def server_process(tmp_path, tiny_llama_dir):
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    key = key_for(settings, "alice")
    port = free_port()
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(port)], env={**os.environ, **tiny_env(settings)},
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/openapi.json", timeout=5).close()
                break
            except OSError:
                time.sleep(0.3)
        yield proc, port, key
    finally:
        kill_if_running(proc)


def test_bodies_without_a_key_or_over_the_limit_are_refused_before_the_server_reads_them(server_process):
    """The finding: an unauthenticated 200 MB POST /v1/batches raised the server's peak memory by
    600 MB before its 401. Now the 401 comes before the body is read, chunked or not, and neither it,
    nor an authenticated body over the limit, nor an upload of 3,000 fields of 64 KiB (refused at
    field 17, the rest dropped as it streams in) moves the server's peak memory by more than 8 MB."""
    proc, port, key = server_process
    json_headers = {"Content-Type": "application/json"}
    for _ in range(3):  # every code path of the requests below runs once before the measure
        assert raw_post(port, "/v1/batches", json_headers, [b"{}"], 2)[0] == 401
        assert raw_post(port, "/v1/batches", {**json_headers, "Authorization": f"Bearer {key}"}, [b"{}"], 2,
                        early=0)[0] == 400
        body, length = _form_of_fields("b0undary", 40, 1024)
        assert raw_post(port, "/v1/files", {"Content-Type": "multipart/form-data; boundary=b0undary",
                                            "Authorization": f"Bearer {key}"}, body, length, early=0)[0] == 400
    before = _memory_kib(proc.pid)

    big = raw_post(port, "/v1/batches", json_headers, _json_string(200 * MB), 200 * MB)
    chunked = raw_post(port, "/v1/batches", {**json_headers, "Authorization": "Bearer berth-wrong"},
                       _json_string(50 * MB), None)
    over = raw_post(port, "/v1/batches", {**json_headers, "Authorization": f"Bearer {key}"}, _json_string(200 * MB),
                    200 * MB)
    body, length = _form_of_fields("b0undary", 3000, 64 << 10)
    fields = raw_post(port, "/v1/files", {"Content-Type": "multipart/form-data; boundary=b0undary",
                                          "Authorization": f"Bearer {key}"}, body, length, early=0)
    after = _memory_kib(proc.pid)

    grown = (after["VmHWM"] - before["VmHWM"]) / 1024
    print(f"server peak memory {before['VmHWM'] / 1024:.1f} -> {after['VmHWM'] / 1024:.1f} MB")
    assert grown < 8, f"the server's peak memory grew by {grown:.1f} MB: {before} -> {after}"
    for (status, answer, _), expected in ((big, (401, "invalid_api_key")), (chunked, (401, "invalid_api_key")),
                                          (over, (413, "request_too_large")), (fields, (400, "too_many_fields"))):
        assert (status, answer["error"]["code"]) == expected, answer
    assert big[2] < 200 * MB  # answered before the body was all sent


def _json_string(total: int):
    """A JSON body of ``total`` bytes: one long string."""
    yield b'{"input_file_id": "'
    yield from _zeros(total - 21)
    yield b'"}'


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("http-limits")
    settings = embedded_settings(tiny_llama_dir, tmp)
    with serving(settings, worker=False) as server:
        yield server, tmp


def _error(status: int, answer: dict, code: str) -> None:
    assert status == 413 and set(answer["error"]) == {"message", "type", "param", "code"}, answer
    assert answer["error"]["code"] == code and answer["error"]["type"] == "invalid_request_error", answer


def test_a_json_body_over_the_default_limit_is_a_413_in_openais_body(served):
    server, _ = served
    key = key_for(server.settings, "bob")
    auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    big = json.dumps({"input_file_id": "file-0", "endpoint": "/v1/completions", "completion_window": "24h",
                      "metadata": {"pad": "x" * (2 * MB)}}).encode()
    status, answer, _ = raw_post(server.port, "/v1/batches", auth, [big], len(big))  # said by its Content-Length
    _error(status, answer, "request_too_large")
    assert "1,048,576 bytes" in answer["error"]["message"] and "BERTH_HTTP_MAX_BODY_BYTES" in answer["error"]["message"]
    status, answer, _ = raw_post(server.port, "/v1/batches/batch_000000000000000000000000/cancel", auth, [big],
                                 len(big))
    _error(status, answer, "request_too_large")

    with TestClient(server.app) as c:  # sent in chunks, no length: counted as it is read
        answer = c.post("/v1/batches", headers=auth,
                        content=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]))
    _error(answer.status_code, answer.json(), "request_too_large")


def test_the_body_limit_is_a_setting(tmp_path, tiny_llama_dir):
    settings = embedded_settings(tiny_llama_dir, tmp_path, http_max_body_bytes="1KiB")
    key = key_for(settings, "bob")
    with serving(settings, worker=False) as server:
        c = client(server, key)
        file_id = upload(c, write_requests(tmp_path / "r.jsonl", 2)).id
        assert c.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
        with pytest.raises(openai.APIStatusError) as caught:
            c.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h",
                             metadata={f"k{i}": "v" * 100 for i in range(12)})
    assert caught.value.status_code == 413 and caught.value.code == "request_too_large"


def test_an_upload_of_too_many_form_fields_is_refused(served):
    """Form fields besides the file are few (16 by default; OpenAI's upload sends 3): a form of more is a
    400 naming the limit; a field of over 64 KiB is too."""
    server, tmp = served
    key = key_for(server.settings, "carol")
    headers = {"Content-Type": "multipart/form-data; boundary=b0undary", "Authorization": f"Bearer {key}"}
    body, length = _form_of_fields("b0undary", 3000, 16)
    status, answer, _ = raw_post(server.port, "/v1/files", headers, body, length, early=0)
    assert status == 400 and answer["error"]["code"] == "too_many_fields" and "16" in answer["error"]["message"]
    body, length = _form_of_fields("b0undary", 1, 65 << 10)
    status, answer, _ = raw_post(server.port, "/v1/files", headers, body, length, early=0)
    assert status == 400 and answer["error"]["code"] == "field_too_long", answer
    c = client(server, key)  # the openai client's upload, with expires_after: 4 parts, well within
    assert upload(c, write_requests(tmp / "ok.jsonl", 2), expires_after={"anchor": "created_at", "seconds": HOUR})


def _stored(settings) -> list[str]:
    root = Path(settings.storage_url.removeprefix("file://")) / "files"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_a_tenants_files_are_bounded_in_number_and_bytes(tmp_path, tiny_llama_dir):
    requests = write_requests(tmp_path / "r.jsonl", 2)
    size = requests.stat().st_size
    settings = embedded_settings(tiny_llama_dir, tmp_path, tenant_max_files=3, tenant_max_storage_bytes=3 * size + 10)
    with serving(settings, worker=False) as server:
        alice, bob = client(server, key_for(settings, "alice")), client(server, key_for(settings, "bob"))
        made = [upload(alice, requests) for _ in range(3)]
        with pytest.raises(openai.APIStatusError) as caught:
            upload(alice, requests)
        assert caught.value.status_code == 413 and caught.value.code == "too_many_files"
        assert "BERTH_TENANT_MAX_FILES" in caught.value.message
        assert len(_stored(settings)) == 3  # the refused upload left nothing behind
        assert upload(bob, requests)  # another tenant's quota is its own

        alice.files.delete(made[0].id)  # room for one more file, which the bytes allow
        assert upload(alice, write_requests(tmp_path / "small.jsonl", 1)).bytes < size
        alice.files.delete(made[1].id)
        with pytest.raises(openai.APIStatusError) as caught:  # room for a file, not for these bytes
            upload(alice, write_requests(tmp_path / "big.jsonl", 4))
        assert caught.value.status_code == 413 and caught.value.code == "storage_quota_exceeded"
        assert f"of {3 * size + 10:,} bytes" in caught.value.message
        assert len(alice.files.list().data) == 2


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_uploads_at_once_cannot_share_the_last_room(backend, tmp_path, tiny_llama_dir, request):
    """Room for one more file and eight uploads at once: the check runs with the tenant's row held, so
    exactly one gets in, whatever the order."""
    from concurrent.futures import ThreadPoolExecutor

    requests = write_requests(tmp_path / "r.jsonl", 2)
    settings = embedded_settings(tiny_llama_dir, tmp_path, tenant_max_files=2)
    if backend == "postgresql":
        settings.database_url = request.getfixturevalue("pg_url")
    with serving(settings, worker=False) as server:
        c = client(server, key_for(settings, "alice"))
        upload(c, requests)

        def attempt(_) -> str:
            try:
                return upload(c, requests).id
            except openai.APIStatusError as exc:
                return exc.code

        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(attempt, range(8)))
        assert sorted(o.startswith("file-") for o in outcomes) == [False] * 7 + [True], outcomes
        assert outcomes.count("too_many_files") == 7
        assert len(c.files.list().data) == 2 and len(_stored(settings)) == 2


def test_an_upload_expires_after_its_expires_after(served):
    from jobs.records.file_removal import expire_files
    from storage import open_store

    server, tmp = served
    c = client(server, key_for(server.settings, "dave"))
    requests = write_requests(tmp / "expiring.jsonl", 2)
    kept = upload(c, requests)
    f = upload(c, requests, expires_after={"anchor": "created_at", "seconds": 2 * HOUR})
    assert f.expires_at == f.created_at + 2 * HOUR and kept.expires_at is None
    assert c.files.retrieve(f.id).expires_at == f.expires_at
    for wrong in ({"anchor": "created_at", "seconds": 60}, {"anchor": "last_active_at", "seconds": HOUR}):
        with pytest.raises(openai.BadRequestError) as caught:
            upload(c, requests, expires_after=wrong)
        assert caught.value.param == "expires_after"

    db, store = open_database(server.settings.database_url), open_store(server.settings.storage_url)
    expire_files(db, store, at=f.created_at + 2 * HOUR - 2)  # (other tests' files of an hour go)
    assert c.files.retrieve(f.id) and f"files/{f.id}" in [o.key for o in store.list("files/")]
    assert expire_files(db, store, at=f.created_at + 2 * HOUR + 1) >= 1
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        c.files.content(f.id)
    assert [x.id for x in c.files.list()] == [kept.id]
    assert f"files/{f.id}" not in [o.key for o in store.list("files/")]


def test_a_batchs_output_files_expire_after_its_output_expires_after(tmp_path, tiny_llama_dir, tiny_engine):
    """The finding: output_expires_after was accepted and ignored. Now the batch's output and errors
    files say when they expire (counted from the batch's end) and are deleted then: a 404 as OpenAI
    shows an expired file, gone from the store, shown as gone on the dashboard; the outputs of a
    batch nobody looked at go at the same time."""
    from jobs.records.file_removal import expire_files
    from jobs.records.status import get_job
    from storage import open_store

    lines = write_requests(tmp_path / "r.jsonl", 3).read_text().splitlines()
    lines[1] = "not json"  # an errors file too
    (tmp_path / "r.jsonl").write_text("\n".join(lines) + "\n")
    settings = embedded_settings(tiny_llama_dir, tmp_path)
    key = key_for(settings, "erin")
    with serving(settings, engine=tiny_engine) as server:
        c = client(server, key)
        file_id = upload(c, tmp_path / "r.jsonl").id
        policy = {"anchor": "created_at", "seconds": HOUR}
        batch = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                 output_expires_after=policy)
        unseen = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                                  output_expires_after=policy).id
        kept = c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        batch = wait_for(c, batch.id)
        kept = wait_for(c, kept.id)
        db = open_database(settings.database_url)
        deadline = time.monotonic() + 120
        while not get_job(db, unseen).status.is_final:  # through the database: the API never shows its files
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert batch.status == "completed" and batch.output_file_id and batch.error_file_id
        output, errors = c.files.retrieve(batch.output_file_id), c.files.retrieve(batch.error_file_id)
        assert output.expires_at == errors.expires_at == batch.completed_at + HOUR
        assert c.files.retrieve(kept.output_file_id).expires_at is None
        store = open_store(settings.storage_url)
        unseen_keys = [get_job(db, unseen).output_key, get_job(db, unseen).errors_key]
        assert all(k and store.exists(k) for k in unseen_keys)

        assert expire_files(db, store, at=batch.completed_at + HOUR - 5) == 0
        # their outputs and errors files, and (issue 34) their copies of their input, which expire with them
        assert expire_files(db, store, at=time.time() + HOUR + 5) == 6
        assert [store.exists(f"jobs/{b}/input.jsonl") for b in (batch.id, unseen, kept.id)] == [False, False, True]
        for file_id in (batch.output_file_id, batch.error_file_id):
            with pytest.raises(openai.NotFoundError):
                c.files.retrieve(file_id)
            with pytest.raises(openai.NotFoundError):
                c.files.content(file_id)
        assert c.batches.retrieve(batch.id).output_file_id == batch.output_file_id  # as OpenAI: the id stays
        with pytest.raises(openai.NotFoundError, match="expired or was deleted"):  # berth's results extension
            c.get(f"/batches/{batch.id}/results", cast_to=str)
        assert not any(store.exists(k) for k in unseen_keys)
        assert get_job(db, unseen).output_key is None
        assert c.files.content(kept.output_file_id).content  # a batch without the policy keeps its files
        with urllib.request.urlopen(urllib.request.Request(f"{server.url}/dashboard/jobs/{batch.id}",
                                                           headers={"Authorization": f"Bearer {key}"})) as r:
            page = r.read().decode()
        assert "output file" in page and "gone: it expired or was deleted" in page
