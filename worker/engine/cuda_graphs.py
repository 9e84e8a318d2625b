"""CUDA graphs of decode steps: a decode step's forward pass replayed as one launch instead of the few
hundred kernels eager PyTorch launches one by one, so that the host's launch time stops bounding a
small step (docs/engine.md, "CUDA graphs").

What is captured: ``DecoderModel.forward`` of a decode-only step (every row one token, no pooled rows)
of ``bucket`` rows, for each size of ``bucket_sizes`` a step has needed, over persistent input buffers
(``DecodeInputs``) that each step copies its inputs into. The logits stay eager: one large multiply, and
a graph's output lives as long as the graph, so ``[bucket, vocab]`` float32 kept per bucket would cost
more memory than every other part of the graphs together.

Padding rows (a step of ``n`` rows replayed in the graph of the next bucket up) read and write only a
scratch KV block that the block manager never hands out: their slot is its first slot and their context
that one token, so they harm no sequence's cache and produce finite values in rows no one reads.

Captured lazily, a bucket the first time a step needs it, not all at start: a bulk worker's batches
mostly sit at one size, a start stays as quick as without graphs (a worker is respawned often), and
only buckets in use take memory. The cost is one synchronisation and a capture (a few eager warm-up
passes, which also compile the Triton kernels for the bucket's shape) on a bucket's first step.

No host synchronisation is allowed under capture. The forward pass has none on the Triton path: its
wrappers read only shapes, and the decode kernel's grid (rows, kv heads, splits) and split count come
from the bucket and the block tables' fixed width, never from values (context lengths are read on the
device). The PyTorch reference attention is not captured (``reason_not_to``): it was not written for
it. A capture that fails turns graphs off for the runner, with the reason logged: eager steps still run.

Not bit-exact against eager: a padded batch may take other matrix-multiply kernels, and the decode
kernel splits a context by the buffers' width, not the step's; replaying a graph gives the very values
of an eager pass over the same padded inputs.
"""

from __future__ import annotations

import bisect
import logging

import torch

from worker.model.decoder import DecoderModel, StepInput

log = logging.getLogger("berth.engine")

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16
"""Buckets past the small ones are multiples of this: a step pads at most this many rows less one."""
WARMUP_PASSES = 2
"""Eager passes before a capture: the first compiles the Triton kernels and sets cuBLAS up."""


def bucket_sizes(max_rows: int) -> tuple[int, ...]:
    """The row counts graphs are captured for: 1, 2, 4, 8, then every ``BUCKET_STEP`` up to ``max_rows``,
    which is the last (a step never has more rows than ``max_num_seqs``)."""
    sizes = [s for s in SMALL_BUCKETS if s < max_rows]
    sizes += range(BUCKET_STEP, max_rows, BUCKET_STEP)
    return tuple(sorted(set(sizes) | {max_rows}))


