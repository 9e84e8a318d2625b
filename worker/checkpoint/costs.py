"""What checkpoint I/O costs and saves, measured as the worker runs (``TransferRates``), and the two
decisions made from it: whether a request's KV blocks are worth writing (``KvPolicy``), and whether
blocks on the store are read back or computed again. docs/engine.md gives the formula."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from worker.engine.stats import EngineStats

DEFAULT_PREFILL_TOKENS_PER_SECOND = 2_000.0  # until a step measures it
DEFAULT_STORAGE_BYTES_PER_SECOND = 100e6  # reading, until a read measures it
DEFAULT_WRITE_BYTES_PER_SECOND = 100e6  # until a large PUT measures it
DEFAULT_PUT_SECONDS = 0.02  # an object store's round trip for one small PUT, until one measures it
DEFAULT_STEP_SECONDS = 0.05
SMALL_PUT_BYTES = 256 << 10  # a PUT below this measures the per-object cost, above it the bandwidth
MAX_STEP_GAP = 5.0  # seconds between steps beyond this are an idle engine, not a slow step
SMOOTHING = 0.3  # weight of a new measurement


def _smooth(old: float, new: float) -> float:
    return (1 - SMOOTHING) * old + SMOOTHING * new


@dataclass
class TransferRates:
    """What a block costs to write, to read back and to compute again, measured as the worker runs."""

    prefill_tokens_per_second: float = DEFAULT_PREFILL_TOKENS_PER_SECOND
    storage_bytes_per_second: float = DEFAULT_STORAGE_BYTES_PER_SECOND
    write_bytes_per_second: float = DEFAULT_WRITE_BYTES_PER_SECOND
    put_seconds: float = DEFAULT_PUT_SECONDS
    step_seconds: float = DEFAULT_STEP_SECONDS
    _seen: tuple[int, int, float] = field(default=(0, 0, 0.0), repr=False)  # engine totals last seen

    def observe_step(self, stats: EngineStats) -> None:
        """After a step: the forward pass's tokens/s, from steps that were mostly prefill."""
        prefill = stats.prompt_tokens_computed + stats.recomputed_tokens
        d_prefill, d_output = prefill - self._seen[0], stats.output_tokens - self._seen[1]
        d_seconds = stats.forward_seconds - self._seen[2]
        self._seen = (prefill, stats.output_tokens, stats.forward_seconds)
        if d_prefill >= d_output and d_prefill > 0 and d_seconds > 0:
            self.prefill_tokens_per_second = _smooth(self.prefill_tokens_per_second,
                                                     (d_prefill + d_output) / d_seconds)

    def observe_step_time(self, seconds: float) -> None:
        """Wall seconds from one step to the next (a gap past ``MAX_STEP_GAP`` is idleness, not a step)."""
        if 0 < seconds <= MAX_STEP_GAP:
            self.step_seconds = _smooth(self.step_seconds, seconds)

    def observe_read(self, nbytes: int, seconds: float) -> None:
        if nbytes and seconds > 0:
            self.storage_bytes_per_second = _smooth(self.storage_bytes_per_second, nbytes / seconds)

    def observe_write(self, nbytes: int, seconds: float) -> None:
        """One PUT of ``nbytes`` took ``seconds`` (called from the writer's threads: plain float updates)."""
        if seconds <= 0:
            return
        if nbytes < SMALL_PUT_BYTES:
            self.put_seconds = _smooth(self.put_seconds, seconds)
        else:
            self.write_bytes_per_second = _smooth(self.write_bytes_per_second,
                                                  nbytes / max(seconds - self.put_seconds, seconds / 10))

    def load_seconds(self, num_blocks: int, block_bytes: int) -> float:
        return num_blocks * block_bytes / self.storage_bytes_per_second

    def recompute_seconds(self, num_blocks: int, block_size: int) -> float:
        return num_blocks * block_size / self.prefill_tokens_per_second

    def write_seconds(self, nbytes: int, objects: int) -> float:
        return nbytes / self.write_bytes_per_second + objects * self.put_seconds


@dataclass(frozen=True)
class KvPolicy:
    """Whether to write a request's KV blocks now: ``mode`` "auto" weighs the costs above, "always"
    writes every block it can, "never" none (states alone: a resumed request computes its KV again)."""

    mode: str = "auto"
    mtbf: float = 6 * 3600.0

    def crash_chance(self, remaining_seconds: float) -> float:
        """The chance that the worker dies within ``remaining_seconds`` (crashes as a Poisson process)."""
        if self.mtbf <= 0:
            return 1.0
        return -math.expm1(-max(0.0, remaining_seconds) / self.mtbf)

    def worth_writing(self, rates: TransferRates, *, blocks: int, block_size: int, block_bytes: int,
                      written_blocks: int, objects: int, remaining_steps: int) -> bool:
        """``blocks`` blocks would be saved from recomputing by writing ``written_blocks`` blocks in
        ``objects`` objects, for a request with ``remaining_steps`` steps to go."""
        if self.mode != "auto":
            return self.mode == "always"
        saved = rates.recompute_seconds(blocks, block_size) - rates.load_seconds(blocks, block_bytes)
        expected = self.crash_chance(remaining_steps * rates.step_seconds) * saved
        return expected > rates.write_seconds(written_blocks * block_bytes, objects)
