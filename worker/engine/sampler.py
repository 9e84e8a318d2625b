"""Pick the next token of every sampling sequence of a step, the whole batch at once.

Randomness is a pure function of (request seed, sample index, token position): each row draws one
uniform number from a counter-based hash and inverts the cumulative distribution with it. The same
request therefore gives the same text whatever shares its batch, and after a restart.

Structured outputs: the rows a grammar constrains come with a bitmask of their allowed tokens
(worker/engine/structured/grammar.py), applied to their logits after any bias and penalty (so no bias lifts a
token the grammar forbids), before min_tokens, temperature, min-p, top-k and top-p;
the draw is unchanged, so a constrained row is as deterministic as any. Rows without a grammar take
the same path as when no row has one.

Logits processing: rows with a ``logit_bias`` or a repetition, frequency or presence penalty have
them applied first (worker/engine/penalties.py), then everything else; ``min_p`` is applied after
the temperature, before top-k and top-p (vLLM's order; transformers' ``MinPLogitsWarper``). Rows
without them take the path they took before these existed, at the same cost.

Logprobs are of the distribution after the bias and penalties (the model's as the request asked
to change it; vLLM's ``processed`` logprobs, less the temperature) and before any grammar mask,
``min_tokens`` suppression, temperature or truncation, so a constrained token's logprob says how
likely it was. A row without bias or penalty reports the raw distribution, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.engine import penalties
from worker.engine.request import SamplingParams
from worker.engine.structured.grammar import apply_bitmask

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def uniform(seed: int, sample_index: int, position: int) -> float:
    """A number in [0, 1) that depends on its three arguments alone."""
    x = _splitmix64(_splitmix64(_splitmix64(seed & _MASK) ^ sample_index) ^ position)
    return (x >> 11) * (1.0 / (1 << 53))


@dataclass
class SampleRow:
    params: SamplingParams
    sample_index: int
    position: int  # where the sampled token will stand in the sequence
    num_output_tokens: int  # generated so far
    suppress_ids: tuple[int, ...]  # token ids forbidden before min_tokens (EOS and stop ids)
    counts: penalties.TokenCounts | None = None  # the sequence's token counts, where it uses a penalty


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[dict | None]  # per row: {"logprob": float, "top": [(token_id, logprob), ...]}


def sample(logits: torch.Tensor, rows: list[SampleRow],
           grammar_mask: tuple[list[int], torch.Tensor] | None = None) -> Sampled:
    """``logits``: float32 ``[len(rows), vocab]``; ``grammar_mask``: the constrained rows' indices and
    their bitmask (``worker.engine.structured.grammar.fill_bitmask``), or None when no row is constrained."""
    return draw(logits, rows, grammar_mask)[1]()


def draw(logits: torch.Tensor, rows: list[SampleRow], grammar_mask: tuple[list[int], torch.Tensor] | None = None
         ) -> tuple[torch.Tensor, Callable[[], Sampled]]:
    """``sample`` in two halves: the tokens as a tensor where the logits are, drawn without waiting for the
    device, and a function that reads them and their logprobs on the host (which waits)."""
    n = len(rows)
    device = logits.device
    processed = [i for i, r in enumerate(rows) if r.params.processed]
    if processed:
        if len(processed) == n:
            logits = penalties.process(logits, [r.params for r in rows], [r.counts for r in rows])
        else:
            logits[processed] = penalties.process(logits[processed], [rows[i].params for i in processed],
                                                  [rows[i].counts for i in processed])
    want_logprobs = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    raw_logprobs = torch.log_softmax(logits[want_logprobs], dim=-1) if want_logprobs else None
    if grammar_mask is not None:
        apply_bitmask(logits, *grammar_mask)
    for i, r in enumerate(rows):
        if r.num_output_tokens < r.params.min_tokens and r.suppress_ids:
            logits[i, list(r.suppress_ids)] = float("-inf")
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if len(greedy) == n:  # the common bulk case: no copy of the logits
        tokens = logits.argmax(dim=-1)
    else:
        tokens = torch.empty(n, dtype=torch.long, device=device)
        if greedy:
            tokens[greedy] = logits[greedy].argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        tokens[random_rows] = _sample_random(logits[random_rows], [rows[i] for i in random_rows])
    if want_logprobs:  # the chosen tokens' and the top ones', computed on the device before anything is read
        chosen = raw_logprobs.gather(1, tokens[want_logprobs].unsqueeze(1)).squeeze(1)
        widest = max(rows[i].params.logprobs for i in want_logprobs)
        top = torch.topk(raw_logprobs, widest, dim=-1) if widest else None

    def read() -> Sampled:
        token_list = tokens.tolist()
        logprobs: list[dict | None] = [None] * n
        if want_logprobs:
            chosen_list = chosen.tolist()
            top_ids, top_values = (top.indices.tolist(), top.values.tolist()) if top is not None else ((), ())
            for j, i in enumerate(want_logprobs):
                k = rows[i].params.logprobs
                logprobs[i] = {"logprob": chosen_list[j],
                               "top": list(zip(top_ids[j][:k], top_values[j][:k])) if k else []}
        return Sampled(token_list, logprobs)

    return tokens, read


def apply_min_p(x: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """transformers' ``MinPLogitsWarper``, each row with its own ``min_p`` (0 keeps every token): a
    token less likely than ``min_p`` times the row's top token is dropped. The top token is never
    below that floor (``min_p <= 1``), so one always stays."""
    probs = torch.softmax(x, dim=-1)
    floor = torch.tensor(min_p, dtype=x.dtype, device=x.device)[:, None] * probs.amax(dim=-1, keepdim=True)
    return x.masked_fill(probs < floor, float("-inf"))


def _sample_random(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=logits.device)
    x = logits / temps[:, None]
    min_p = [r.params.min_p for r in rows]
    if any(min_p):
        x = apply_min_p(x, min_p)
    top_k = [r.params.top_k for r in rows]
    if any(top_k):
        top_k = [min(k, x.shape[-1]) for k in top_k]  # the door refuses more; never let torch.topk raise
        kth = torch.topk(x, max(top_k), dim=-1).values
        for i, k in enumerate(top_k):
            if k:
                x[i][x[i] < kth[i, k - 1]] = float("-inf")
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=x.dtype, device=x.device)
    if (top_p < 1).any():
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
        sorted_x[before > top_p[:, None]] = float("-inf")  # the top token always stays
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    cdf = torch.softmax(x, dim=-1).cumsum(dim=-1)
    u = torch.tensor([uniform(r.params.seed, r.sample_index, r.position) for r in rows],
                     dtype=cdf.dtype, device=cdf.device)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return picked.clamp_(max=cdf.shape[-1] - 1)
