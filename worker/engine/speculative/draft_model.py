"""Drafts from a draft model (``--speculative-model``): a smaller model of the target's tokenizer proposes
each drafting sequence's next k tokens greedily, and the engine verifies them as it does prompt lookup's
(``verifier.py``: greedy and seeded outputs are the same tokens as without drafts, whatever the draft).

The draft model runs through the engine's own parts: a ``ModelRunner`` (the same attention path, paged KV
cache and step tensors) and a ``BlockManager`` of its own, without prefix caching. Each target sequence
that drafts has a shadow: a ``Sequence`` of the same request whose ``token_ids`` are the target's tokens
(then the draft's) and whose ``num_computed_tokens`` and ``block_table`` say what the draft's cache holds
of them. A proposal, for all of a step's drafting sequences at once:

1. catches up: one model call prefills, for each shadow, the tokens its cache lacks (the whole prompt on
   first use; afterwards the tokens accepted since, and the bonus token) and takes its first draft token;
2. runs k - 1 batched decode steps, each feeding the token just drafted (the k-th draft token itself is
   never fed: the target verifies it).

Blocks for the whole proposal are taken up front; a sequence for which the draft pool has no room (after
dropping the shadows of sequences that are not drafting this step) gets no draft this step. After
verification (``rollback``) the shadow keeps only the accepted tokens: its computed count goes back to at
most the tokens its sequence holds, and the blocks past it are freed (``BlockManager.trim``). A proposal
also checks that the shadow's computed tokens are the sequence's (a shortened or cut draft) and rolls back
further if not. Shadows of sequences that finished, were aborted or preempted are dropped lazily: at each
proposal, any whose sequence is no longer running (a finished one at once, ``release``).

The pool's size is not a setting: the draft's cache holds ``POOL_SHARE`` of the target cache's tokens
(blocks of the same size), in the draft model's own, much smaller, bytes a token. Drafts are the draft
model's argmax; ids past the target's vocabulary (a padded embedding) end a draft. The draft model runs
in the compute dtype, its cache unquantized, without CUDA graphs.
"""

from __future__ import annotations

import logging

import torch

from worker.engine.block_manager import BlockManager
from worker.engine.model_runner import ModelRunner, decode_rows_first
from worker.engine.request import SeqStatus, Sequence

log = logging.getLogger("berth.engine")

POOL_SHARE = 0.25  # of the target cache's tokens, held by the draft's cache
SAMPLE_IDS = 512  # token ids compared between the two tokenizers, evenly spread


class TokenizerMismatch(ValueError):
    """The draft model's tokenizer is not the target's: its drafts would be other tokens."""


