"""What the speculation tests share: requests asking what a draft must respect, and outputs in a form that
compares them token for token (logprobs to float32's rounding: a verified row is computed beside its draft's)."""

from __future__ import annotations

import pytest

from worker.engine.request import SamplingParams


def draft_params(n: int) -> list[SamplingParams]:
    """Greedy requests with stop strings, max_tokens inside a draft, n = 2, logprobs, min_tokens, logit_bias."""
    return [SamplingParams(max_tokens=(7, 24, 30, 13)[i % 4], temperature=0.0,
                           stop=(" the",) if i % 5 == 2 else (), logprobs=2 if i % 3 == 1 else None,
                           n=2 if i % 7 == 3 else 1, min_tokens=4 if i % 4 == 3 else 0,
                           logit_bias=((13, 1.5),) if i % 6 == 5 else ()) for i in range(n)]


def output_texts(outputs) -> list:
    """Each completion's tokens, text, finish reason and logprobs (tokens and top ids exact, values approx)."""
    return [[(c.token_ids, c.text, c.finish_reason,
              [(lp["token_id"], pytest.approx(lp["logprob"], rel=1e-3, abs=1e-4), [t for t, _ in lp["top"]])
               for lp in c.logprobs or ()]) for c in o.completions] for o in outputs]
