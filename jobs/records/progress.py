"""Showing jobs to a person: a summary, a table, and a live progress bar (rich).

rich is imported by the table and the bar that use it: ``berth status`` prints ``describe``'s plain lines.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from jobs.records.status import JobView

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

WATCH_INTERVAL = 1.0


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def describe(view: JobView) -> str:
    lines = [f"{view.id}  {view.status.value}  (tenant {view.tenant}, priority {view.priority}, model {view.model})",
             f"requests  {view.done}/{view.total} done: {view.completed} completed, {view.failed} failed",
             f"tokens    {view.prompt_tokens} prompt, {view.completion_tokens} output"
             + (f" (+{view.tokens_in_flight} running)" if view.tokens_in_flight else "")
             + (f" of ~{view.expected_tokens} expected" if view.expected_tokens and not view.status.is_final else "")
             + f"; {view.tokens_per_second:.1f} output tok/s, {view.requests_per_second:.2f} req/s",
             f"time      running {duration(view.seconds_running)}, ETA {duration(view.eta_seconds)}"
             + (f", expected to finish {_clock(view.expected_finish_at)}" if view.expected_finish_at else "")
             + f"; window {view.completion_window}, ends {_clock(view.expires_at)}"
             + (" — AT RISK: expected to finish after its window ends" if view.at_risk else "")]
    if view.error:
        lines.append(f"error     {view.error}")
    if view.errors_key:
        lines.append(f"errors    written; `berth results {view.id} -o FILE` fetches them with the output")
    return "\n".join(lines)


COLUMNS = ("id", "status", "tenant", "pri", "done/total", "failed", "tok/s", "created")
GIVE_WAY = ("created", "pri", "tok/s", "failed", "tenant")  # left out in this order where the terminal is narrow


def job_table(views: list[JobView], console: Console | None = None) -> None:
    """The jobs as a table. Ids are never cut short or wrapped (they are copied into other commands):
    in a narrow terminal the columns of ``GIVE_WAY`` are left out, as many as it takes, before the
    others shrink."""
    from rich.console import Console

    console = console or Console()
    rows = [dict(zip(COLUMNS, (v.id, v.status.value, v.tenant, str(v.priority), f"{v.done}/{v.total}", str(v.failed),
                               f"{v.output_tokens_per_second:.1f}",
                               time.strftime("%Y-%m-%d %H:%M", time.localtime(v.created_at))))) for v in views]
    shown = list(COLUMNS)
    table = _table(rows, shown)
    unbounded = console.options.update(max_width=1 << 16)  # the table's natural width, not the terminal's
    for column in GIVE_WAY:
        if console.measure(table, options=unbounded).maximum <= console.width:
            break
        shown.remove(column)
        table = _table(rows, shown)
    console.print(table)


def _table(rows: list[dict[str, str]], columns: list[str]) -> Table:
    from rich.table import Table

    table = Table()
    for name in columns:
        if name == "id":
            table.add_column(name, no_wrap=True, min_width=max((len(r["id"]) for r in rows), default=2))
        else:
            table.add_column(name)
    for row in rows:
        table.add_row(*(row[name] for name in columns))
    return table


class JobProgress:
    """A live bar of one job's requests, fed with ``update(view)``."""

    def __init__(self, disabled: bool = False):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[rates]}"), TimeElapsedColumn(),
                                 TextColumn("ETA {task.fields[eta]}"),
                                 console=Console(stderr=True), disable=disabled)
        self.task = None

    def update(self, view: JobView) -> None:
        """The bar counts output tokens made against those expected where the job keeps its budget (work
        done: requests mostly finish at the end), else requests done."""
        expected = view.expected_tokens
        done, total = (view.tokens_made, expected) if expected else (view.done, view.total or None)
        fields = {"description": view.status.value, "completed": done, "total": total,
                  "rates": f"{view.done}/{view.total} requests, {view.tokens_per_second:.1f} tok/s",
                  "eta": duration(view.eta_seconds)}
        if self.task is None:
            self.task = self.progress.add_task(**fields)
        else:
            self.progress.update(self.task, **fields)

    def __enter__(self) -> JobProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()


def watch(fetch: Callable[[], JobView]) -> None:
    """Follow a job until it ends."""
    with JobProgress() as bar:
        while True:
            view = fetch()
            bar.update(view)
            if view.status.is_final:
                return
            time.sleep(WATCH_INTERVAL)
