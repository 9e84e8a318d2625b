"""The chart of a job's progress over time on its dashboard page: requests done against time since it
started, drawn on the server as SVG numbers (the page's CSP runs no inline script), axes labelled."""

from __future__ import annotations

from dataclasses import dataclass

from jobs.records.job_timeline import ProgressPoint

WIDTH, HEIGHT, LEFT, BOTTOM, TOP = 420, 140, 44, 18, 6


@dataclass(frozen=True)
class Tick:
    x: float
    y: float
    label: str


@dataclass(frozen=True)
class ProgressChart:
    polyline: str  # "x,y x,y ..." in the viewBox
    ticks: list[Tick]
    points: int
    width: int = WIDTH
    height: int = HEIGHT
    left: int = LEFT
    bottom: int = HEIGHT - BOTTOM


def progress_chart(points: list[ProgressPoint], total: int, seconds: float) -> ProgressChart:
    """Requests done (0 to ``total``) over ``seconds`` since the job started."""
    span, top = max(seconds, 1.0), max(total, 1)

    def x(t: float) -> float:
        return LEFT + (WIDTH - LEFT - 4) * min(t, span) / span

    def y(done: float) -> float:
        return TOP + (HEIGHT - BOTTOM - TOP) * (1 - done / top)

    line = " ".join(f"{x(p.seconds):.1f},{y(p.done):.1f}" for p in points)
    unit, scale = ("min", 60) if span >= 120 else ("s", 1)
    ticks = [Tick(LEFT - 4, y(v) + 3, f"{v:,}") for v in (0, top // 2, top)]
    ticks += [Tick(x(f * span), HEIGHT - 4, f"{f * span / scale:.0f} {unit}") for f in (0, 0.5, 1)]
    return ProgressChart(line, ticks, len(points))
