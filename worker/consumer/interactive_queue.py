"""Interactive requests through RabbitMQ, the worker's side: the model's interactive queue into the
``InteractiveInbox``, each request's events out to its caller's direct reply-to address.

``berth serve`` with a broker (``jobs.http.interactive_channel_broker``) publishes each chat or completions
request it accepted to ``<prefix>.interactive.<model>`` (``worker.messaging.topology``): a transient
message with an expiration, ``reply_to`` RabbitMQ's direct reply-to and ``correlation_id`` the
request's id, whose body is JSON ``{request_id, tenant, url, body}`` (``message_body``), the OpenAI
body as the caller sent it. Never a pickled request: any producer with broker access can publish,
so the worker checks the body again with the batch lines' own front door, which ``jobs`` hands it
as a ``Door`` (``worker/`` imports nothing of ``jobs/``), just as a request queue's message is
checked against its row. The door does the cheap checks only, on the loop's thread: a grammar is
compiled by the engine in the background (``worker.engine.admission.GrammarWaits``), never here.

``RemoteRequests``, on the loop's thread (the one that owns the broker link), each iteration:

- a delivery whose ``reply_to`` is not a direct reply-to address is acked and dropped with a log
  line (there is nobody to tell, and publishing to any other name would write into berth's queues);
  one that is unreadable or fails the checks gets a ``Failed`` reply with the reason (what a 400
  would say) and is acked: refused, never requeued;
- the rest go to ``InteractiveInbox.submit`` with a sink that publishes each step's events as one
  reply ``{"seq": n, "events": [...]}`` (``reply_body``; ``Done`` carries the ``RequestOutput``, so
  the server builds the same response a batch line gets). The message is acked once its first event
  went out: a worker that dies before any token leaves it unacked, the broker gives it to another
  worker, which runs it from the start (nothing was sent: no text twice); one that dies after has
  acked it, and the server ends the stream with an error event once the worker is silent for
  ``interactive_deadline`` seconds. So that silence means death, each live request that said nothing
  for ``KEEPALIVE`` seconds gets a reply with no events;
- the worker holds at most ``interactive_prefetch`` live requests, acked or not: at that many the
  queue's consumer pauses (``BrokerLink.interactive_room``) and resumes once one ends; a delivery
  that came while it was full (on its way when it paused) is requeued, unread, for any worker;
- an abort (the caller left: ``<prefix>.interactive.abort``) drops the request before the next step
  and acks its message; the ids of the last ``MAX_ABORTED`` aborts are kept, so a request whose
  caller left while it waited in the queue is not run when it comes;
- a request whose delivery was lost with the broker link before its first event is dropped here
  (the broker gives it to a worker again); a worker stopping hands back the ones that have not
  started (requeued), and the ones that have end with ``Failed``.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.consumer.broker import BrokerLink, Delivery
from worker.consumer.interactive_inbox import Delta, Done, Event, Failed, InteractiveInbox
from worker.engine.request import Completion, Request, RequestOutput
from worker.messaging.message_body import UnreadableBody, read_json
from worker.messaging.topology import BadMessage
from worker.metrics import WorkerMetrics

log = logging.getLogger("berth.worker")

KEEPALIVE = 1.0  # seconds a live request may go without a reply before it gets an empty one
MAX_ABORTED = 10_000  # aborted request ids remembered
REPLY_TO_PREFIX = "amq.rabbitmq.reply-to."
URLS = ("/v1/chat/completions", "/v1/completions")  # jobs.lines.request_fields's CHAT_URL and COMPLETIONS_URL
REQUEST_ID = re.compile(r"i-[A-Za-z0-9_-]{1,64}")  # the HTTP door's ids: never a batch request's (digits)
TENANT = re.compile(r"[^\x00-\x1f\x7f]{1,200}")
MESSAGE_OVERHEAD = 4096  # bytes of a message besides the body (whose size the HTTP door bounded)


class Refused(ValueError):
    """A body the door refused: ``reason`` is what a 400 would say, ``code`` its error code."""

    def __init__(self, reason: str, code: str = "invalid_request"):
        super().__init__(reason)
        self.reason, self.code = reason, code


# url, body, request id, tenant -> the engine request (``Refused`` with the reason)
Door = Callable[[str, dict, str, str], Request]


# ---- the message
@dataclass(frozen=True)
class InteractiveMessage:
    request_id: str
    tenant: str
    url: str
    body: dict


def message_body(request_id: str, tenant: str, url: str, body: dict) -> bytes:
    return json.dumps({"request_id": request_id, "tenant": tenant, "url": url, "body": body},
                      ensure_ascii=False).encode()


def parse_message(payload: object) -> InteractiveMessage:
    """What a decoded interactive message asks for; ``BadMessage`` with the reason for anything else."""
    if not isinstance(payload, dict):
        raise BadMessage(f"the body is a JSON {type(payload).__name__}, not an object with request_id, tenant, url "
                         "and body")
    request_id, tenant, url, body = (payload.get(k) for k in ("request_id", "tenant", "url", "body"))
    if not isinstance(request_id, str) or not REQUEST_ID.fullmatch(request_id):
        raise BadMessage("request_id must be 'i-' and 1 to 64 letters, digits, '_' or '-', "
                         f"not {str(request_id)[:80]!r}")
    if not isinstance(tenant, str) or not TENANT.fullmatch(tenant):
        raise BadMessage(f"tenant must be a string of 1 to 200 printable characters, not {str(tenant)[:80]!r}")
    if url not in URLS:
        raise BadMessage(f"url must be one of {', '.join(URLS)}, not {str(url)[:80]!r}")
    if not isinstance(body, dict):
        raise BadMessage(f"body must be a JSON object (the request's OpenAI body), not {type(body).__name__}")
    return InteractiveMessage(request_id, tenant, url, body)


# ---- the replies: {"seq": n, "events": [...]}, n counting the replies with events of each request from 1
# (a keepalive has no events and the seq of the last reply that had some, 0 before the first)
def reply_body(seq: int, events: list[Event]) -> bytes:
    return json.dumps({"seq": seq, "events": [_event_json(e) for e in events]}, ensure_ascii=False).encode()


def read_reply(data: bytes | str) -> tuple[int, list[Event]]:
    """A reply's sequence number and events (none: a keepalive); ``ValueError`` for anything else."""
    payload = json.loads(data)
    seq, events = payload["seq"], payload["events"]
    if type(seq) is not int or seq < 0 or not isinstance(events, list):
        raise ValueError("a reply is {seq: an integer from 0, events: a list}")
    return seq, [_event_of(e) for e in events]


