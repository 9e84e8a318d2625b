"""A producer and an event consumer that are not berth's code: pika, publishing raw JSON bytes with
AMQP properties, as any client of RabbitMQ would (docs/queue.md)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid

import pika
import pytest
from sqlalchemy import select

from jobs.queue_door.consumer import QueueDoor
from jobs.queue_door.permissions import rabbitmqctl_commands
from jobs.records.db import open_database
from jobs.records.models import Job
from tests.support.jobs_env import TINY_NAME, tiny_settings

PIKA_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"


def door_settings(tmp_path, model_dir, pg_url, prefix, **overrides):
    from tests.support.jobs_env import AMQP_URL

    (tmp_path / "inbox").mkdir(exist_ok=True)
    overrides.setdefault("submit_input_stores", f"file://{tmp_path / 'inbox'}/{{tenant}}")  # inbox/<tenant>/...
    return tiny_settings(model_dir, database_url=pg_url, broker_url=AMQP_URL, queue_prefix=prefix,
                         storage_url=f"file://{tmp_path / 'store'}", max_num_seqs=16, **overrides)


def start_door(settings) -> QueueDoor:
    """The submit consumer (ingesting in its thread), relay and webhook sender; returns once the
    jobs queue is there to publish to."""
    door = QueueDoor(settings, eager_ingest=True).start()
    deadline = time.monotonic() + 30
    while jobs_queue_depth(settings.queue_prefix) is None:
        assert time.monotonic() < deadline, "the submit consumer did not declare its queue"
        time.sleep(0.2)
    return door


def jobs_queue_depth(prefix: str) -> int | None:
    """Messages ready in ``<prefix>.jobs`` (None: no such queue)."""
    conn = pika.BlockingConnection(pika.URLParameters(PIKA_URL))
    try:
        return conn.channel().queue_declare(f"{prefix}.jobs", passive=True).method.message_count
    except pika.exceptions.ChannelClosedByBroker:
        return None
    finally:
        if conn.is_open:
            conn.close()


def publish(prefix: str, body: bytes, message_id: str | None, user_id: str | None = "guest",
            content_type: str | None = "application/json", url: str = PIKA_URL, **properties) -> None:
    """One persistent message to ``<prefix>.jobs`` through ``<prefix>.submit``, confirmed (``url``:
    connected as another user; ``properties``: more AMQP properties)."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = conn.channel()
        channel.confirm_delivery()
        channel.basic_publish(f"{prefix}.submit", f"{prefix}.jobs", body, pika.BasicProperties(
            message_id=message_id, user_id=user_id, content_type=content_type, delivery_mode=2, **properties),
            mandatory=True)
    finally:
        if conn.is_open:
            conn.close()


def publish_all(prefix: str, messages: list[tuple[bytes, str]], user_id: str = "guest") -> None:
    """Many messages (body, message_id) on one connection, as a busy producer sends them, confirmed."""
    conn = pika.BlockingConnection(pika.URLParameters(PIKA_URL))
    try:
        channel = conn.channel()
        channel.confirm_delivery()
        for body, message_id in messages:
            channel.basic_publish("", f"{prefix}.jobs", body, pika.BasicProperties(
                message_id=message_id, user_id=user_id, content_type="application/json", delivery_mode=2),
                mandatory=True)
    finally:
        if conn.is_open:
            conn.close()


def submit_body(**fields) -> bytes:
    return json.dumps({"version": 1, "model": TINY_NAME, **fields}).encode()


