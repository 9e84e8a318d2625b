"""What travels on the request queue: one message per request, carrying what an engine worker
needs to run it and write its result. The database stays the source of truth; a message can be
rebuilt from its request row at any time (``from_row``)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from jobs.batch_format import BatchLine
from worker.request import Request, SamplingParams

_PARAM_FIELDS = {f.name for f in fields(SamplingParams)}


class MalformedMessage(ValueError):
    """A queue message berth cannot read (not written by this version of berth)."""


def params_to_dict(params: SamplingParams) -> dict:
    return {f.name: getattr(params, f.name) for f in fields(params)}  # its fields are immutable: no deep copy


def params_from_dict(data: dict) -> SamplingParams:
    values = {k: v for k, v in data.items() if k in _PARAM_FIELDS}
    for name in ("stop", "stop_token_ids"):
        values[name] = tuple(values.get(name, ()))
    return SamplingParams(**values)


@dataclass(frozen=True)
class RequestMessage:
    request_id: int
    job_id: str
    line: int
    custom_id: str
    url: str
    model: str
    prompt_token_ids: list[int]
    params: dict
    priority: int = 0
    tenant: str = "default"

    @classmethod
    def from_row(cls, row, model: str, priority: int, tenant: str) -> RequestMessage:
        return cls(row.id, row.job_id, row.line, row.custom_id, row.url, model, list(row.prompt_token_ids),
                   dict(row.params), priority, tenant)

    def to_body(self) -> dict:
        # not dataclasses.asdict: it deep-copies each token id on its own, the most costly step of a large submit
        return {**{f.name: getattr(self, f.name) for f in fields(self)},
                "prompt_token_ids": list(self.prompt_token_ids), "params": dict(self.params)}

    @classmethod
    def from_body(cls, body) -> RequestMessage:
        try:
            message = cls(**body)
            params_from_dict(message.params)
        except (TypeError, ValueError) as exc:
            raise MalformedMessage(f"not a berth request message ({exc}): {str(body)[:200]}") from None
        return message

    @property
    def engine_id(self) -> str:
        """The id the engine knows it by: unique across jobs, and what the output's request_id shows."""
        return str(self.request_id)

    def engine_request(self) -> Request:
        return Request(self.engine_id, list(self.prompt_token_ids), params_from_dict(self.params),
                       priority=self.priority, tenant=self.tenant)

    def batch_line(self) -> BatchLine:
        return BatchLine(self.line, self.custom_id, self.url, {})

    @property
    def kv_tokens(self) -> int:
        """The most KV slots the request can hold: its prompt and every sample's output."""
        p = params_from_dict(self.params)
        return len(self.prompt_token_ids) + p.n * p.max_tokens
