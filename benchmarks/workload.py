"""The benchmark's workload: prompts cut from real text and output lengths, all drawn from one seed.

Prompts come from the Python standard library's own source: its top-level ``.py`` files in sorted
order, concatenated until ``CORPUS_CHARS`` characters, tokenized once with the model's tokenizer.
Request ``i`` draws, in this order, its prompt length (log-uniform), the offset its prompt is cut
at, and its output length (uniform), from one ``random.Random(seed)``. So a run of N requests is
the first N requests of any longer run with the same seed, and every system measured in a run gets
the very same token ids. (Another Python version ships other stdlib files, hence other prompts.)
"""

from __future__ import annotations

import math
import os
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

PROMPT_LEN_RANGE = (16, 512)
OUTPUT_LEN_RANGE = (8, 256)
CORPUS_CHARS = 1_000_000


@dataclass(frozen=True)
class Workload:
    """Request ``i`` is ``prompts[i]`` (token ids) and must generate exactly ``output_lens[i]`` tokens."""

    prompts: list[list[int]]
    output_lens: list[int]
    seed: int

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        """The useful output tokens: what the requests asked for, summed."""
        return sum(self.output_lens)

    def summary(self) -> dict:
        """Sizes and length statistics, for the results file."""
        prompt_lens = [len(p) for p in self.prompts]
        return {
            "requests": len(self), "seed": self.seed,
            "prompt_len_range": list(PROMPT_LEN_RANGE), "output_len_range": list(OUTPUT_LEN_RANGE),
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "prompt_len": _stats(prompt_lens), "output_len": _stats(self.output_lens),
        }


def _stats(values: list[int]) -> dict:
    return {"min": min(values), "mean": round(statistics.fmean(values), 1),
            "median": statistics.median(values), "max": max(values)}


def corpus_files() -> list[Path]:
    """The standard library's top-level ``.py`` files, sorted by name."""
    return sorted(Path(os.path.dirname(os.__file__)).glob("*.py"))


def corpus_token_ids(tokenizer, max_chars: int = CORPUS_CHARS) -> list[int]:
    """Token ids of the stdlib files, in order, until ``max_chars`` characters have been read.

    Each file is tokenized on its own (no special tokens) and the ids concatenated, which keeps the
    tokenizer's inputs short; a file is cut at the character budget.
    """
    ids: list[int] = []
    remaining = max_chars
    for path in corpus_files():
        if remaining <= 0:
            break
        text = path.read_text(encoding="utf-8", errors="replace")[:remaining]
        remaining -= len(text)
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def make_workload(tokenizer, num_requests: int, seed: int = 0) -> Workload:
    """``num_requests`` requests drawn from ``seed`` over the stdlib corpus tokenized by ``tokenizer``."""
    corpus = corpus_token_ids(tokenizer)
    lo, hi = PROMPT_LEN_RANGE
    if len(corpus) <= hi:
        raise ValueError(f"the corpus has {len(corpus)} tokens, fewer than the longest prompt ({hi})")
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_requests):
        n = min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))
        start = rng.randrange(len(corpus) - n)
        prompts.append(corpus[start:start + n])
        output_lens.append(rng.randint(*OUTPUT_LEN_RANGE))
    return Workload(prompts, output_lens, seed)
