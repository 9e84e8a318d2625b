"""Structured outputs, as vLLM's ``v1/structured_output``: a request's ``StructuredOutput`` compiled
into a grammar (``check``, ``compiler_for``), one matcher per sample (``new_matcher``), and the token
mask that keeps every sampled token inside the grammar (``fill_bitmask``, ``apply_bitmask``); the
grammar's end is the model's EOS. docs/engine.md says why xgrammar and how a compile is bounded."""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np
import torch

from worker.config import Settings
from worker.engine.request import StructuredOutput
from worker.engine.structured.grammar_compile import (
    COMPILE_THREADS,
    CompileTimeout,
    GrammarDeadEnd,
    GrammarError,
    allows_nothing,
    choice_grammar,
    compile_spec,
)
from worker.engine.structured.grammar_pool import CompileJob, CompileRules, Vocabulary, compile_pool
from worker.engine.structured.schema_bounds import over_bounds
from worker.model.tokenizer import as_transformers

if TYPE_CHECKING:  # imported where used: an engine that never sees a grammar never pays its import
    import xgrammar as xgr

__all__ = ["DEFAULT_RULES", "CompileRules", "CompileTimeout", "Compiler", "GrammarDeadEnd", "GrammarError", "Wait",
           "accept", "allowed_prefix", "apply_bitmask",
           "check", "choice_grammar", "compiler_for", "fill_bitmask", "new_matcher", "tokenizer_info", "too_costly"]

CACHE_ENTRIES = 128  # compiled grammars kept per tokenizer (a large schema's is a few MB)
# the step's mask fill: a second thread cost more than it gave on 2 shared cores (benchmarks/HISTORY.md)
FILL_THREADS = 1
DEFAULT_RULES = CompileRules.of(Settings.model_construct())
_numbers = itertools.count(1)  # a Compiler's vocabulary key: unique in the process


class Compiler:
    """Compiles specs for one tokenizer (and logits width), through the process's compile pool, with a bounded LRU."""

    def __init__(self, tokenizer, vocab_size: int | None = None, stop_token_ids: Sequence[int] | None = None):
        import xgrammar as xgr

        self.info = tokenizer_info(tokenizer, vocab_size, list(stop_token_ids) if stop_token_ids else None)
        self.vocab_size = self.info.vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=COMPILE_THREADS, cache_enabled=False)
        self._cache: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._info_json: str | None = None
        self._info_lock = threading.Lock()
        self.vocabulary = Vocabulary(f"{next(_numbers)}-{self.vocab_size}", self._serialised_info)

    def _serialised_info(self) -> str:
        """The tokenizer info as compile processes take it (0.1 s and 1.6 MB for the default model's), made once."""
        with self._info_lock:
            if self._info_json is None:
                self._info_json = self.info.serialize_json()
            return self._info_json

    def submit(self, spec: StructuredOutput, tenant: str = "default", rules: CompileRules = DEFAULT_RULES) -> Future:
        """A future of the compiled grammar (``GrammarError`` when it does not compile, or not in
        ``rules.seconds``). Compiled for ``tenant``, in its turn among the tenants; kept in its queue
        whoever else leaves (``wait``)."""
        return self._entry(spec, tenant, rules, leaving=False).future

    def wait(self, spec: StructuredOutput, tenant: str = "default", rules: CompileRules = DEFAULT_RULES) -> Wait:
        """``submit``, for a caller that may leave before the compile is done (``Wait.leave``): a
        compile still queued that nobody else waits for is then taken out of its queue."""
        return Wait(self, self._entry(spec, tenant, rules, leaving=True))

    def _entry(self, spec: StructuredOutput, tenant: str, rules: CompileRules, leaving: bool) -> _Entry:
        key = hashlib.sha256(json.dumps([spec.kind, spec.value]).encode()).digest()
        with self._lock:
            entry = self._cached(key, rules)
            if entry is not None:
                self._cache.move_to_end(key)
                return entry.held(leaving)
        if (why := too_costly(spec, rules)) is not None:  # not cached: the bounds may be raised
            future = Future()
            future.set_exception(GrammarError(why))
            return _Entry(key, future, None)
        with self._lock:
            entry = self._cached(key, rules)
            if entry is not None:
                return entry.held(leaving)
            job = CompileJob(spec, tenant, rules, self.vocabulary, lambda: self.compile(spec))
            entry = _Entry(key, compile_pool().submit(job), job)
            self._cache[key] = entry
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return entry.held(leaving)

    def _cached(self, key: bytes, rules: CompileRules) -> _Entry | None:
        entry = self._cache.get(key)
        if entry is None or entry.future.cancelled() or _ran_out_sooner(entry.future, rules.seconds):
            return None
        return entry

    def _leave(self, entry: _Entry) -> None:
        with self._lock:
            entry.leavers -= 1
            if entry.leavers > 0 or entry.kept or entry.job is None or entry.future.done():
                return
            if compile_pool().withdraw(entry.job) and self._cache.get(entry.key) is entry:
                del self._cache[entry.key]

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """Compile ``spec`` now, on the calling thread, uncached (once it passed its trial)."""
        return compile_spec(self._compiler, spec)