def check_same_tokenizer(draft, target, draft_path: str, target_path: str) -> None:
    """Raise ``TokenizerMismatch`` naming both paths and what differs, unless the two tokenizers have the same
    number of tokens, the same BOS and EOS ids, and the same token at ``SAMPLE_IDS`` ids spread over the
    vocabulary (its ends included). The models' logits widths may differ (a padded embedding)."""
    a, b = draft.tokenizer, target.tokenizer
    where = f"the draft model {draft_path} and the target {target_path}"
    if len(a) != len(b):
        raise TokenizerMismatch(f"{where} have different tokenizers: {len(a)} tokens against {len(b)}")
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(a, name, None) != getattr(b, name, None):
            raise TokenizerMismatch(f"{where} have different tokenizers: {name} {getattr(a, name, None)} "
                                    f"against {getattr(b, name, None)}")
    n = len(a)
    ids = sorted({i * (n - 1) // (SAMPLE_IDS - 1) for i in range(SAMPLE_IDS)} if n > 1 else {0})
    for i, x, y in zip(ids, a.convert_ids_to_tokens(ids), b.convert_ids_to_tokens(ids)):
        if x != y:
            raise TokenizerMismatch(f"{where} have different tokenizers: token {i} is {x!r} against {y!r}")


class DraftModel:
    """The draft model's runner, block pool and shadows; ``propose`` drafts, ``rollback`` keeps what was
    accepted, ``release`` frees a finished sequence's cache."""

    def __init__(self, loaded, *, target_blocks: int, target_vocab: int, dtype: torch.dtype, device: torch.device,
                 block_size: int, attention_backend: str = "auto"):
        tokens = max(block_size, int(POOL_SHARE * target_blocks) * block_size)
        # the runner sizes its cache for max_seqs sequences of max_model_len tokens: here one "sequence" of the
        # pool's tokens (kv_memory 0), at most the runner's usual share of the free memory
        self.runner = ModelRunner(loaded, dtype=dtype, device=device, block_size=block_size, kv_memory=0,
                                  attention_backend=attention_backend, max_seqs=1, max_model_len=tokens,
                                  cuda_graphs=False)
        self.blocks = BlockManager(self.runner.num_blocks, block_size, enable_prefix_cache=False)
        self.target_vocab = target_vocab
        self.shadows: dict[int, tuple[Sequence, Sequence]] = {}  # target's seq_id -> (target, shadow)
        log.info("draft model %s: %d KV blocks", loaded.path, self.runner.num_blocks)

    # ---- drafts
    def propose(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        """``k`` greedy draft tokens for each (sequence, k), or none where the pool has no room."""
        drafting = {seq.seq_id for seq, _ in wanted}
        self._sweep(drafting)
        runs: list[tuple[Sequence, Sequence, int]] = []  # target, shadow, k
        for seq, k in wanted:
            shadow = self._shadow(seq)
            n = len(shadow.token_ids) - shadow.num_computed_tokens
            if not self._room(shadow, n + k - 1, drafting):
                self.release(seq)
                continue
            runs.append((seq, shadow, k))
        if runs:
            # the catch-up: every shadow's missing tokens and its first draft token, in one call
            self._step([(shadow, len(shadow.token_ids) - shadow.num_computed_tokens) for _, shadow, _ in runs])
            for j in range(1, max(k for _, _, k in runs)):
                self._step([(shadow, 1) for _, shadow, k in runs if k > j])
        drafts = {seq.seq_id: self._draft_of(seq, shadow) for seq, shadow, _ in runs}
        return [drafts.get(seq.seq_id, []) for seq, _ in wanted]

    def _draft_of(self, seq: Sequence, shadow: Sequence) -> list[int]:
        draft = shadow.token_ids[len(seq.token_ids):]
        for i, token in enumerate(draft):
            if token >= self.target_vocab:
                return draft[:i]
        return draft

    def _step(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """One model call over the shadows' next tokens; each shadow's argmax joins its tokens."""
        scheduled = decode_rows_first(scheduled)  # as the runner wants
        step, samplers, _ = self.runner.prepare(scheduled, self.blocks.tables)
        logits, _ = self.runner.execute(step)
        for shadow, n in scheduled:
            shadow.num_computed_tokens += n
        for shadow, token in zip(samplers, logits.argmax(dim=-1).tolist()):
            shadow.token_ids.append(token)

    # ---- the shadows
    def _shadow(self, seq: Sequence) -> Sequence:
        """``seq``'s shadow, its tokens set to ``seq``'s and its computed ones those it shares with them."""
        entry = self.shadows.get(seq.seq_id)
        if entry is None:
            shadow = Sequence(request=seq.request, sample_index=seq.sample_index, token_ids=[],
                              num_prompt_tokens=seq.num_prompt_tokens, status=SeqStatus.RUNNING)
            self.shadows[seq.seq_id] = (seq, shadow)
        else:
            shadow = entry[1]
        self._cut(shadow, seq.token_ids)
        shadow.token_ids = list(seq.token_ids)
        return shadow

    def _cut(self, shadow: Sequence, tokens: list[int]) -> None:
        """Set ``shadow``'s computed count back to its tokens that begin ``tokens`` (at most one short of
        ``tokens``: the last is an input still), freeing the blocks past them."""
        n = min(shadow.num_computed_tokens, len(tokens) - 1)
        if shadow.token_ids[:n] != tokens[:n]:
            n = next(i for i, (x, y) in enumerate(zip(shadow.token_ids, tokens)) if x != y)
        shadow.num_computed_tokens = max(n, 0)
        self.blocks.trim(shadow)

    def _room(self, shadow: Sequence, tokens: int, drafting: set[int]) -> bool:
        """Blocks for ``tokens`` more tokens of ``shadow``; if the pool lacks them, shadows of sequences not
        drafting now are dropped first."""
        if self.blocks.allocate(shadow, tokens):
            return True
        for seq_id, (seq, _) in list(self.shadows.items()):
            if seq_id not in drafting:
                self.release(seq)
        return self.blocks.allocate(shadow, tokens)

    def _sweep(self, keep: set[int]) -> None:
        """Drop the shadows of sequences no longer running (finished, aborted, preempted)."""
        for seq_id, (seq, _) in list(self.shadows.items()):
            if seq_id not in keep and seq.status is not SeqStatus.RUNNING:
                self.release(seq)

    def rollback(self, seq: Sequence, accepted: int) -> None:
        """``seq``'s draft of ``len(shadow tokens) - len(seq.token_ids)`` tokens was verified, ``accepted`` of
        them kept (``seq.token_ids`` not yet holding them): the shadow keeps its computed tokens among the
        sequence's and those, its blocks past them freed, its tokens cut there."""
        entry = self.shadows.get(seq.seq_id)
        if entry is None:
            return
        shadow = entry[1]
        keep = len(seq.token_ids) + accepted
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, keep)
        del shadow.token_ids[shadow.num_computed_tokens:]
        self.blocks.trim(shadow)

    def release(self, seq: Sequence) -> None:
        """Free ``seq``'s draft cache (it finished, or its shadow is dropped)."""
        entry = self.shadows.pop(seq.seq_id, None)
        if entry is not None:
            self.blocks.free_sequence(entry[1])

    def held_tokens(self, seq: Sequence) -> list[int] | None:
        """The tokens the draft's cache holds of ``seq`` (None: no shadow): for tests and inspection."""
        entry = self.shadows.get(seq.seq_id)
        return None if entry is None else entry[1].token_ids[:entry[1].num_computed_tokens]