def _event_json(e: Event) -> dict:
    if isinstance(e, Delta):
        return {"type": "delta", "index": e.index, "text": e.text, "token_ids": list(e.token_ids),
                "logprobs": None if e.logprobs is None else list(e.logprobs), "finish_reason": e.finish_reason}
    if isinstance(e, Done):
        o = e.output
        return {"type": "done", "output": {
            "request_id": o.request_id, "prompt_token_ids": list(o.prompt_token_ids),
            "num_cached_prompt_tokens": o.num_cached_prompt_tokens, "error": o.error,
            "completions": [{"index": c.index, "token_ids": list(c.token_ids), "text": c.text,
                             "finish_reason": c.finish_reason, "logprobs": c.logprobs} for c in o.completions]}}
    return {"type": "failed", "reason": e.reason, "code": e.code}


def _event_of(d: dict) -> Event:
    kind = d["type"]
    if kind == "delta":
        logprobs = d["logprobs"]
        return Delta(_int(d["index"]), _str(d["text"]), tuple(_int(t) for t in d["token_ids"]),
                     None if logprobs is None else tuple(logprobs), _opt_str(d["finish_reason"]))
    if kind == "done":
        o = d["output"]
        completions = [Completion(_int(c["index"]), [_int(t) for t in c["token_ids"]], _str(c["text"]),
                                  _str(c["finish_reason"]), c["logprobs"]) for c in o["completions"]]
        return Done(RequestOutput(_str(o["request_id"]), [_int(t) for t in o["prompt_token_ids"]], completions,
                                  _int(o["num_cached_prompt_tokens"]), _opt_str(o["error"])))
    if kind == "failed":
        return Failed(_str(d["reason"]), _str(d["code"]))
    raise ValueError(f"unknown event type {str(kind)[:40]!r}")


def _int(v) -> int:
    if type(v) is not int:
        raise ValueError(f"not an integer: {str(v)[:40]!r}")
    return v


def _str(v) -> str:
    if not isinstance(v, str):
        raise ValueError(f"not a string: {str(v)[:40]!r}")
    return v


def _opt_str(v) -> str | None:
    return None if v is None else _str(v)


# ---- the worker's side
@dataclass(eq=False)
class _Remote:
    """A request from the interactive queue, live in this worker."""

    delivery: Delivery
    seq: int = 0  # replies sent
    acked: bool = False  # its first event went out
    last_sent: float = field(default_factory=time.monotonic)
    detached: bool = False  # handed back or dropped: its sink sends nothing more


