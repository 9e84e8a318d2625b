"""What a decode step costs on this device, as ``a + b * rows`` seconds, fitted from the steps' own times.

``a`` is what a step costs whatever its rows (every weight streamed once, the host's own work between two
steps), ``b`` what each row adds (its share of the multiplies, its attention). Speculation needs their
ratio: a draft token costs ``b`` and is worth the chance it is kept, while the step's other tokens cost
``(a + b * rows) / rows`` each (``policy.SpeculationPolicy``). On a GPU ``a`` dominates up to large
batches; on a CPU ``b`` is a fifth of a step's time at 16 rows of a 135M model and most of it at 64.

The fit is least squares over the decode steps' (rows, seconds), each weighted ``DECAY ** age``, so it
follows the machine's load and the batch as it shrinks; it answers only once the rows it saw differ
enough to tell ``b`` from ``a`` (``SPREAD``).
"""

from __future__ import annotations

DECAY = 0.98  # the weight of a step one step older (the fit's memory is ~50 steps)
SPREAD = 2.0  # the weighted standard deviation of the rows seen before the fit answers
LEAST = 8.0  # the weighted count of steps seen before the fit answers


class StepCost:
    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        """A decode step of ``rows`` rows (drafts included) took ``seconds``, from the end of the step before."""
        if rows < 1 or not 0 < seconds < 60:
            return
        d = DECAY
        self._w = self._w * d + 1
        self._x = self._x * d + rows
        self._y = self._y * d + seconds
        self._xx = self._xx * d + rows * rows
        self._xy = self._xy * d + rows * seconds

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)`` in seconds, or None until enough steps of different sizes were seen."""
        if self._w < LEAST:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        if var < SPREAD * SPREAD:
            return None
        b = (self._xy / self._w - mean_x * mean_y) / var
        b = max(b, 0.0)
        a = max(mean_y - b * mean_x, 0.0)
        if a + b <= 0:
            return None
        return a, b
