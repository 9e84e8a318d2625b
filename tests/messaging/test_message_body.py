"""One reading of a delivery's body for every consumer of berth's (worker/messaging/message_body.py):
the engine worker's broker link and the queue door read the same bytes the same way, whatever the
message's content_encoding, whether the client library handed the body over as bytes or as a str,
and never fail with anything but UnreadableBody (which the caller turns into a refusal and an ack)."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from jobs.queue_door.contract import SubmitRefused, decode
from worker.consumer.broker import Delivery
from worker.messaging.message_body import BodyTooLarge, UnreadableBody, raw_body, read_json

GOOD = json.dumps({"request_id": 7, "job_id": "batch_x", "text": "caf\u00e9 \u2603"}).encode()


@pytest.mark.parametrize("encoding", [None, "", "utf-8", "UTF-8", "utf8", "binary", "identity", "latin-1", "gzip",
                                      "utf-16", "no-such-codec"])
def test_utf8_bytes_are_read_whatever_the_content_encoding_says(encoding):
    assert read_json(GOOD, "application/json", encoding) == json.loads(GOOD)


@pytest.mark.parametrize("encoding", ["utf-8", "utf8", "latin-1", "cp1252", "ascii"])
def test_a_body_the_client_library_decoded_is_read_from_the_bytes_it_came_as(encoding):
    body = json.dumps({"request_id": 7, "job_id": "batch_x"}).encode()  # ASCII: every one of these decodes it
    as_str = body.decode(encoding)  # what py-amqp hands over for a message with this content_encoding
    assert raw_body(as_str, encoding) == body
    assert read_json(as_str, "application/json; charset=utf-8", encoding) == json.loads(body)
    assert raw_body(GOOD.decode("utf-8"), "utf-8") == GOOD


@pytest.mark.parametrize("body, content_type, encoding, reason", [
    (GOOD, "application/x-python-serialize", None, "content type"),
    (GOOD, "text/plain", "utf-8", "content type"),
    ("caf\u00e9".encode("latin-1"), None, "latin-1", "not UTF-8 text (its content_encoding is 'latin-1'"),
    (gzip.compress(GOOD, mtime=0), None, "gzip", "not UTF-8 text (its content_encoding is 'gzip'"),
    (b"\xff\xfe", None, "utf-8", "not UTF-8 text: send"),
    (b"{not json", None, "utf-8", "not JSON"),
    (b"[" * 100_000, None, None, "not JSON"),
    ("{not json", None, "utf-8", "not JSON"),
])
def test_what_cannot_be_read_is_refused_with_the_reason(body, content_type, encoding, reason):
    with pytest.raises(UnreadableBody, match=reason.replace("(", r"\(")):
        read_json(body, content_type, encoding)


def test_the_size_is_the_published_bytes_checked_before_parsing():
    with pytest.raises(BodyTooLarge, match="over the limit of 10"):
        read_json(b"[" * 11, None, None, max_bytes=10)
    assert read_json("[1]", None, "utf-8", max_bytes=3) == [1]


def test_any_body_with_any_properties_is_read_or_refused_never_an_error_of_another_kind():
    rng = random.Random(20)
    encodings = [None, "utf-8", "latin-1", "utf-16", "utf-32", "gzip", "base64", "rot13", "idna", "unicode_escape",
                 "binary", "x" * 300, "\u00e9"]
    kinds = [None, "application/json", "application/JSON; charset=latin-1", "application/octet-stream", ""]
    samples = [GOOD, b"", b"null", b'"\xed\xa0\x80"', bytes(rng.randrange(256) for _ in range(64))]
    for _ in range(400):
        body = rng.choice(samples) if rng.random() < 0.5 else bytes(rng.randrange(256)
                                                                    for _ in range(rng.randrange(40)))
        encoding = rng.choice(encodings)
        if rng.random() < 0.5:  # as a client library that decodes by content_encoding hands it over
            try:
                body = body.decode(encoding)
            except Exception:  # noqa: BLE001 (py-amqp leaves it as bytes then)
                pass
        content_type = rng.choice(kinds)
        try:
            worker = ("value", Delivery(body, content_type, encoding, False, None).decode())
        except UnreadableBody as exc:
            worker = ("refused", str(exc))
        try:
            door = ("value", decode(body, content_type, 1 << 20, encoding))
        except SubmitRefused as exc:
            door = ("refused", str(exc))
        assert worker[0] == door[0] and (worker[0] == "refused" or worker == door)  # one reading, both sides
        assert isinstance(raw_body(body, encoding), bytes)