class _Entry:
    """A spec's compile: its future, its job in the pool, and who waits for it."""

    def __init__(self, key: bytes, future: Future, job: CompileJob | None):
        self.key, self.future, self.job = key, future, job
        self.leavers = 0  # callers waiting that may leave (``Compiler.wait``)
        self.kept = False  # a caller that never leaves waits too (``Compiler.submit``, the engine)

    def held(self, leaving: bool) -> _Entry:
        if leaving:
            self.leavers += 1
        else:
            self.kept = True
        return self


class Wait:
    """One caller's wait for a compile (``Compiler.wait``): ``future`` resolves when it is done; ``leave``
    once, when the caller no longer waits (it left, or it has the result)."""

    def __init__(self, compiler: Compiler, entry: _Entry):
        self.future, self._compiler, self._entry = entry.future, compiler, entry
        self._left = False

    def leave(self) -> None:
        if not self._left:
            self._left = True
            self._compiler._leave(self._entry)


def _ran_out_sooner(future: Future, seconds: float) -> bool:
    """A compile stopped at a deadline shorter than ``seconds``: worth another try."""
    if not future.done() or future.cancelled():
        return False
    exc = future.exception()
    return isinstance(exc, CompileTimeout) and exc.seconds < seconds


def too_costly(spec: StructuredOutput, rules: CompileRules) -> str | None:
    """Why a JSON schema's shape (or that of one inside a structural tag) is over ``rules.bounds``,
    before any compile; None if it is not."""
    if spec.kind not in ("json_schema", "structural_tag"):
        return None
    try:
        value = json.loads(spec.value)
    except (ValueError, RecursionError):
        return None  # the library says what is wrong with it
    schemas = [value] if spec.kind == "json_schema" else _tag_schemas(value)
    return next((why for s in schemas if isinstance(s, dict) and (why := over_bounds(s, rules.bounds))), None)


def _tag_schemas(tag) -> list:
    """The JSON schemas of a structural tag's ``json_schema`` formats, wherever they nest."""
    found, stack = [], [tag]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                found.append(node["json_schema"])
            else:
                stack.extend(node.values())
    return found


def tokenizer_info(tokenizer, vocab_size: int | None, stop_token_ids: list[int] | None):
    """xgrammar's ``TokenizerInfo``: from the facts kept with a ``FastTokenizer`` (as
    ``from_huggingface`` builds it, without loading transformers), else from transformers' tokenizer."""
    import xgrammar as xgr

    facts = (getattr(tokenizer, "facts", None) or {}).get("grammar")
    if not facts:
        return xgr.TokenizerInfo.from_huggingface(as_transformers(tokenizer), vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids)
    vocab = tokenizer.get_vocab()
    size = vocab_size or max(len(vocab), max(vocab.values()) + 1)
    encoded = [""] * size
    for token, i in vocab.items():
        if i < size:
            encoded[i] = token
    if stop_token_ids is None and tokenizer.eos_token_id is not None:
        stop_token_ids = [tokenizer.eos_token_id]
    return xgr.TokenizerInfo(encoded, vocab_type=xgr.VocabType[facts["vocab_type"]], vocab_size=size,
                             stop_token_ids=stop_token_ids, add_prefix_space=facts["add_prefix_space"])


_compilers: dict[tuple, Compiler] = {}
_compilers_lock = threading.Lock()


def compiler_for(tokenizer, vocab_size: int | None = None, stop_token_ids: Sequence[int] | None = None) -> Compiler:
    """The process's compiler for a tokenizer: built once (building the tokenizer's info takes a
    fraction of a second), shared by the door's checks and the engine."""
    key = (type(tokenizer).__name__, getattr(tokenizer, "name_or_path", ""), len(tokenizer), vocab_size,
           tuple(stop_token_ids or ()))
    with _compilers_lock:
        if key not in _compilers:
            _compilers[key] = Compiler(tokenizer, vocab_size, stop_token_ids)
        return _compilers[key]


