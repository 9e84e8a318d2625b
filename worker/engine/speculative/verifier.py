"""Verifying drafts (vLLM's rejection sampler, for drafts without a model): a sequence with k draft tokens was
scored as one chunk of k + 1 query tokens (its last token and the drafts), so the step has k + 1 rows of
logits for it, each sampled as its own position (``Engine._sample_row`` with the row's offset: bias,
``min_tokens`` and logprobs as without drafts; penalties count the draft tokens before the row, and a
grammar's mask is its matcher's past them, rolled back after: ``grammar.fill_bitmask``'s ``ahead``). The draft
is accepted as far as it equals those tokens; the token sampled after the last accepted one is the bonus
token. The sequence keeps the accepted tokens and the bonus (1 to k + 1 tokens), exactly the tokens k + 1
plain decode steps would have sampled, and gives back the KV slots of the rejected ones: its computed count
set back and the blocks past it freed. Those blocks were never named for the prefix cache (a block is named
only once ``Sequence.token_ids`` fills it: drafts are never there), so no cached hash ever holds a rejected
draft.

Seeded rows alike: each row is drawn with the uniform number of its own position (``sampler.uniform``), the
draw the engine makes there without drafts, so a draft token is kept exactly when that draw is it. A
prompt-lookup draft is one token a position with certainty (q = 1), for which this is rejection sampling:
kept with probability p(x), and on rejection the bonus token drawn from p without x, renormalised (the
draw, given it is not x). The text is the same as without drafts, a function of the seed alone.
"""

from __future__ import annotations

from worker.engine.block_manager import BlockManager
from worker.engine.request import Sequence
from worker.engine.sampler import Sampled


def accepted_length(draft: list[int], target: list[int]) -> int:
    """How many leading draft tokens equal the tokens sampled at their positions (``target`` has one
    more row than ``draft``: the last is the bonus token's)."""
    n = 0
    for proposed, sampled in zip(draft, target):
        if proposed != sampled:
            break
        n += 1
    return n


def row_offsets(rows: list[Sequence]) -> list[int]:
    """Each row's offset past its sequence's next position: 0 for a sequence's first row, j for the row
    after its j-th draft token (a verified sequence's rows are consecutive)."""
    offsets, previous = [], None
    for seq in rows:
        offsets.append(offsets[-1] + 1 if seq is previous else 0)
        previous = seq
    return offsets


def settle(rows: list[Sequence], sampled: Sampled, blocks: BlockManager
           ) -> tuple[list[Sequence], Sampled, list[tuple[Sequence, int, int]]]:
    """The rows and tokens that stand once each verified sequence's draft is judged (its accepted tokens
    and the bonus, in order; a plain row as it was), and (sequence, drafted, accepted) for each verified
    one. A verified sequence's computed count drops by its rejected drafts, and blocks holding only those
    go back to the free list; its draft is cleared."""
    kept_rows: list[Sequence] = []
    tokens: list[int] = []
    logprobs: list[dict | None] = []
    verified: list[tuple[Sequence, int, int]] = []
    i = 0
    while i < len(rows):
        seq = rows[i]
        k = len(seq.draft)
        width = k + 1 if k and i + k < len(rows) and rows[i + k] is seq else 1
        keep = width
        if width > 1:
            accepted = accepted_length(seq.draft, sampled.token_ids[i:i + width])
            keep = accepted + 1
            verified.append((seq, k, accepted))
            seq.draft = []
            if not seq.is_finished:  # failed or aborted since: its blocks are gone already
                seq.num_computed_tokens -= k - accepted
                blocks.trim(seq)
        kept_rows += rows[i:i + keep]
        tokens += sampled.token_ids[i:i + keep]
        logprobs += sampled.logprobs[i:i + keep]
        i += width
    return kept_rows, Sampled(tokens, logprobs), verified
