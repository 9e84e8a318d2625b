"""Structured outputs: a request's ``StructuredOutput`` compiled into a grammar, one matcher per sample,
and the token mask that keeps every sampled token inside the grammar.

The library is xgrammar, chosen over llguidance by measuring both on the default model's tokenizer
(``benchmarks/grammar_libraries.py``; figures in benchmarks/README.md, "Structured outputs"). What
decided it is the cost paid every step: xgrammar precomputes at compile time which tokens each
grammar position allows (its adaptive token-mask cache), so filling the bitmask of a whole batch of
constrained rows is one cheap batch call, where llguidance computes masks lazily as it goes and
took tens of times longer for the same batch. xgrammar pays at compile time instead (several times
llguidance's compile), which a bulk job pays once: its 100,000 requests share one schema, and
compiled grammars are cached. Its tokenizer info also builds faster. Both libraries let go of the
GIL while compiling (measured: the engine's thread is never stalled for the compile), so a small
thread pool compiles beside the engine loop, never inside it, and no process pool is needed.

JSON schemas compile without free whitespace (``any_whitespace=False``: xgrammar's default
separators): a small model let loose on whitespace can fill its whole ``max_tokens`` with newlines.
A constrained row's EOS is not suppressed by ``min_tokens`` (its grammar says where it ends).

The pieces:

- ``check(spec, tokenizer)``: what the door calls; compiles (and caches) or raises ``GrammarError``
  with a reason a user can act on.
- ``compiler_for(tokenizer, vocab_size, stop_token_ids)``: one ``GrammarCompiler`` per tokenizer,
  holding a bounded LRU of compiled grammars keyed by a hash of ``(kind, value)``; ``submit(spec)``
  compiles on its thread pool and hands back a future (concurrent requests for one schema share
  one compile; a spec that failed fails again at once).
- ``new_matcher(compiled, output_ids)``: a sample's matcher, having accepted the tokens it already has
  (a resumed request, a fork).
- ``fill_bitmask(matchers)`` then ``apply_bitmask(logits, rows, bitmask)``: the step's constrained
  rows' masks in one batch call, applied to their logits in one go (ids past the tokenizer's
  vocabulary, the model's padding, are masked too).

The grammar's end is the model's EOS: a matcher allows EOS only where the grammar may end, and it is
terminated once it accepts it.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from worker.engine.request import StructuredOutput
from worker.model.tokenizer import as_transformers

if TYPE_CHECKING:  # imported where used: an engine that never sees a grammar never pays its import
    import xgrammar as xgr

CACHE_ENTRIES = 128  # compiled grammars kept per tokenizer (a large schema's is a few MB)
COMPILE_THREADS = 2  # grammars compiled at once (each may use COMPILE_THREADS threads inside)
FILL_THREADS = 1  # the step's mask fill: a second thread cost more than it gave on 2 shared cores (benchmarks/README.md)
_NOISE = re.compile(r"\[\d\d:\d\d:\d\d\] \S+\.(cc|h):\d+: |Check failed: \(.*?\) is false: ")


class GrammarError(ValueError):
    """A structured-output spec that cannot be enforced: what was wrong and what to change."""


class Compiler:
    """Compiles specs for one tokenizer (and logits width), on a thread pool, with a bounded LRU."""

    def __init__(self, tokenizer, vocab_size: int | None = None, stop_token_ids: Sequence[int] | None = None):
        import xgrammar as xgr

        self.info = tokenizer_info(tokenizer, vocab_size, list(stop_token_ids) if stop_token_ids else None)
        self.vocab_size = self.info.vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=COMPILE_THREADS, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="berth-grammar")
        self._cache: OrderedDict[bytes, Future] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, spec: StructuredOutput) -> Future:
        """A future of the compiled grammar (``GrammarError`` when it does not compile)."""
        key = hashlib.sha256(json.dumps([spec.kind, spec.value]).encode()).digest()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self.compile, spec)
            self._cache[key] = future
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """Compile ``spec`` now, on the calling thread, uncached."""
        try:
            if spec.kind == "json_schema":
                return self._compiler.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)
            if spec.kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                return self._compiler.compile_grammar(choice_grammar(spec.value))
            return self._compiler.compile_grammar(spec.value)
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001 (xgrammar raises RuntimeError and kin, with the reason)
            raise GrammarError(f"{_WHAT[spec.kind]} does not compile: {_clean(exc)}") from None


_WHAT = {"json_schema": "the JSON schema", "json_object": "the JSON object grammar",
         "regex": "the regular expression", "choice": "the choice list", "grammar": "the grammar (EBNF/GBNF)"}


def _clean(exc: Exception) -> str:
    """xgrammar's message without its C++ file, line and check text."""
    return " ".join(_NOISE.sub("", str(exc)).split())[:500] or type(exc).__name__


def choice_grammar(value: str) -> str:
    """An EBNF grammar matching exactly one of the strings of a JSON list (JSON string escapes are
    EBNF string escapes)."""
    try:
        choices = json.loads(value)
    except ValueError as exc:
        raise GrammarError(f"the choice list must be a JSON list of strings: {exc}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("the choice list must be a non-empty JSON list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


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


def check(spec: StructuredOutput, tokenizer, seconds: float | None = None) -> None:
    """Raise ``GrammarError`` (with the reason) unless ``spec`` compiles for ``tokenizer`` within
    ``seconds``; the compiled grammar stays cached for the engine of the same process."""
    try:
        compiler_for(tokenizer).submit(spec).result(timeout=seconds)
    except TimeoutError:
        raise too_slow(spec, seconds) from None


def too_slow(spec: StructuredOutput, seconds: float) -> GrammarError:
    """A compile still running after ``seconds`` (a pathological schema or regex: the library cannot
    stop it, so it finishes on its thread and its request fails)."""
    return GrammarError(f"{_WHAT[spec.kind]} did not compile within {seconds:g} s "
                        "(BERTH_STRUCTURED_COMPILE_SECONDS): simplify it")


def new_matcher(compiled: xgr.CompiledGrammar, output_ids: Sequence[int] = ()) -> xgr.GrammarMatcher:
    """A matcher at the start of the grammar, then past ``output_ids`` (the tokens a resumed sample
    already has); ``GrammarError`` if the grammar refuses one of them."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    for i, token in enumerate(output_ids):
        if not matcher.accept_token(token):
            raise GrammarError(f"the structured output's grammar refuses token {token} at output position {i}")
    return matcher


def accept(matcher: xgr.GrammarMatcher, token: int) -> None:
    """Advance ``matcher`` past a sampled token (the mask allowed it: a refusal is a bug, failed alone)."""
    if not matcher.accept_token(token):
        raise GrammarError(f"the structured output's grammar refused sampled token {token}")


_batch = threading.local()


def fill_bitmask(matchers: Sequence[xgr.GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """int32 ``[len(matchers), ceil(vocab_size/32)]``, bit ``t`` of row ``i`` set when matcher ``i``
    allows token ``t``; filled for every row in one batch call."""
    import xgrammar as xgr

    bitmask = torch.empty((len(matchers), (vocab_size + 31) // 32), dtype=torch.int32)
    if not hasattr(_batch, "matcher"):
        _batch.matcher = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
    _batch.matcher.batch_fill_next_token_bitmask(list(matchers), bitmask)
    return bitmask


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