class RemoteRequests:
    """The interactive queue's deliveries into ``inbox``; on the loop's thread only."""

    def __init__(self, inbox: InteractiveInbox, broker: BrokerLink, door: Door, metrics: WorkerMetrics,
                 max_body_bytes: int, name: str):
        self.inbox, self.broker, self.door, self.metrics, self.name = inbox, broker, door, metrics, name
        self.max_bytes = max_body_bytes + MESSAGE_OVERHEAD
        self.live: dict[str, _Remote] = {}
        self.limit = broker.interactive_prefetch  # live requests held at once, acked or not
        self.closed = False  # stopping: deliveries go back to the queue
        self._aborted: OrderedDict[str, None] = OrderedDict()

    def admit(self) -> None:
        """Before the inbox admits: what the broker brought (requests, aborts), and requests whose
        delivery was lost before they said anything (the broker gives them to a worker again)."""
        deliveries, aborts = self.broker.take_interactive()
        for request_id in aborts:
            self._abort(request_id)
        for request_id, remote in list(self.live.items()):
            if not remote.acked and not self.broker.is_current(remote.delivery):
                log.info("worker %s: interactive request %s lost its delivery before its first token; the broker "
                         "gives it to a worker again", self.name, request_id)
                self._drop(request_id)
        for delivery in deliveries:
            self._take(delivery)
        if not self.closed:
            self.broker.interactive_room(self.limit - len(self.live))
        self.metrics.interactive_live.set(len(self.live))

    def keepalive(self) -> None:
        """An empty reply for each live request that said nothing for ``KEEPALIVE`` seconds."""
        now = time.monotonic()
        for request_id, remote in list(self.live.items()):
            if now - remote.last_sent >= KEEPALIVE and not remote.detached:
                remote.last_sent = now
                d = remote.delivery
                if not self.broker.reply(d.reply_to, d.correlation_id, reply_body(remote.seq, [])) and not remote.acked:
                    self._hand_back(request_id)  # nobody can hear it: another worker may

    def hand_back(self) -> None:
        """The worker stops: the requests that have said nothing go back to the queue (another worker
        runs them from the start), and those that come from now on; the others end as the inbox ends them."""
        self.closed = True
        for delivery in self.broker.take_interactive()[0]:
            self.broker.requeue(delivery)
        for request_id, remote in list(self.live.items()):
            if not remote.acked:
                self._hand_back(request_id)
        self.metrics.interactive_live.set(len(self.live))

    # ---- in
    def _take(self, delivery: Delivery) -> None:
        if self.closed or len(self.live) >= self.limit:  # stopping, or holding all it may: for any worker
            self.broker.requeue(delivery)
            return
        reply_to = delivery.reply_to
        if not reply_to or not reply_to.startswith(REPLY_TO_PREFIX):
            log.warning("worker %s: dropped a message on the interactive queue without a direct reply-to address "
                        "(reply_to %r): nobody to answer", self.name, (reply_to or "")[:100])
            self.metrics.interactive_refused.inc()
            self.broker.ack(delivery)
            return
        try:
            message = parse_message(read_json(delivery.body, delivery.content_type, delivery.content_encoding,
                                              self.max_bytes))
        except (UnreadableBody, BadMessage) as exc:
            self._refuse(delivery, f"the interactive message was refused: {exc}")
            return
        request_id = message.request_id
        if request_id in self._aborted:  # its caller left while it waited
            self.broker.ack(delivery)
            return
        if request_id in self.live:
            log.warning("worker %s: a second message for interactive request %s, which runs here: dropped",
                        self.name, request_id)
            self.broker.ack(delivery)
            return
        try:
            request = self.door(message.url, message.body, request_id, message.tenant)
        except Refused as exc:
            self._refuse(delivery, exc.reason, exc.code)
            return
        except Exception as exc:
            log.exception("worker %s: checking interactive request %s raised", self.name, request_id)
            self._refuse(delivery, f"the request could not be checked ({type(exc).__name__}); fix it or report it "
                                   "as a bug")
            return
        remote = self.live[request_id] = _Remote(delivery)
        self.metrics.interactive_taken.inc()
        self.inbox.submit(request, lambda events: self._sink(request_id, remote, events))

    def _refuse(self, delivery: Delivery, reason: str, code: str = "invalid_request") -> None:
        self.metrics.interactive_refused.inc()
        self.broker.reply(delivery.reply_to, delivery.correlation_id, reply_body(1, [Failed(reason[:2000], code)]))
        self.broker.ack(delivery)

    def _abort(self, request_id: str) -> None:
        self._aborted[request_id] = None
        while len(self._aborted) > MAX_ABORTED:
            self._aborted.popitem(last=False)
        remote = self.live.pop(request_id, None)
        if remote is not None:  # its caller left: nothing to give to another worker
            remote.detached = True
            self.inbox.abort(request_id)
            self.broker.ack(remote.delivery)

    def _drop(self, request_id: str) -> None:
        self.live.pop(request_id).detached = True
        self.inbox.abort(request_id)

    def _hand_back(self, request_id: str) -> None:
        remote = self.live[request_id]
        self._drop(request_id)
        self.broker.requeue(remote.delivery)

    # ---- out (the inbox calls the sink on the loop's thread)
    def _sink(self, request_id: str, remote: _Remote, events: list[Event]) -> None:
        if remote.detached:
            return
        if not self._publish(remote, events):
            if not remote.acked:  # nothing went out: another worker can run it from the start
                self._hand_back(request_id)
            else:
                self.live.pop(request_id, None)
            raise ConnectionError("the reply was not published")  # the inbox aborts the request
        if not remote.acked:
            remote.acked = True
            self.broker.ack(remote.delivery)
        if any(isinstance(e, (Done, Failed)) for e in events):
            self.live.pop(request_id, None)
            self.metrics.interactive_live.set(len(self.live))

    def _publish(self, remote: _Remote, events: list[Event]) -> bool:
        remote.seq += 1
        remote.last_sent = time.monotonic()
        d = remote.delivery
        return self.broker.reply(d.reply_to, d.correlation_id, reply_body(remote.seq, events))
