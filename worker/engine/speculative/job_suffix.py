"""Drafts without a model from a job's earlier text: a suffix trie over the prompts and outputs of the same
job's requests (SuffixDecoding, Oliaro et al.; vLLM's ``method: suffix``). A job's lines are one template
filled many times, so a line's output tends to repeat spans its siblings' prompts and outputs had; the
job's tail (few sequences running, the step memory-bound) gains most.

``JobSuffixIndex`` keeps one ``SuffixTrie`` per ``(tenant, job)``: a request reads and feeds only its own
tenant's and job's trie, so no tenant's text ever drafts another tenant's tokens (a job id is the tenant's
own name, two tenants may use the same one). A request of no job (``Request.job`` None: interactive ones)
neither feeds nor reads. A request's prompt is fed when it is added (its last ``PROMPT_TAIL`` tokens: a
long head shared by a job's lines would cost each line a walk of it), each finished sample's output when
its request finishes (with the prompt's last tokens as left context, so that no span is counted twice).

The trie holds every span of at most ``depth`` tokens of the text fed, each node counting how often its
span occurred (its start positions). A proposal finds the longest span of at least ``MIN_MATCH`` and at
most ``max_match`` tokens that ends the sequence and is in the trie (a suffix trie holds every span's
suffixes too, so presence falls with the length: a binary search, a few walks of at most ``max_match``
dict lookups), then follows the most frequent child (kept per node, ``_best``) for up to k tokens, while
a child's share of its parent's count is at least ``min_share`` and the depth allows. Its ``confidence``
is the product of those shares: the chance, by the counts, that the whole draft is what followed.
A feed of n new tokens costs at most (n + depth) x depth dict operations, once per request: 1-2.5 ms of
Python for a line of a few hundred tokens, as long as a GPU's whole decode step. So ``JobSuffixIndex`` only
queues a feed; the engine feeds the queue while the device runs a step it would otherwise wait for
(``catch_up``, until the step's tokens are ready), and a proposal first feeds whatever is queued. Where
steps leave the host no such time (a CPU's, computed on the loop's own thread), at most ``PENDING`` feeds
wait: past that the oldest are fed at once, as before.

Memory bound: a trie stops growing at ``max_nodes`` nodes (its existing nodes keep counting: the job's
first lines, which its later ones resemble, are what it holds; a full trie takes one feed in ``FULL_EVERY``,
a sample of the job's lines whose shares are the lines' in expectation, at a fraction of the cost: the
feeds were half of what auto cost a worker at a GPU's pace), and at most ``max_jobs`` tries are kept,
the one fed longest ago dropped first. A node is one entry of a dict keyed by ``parent << 32 | token`` and
three entries of flat int arrays: 115 to 150 bytes (CPython 3.11, 64-bit; the most just after the dict
grows; tests/engine/speculative/test_job_suffix.py measures it). With the defaults (65,536 nodes, 16 jobs)
at most about 150 MiB of host memory in all, whatever the jobs' sizes."""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

DEPTH = 24  # the longest span kept
MAX_MATCH = 8  # the longest suffix of a sequence matched: the rest of the depth is for the draft
MIN_MATCH = 2  # a shorter match proposes nothing
MIN_SHARE = 0.1  # a draft stops before a child seen less often than this share of its parent
MAX_NODES = 1 << 16  # nodes of one job's trie
MAX_JOBS = 16  # tries kept, the one fed longest ago dropped first
PROMPT_TAIL = 1024  # a prompt's last tokens fed: a line's own text is in its own n-grams, a long shared head costs
CONFIDENT = 0.5  # a proposal this sure and matching more than a sequence's own n-grams may is preferred to theirs
PENDING = 64  # feeds queued at most (``JobSuffixIndex.catch_up``); past it the oldest are fed at once
CHUNK = 32  # start positions a queued feed takes between two looks at whether to go on (~0.05 ms)
FULL_EVERY = 8  # a full trie takes one feed in this many
_ROOT = 0


