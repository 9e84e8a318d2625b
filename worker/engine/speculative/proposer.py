"""Drafts without a model: prompt lookup (vLLM's n-gram proposer) over a sequence's own tokens.

The draft is what followed, the last time it occurred, the longest n-gram (``max_n`` down to ``min_n``
tokens) that ends the sequence: a model copying a span of its prompt (extraction, rewriting, JSON with
the input's values) or repeating itself writes what the lookup proposes. A continuation that runs into
the sequence's end goes on with the draft itself, so a repeating cycle is drafted whole.

``NgramIndex`` keeps, per sequence, each n-gram's latest end and takes new tokens as they come (a few
dict writes a token), so a proposal costs O(max_n + k) whatever the sequence's length; vLLM's proposer
searches the whole context each step instead (KMP over the reversed tokens). The index only grows:
tokens a sequence holds are never taken back (drafts never enter ``Sequence.token_ids``)."""

from __future__ import annotations


class NgramIndex:
    """The n-grams of one sequence's tokens, each to the end (exclusive) of its latest occurrence that a
    token follows; ``propose`` looks up the n-gram ending the sequence."""

    def __init__(self, min_n: int = 1, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, not {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n)]
        self._indexed = 0  # n-grams ending before this position are in ``_ends``

    def update(self, tokens: list[int]) -> None:
        """Index the n-grams of ``tokens`` (the same list, grown) that a token now follows."""
        for end in range(max(self._indexed, 1), len(tokens)):  # tokens[end] follows the n-gram ending here
            for n in range(1, min(self.max_n, end) + 1):
                self._ends[n - 1][tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, len(tokens))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest n-gram ending ``tokens``, at its latest occurrence;
        none when no n-gram of at least ``min_n`` tokens occurred before."""
        self.update(tokens)
        length = len(tokens)
        if k < 1:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self._ends[n - 1].get(tuple(tokens[length - n:]))
            if end is not None:
                draft: list[int] = []
                for at in range(end, end + k):  # past the end, the draft repeats itself
                    draft.append(tokens[at] if at < length else draft[at - length])
                return draft
        return []
