"""xgrammar against llguidance on the default model's tokenizer: the figures berth chose its grammar
engine by (see worker/engine/structured/grammar.py).

For each library: the tokenizer-info build, the compile time of a few JSON schemas (nested objects,
enums, arrays with minItems, bounded numbers, a string pattern) with its cache off, the per-step cost
of filling one bitmask ``[rows, ceil(vocab/32)]`` for a batch of constrained rows with the library's
batch call and accepting the sampled tokens, and whether compiling holds the GIL (a Python loop
spins beside a compile in a thread; its longest stall).

The masks are applied with berth's ``worker.engine.structured.grammar.apply_bitmask`` for both libraries (it is
several times faster on CPU than either library's own), so the fill is what tells them apart.

    python benchmarks/grammar_libraries.py [--rows 64] [--steps 48] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks.machine import machine_info
from worker.config import default_model_path
from worker.engine.structured.grammar import apply_bitmask
from worker.model.tokenizer import load_tokenizer

VOCAB = 49152
SCHEMAS = {
    "nested objects": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {
            "name": {"type": "string"}, "address": {"type": "object", "properties": {
                "street": {"type": "string"}, "city": {"type": "string"}}, "required": ["street", "city"]}},
            "required": ["name", "address"]}}, "required": ["person"]},
    "enum": {"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "language": {"type": "string", "enum": ["en", "fr", "de", "es"]}}, "required": ["sentiment", "language"]},
    "array minItems": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 5}}, "required": ["tags"]},
    "bounded numbers": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["age", "score"]},
    "string pattern": {"type": "object", "properties": {
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "email": {"type": "string", "format": "email"}}, "required": ["date", "email"]},
}
BIG_SCHEMA = {"type": "object", "properties": {f"field_{i}": {"type": "object", "properties": {
    "kind": {"enum": [f"k{j}" for j in range(20)]}, "value": {"type": "integer", "minimum": -i, "maximum": 1000 + i},
    "items": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "minItems": 1}},
    "required": ["kind", "value"]} for i in range(40)}, "required": [f"field_{i}" for i in range(40)]}


def timed(fn):
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, threads: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.info, self.tokenizer_seconds = timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer,
                                                                                             vocab_size=VOCAB))
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False, max_threads=2)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matchers, tokens):
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def done(self, m) -> bool:
        return m.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, threads: int):
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        self.info, self.tokenizer_seconds = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB))
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema: dict):
        """A matcher builds its lexer lazily: the first mask is part of compiling."""
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        m = self.ll.LLMatcher(self.info, grammar)
        m.compute_bitmask()
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.info, compiled)

    def fill(self, matchers, bitmask):
        from llguidance.torch import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matchers, tokens):
        return self.executor.consume_token_par(list(zip(matchers, tokens)))

    def done(self, m) -> bool:
        return m.is_stopped()


def compile_times(lib) -> dict:
    out = {}
    for name, schema in {**SCHEMAS, "40-field object": BIG_SCHEMA}.items():
        _, seconds = timed(lambda: lib.compile(schema))
        out[name] = round(seconds * 1000, 2)
    return out


def mask_cost(lib, rows: int, steps: int) -> dict:
    """``rows`` matchers over the five schemas, driven by masked argmax over seeded random logits
    (a finished row starts its grammar again). Milliseconds per step of the batch fill, the masking
    of the logits and the acceptance."""
    compiled = [lib.compile(s) for s in SCHEMAS.values()]
    matchers = [lib.matcher(compiled[i % len(compiled)]) for i in range(rows)]
    bitmask = torch.full((rows, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    fill = apply = accept = 0.0
    for _ in range(steps):
        logits = torch.randn(rows, VOCAB, generator=gen)
        t0 = time.perf_counter()
        lib.fill(matchers, bitmask)
        t1 = time.perf_counter()
        apply_bitmask(logits, list(range(rows)), bitmask)
        tokens = logits.argmax(dim=-1).tolist()
        t2 = time.perf_counter()
        ok = lib.accept(matchers, tokens)
        t3 = time.perf_counter()
        assert all(ok), "a masked token was refused"
        fill, apply, accept = fill + t1 - t0, apply + t2 - t1, accept + t3 - t2
        for i, m in enumerate(matchers):
            if lib.done(m):
                matchers[i] = lib.matcher(compiled[i % len(compiled)])
    per = 1000 / steps
    return {"fill_ms_per_step": round(fill * per, 3), "apply_ms_per_step": round(apply * per, 3),
            "accept_ms_per_step": round(accept * per, 3),
            "total_ms_per_row": round((fill + apply + accept) * per / rows, 4)}


def gil_stall_ms(lib) -> dict:
    """Compile the big schema in a thread while this thread spins: the longest this thread waited
    between two turns of its loop. A compile that held the GIL would stall it for the whole compile."""
    schema = {**BIG_SCHEMA, "title": f"fresh {time.time()}"}  # never a cache hit
    done, took = threading.Event(), []

    def compile_it():
        t0 = time.perf_counter()
        lib.compile(schema)
        took.append(time.perf_counter() - t0)
        done.set()

    thread = threading.Thread(target=compile_it)
    longest, last = 0.0, time.perf_counter()
    thread.start()
    while not done.is_set():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    thread.join()
    return {"compile_ms": round(took[0] * 1000, 1), "longest_stall_ms": round(longest * 1000, 1)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1, help="threads of the batch mask fill (default: %(default)s)")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(default_model_path())
    report = {"machine": machine_info(args.threads), "rows": args.rows, "vocab": VOCAB}
    for cls in (XGrammar, LLGuidance):
        lib = cls(tokenizer, args.threads)
        lib.compile(SCHEMAS["enum"])  # warm-up
        report[lib.name] = {"tokenizer_info_ms": round(lib.tokenizer_seconds * 1000, 1),
                            "compile_ms": compile_times(lib), "mask": mask_cost(lib, args.rows, args.steps),
                            "gil": gil_stall_ms(lib)}
        print(json.dumps({lib.name: report[lib.name]}, indent=1), flush=True)
    return report


if __name__ == "__main__":
    main()
