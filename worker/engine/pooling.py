"""Embeddings inside the engine: which rows of a step an input's vector is pooled from, and the vector.

An embeddings input is a sequence that is prefilled and never sampled. Its chunks run in the same
flattened steps as everything else; the rows they pool are put after the rows that need logits, so
the model's final norm runs once over both and a step without embeddings runs the rows it always
ran. Mean pooling adds each chunk's rows to a running float32 sum on the sequence (restarted by a
chunk from position 0, as a recomputed sequence's first one is, so a preemption changes nothing);
last-token pooling takes the final row when the chunk that holds it runs. When the last chunk has
run, the vector is the mean (or the last row), cut to ``dimensions`` and L2-normalised, as
sentence-transformers' Pooling then Normalize modules and OpenAI's ``dimensions`` give it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from worker.engine.request import Sequence
from worker.model.pooling_config import LAST, MEAN

__all__ = ["LAST", "MEAN", "PoolRows", "accumulate", "chunk_rows", "pool_step", "vector"]


@dataclass
class PoolRows:
    """The pooled rows of one step: per row its segment, per segment the sequence and the chunk's start."""

    rows: list[int] = field(default_factory=list)  # rows of the step's hidden states
    segments: list[int] = field(default_factory=list)  # per row, the index into ``seqs``
    seqs: list[Sequence] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # per sequence, the position its chunk began at
    segment_ids: torch.Tensor | None = None  # ``segments`` on the model's device, set by the model runner

    def add(self, seq: Sequence, start: int, first_row: int, positions: range) -> None:
        """Rows ``first_row + (p - start)`` for ``p`` in ``positions`` pool into ``seq``."""
        if not positions:
            return
        index = len(self.seqs)
        self.seqs.append(seq)
        self.starts.append(start)
        self.rows.extend(first_row + p - start for p in positions)
        self.segments.extend([index] * len(positions))


def chunk_rows(kind: str, start: int, end: int, num_tokens: int) -> range:
    """The positions of a chunk ``[start, end)`` whose hidden states the sequence's vector needs."""
    if kind == LAST:
        return range(num_tokens - 1, num_tokens) if end == num_tokens else range(0)
    return range(start, end)


def pool_step(pool: PoolRows, hidden: torch.Tensor, kind: str) -> None:
    """Add a step's pooled rows (``hidden``, in ``pool.rows`` order) to their sequences: the rows of
    each segment summed in float32 at once (a last-token segment has one row)."""
    out = torch.zeros((len(pool.seqs), hidden.shape[-1]), dtype=torch.float32, device=hidden.device)
    out.index_add_(0, pool.segment_ids, hidden.float())
    for seq, start, part in zip(pool.seqs, pool.starts, out):
        accumulate(seq, kind, start, part)


def accumulate(seq: Sequence, kind: str, start: int, part: torch.Tensor) -> None:
    if kind == MEAN and start > 0 and seq.pooled is not None:
        seq.pooled = seq.pooled + part
    else:
        seq.pooled = part


def vector(seq: Sequence, kind: str, dimensions: int | None) -> torch.Tensor:
    """The finished input's unit vector (float32, on the CPU)."""
    v = seq.pooled / seq.num_tokens if kind == MEAN else seq.pooled
    return F.normalize(v[:dimensions].cpu(), dim=-1)