class EventTap:
    """A queue of its own bound to ``<prefix>.events`` (``#``): every event from now on."""

    def __init__(self, prefix: str, binding: str = "#"):
        self.conn = pika.BlockingConnection(pika.URLParameters(PIKA_URL))
        self.channel = self.conn.channel()
        self.channel.exchange_declare(f"{prefix}.events", "topic", durable=True)
        self.queue = self.channel.queue_declare("", exclusive=True).method.queue
        self.channel.queue_bind(self.queue, f"{prefix}.events", binding)
        self.events: list[tuple[str, dict, dict, object]] = []  # routing key, body, headers, properties

    def poll(self) -> None:
        while True:
            method, properties, body = self.channel.basic_get(self.queue, auto_ack=True)
            if method is None:
                return
            self.events.append((method.routing_key, json.loads(body), properties.headers or {}, properties))

    def wait_for(self, predicate, timeout: float = 30.0) -> list[dict]:
        """Events so far, once one of them satisfies ``predicate(routing_key, body)``."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if any(predicate(key, body) for key, body, _, _ in self.events):
                return [body for _, body, _, _ in self.events]
            assert time.monotonic() < deadline, f"no such event in {timeout}s; got {[k for k, *_ in self.events]}"
            time.sleep(0.2)

    def of_job(self, job_id: str) -> list[tuple[str, dict, dict, object]]:
        self.poll()
        return [e for e in self.events if e[1].get("job_id") == job_id]

    def close(self) -> None:
        if self.conn.is_open:
            self.conn.close()


def dead_letters(prefix: str) -> list[tuple[bytes, dict]]:
    """Everything in ``<prefix>.dead``: (body, headers), taken off the queue."""
    conn = pika.BlockingConnection(pika.URLParameters(PIKA_URL))
    out = []
    try:
        channel = conn.channel()
        while True:
            method, properties, body = channel.basic_get(f"{prefix}.dead", auto_ack=True)
            if method is None:
                return out
            out.append((body, properties.headers or {}))
    finally:
        conn.close()


class WebhookReceiver:
    """A webhook receiver on loopback that answers 204 at once and keeps what it got:
    (headers, body, time it came), in order."""

    def __init__(self, port: int = 0):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        got = self.got = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                got.append((dict(self.headers), body, time.time()))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def bodies(self) -> list[dict]:
        return [json.loads(body) for _, body, _ in list(self.got)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class TricklingReceiver:
    """A receiver that reads the POST and answers ``200 OK``, one byte every ``gap`` seconds: slow,
    or hostile (a socket timeout never trips on it). ``connections`` counts the POSTs it got."""

    ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"

    def __init__(self, gap: float):
        import socket
        import threading

        self.gap, self.connections, self.closed = gap, 0, threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn) -> None:
        try:
            conn.settimeout(30)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            for byte in self.ANSWER:
                if self.closed.wait(self.gap):
                    return
                conn.sendall(bytes([byte]))
        except OSError:  # the sender gave up on it
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.closed.set()
        self.sock.close()


def rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, timeout=120)


@pytest.fixture
def broker_users(queue_prefix):
    """``make(tenant)``: a RabbitMQ user of a unique name with the documented permissions of a
    tenant's user (``jobs.queue_door.permissions``, applied as printed); its pika URL. Deleted at the end."""
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not installed")
    made = []

    def make(tenant: str) -> tuple[str, str]:
        user, password = f"berth-test-{uuid.uuid4().hex[:12]}", uuid.uuid4().hex
        rabbitmqctl("add_user", user, password)
        made.append(user)
        for command in rabbitmqctl_commands(user, tenant, queue_prefix, "/"):
            subprocess.run(command, check=True, capture_output=True, timeout=120)
        return user, f"amqp://{user}:{password}@127.0.0.1:5672/%2F"

    yield make
    for user in made:
        rabbitmqctl("delete_user", user)


def job_of(settings, message_id: str, timeout: float = 30.0) -> str:
    db = open_database(settings.database_url)
    deadline = time.monotonic() + timeout
    while True:
        with db.session() as s:
            found = s.scalar(select(Job.id).where(Job.submit_message_id == message_id))
        if found:
            return found
        assert time.monotonic() < deadline, f"no job for message {message_id!r}"
        time.sleep(0.1)
