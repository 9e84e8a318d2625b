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

from jobs.lifecycle import window_seconds
from jobs.queue_door.destinations import PUBLIC_ONLY, Allowed, DestinationRefused, check_url

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


def read_submit(body: bytes, content_type: str | None, max_bytes: int,
                webhook_allow: Allowed = PUBLIC_ONLY) -> SubmitMessage:
    """The message a body holds; ``SubmitRefused`` with the reason when it is not a valid one
    (``webhook_allow``: the operator's allow-list of webhook destinations, BERTH_WEBHOOK_ALLOW)."""
    data = decode(body, content_type, max_bytes)
    if isinstance(data, dict) and ("input_url" in data) == ("requests" in data):
        raise SubmitRefused("give the input as input_url (an object in a store berth reads submit inputs from) or "
                            "as requests (the request lines inline), exactly one of them")
    from jsonschema.exceptions import best_match

    error = best_match(validator(SUBMIT_SCHEMA).iter_errors(data))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "the message"
        raise SubmitRefused(f"{where}: {error.message}"[:MAX_REASON] + " (see jobs/queue_door/schemas/job-submit.v1.json)")
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


def decode(body: bytes, content_type: str | None, max_bytes: int) -> object:
    """The JSON a body holds (UTF-8, at most ``max_bytes``); ``SubmitRefused`` otherwise. Never
    anything but JSON: a body of another content type is refused, not decoded."""
    kind = (content_type or "application/json").split(";")[0].strip().lower()
    if kind != "application/json":
        raise SubmitRefused(f"content type {content_type[:100]!r}: send the message as application/json")
    if len(body) > max_bytes:
        raise SubmitRefused(f"the message is {len(body):,} bytes, over the limit of {max_bytes:,}: put the requests "
                            "in a file and give its input_url, or raise BERTH_MAX_SUBMIT_BYTES")
    try:
        return json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise SubmitRefused("the message is not UTF-8 text: send a JSON object (docs/queue.md)") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, a number of too many digits, nesting too deep
        raise SubmitRefused(f"the message is not JSON ({type(exc).__name__}: {str(exc)[:200]}): send a JSON object "
                            "(docs/queue.md)") from None


def salvage(body: bytes, max_bytes: int, webhook_allow: Allowed = PUBLIC_ONLY) -> dict:
    """What can be kept of a refused message for its failed job (and the job's events): each of
    model, priority, completion_window, metadata and webhook_url that is valid on its own."""
    try:
        data = decode(body, None, max_bytes)
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
