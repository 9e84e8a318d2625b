"""The queue's public message contract (``docs/queue.md``): a job-submit message read into one typed
value, and the schema of job events.

The JSON Schemas in ``jobs/queue_door/schemas/`` are the contract, versioned in their names
(``job-submit.v1.json``, ``job-event.v1.json``); a submit message is checked against the schema a
producer reads, then for what a schema cannot say (a completion window of zero, a webhook URL
without a host or to an address berth does not POST to: ``destinations``). Whatever is wrong comes
back as one ``SubmitRefused`` whose text says what and where, and which becomes the failed job's
``error``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from jobs.queue_door.destinations import PUBLIC_ONLY, Allowed, DestinationRefused, check_url
from jobs.records.lifecycle import window_seconds
from worker.messaging.message_body import BodyTooLarge, UnreadableBody, read_json

if TYPE_CHECKING:  # jsonschema is imported where a message is checked: an engine worker never does
    from jsonschema import Draft202012Validator

SCHEMA_DIR = Path(__file__).parent / "schemas"
SUBMIT_SCHEMA = "job-submit.v1.json"
EVENT_SCHEMA = "job-event.v1.json"
CONTRACT_VERSION = 1
MAX_REASON = 600  # characters of a schema error kept in a reason (its messages quote the value)


@functools.cache
def schema(name: str) -> dict:
    return json.loads((SCHEMA_DIR / name).read_text())


def _validator_of(schema_part: dict) -> Draft202012Validator:
    from jsonschema import Draft202012Validator

    return Draft202012Validator(schema_part)


@functools.cache
def validator(name: str) -> Draft202012Validator:
    return _validator_of(schema(name))


def event_routing_key(tenant: str | None, event_type: str) -> str:
    r"""The routing key of an event on ``<prefix>.events``: the tenant's word, a dot, the event's type
    (``team-a.job.completed``, ``team-a.submit.rejected``).

    Why the tenant comes first, as one word: RabbitMQ's topic permissions check the key of every
    binding a user makes against a regular expression (``set_topic_permissions``), so a tenant's
    user allowed ``^team-a\.`` can bind ``team-a.#`` or ``team-a.job.completed`` and nothing that
    matches another tenant's events (``#``, ``*.job.completed``). A tenant's name may hold dots,
    which would make it several words (tenant ``team`` binding ``team.#`` would get tenant
    ``team.a``'s events), so a dot in it is written ``%2E``, which no other name can be (names
    have no ``%``). A submit message with no tenant (no ``user_id``, a user mapped to none) has an
    empty word, ``.submit.rejected``: no tenant's pattern matches it, the operator's ``#`` does."""
    word = "" if tenant is None else tenant.replace(".", "%2E")
    return f"{word}.{event_type}"


class SubmitRefused(ValueError):
    """A submit message berth will not run; the text is the reason the producer gets."""


@dataclass(frozen=True)
class SubmitMessage:
    """A job-submit message as the schema and the checks accepted it."""

    model: str
    input_url: str | None  # exactly one of input_url and requests
    requests: list[dict] | None
    priority: int = 0
    completion_window: str = "24h"
    metadata: dict[str, str] = field(default_factory=dict)
    webhook_url: str | None = None


def read_submit(body: bytes | str, content_type: str | None, max_bytes: int,
                webhook_allow: Allowed = PUBLIC_ONLY, *, content_encoding: str | None = None) -> SubmitMessage:
    """The message a body holds; ``SubmitRefused`` with the reason when it is not a valid one
    (``webhook_allow``: the operator's allow-list of webhook destinations, BERTH_WEBHOOK_ALLOW)."""
    data = decode(body, content_type, max_bytes, content_encoding)
    if isinstance(data, dict) and ("input_url" in data) == ("requests" in data):
        raise SubmitRefused("give the input as input_url (an object in a store berth reads submit inputs from) or "
                            "as requests (the request lines inline), exactly one of them")
    from jsonschema.exceptions import best_match

    error = best_match(validator(SUBMIT_SCHEMA).iter_errors(data))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "the message"
        raise SubmitRefused(f"{where}: {error.message}"[:MAX_REASON]
                            + " (see jobs/queue_door/schemas/job-submit.v1.json)")
    try:
        window_seconds(data.get("completion_window", "24h"))
    except ValueError as exc:
        raise SubmitRefused(f"completion_window: {exc}") from None
    webhook = data.get("webhook_url")
    if webhook is not None:
        try:
            check_url(webhook, webhook_allow)
        except DestinationRefused as exc:
            raise SubmitRefused(str(exc)) from None
    return SubmitMessage(data["model"], data.get("input_url"), data.get("requests"), data.get("priority", 0),
                         data.get("completion_window", "24h"), dict(data.get("metadata", {})), webhook)


def decode(body: bytes | str, content_type: str | None, max_bytes: int, content_encoding: str | None = None) -> object:
    """The JSON a body holds (UTF-8, at most ``max_bytes``); ``SubmitRefused`` otherwise. The body is
    read as the engine worker reads its messages (``worker.messaging.message_body``): never anything
    but JSON, whatever ``content_encoding`` says, a ``str`` body taken back to its bytes."""
    try:
        return read_json(body, content_type, content_encoding, max_bytes)
    except BodyTooLarge as exc:
        raise SubmitRefused(f"{exc}: put the requests in a file and give its input_url, or raise "
                            "BERTH_MAX_SUBMIT_BYTES") from None
    except UnreadableBody as exc:
        raise SubmitRefused(f"{exc} (docs/queue.md)") from None


def salvage(body: bytes | str, max_bytes: int, webhook_allow: Allowed = PUBLIC_ONLY, *,
            content_encoding: str | None = None) -> dict:
    """What can be kept of a refused message for its failed job (and the job's events): each of
    model, priority, completion_window, metadata and webhook_url that is valid on its own."""
    try:
        data = decode(body, None, max_bytes, content_encoding)
    except SubmitRefused:
        return {}
    if not isinstance(data, dict):
        return {}
    properties = schema(SUBMIT_SCHEMA)["properties"]
    kept = {}
    for name in ("model", "priority", "completion_window", "metadata", "webhook_url"):
        if name in data and _validator_of(properties[name]).is_valid(data[name]):
            kept[name] = data[name]
    try:
        window_seconds(kept.get("completion_window", "24h"))
    except ValueError:
        kept.pop("completion_window")
    if "webhook_url" in kept:
        try:
            check_url(kept["webhook_url"], webhook_allow)
        except DestinationRefused:
            kept.pop("webhook_url")
    return kept
