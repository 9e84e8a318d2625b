"""Prompt lookup: the longest n-gram ending the sequence, what followed its latest occurrence."""

from __future__ import annotations

import pytest

from worker.engine.speculative.proposer import NgramIndex


def test_proposes_what_followed_the_longest_match():
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 1, 2, 3]
    # (1, 2, 3) occurred at the start, followed by 4 9 2; (2, 3) later, followed by 5 6: the longest wins
    assert NgramIndex(1, 3).propose(tokens, 3) == [4, 9, 2]
    assert NgramIndex(1, 2).propose(tokens, 3) == [5, 6, 7]  # (2, 3): its latest occurrence


def test_no_match_no_draft_and_min_n_is_kept():
    assert NgramIndex(1, 3).propose([1, 2, 3, 4], 4) == []
    assert NgramIndex(2, 3).propose([5, 1, 7, 1], 4) == []  # (1,) occurred, but one token is under min_n
    assert NgramIndex(1, 3).propose([5, 1, 7, 1], 4) == [7, 1, 7, 1]
    assert NgramIndex(1, 3).propose([5], 4) == []
    assert NgramIndex(1, 3).propose([5, 6, 5, 6], 0) == []


def test_a_cycle_is_drafted_past_the_end():
    # the match's continuation runs into the end: the draft goes on repeating the cycle
    assert NgramIndex(1, 3).propose([8, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert NgramIndex(1, 3).propose([4, 4, 4], 3) == [4, 4, 4]


def test_the_index_follows_a_growing_sequence():
    index, tokens = NgramIndex(1, 3), [10, 11, 12, 13]
    assert index.propose(tokens, 2) == []
    tokens += [10, 11]
    assert index.propose(tokens, 2) == [12, 13]
    tokens += [99]
    assert index.propose(tokens, 2) == []
    tokens += [12]
    assert index.propose(tokens, 2) == [13, 10]
    # the same answers as an index built at once
    assert NgramIndex(1, 3).propose(tokens, 2) == [13, 10]


@pytest.mark.parametrize("sizes", [(0, 3), (3, 2)])
def test_sizes_are_checked(sizes):
    with pytest.raises(ValueError):
        NgramIndex(*sizes)
