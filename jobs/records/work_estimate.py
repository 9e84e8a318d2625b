"""How many tokens a set of requests will make, from the work done so far: what a progress bar's total
and its ETA should count. With continuous batching nearly every request finishes near the end, so a
count of finished requests says little until then; tokens made against tokens expected do.

A finished request made what it made. An unfinished one will make its budget (``max_tokens`` x ``n``)
scaled by how much of their budgets the finished ones used, and at least what it has made so far (the
first to finish are the short ones: their ratio alone would promise too early an end)."""

from __future__ import annotations


class WorkEstimate:
    def __init__(self, budgets: dict[str, int]):
        """``budgets``: each request's most output tokens (``max_tokens`` x ``n``), by id."""
        self.budgets = dict(budgets)
        self.unfinished_budget = sum(self.budgets.values())
        self.made = 0  # by the finished requests
        self.finished_budget = 0

    def finished(self, request_id: str, tokens: int, counted: bool = True) -> None:
        """``request_id`` ended having made ``tokens``; ``counted`` False: it never ran (refused), its budget
        tells nothing of the others'."""
        budget = self.budgets.pop(request_id, 0)
        self.unfinished_budget -= budget
        if counted:
            self.made += tokens
            self.finished_budget += budget

    @property
    def ratio(self) -> float:
        """The share of their budgets the finished requests used (1 until one has finished)."""
        return self.made / self.finished_budget if self.finished_budget else 1.0

    def expected(self, running: dict[str, int] | None = None) -> int:
        """The tokens all of them will have made; ``running``: tokens made so far by unfinished ones, by id."""
        ratio = self.ratio
        total = self.made + ratio * self.unfinished_budget
        for request_id, made in (running or {}).items():
            budget = self.budgets.get(request_id)
            if budget is not None and made > ratio * budget:
                total += made - ratio * budget
        return round(total)