@dataclass(frozen=True)
class Proposal:
    """A draft (empty: none), the length of the match it follows, and its confidence (the product of the
    shares of the children it took: 1.0 where each was all that ever followed)."""

    tokens: list[int]
    matched: int = 0
    confidence: float = 0.0


NONE = Proposal([])


class SuffixTrie:
    """Every span of at most ``depth`` tokens of the text fed, with its count and its most frequent child."""

    def __init__(self, depth: int = DEPTH, max_nodes: int = MAX_NODES, max_match: int = MAX_MATCH,
                 min_share: float = MIN_SHARE):
        if not MIN_MATCH <= max_match < depth:
            raise ValueError(f"need {MIN_MATCH} <= max_match < depth, not {max_match}, {depth}")
        self.depth, self.max_nodes, self.max_match, self.min_share = depth, max_nodes, max_match, min_share
        self._child: dict[int, int] = {}  # parent << 32 | token -> child
        self._count = array("q", [0])  # by node; the root's counts the start positions fed
        self._best = array("q", [-1])  # by node: its most frequent child, -1 for none
        self._token = array("q", [-1])  # by node: the token of its edge from its parent
        self.feeds_when_full = 0  # feeds offered since it was full (``JobSuffixIndex.feed`` takes 1 in FULL_EVERY)

    @property
    def num_nodes(self) -> int:
        return len(self._count)

    @property
    def full(self) -> bool:
        """It has ``max_nodes`` nodes: feeds only count."""
        return len(self._count) >= self.max_nodes

    def feed(self, tokens: list[int], new_from: int = 0) -> None:
        """Count the spans of ``tokens`` that end at or after ``new_from`` (those ending before it were fed
        already, with the same tokens before them: a prompt, then prompt and output from the prompt's end)."""
        self.feed_starts(tokens, new_from, self.first_start(new_from), len(tokens))

    def first_start(self, new_from: int) -> int:
        """The first start position a feed from ``new_from`` walks."""
        return max(0, new_from - self.depth + 1)

    def feed_starts(self, tokens: list[int], new_from: int, begin: int, end: int) -> None:
        """``feed``'s walks from the start positions ``begin`` to ``end`` (exclusive): a feed in pieces."""
        depth, child, count, best, token_of = self.depth, self._child, self._count, self._best, self._token
        full = self.full
        for start in range(begin, end):
            node = _ROOT
            if start >= new_from:
                count[_ROOT] += 1
            for at in range(start, min(start + depth, len(tokens))):
                key = node << 32 | tokens[at]
                nxt = child.get(key)
                if nxt is None:
                    if full:
                        break
                    nxt = child[key] = len(count)
                    count.append(0)
                    best.append(-1)
                    token_of.append(tokens[at])
                    full = len(count) >= self.max_nodes
                    counted = True
                else:
                    counted = at >= new_from
                if counted:
                    count[nxt] += 1
                    b = best[node]
                    if b < 0 or (b != nxt and count[nxt] > count[b]):
                        best[node] = nxt
                node = nxt

    def _walk(self, tokens: list[int], start: int) -> int:
        """The node of the span ``tokens[start:]``, -1 where it is not in the trie."""
        node, child = _ROOT, self._child
        for at in range(start, len(tokens)):
            node = child.get(node << 32 | tokens[at], -1)
            if node < 0:
                return -1
        return node

    def propose(self, tokens: list[int], k: int) -> Proposal:
        """Up to ``k`` tokens along the most frequent path after the longest span ending ``tokens``."""
        n = len(tokens)
        lo, hi = MIN_MATCH - 1, min(self.max_match, n)  # a match of lo tokens (or none) found; hi: the most
        node = -1
        while lo < hi:  # the longest length whose span is in the trie (present for each shorter one)
            mid = (lo + hi + 1) // 2
            found = self._walk(tokens, n - mid)
            if found < 0:
                hi = mid - 1
            else:
                lo, node = mid, found
        if node < 0 or k < 1:
            return NONE
        if lo < MIN_MATCH:
            return NONE
        count, best, token_of = self._count, self._best, self._token
        draft: list[int] = []
        confidence = 1.0
        for _ in range(min(k, self.depth - lo)):
            nxt = best[node]
            if nxt < 0:
                break
            share = count[nxt] / count[node]
            if share < self.min_share:
                break
            draft.append(token_of[nxt])
            confidence *= share
            node = nxt
        return Proposal(draft, lo, confidence) if draft else NONE


