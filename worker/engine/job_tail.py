"""A job's tail: how long each of its waiting requests is expected to run, so that once a job's
waiting requests fit in the running batch the longest start first (``WaitingQueue.head``).

With continuous batching a job's last minutes are its last requests running: started in arrival
order, a long request admitted last runs on alone while the batch empties around it. Started longest
first (LPT), the short ones fill the seats the long ones leave, and the batch stays full nearly to the
end. A request's length is predicted from its ``max_tokens`` and the job's finished requests of the
same shape on this engine (the same ``max_tokens``): their mean output; before any has finished, its
``max_tokens`` scaled by the share of their budgets the job's finished requests used, and before any
at all, its ``max_tokens`` (the rule of ``jobs.records.work_estimate``, per shape). What a preempted
sequence has made already is counted off.
"""

from __future__ import annotations

from collections import OrderedDict

from worker.engine.request import Sequence

JOBS_KEPT = 1000  # jobs whose lengths are remembered, the most recently finishing: a worker runs many jobs


class JobLengths:
    """Finished requests' output lengths per job and shape, and the length expected of a waiting one."""

    def __init__(self):
        # job -> (tokens made, their budgets, {max_tokens: (finished, tokens made)}), oldest first
        self._jobs: OrderedDict[str, tuple[int, int, dict[int, tuple[int, int]]]] = OrderedDict()

    def finished(self, seq: Sequence) -> None:
        """``seq`` ended (a sample of a generation); an embeddings input or a job-less request tells nothing."""
        job, params = seq.request.job, seq.request.params
        if job is None or params.embedding is not None:
            return
        made = seq.num_output_tokens
        made_all, budget, shapes = self._jobs.pop(job, (0, 0, {}))
        n, tokens = shapes.get(params.max_tokens, (0, 0))
        shapes[params.max_tokens] = (n + 1, tokens + made)
        self._jobs[job] = (made_all + made, budget + params.max_tokens, shapes)
        if len(self._jobs) > JOBS_KEPT:
            self._jobs.popitem(last=False)

    def expected_left(self, seq: Sequence) -> float:
        """The output tokens ``seq`` is expected still to make."""
        job, max_tokens = seq.request.job, seq.request.params.max_tokens
        made, budget, shapes = self._jobs.get(job, (0, 0, {}))
        n, tokens = shapes.get(max_tokens, (0, 0))
        expected = tokens / n if n else max_tokens * (made / budget if budget else 1.0)
        return max(expected - seq.num_output_tokens, 1.0)
