"""What a request must be to enter the engine (``check``: it fits the context and the KV cache, its
token ids are in the vocabulary), and requests waiting for their grammar before they are scheduled
(``GrammarWaits``, vLLM's ``WAITING_FOR_FSM``: no running slot, no KV blocks)."""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass

from worker.engine.request import Request
from worker.engine.structured import grammar


class RequestRejected(ValueError):
    """A request the engine can never run (too long for the model or the KV cache)."""


@dataclass(frozen=True)
class Limits:
    """What the engine can run: the model's context, its vocabulary and hidden size, the KV cache's
    tokens and the part of them batch work may hold (``Settings.interactive_kv_blocks``)."""

    max_model_len: int
    vocab_size: int
    hidden_size: int
    cache_tokens: int
    batch_tokens: int


def check(request: Request, limits: Limits) -> None:
    """Refuse (``RequestRejected``) what the engine can never run, whoever let it through."""
    p = request.params
    if p.embedding is not None:
        _check_embedding(request, limits)
    else:
        total = len(request.prompt_token_ids) + p.max_tokens
        _check_fits(limits, total, f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens ({p.max_tokens})",
                    f"prompt + max_tokens ({total} tokens)", request.interactive)
    _check_tokens(request, limits.vocab_size)


def _check_fits(limits: Limits, tokens: int, as_context: str, as_cache: str, interactive: bool) -> None:
    """A sequence of ``tokens`` must fit the model's context and the whole KV cache, a batch one the
    part of it batch work may hold (``Settings.interactive_kv_blocks``); the refusal names it as
    ``as_context`` or ``as_cache``."""
    if tokens > limits.max_model_len:
        raise RequestRejected(f"{as_context} exceeds the model's context of {limits.max_model_len} tokens")
    if tokens > limits.cache_tokens:
        raise RequestRejected(f"{as_cache} exceeds the whole KV cache ({limits.cache_tokens} tokens): "
                              "raise --kv-memory")
    if not interactive and tokens > limits.batch_tokens:
        raise RequestRejected(f"{as_cache} exceeds the part of the KV cache batch work may hold "
                              f"({limits.batch_tokens} tokens; --interactive-kv-blocks holds the rest): "
                              "raise --kv-memory")


def _check_embedding(request: Request, limits: Limits) -> None:
    """Each input runs as a sequence of its own: each must fit the context and the KV cache."""
    p, longest = request.params, max(request.params.embedding.lengths)
    _check_fits(limits, longest, f"an input of {longest} tokens", f"an input of {longest} tokens", request.interactive)
    dims = p.embedding.dimensions
    if dims is not None and dims > limits.hidden_size:
        raise RequestRejected(f"dimensions {dims} exceeds the model's hidden size {limits.hidden_size}")
    if p.structured is not None or request.resume_output_ids:
        raise RequestRejected(f"request {request.request_id}: an embeddings request samples nothing: it takes "
                              "no structured output and resumes from no checkpoint")


def _check_tokens(request: Request, vocab: int) -> None:
    """What the model cannot run is refused here, whoever let it through: token ids out of the
    vocabulary (a negative one would index from its end), resumed outputs longer than allowed."""
    p = request.params
    for what, ids in (("prompt", request.prompt_token_ids), ("stop_token_ids", p.stop_token_ids),
                      ("logit_bias", [t for t, _ in p.logit_bias]),
                      *((f"resumed sample {i}", out) for i, out in enumerate(request.resume_output_ids))):
        if ids and not (0 <= min(ids) and max(ids) < vocab):
            raise RequestRejected(f"request {request.request_id}: {what} has token ids outside [0, {vocab})")
    for i, out in enumerate(request.resume_output_ids):
        if len(out) >= p.max_tokens:
            raise RequestRejected(f"request {request.request_id}: resumed sample {i} has {len(out)} tokens, "
                                  f"max_tokens is {p.max_tokens}")
    if p.top_k > vocab:
        raise RequestRejected(f"request {request.request_id}: top_k {p.top_k} exceeds the vocabulary ({vocab})")


class GrammarWaits:
    """Requests whose grammar compiles in its tenant's turn in the compile pool, outside the scheduler."""

    def __init__(self) -> None:
        self.requests: list[Request] = []

    def __bool__(self) -> bool:
        return bool(self.requests)

    def __contains__(self, request: Request) -> bool:
        return request in self.requests

    def submit(self, request: Request, compiler: grammar.Compiler, rules: grammar.CompileRules) -> None:
        request.grammar_future = compiler.submit(request.params.structured, request.tenant, rules)
        self.requests.append(request)

    def remove(self, request: Request) -> None:
        self.requests.remove(request)

    def any_isolated(self) -> bool:
        return any(r.isolated for r in self.requests)

    @property
    def num_sequences(self) -> int:
        return sum(len(r.sequences) for r in self.requests)

    def wait(self, timeout: float) -> None:
        """Until one compile ends or ``timeout`` (an engine with nothing else to run)."""
        wait([r.grammar_future for r in self.requests], timeout=timeout, return_when=FIRST_COMPLETED)

    def take_done(self) -> list[tuple[Request, Exception | None]]:
        """Requests whose compile ended, out of the wait: each with a matcher per sample (past the tokens
        a resumed sample has), or with the exception that fails it (one past its deadline among them:
        the compile pool stops it and fails its future)."""
        done, pending, self.requests = [], self.requests, []
        for request in pending:
            (done if request.grammar_future.done() else self.requests).append(request)
        taken: list[tuple[Request, Exception | None]] = []
        for request in done:
            try:
                request.grammar = request.grammar_future.result()
                for seq in request.sequences:
                    seq.matcher = grammar.new_matcher(request.grammar, seq.output_token_ids)
            except Exception as exc:  # noqa: BLE001 (this request's spec: it fails alone)
                taken.append((request, exc))
                continue
            taken.append((request, None))
        return taken