def check(spec: StructuredOutput, tokenizer, rules: CompileRules = DEFAULT_RULES, tenant: str = "default") -> None:
    """Raise ``GrammarError`` (with the reason) unless ``spec`` compiles for ``tokenizer`` within
    ``rules``; the compiled grammar stays cached for the engine of the same process. Waits its turn:
    the deadline covers the compile, never the wait."""
    compiler_for(tokenizer).submit(spec, tenant, rules).result()


def new_matcher(compiled: xgr.CompiledGrammar, output_ids: Sequence[int] = ()) -> xgr.GrammarMatcher:
    """A matcher at the start of the grammar, then past ``output_ids`` (the tokens a resumed sample
    already has); ``GrammarError`` if the grammar refuses one of them."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    for i, token in enumerate(output_ids):
        if not matcher.accept_token(token):
            raise GrammarError(f"the structured output's grammar refuses token {token} at output position {i}")
    return matcher


def accept(matcher: xgr.GrammarMatcher, token: int, vocab_size: int) -> None:
    """Advance ``matcher`` past a sampled token. The mask allowed it, so a refusal is either a grammar
    that allowed no token at all here (``GrammarDeadEnd``: the request's spec) or a bug; either fails
    the request alone."""
    if not matcher.accept_token(token):
        if allows_nothing(matcher, vocab_size):
            raise GrammarDeadEnd("the structured output allows no token after the output so far, so it cannot be "
                                 "completed: a part of the grammar matches nothing")
        raise GrammarError(f"the structured output's grammar refused sampled token {token}")


_batch = threading.local()


def fill_bitmask(matchers: Sequence[xgr.GrammarMatcher], vocab_size: int,
                 ahead: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """int32 ``[len(matchers), ceil(vocab_size/32)]``, bit ``t`` of row ``i`` set when matcher ``i``
    allows token ``t``; filled in one batch call. ``ahead[i]``: tokens row ``i``'s matcher takes before its
    mask (a verified draft's row follows the draft tokens before it; a sequence's rows come in draft order):
    such rows are filled one by one past those tokens, and each matcher is rolled back after. Past a draft
    token the grammar refuses, or past its end, a row's mask is its previous row's (the verifier keeps no
    token past a refused draft token: the row before it forbids it)."""
    import xgrammar as xgr

    bitmask = torch.empty((len(matchers), (vocab_size + 31) // 32), dtype=torch.int32)
    if not hasattr(_batch, "matcher"):
        _batch.matcher = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
    rows = [i for i in range(len(matchers)) if not ahead or not ahead[i]]
    if len(rows) == len(matchers):
        _batch.matcher.batch_fill_next_token_bitmask(list(matchers), bitmask)
        return bitmask
    if rows:
        first = torch.empty((len(rows), bitmask.shape[1]), dtype=torch.int32)
        _batch.matcher.batch_fill_next_token_bitmask([matchers[i] for i in rows], first)
        bitmask[rows] = first
    taken: dict[int, tuple[xgr.GrammarMatcher, int]] = {}  # id(matcher) -> (matcher, draft tokens it took)
    for i, tokens in enumerate(ahead):
        if not tokens:
            continue
        matcher = matchers[i]
        done = _take(matcher, tokens, taken.get(id(matcher), (matcher, 0))[1])
        taken[id(matcher)] = (matcher, done)
        if done == len(tokens) and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, i)
        else:
            bitmask[i] = bitmask[i - 1]
    for matcher, done in taken.values():
        if done:
            matcher.rollback(done)
    return bitmask


def allowed_prefix(matcher: xgr.GrammarMatcher, tokens: Sequence[int]) -> int:
    """How many of ``tokens`` the grammar takes in turn from ``matcher``'s state, which is left as it was: a
    draft ends at the first token its grammar refuses."""
    done = _take(matcher, tokens, 0)
    if done:
        matcher.rollback(done)
    return done


def _take(matcher: xgr.GrammarMatcher, tokens: Sequence[int], done: int) -> int:
    """Advance ``matcher``, which has taken ``tokens[:done]``, through the rest of ``tokens`` while the
    grammar takes them; how many it has taken then (the caller rolls them back)."""
    while done < len(tokens) and not matcher.is_terminated() and matcher.accept_token(tokens[done]):
        done += 1
    return done


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of ``rows`` that their bitmask rows forbid, ids past the
    bitmask's width (the model's padding beyond the tokenizer) included. Unpacked with numpy:
    several times faster on CPU than xgrammar's own ``apply_token_bitmask_inplace`` there."""
    width = logits.shape[-1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=width, bitorder="little")
    allowed = torch.from_numpy(bits.view(np.bool_)).to(logits.device)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))