def bucket_for(rows: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket of ``sizes`` holding ``rows``; None past the largest."""
    i = bisect.bisect_left(sizes, rows)
    return sizes[i] if i < len(sizes) else None


def decode_only(step: StepInput) -> bool:
    """Whether ``step`` is what a graph replays: rows all single-token queries, none pooled."""
    return 0 < step.num_decode == step.input_ids.shape[0] and not step.num_pooled


def reason_not_to(enabled: bool, device: torch.device, attention: str) -> str | None:
    """Why a runner keeps every step eager, or None where decode steps are graphed: CUDA and the Triton
    attention only (the CPU has no graphs; the PyTorch reference attention is not capture-safe)."""
    if not enabled:
        return "cuda_graphs is off"
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    if attention != "triton":
        return f"the attention is {attention}, not Triton"
    return None


class DecodeInputs:
    """The persistent inputs of every decode graph: buffers of ``max_rows`` rows, block tables
    ``max_blocks`` wide; the graph of a bucket reads their first ``bucket`` rows (``view``)."""

    def __init__(self, max_rows: int, max_blocks: int, scratch_block: int, block_size: int,
                 device: torch.device):
        z = lambda *shape, dtype=torch.int64: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.scratch_block, self.scratch_slot = scratch_block, scratch_block * block_size
        self.input_ids, self.positions, self.slot_mapping = z(max_rows), z(max_rows), z(max_rows)
        self.block_tables = z(max_rows, max_blocks, dtype=torch.int32)
        self.context_lens = z(max_rows, dtype=torch.int32)
        self.rows = torch.arange(max_rows, device=device)
        self._no_prefill = (z(1, dtype=torch.int32), z(0, 1, dtype=torch.int32), z(0, dtype=torch.int32))
        self.pad(0, max_rows)

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    def view(self, bucket: int) -> StepInput:
        """The step a graph of ``bucket`` rows is captured on: views of the buffers, so that what
        ``load`` copies in is what a replay reads."""
        start, tables, lens = self._no_prefill
        return StepInput(input_ids=self.input_ids[:bucket], positions=self.positions[:bucket],
                         slot_mapping=self.slot_mapping[:bucket], num_decode=bucket,
                         decode_block_tables=self.block_tables[:bucket],
                         decode_context_lens=self.context_lens[:bucket], prefill_query_start_loc=start,
                         prefill_block_tables=tables, prefill_context_lens=lens, logits_rows=self.rows[:bucket])

    def load(self, step: StepInput, bucket: int) -> None:
        """Copy a decode-only ``step`` into the first rows and pad the rest of ``bucket`` (device copies,
        no wait). Columns of a row past the step's table width keep stale ids: the kernel reads a table
        only below the row's context length."""
        n, width = step.num_decode, step.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(step.input_ids)
        self.positions[:n].copy_(step.positions)
        self.slot_mapping[:n].copy_(step.slot_mapping)
        self.context_lens[:n].copy_(step.decode_context_lens)
        self.block_tables[:n, :width].copy_(step.decode_block_tables)
        self.pad(n, bucket)

    def pad(self, start: int, end: int) -> None:
        """Rows ``[start, end)`` as padding: token 0 at position 0, written to and read from the scratch
        block's first slot only."""
        if start >= end:
            return
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = self.scratch_slot
        self.context_lens[start:end] = 1
        self.block_tables[start:end, 0] = self.scratch_block


class DecodeGraphs:
    """A runner's decode graphs: ``run`` replays the step's bucket (capturing it first if new), or says
    None where the step runs eagerly."""

    def __init__(self, model: DecoderModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_rows: int,
                 max_blocks: int, scratch_block: int, block_size: int, device: torch.device):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.sizes = bucket_sizes(max_rows)
        self.inputs = DecodeInputs(max_rows, max_blocks, scratch_block, block_size, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()  # one memory pool: replays never run at once
        self.broken: str | None = None  # why graphs were turned off after a failed capture
        self.replays = 0  # steps replayed (tests and benchmarks read it)

    def run(self, step: StepInput) -> torch.Tensor | None:
        """Final hidden states of ``step.logits_rows``, as ``DecoderModel.forward`` gives them, from a
        graph; None where ``step`` is not graphed (mixed, too many rows or blocks, graphs broken).

        The result lives in the graph's memory until the next replay: the caller uses it first."""
        if self.broken is not None or not decode_only(step):
            return None
        bucket = bucket_for(step.num_decode, self.sizes)
        if bucket is None or step.decode_block_tables.shape[1] > self.inputs.max_blocks:
            return None
        if bucket not in self.graphs and not self._capture(bucket):
            return None
        graph, hidden = self.graphs[bucket]
        self.inputs.load(step, bucket)
        graph.replay()
        self.replays += 1
        n = step.num_decode
        # a decode-only step's logits rows rise through [0, n): all n of them is every row, in order
        return hidden[:n] if step.logits_rows.shape[0] == n else hidden.index_select(0, step.logits_rows)

    def _capture(self, bucket: int) -> bool:
        """Capture the graph of ``bucket`` rows on padding inputs (which touch only the scratch block)."""
        inputs = self.inputs.view(bucket)
        self.inputs.pad(0, bucket)
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_PASSES):
                    self.model.forward(inputs, self.kv_caches)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = self.model.forward(inputs, self.kv_caches)
        except Exception as exc:  # noqa: BLE001 (never the worker's end: its steps run eagerly from now on)
            self.broken = f"capturing the decode graph of {bucket} rows failed: {exc!r}"
            log.warning("CUDA graphs off: %s", self.broken)
            return False
        self.graphs[bucket] = (graph, hidden)
        log.info("captured the CUDA graph of decode steps of %d rows (%d graphs)", bucket, len(self.graphs))
        return True
