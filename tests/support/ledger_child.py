"""A ledger for ``worker.consumer.ledger_process``'s tests, built in its child: it says which process answers
and takes as long as asked. Light to import (the child imports it): nothing of torch."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from worker.consumer.ledger import LedgerDown


@dataclass(frozen=True)
class PidLedgerRecipe:
    down: bool = False  # every call raises ``LedgerDown``, as a ledger whose database does not answer

    def __call__(self) -> PidLedger:
        return PidLedger(self.down)


class PidLedger:
    def __init__(self, down: bool):
        self.down = down

    def live_tenants(self, model):
        if self.down:
            raise LedgerDown("the database is down")
        return {"pid": float(os.getpid())}

    def record(self, outcomes, worker):
        return {o.request_id for o in outcomes if o.output is not None and o.output.completions[0].text}

    def note_error(self, request_id, error):
        time.sleep(float(error))  # a call that takes ``error`` seconds

    def close(self):
        pass
