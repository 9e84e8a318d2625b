"""The door of a worker's interactive queue: a message's request checked as ``berth serve`` checks it."""

from __future__ import annotations

import functools

from jobs.lines.batch_format import BatchLine, LineError, check_request
from jobs.lines.validate import ModelInfo
from worker.config import Settings
from worker.consumer.interactive_queue import Refused
from worker.engine.engine import Engine
from worker.engine.request import Request


class InteractiveDoor:
    """An interactive queue's message to an engine request, checked by the batch lines' own front door
    (``to_request``) against this worker's engine, as ``berth serve`` checked it before publishing:
    any producer with broker access can publish, so the worker never takes the server's word for it.

    Its cheap checks only, on the worker's loop thread: a structured-output constraint is checked but
    not compiled here (a compile can take a minute, and would stop every stream and step of the
    worker meanwhile). The engine compiles it in the background in the tenant's turn
    (``worker.engine.admission.GrammarWaits``), and a grammar that does not compile fails the request
    with the reason as a ``request_rejected`` event, which the server answers as a 400, as before."""

    def __init__(self, engine: Engine, settings: Settings):
        self.engine, self.settings = engine, settings

    @functools.cached_property
    def info(self) -> ModelInfo:
        return ModelInfo.of_engine(self.engine, self.settings)

    def __call__(self, url: str, body: dict, request_id: str, tenant: str) -> Request:
        info = self.info
        line = BatchLine(1, "request", url, body)
        try:
            # every check but the grammar's compile, which the engine does in the background (off this loop)
            return check_request(line, info.tokenizer, info.name, info.max_model_len, request_id=request_id,
                                 tenant=tenant, vocab_size=info.vocab_size, structured_limits=info.structured_limits,
                                 hidden_size=info.hidden_size).request
        except LineError as exc:
            param = exc.param.removeprefix("body.") if exc.param else None
            raise Refused(f"{param}: {exc.message}" if param else exc.message, "invalid_request") from None
