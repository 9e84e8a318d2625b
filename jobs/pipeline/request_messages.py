"""The message jobs/ publishes for each request: it names the request (``worker.messaging.topology`` holds the
contract), and carries where it goes: the model and tenant of its queue, and its priority: the job's urgency
(its completion window) and the job's priority (``worker.messaging.topology.message_priority``).
An engine worker reads everything else from the request's database row, the source of truth, so a
message can be rebuilt from its row at any time (``from_row``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from worker.engine.request import SamplingParams
from worker.messaging.topology import message_priority, request_body


def params_to_dict(params: SamplingParams) -> dict:
    """The parameters as the JSON a request row holds; ``jobs.hosting.database_ledger.params_from_dict``
    reads it back."""
    values = {f.name: getattr(params, f.name) for f in fields(params)}  # its fields are immutable: no deep copy
    values["structured"] = asdict(params.structured) if params.structured is not None else None
    if params.embedding is None:
        del values["embedding"]  # a generation's row, as before embeddings existed
    else:
        values["embedding"] = asdict(params.embedding)
    return values


@dataclass(frozen=True)
class RequestMessage:
    request_id: int
    job_id: str
    model: str
    priority: int = 0  # the message's priority (``topology.message_priority``: the job's urgency and priority)
    tenant: str = "default"

    @classmethod
    def from_row(cls, row, model: str, priority: int, tenant: str, window: float | None = None) -> RequestMessage:
        """``priority``: the job's; ``window``: its completion window's seconds (None: 24 hours)."""
        return cls(row.id, row.job_id, model, message_priority(priority, window), tenant)

    def to_body(self) -> dict:
        return request_body(self.request_id, self.job_id)
