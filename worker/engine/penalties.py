"""Logits processing before the draw: logit_bias, then the repetition, frequency and presence penalties.

The order and formulas are those of the services whose files berth runs (vLLM's sampler applies the
bias, then ``apply_penalties``):

- ``logit_bias`` (OpenAI): ``logit[j] += bias[j]``.
- ``repetition_penalty`` (vLLM; transformers' ``RepetitionPenaltyLogitsProcessor``): over the prompt
  and the output, a seen token's logit is divided by the penalty where positive, multiplied where negative.
- ``frequency_penalty`` and ``presence_penalty`` (OpenAI): over the output so far,
  ``logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty``.

``min_p`` needs the temperature-scaled distribution and lives with the other truncations in
``worker.engine.sampler``.

Cost: a sequence that uses a penalty carries a ``TokenCounts`` (its distinct tokens, each with its
count in the output), built once from its tokens the first time it is sampled (so a sequence
resumed from a checkpoint, forked for ``n > 1`` or recomputed after a preemption counts exactly its
own tokens) and then kept up to date one token per step. A step gathers the logits of every
penalised row's seen tokens at once, applies each row's parameters to them and scatters them back:
work in proportion to the rows' distinct tokens, not to rows x vocabulary. Rows without any
processing are not touched, and a step without such rows runs none of this.
"""

from __future__ import annotations

import functools
from array import array
from dataclasses import dataclass

import numpy as np
import torch

from worker.engine.request import SamplingParams


@dataclass(eq=False)
class TokenCounts:
    """One sequence's distinct tokens (prompt and output), each with how many times it was generated,
    kept incrementally. Sparse: a step touches only the logits of tokens a row has seen, so the
    cost follows the rows' lengths, not rows x vocabulary (the dense form cost several times the
    sampling itself on CPU). Host arrays: appending a token is a few Python operations, and a step
    hands all rows' entries to torch in one concatenation."""

    slot: dict[int, int]  # token id -> its index in ids and output
    ids: array  # int64: the distinct token ids, in order of first appearance
    output: array  # float32: times each was generated (0 for a token only in the prompt)

    @classmethod
    def of(cls, token_ids: list[int], num_prompt_tokens: int) -> TokenCounts:
        slot: dict[int, int] = {}
        for t in token_ids:
            slot.setdefault(t, len(slot))
        output = array("f", bytes(4 * len(slot)))
        for t in token_ids[num_prompt_tokens:]:
            output[slot[t]] += 1
        return cls(slot, array("q", slot), output)

    def extended(self, tokens: list[int]) -> TokenCounts:
        """A copy that has also generated ``tokens``: the counts a verified row sees after the draft tokens
        before it (``worker.engine.speculative``)."""
        copy = TokenCounts(dict(self.slot), array("q", self.ids), array("f", self.output))
        for token in tokens:
            copy.add(token)
        return copy

    def add(self, token: int) -> None:
        """The sequence has generated ``token``."""
        s = self.slot.get(token)
        if s is None:
            self.slot[token] = s = len(self.ids)
            self.ids.append(token)
            self.output.append(0.0)
        self.output[s] += 1


@functools.lru_cache(maxsize=4096)
def _bias(logit_bias: tuple[tuple[int, float], ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's bias as (ids, values), built once per distinct bias, not every step."""
    ids, values = zip(*logit_bias)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(values, dtype=torch.float32)


def process(logits: torch.Tensor, params: list[SamplingParams], counts: list[TokenCounts | None]) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` (float32) with each row's bias and penalties applied, in place
    where possible; ``counts[i]`` is needed where ``params[i].penalized``."""
    if any(p.logit_bias for p in params):
        rows, ids, values = [], [], []
        for i, p in enumerate(params):
            if p.logit_bias:
                t, v = _bias(p.logit_bias)
                rows.append(torch.full_like(t, i))
                ids.append(t)
                values.append(v)
        device = logits.device
        logits.index_put_((torch.cat(rows).to(device), torch.cat(ids).to(device)),
                          torch.cat(values).to(device=device, dtype=logits.dtype), accumulate=True)
    penalized = [i for i, p in enumerate(params) if p.penalized]
    if not penalized:
        return logits
    device = logits.device
    lengths = torch.tensor([len(counts[i].ids) for i in penalized])
    rows = torch.tensor(penalized).repeat_interleave(lengths).to(device)
    ids = torch.from_numpy(np.concatenate([np.frombuffer(counts[i].ids, np.int64) for i in penalized])).to(device)
    ps = [params[i] for i in penalized]
    per = lambda values: torch.tensor(values, dtype=logits.dtype).repeat_interleave(lengths).to(device)  # noqa: E731
    x = logits[rows, ids]
    if any(p.repetition_penalty != 1 for p in ps):  # every entry is a seen token
        rep = per([p.repetition_penalty for p in ps])
        x = torch.where(x < 0, x * rep, x / rep)
    if any(p.frequency_penalty or p.presence_penalty for p in ps):
        c = torch.from_numpy(np.concatenate([np.frombuffer(counts[i].output, np.float32) for i in penalized]))
        c = c.to(device=device, dtype=logits.dtype)
        x = x - (c * per([p.frequency_penalty for p in ps]) + (c > 0) * per([p.presence_penalty for p in ps]))
    logits[rows, ids] = x
    return logits
