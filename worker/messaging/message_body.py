"""A delivery's body as berth reads it: one function for every consumer of berth's, the engine
worker's broker link (request messages) and the queue door (job-submit messages).

Any producer with broker access can publish, with any AMQP properties, so reading a body must
never raise anything but ``UnreadableBody``, whose text says what was wrong; the caller then
refuses the message (dead-letters it, or fails its job) and acks it. Raising anything else inside
a consumer's callback leaves the message unacked: it is redelivered first after the reconnection,
raises again, and holds the queue for every tenant behind it.

The rules:

- The body is JSON in UTF-8 (RFC 8259), whatever ``content_encoding`` says. That property is
  ordinary (producers set ``utf-8`` out of habit) and py-amqp acts on it: given a
  ``content_encoding`` it knows as a codec, it hands the body over already decoded, as a ``str``
  (``utf-16`` turns UTF-8 bytes into nonsense, and back into other bytes). berth's consumers ask it
  not to (``keep_bodies_raw``), and ``raw_body`` turns a ``str`` body from anywhere else back into
  bytes, so that a body is read, measured and dead-lettered as it came.
- ``content_type`` is ``application/json`` (parameters ignored) or absent; anything else is
  refused, never decoded (no pickle, no YAML: kombu's serializers are not involved).
- ``max_bytes`` bounds the body before it is parsed.
"""

from __future__ import annotations

import json

# bodies whose bytes are read as UTF-8 as they are
UTF8_ENCODINGS = frozenset({"", "utf-8", "utf8", "binary", "identity"})


class UnreadableBody(ValueError):
    """A body berth will not read; the text is the reason, for the producer."""


class BodyTooLarge(UnreadableBody):
    """A body over the size limit (the door adds what to do instead)."""


def keep_bodies_raw(channel) -> None:
    """Ask the channel's client library to hand bodies over as the bytes published (py-amqp's
    ``auto_decode``, on by default, decodes by ``content_encoding``; other transports have none)."""
    if hasattr(channel, "auto_decode"):
        channel.auto_decode = False


def raw_body(body: bytes | bytearray | memoryview | str, content_encoding: str | None) -> bytes:
    """The bytes that were published. A ``str`` is a body the client library decoded with the
    message's ``content_encoding``; encoding it back with that codec gives the bytes it was made
    from (for a codec that does not round-trip, its UTF-8 is as near as can be known)."""
    if isinstance(body, str):
        try:
            return body.encode(content_encoding or "utf-8")
        except (LookupError, UnicodeError, TypeError, ValueError):
            return body.encode("utf-8", "surrogatepass")
    return bytes(body)


def read_json(body: bytes | bytearray | memoryview | str, content_type: str | None, content_encoding: str | None,
              max_bytes: int | None = None) -> object:
    """The JSON value a body holds; ``UnreadableBody`` with the reason for anything else."""
    kind = (content_type or "application/json").split(";")[0].strip().lower()
    if kind != "application/json":
        raise UnreadableBody(f"content type {str(content_type)[:100]!r}: send the message as application/json")
    data = raw_body(body, content_encoding)
    if max_bytes is not None and len(data) > max_bytes:
        raise BodyTooLarge(f"the message is {len(data):,} bytes, over the limit of {max_bytes:,}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        encoding = (content_encoding or "").strip().lower()
        said = "" if encoding in UTF8_ENCODINGS else (
            f" (its content_encoding is {content_encoding[:60]!r}: berth reads the body as UTF-8 JSON whatever that "
            "property says, uncompressed)")
        raise UnreadableBody(f"the message is not UTF-8 text{said}: send a JSON object") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, a number of too many digits, nesting too deep
        raise UnreadableBody(f"the message is not JSON ({type(exc).__name__}: {str(exc)[:200]}): send a JSON "
                             "object") from None
