"""A job's suffix trie: the longest span ending the sequence, then the most frequent path; spans counted once
however the text is fed; nodes and jobs capped; a key reads only what its own key fed."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from worker.engine.speculative.job_suffix import (
    CHUNK,
    FULL_EVERY,
    MIN_MATCH,
    PENDING,
    PROMPT_TAIL,
    JobSuffixIndex,
    SuffixTrie,
)


def test_the_longest_match_then_the_most_frequent_path():
    trie = SuffixTrie(depth=12, max_match=4)
    trie.feed([1, 2, 3, 4, 5, 6])
    trie.feed([9, 3, 4, 7, 8])
    trie.feed([9, 3, 4, 7, 8])
    # (3, 4) was followed by 7 twice and by 5 once: the most frequent path
    p = trie.propose([50, 51, 3, 4], 3)
    assert p.tokens == [7, 8] and p.matched == 2 and p.confidence == pytest.approx(2 / 3)
    # (2, 3, 4) only ever by 5 6: the longer match wins over the more frequent shorter one
    p = trie.propose([50, 2, 3, 4], 5)
    assert p.tokens == [5, 6] and p.matched == 3 and p.confidence == 1.0
    assert trie.propose([50, 2, 3, 4], 1).tokens == [5]
    assert trie.propose([50, 2, 3, 4], 0).tokens == []


def test_the_longest_of_many_matches_wins():
    trie = SuffixTrie(max_match=8)
    trie.feed([1, 2, 3, 4, 5, 6, 7, 8, 100])
    for _ in range(2):
        trie.feed([3, 4, 5, 6, 7, 8, 300])
    for _ in range(3):
        trie.feed([5, 6, 7, 8, 200])
    # each longer match has another most frequent continuation: the search finds the longest
    assert trie.propose([1, 2, 3, 4, 5, 6, 7, 8], 1) == trie.propose([9, 1, 2, 3, 4, 5, 6, 7, 8], 1)
    assert trie.propose([1, 2, 3, 4, 5, 6, 7, 8], 1).tokens == [100]
    assert trie.propose([1, 2, 3, 4, 5, 6, 7, 8], 1).matched == 8
    assert trie.propose([0, 3, 4, 5, 6, 7, 8], 1).tokens == [300]
    assert trie.propose([0, 0, 0, 5, 6, 7, 8], 1).tokens == [200]
    assert trie.propose([0, 0, 0, 0, 0, 7, 8], 1).tokens == [200]


def test_a_match_shorter_than_the_minimum_proposes_nothing():
    trie = SuffixTrie()
    trie.feed([1, 2, 3])
    assert MIN_MATCH == 2
    assert trie.propose([7, 1], 4).tokens == []  # (1,) occurred: one token is not enough
    assert trie.propose([7, 1, 2], 4).tokens == [3]
    assert trie.propose([2], 4).tokens == []


def test_a_rare_child_stops_the_draft():
    def fed(min_share):
        trie = SuffixTrie(min_share=min_share)
        for _ in range(9):
            trie.feed([1, 2, 3, 4, 6])
        trie.feed([1, 2, 3, 5, 6])
        return trie

    assert fed(0.3).propose([1, 2, 3], 3).tokens == [4, 6]
    assert fed(0.95).propose([1, 2, 3], 3).tokens == []  # 4's share 0.9 is under 0.95


def test_feeding_the_output_after_the_prompt_counts_each_span_once():
    prompt, output = [5, 6, 7, 5, 6], [8, 5, 6, 9]
    at_once, in_two = SuffixTrie(depth=4, max_match=3), SuffixTrie(depth=4, max_match=3)
    at_once.feed(prompt + output)
    in_two.feed(prompt)
    in_two.feed(prompt + output, len(prompt))
    assert _spans(at_once) == _spans(in_two)
    # the prompt forgotten (a new trie): its tail is fed with the output, so matches across the join hold
    late = SuffixTrie(depth=4, max_match=3)
    late.feed(prompt + output, len(prompt))
    assert late.propose([0, 7, 5], 2).tokens == [6, 8] and late.propose([6, 8], 2).tokens == [5, 6]


def _spans(trie: SuffixTrie) -> dict[tuple[int, ...], tuple[int, int]]:
    """Each node's span: its count and its most frequent child's token (node ids aside)."""
    parent = {child: key >> 32 for key, child in trie._child.items()}
    out = {}
    for node in parent:
        span, at = [], node
        while at:
            span.append(trie._token[at])
            at = parent[at]
        best = trie._best[node]
        out[tuple(reversed(span))] = (trie._count[node], trie._token[best] if best >= 0 else None)
    return out


def test_the_depth_bounds_span_and_draft():
    trie = SuffixTrie(depth=5, max_match=2)
    trie.feed(list(range(20)))
    assert trie.propose([3, 4], 10).tokens == [5, 6, 7]  # 2 matched, 3 more to the depth
    assert max(_depths(trie)) == 5


def _depths(trie: SuffixTrie) -> list[int]:
    parent = {child: key >> 32 for key, child in trie._child.items()}
    out = []
    for node in parent:
        d = 0
        while node:
            node, d = parent[node], d + 1
        out.append(d)
    return out


def test_nodes_are_capped_and_the_trie_keeps_counting_what_it_holds():
    trie = SuffixTrie(max_nodes=50)
    trie.feed(list(range(100)))
    assert trie.num_nodes == 50
    trie.feed(list(range(200, 300)))  # all new: nothing added
    assert trie.num_nodes == 50
    before = trie.propose([0, 1], 2)
    trie.feed([0, 1, 2])
    assert trie.num_nodes == 50 and trie.propose([0, 1], 2).tokens == before.tokens == [2, 3]


def test_jobs_are_capped_oldest_fed_first_and_keys_never_cross():
    index = JobSuffixIndex(max_jobs=2)
    text = [1, 2, 3, 4, 5]
    index.feed("a", "job", text)
    assert index.propose("a", "job", [1, 2], 3).tokens == [3, 4, 5]
    # the same job id and text under another tenant, another job of the same tenant, no job: nothing
    assert index.propose("b", "job", [1, 2], 3).tokens == []
    assert index.propose("a", "other", [1, 2], 3).tokens == []
    assert index.propose("a", None, [1, 2], 3).tokens == []
    index.feed("a", None, text)  # a request of no job feeds nothing
    assert len(index) == 1
    index.feed("b", "job", [1, 2, 9])
    assert index.propose("b", "job", [1, 2], 3).tokens == [9]
    assert index.propose("a", "job", [1, 2], 3).tokens == [3, 4, 5]  # b's text did not reach a's trie
    index.feed("a", "job", [7, 7])  # a's fed again: b's is now the oldest fed
    index.feed("c", "job", [1, 2, 8])
    assert len(index) == 2 and index.trie("b", "job") is None
    assert index.propose("a", "job", [1, 2], 3).tokens == [3, 4, 5]


def test_a_prompts_tail_is_fed():
    index = JobSuffixIndex()
    prompt = [5, 6] + list(range(100, 100 + PROMPT_TAIL))
    index.feed_prompt("a", "j", prompt)
    assert index.propose("a", "j", [1, 5, 6], 2).tokens == []  # its head was not fed
    assert index.propose("a", "j", [1, 100, 101], 2).tokens == [102, 103]
    index.feed("a", "j", prompt + [7, 8], len(prompt))  # the output, after the tail fed
    assert index.propose("a", "j", [1, 100 + PROMPT_TAIL - 1], 2).tokens == []  # one token: too short
    assert index.propose("a", "j", [1, 100 + PROMPT_TAIL - 2, 100 + PROMPT_TAIL - 1], 2).tokens == [7, 8]


def test_a_node_costs_the_bytes_the_docstring_bounds():
    rng = random.Random(0)
    trie = SuffixTrie(max_nodes=21_850)  # just after its dict has grown: the most bytes a node
    tokens = [rng.randrange(150_000) for _ in range(2_000)]
    tracemalloc.start()
    try:
        trie.feed(tokens)
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert trie.num_nodes == 21_850
    assert used / trie.num_nodes < 150, used / trie.num_nodes


@pytest.mark.parametrize(("depth", "max_match"), [(4, 4), (10, 1)])
def test_sizes_are_checked(depth, max_match):
    with pytest.raises(ValueError):
        SuffixTrie(depth=depth, max_match=max_match)


def test_a_feed_is_queued_until_caught_up_in_pieces_or_read():
    """A feed waits in the queue (the engine feeds it while the device runs: ``catch_up``); ``catch_up`` stops
    between pieces when told, and a proposal first feeds everything queued."""
    index, text = JobSuffixIndex(), list(range(100, 100 + 3 * CHUNK))
    index.feed("t", "j", text)
    trie = index._tries[("t", "j")]
    assert index.pending == 1 and trie.num_nodes == 1  # nothing walked yet
    looks = []
    index.catch_up(lambda: len(looks) < 2 and not looks.append(1))  # go on once, then stop
    assert index.pending == 1 and CHUNK < trie._count[0] < len(text)  # two pieces fed of three
    assert index.propose("t", "j", [100, 101], 3).tokens == [102, 103, 104]
    assert index.pending == 0 and trie._count[0] == len(text)
    whole = SuffixTrie()
    whole.feed(text)
    assert trie._count == whole._count and trie._child == whole._child  # in pieces as in one go


def test_past_the_queues_bound_the_oldest_feeds_go_in_at_once():
    index = JobSuffixIndex()
    for i in range(PENDING + 3):
        index.feed("t", "j", [i, i + 1, i + 2])
    assert index.pending == PENDING
    assert index._tries[("t", "j")]._count[0] == 3 * 3  # the three oldest fed, three starts each


def test_a_full_trie_takes_one_feed_in_full_every():
    """Once full a trie only counts, and a sample of the job's lines keeps their shares: 1 feed in FULL_EVERY."""
    index = JobSuffixIndex(max_nodes=50)
    index.feed("t", "j", list(range(100)))
    trie = index.trie("t", "j")
    assert trie.full
    roots = trie._count[0]
    for _ in range(2 * FULL_EVERY):
        index.feed("t", "j", [0, 1, 2])
    assert index.trie("t", "j")._count[0] == roots + 2 * 3  # two of the 16 feeds, three starts each
