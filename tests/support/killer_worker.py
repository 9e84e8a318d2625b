"""``berth worker`` whose process dies on the spot (``os._exit``, as a segfault or an OOM kill would end
it: nothing cleans up) when an engine step is about to run a request whose prompt is the token ids in
``$TEST_KILLER_PROMPT`` (JSON). A test hook that lives in the tests, not in berth:

    python -m tests.support.killer_worker worker --metrics-port 9100
"""

from __future__ import annotations

import json
import os
import sys

from worker.engine.model_runner import ModelRunner


def install(killer: list[int]) -> None:
    prepare = ModelRunner.prepare

    def prepare_or_die(self, scheduled, tables=None):
        if any(list(seq.request.prompt_token_ids) == killer for seq, _ in scheduled):
            os._exit(139)
        return prepare(self, scheduled, tables)

    ModelRunner.prepare = prepare_or_die


if __name__ == "__main__":
    install(json.loads(os.environ["TEST_KILLER_PROMPT"]))
    from jobs.cli import main

    main(sys.argv[1:])