class JobSuffixIndex:
    """The tries of the jobs seen lately, by ``(tenant, job)``: the only key a request reads or feeds."""

    def __init__(self, max_jobs: int = MAX_JOBS, **trie):
        if max_jobs < 1:
            raise ValueError("max_jobs must be at least 1")
        self.max_jobs = max_jobs
        self._trie_args = trie
        self._tries: OrderedDict[tuple[str, str], SuffixTrie] = OrderedDict()
        self._pending: deque[_Feed] = deque()  # feeds queued, the oldest first (``catch_up``)

    def __len__(self) -> int:
        return len(self._tries)

    @property
    def pending(self) -> int:
        """Feeds queued, not yet in their tries."""
        return len(self._pending)

    def feed(self, tenant: str, job: str | None, tokens: list[int], new_from: int = 0) -> None:
        """Queue ``tokens`` (from ``new_from``: ``SuffixTrie.feed``) for the job's trie, made if new; the trie
        fed longest ago goes where that makes more than ``max_jobs``. A request of no job feeds nothing.
        ``tokens`` must not change until fed (the engine hands a copy, or a list it no longer appends to)."""
        if job is None or new_from >= len(tokens):
            return
        key = (tenant, job)
        trie = self._tries.get(key)
        if trie is None:
            trie = self._tries[key] = SuffixTrie(**self._trie_args)
            while len(self._tries) > self.max_jobs:
                self._tries.popitem(last=False)
        else:
            self._tries.move_to_end(key)
        if trie.full:
            trie.feeds_when_full += 1
            if trie.feeds_when_full % FULL_EVERY:
                return
        self._pending.append(_Feed(trie, tokens, new_from, trie.first_start(new_from)))
        while len(self._pending) > PENDING:
            self._feed_first(lambda: True)

    def catch_up(self, more: Callable[[], bool] = lambda: True) -> None:
        """Feed the queued feeds, the oldest first, ``CHUNK`` start positions at a time, while ``more()``
        (the engine: while the device has not finished the step it waits for)."""
        while self._pending and more():
            self._feed_first(more)

    def _feed_first(self, more: Callable[[], bool]) -> None:
        item = self._pending[0]
        end = len(item.tokens)
        while item.start < end:
            stop = min(item.start + CHUNK, end)
            item.trie.feed_starts(item.tokens, item.new_from, item.start, stop)
            item.start = stop
            if item.start < end and not more():
                return
        self._pending.popleft()

    def feed_prompt(self, tenant: str, job: str | None, prompt: list[int]) -> None:
        """Feed a request's prompt, its last ``PROMPT_TAIL`` tokens (``feed``)."""
        self.feed(tenant, job, list(prompt[-PROMPT_TAIL:]))

    def propose(self, tenant: str, job: str | None, tokens: list[int], k: int) -> Proposal:
        """The job's trie's proposal (``SuffixTrie.propose``); none for a request of no job or a job unseen."""
        trie = self._tries.get((tenant, job)) if job is not None else None
        if trie is None:
            return NONE
        self.catch_up()
        return trie.propose(tokens, k)

    def trie(self, tenant: str, job: str) -> SuffixTrie | None:
        """The job's trie, every queued feed in it."""
        self.catch_up()
        return self._tries.get((tenant, job))


@dataclass(eq=False)
class _Feed:
    """A queued feed: its trie, text and ``new_from``, and the next start position to walk."""

    trie: SuffixTrie
    tokens: list[int]
    new_from: int
    start: int
