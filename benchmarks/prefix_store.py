"""What the prefix store saves: a job whose lines share a long system prompt, on two workers.

Worker A runs the job's first two requests (the second finds the prompt in A's prefix cache, so A
publishes it to the store); then a fresh worker B runs the rest, once with the prefix store (it
loads the prompt's blocks) and once without (it computes them), each arm in a fresh engine on the
same model, driven as the engine worker drives it (a new request is looked up first and added
when its lookup is over; after each step the checkpointer's round and the prefix store's
publishing). Printed: B's prompt tokens computed and blocks loaded, B's seconds for the whole batch
and for its first request (from admission to its last token), the bytes on the store, and whether
both arms gave the same tokens. Default model, default settings, a folder as the store.

    python benchmarks/prefix_store.py --requests 16 --system 1000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks.machine import machine_line
from benchmarks.workload import corpus_token_ids
from storage import open_store
from worker.checkpoint.checkpointer import Checkpointer
from worker.checkpoint.format import KV_PREFIX
from worker.checkpoint.prefix_store import PrefixStore
from worker.config import Settings
from worker.engine.engine import DTYPES, Engine
from worker.engine.request import Request, SamplingParams
from worker.metrics import WorkerMetrics
from worker.model.loader import load_model


class Worker:
    """An engine with (or without) checkpoints and the prefix store, stepped as ``EngineWorker`` does."""

    def __init__(self, settings: Settings, loaded, store_url: str | None):
        self.engine = Engine(settings, loaded=loaded)
        self.checkpoints = self.prefixes = None
        if store_url is not None:
            store, metrics = open_store(store_url), WorkerMetrics()
            self.checkpoints = Checkpointer(self.engine, store, settings, metrics)
            if settings.prefix_store_on():
                self.prefixes = PrefixStore(self.engine, store, self.checkpoints, metrics)

    def run(self, requests: list[Request]) -> tuple[dict[str, list[int]], dict[str, float], float]:
        """Tokens per request, seconds from submission to the end per request, seconds in all."""
        t0 = time.perf_counter()
        for r in requests:
            if self.prefixes is None or not self.prefixes.submit(r):
                self.engine.add_request(r)
        out, ended = {}, {}
        while len(out) < len(requests):
            if self.prefixes is not None:
                for r in self.prefixes.ready():
                    self.engine.add_request(r)
            if not self.engine.has_unfinished():
                time.sleep(0.001)
                continue
            for o in self.engine.step():
                out[o.request_id] = o.completions[0].token_ids
                ended[o.request_id] = time.perf_counter() - t0
            if self.checkpoints is not None:
                self.checkpoints.after_step()
            if self.prefixes is not None:
                self.prefixes.after_step()
        return out, ended, time.perf_counter() - t0

    def close(self) -> None:
        if self.prefixes is not None:
            self.prefixes.close()
        if self.checkpoints is not None:
            self.checkpoints.close(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16, help="requests in the job (A runs 2, B the rest)")
    ap.add_argument("--system", type=int, default=1000, help="tokens of the shared system prompt")
    ap.add_argument("--suffix", type=int, default=40, help="tokens of each request's own part")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both arms, in turn first (a busy machine "
                    "slows both alike)")
    args = ap.parse_args()

    settings = Settings()
    loaded = load_model(settings.model_path(), DTYPES[settings.dtype])
    ids = corpus_token_ids(loaded.tokenizer)
    system = ids[:args.system]
    prompts = [system + ids[50_000 + 97 * i:50_000 + 97 * i + args.suffix] for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    make = lambda first: [Request(str(i), list(prompts[i]), params) for i in range(first, args.requests)]  # noqa: E731
    with tempfile.TemporaryDirectory() as folder:
        url = f"file://{folder}"
        a = Worker(settings, loaded, url)
        a.run(make(0)[:2])
        a.close()  # its checkpoints and prefix runs are written
        store = open_store(url)
        runs = list(store.list(KV_PREFIX))
        stored = sum(info.size for info in runs)
        arms = []
        for r in range(args.rounds):
            order = (("prefix store on", url), ("prefix store off", None))
            for name, store_url in order if r % 2 == 0 else order[::-1]:
                b = Worker(settings, loaded, store_url)
                tokens, ended, seconds = b.run(make(2))
                loaded_blocks = b.prefixes.loaded_blocks if b.prefixes is not None else 0
                arms.append((name, tokens, ended, seconds, b.engine.stats.prompt_tokens_computed, loaded_blocks))
                b.close()
    print(f"{machine_line()}, {settings.dtype}; default model; "
          f"{args.requests} requests, a {args.system}-token system prompt + {args.suffix} own tokens, "
          f"max_tokens {args.max_tokens}")
    print(f"worker A published {len(runs)} runs, {stored / 1e6:.1f} MB on the store")
    for name, tokens, ended, seconds, computed, blocks in arms:
        first = min(ended.values())
        print(f"worker B, {name}: {computed} prompt tokens computed, {blocks} blocks loaded; "
              f"{seconds:.2f} s for its {len(tokens)} requests, the first done after {first:.2f} s")
    same = all(tokens == arms[0][1] for _, tokens, *_ in arms)
    print(f"same tokens with the store on and off: {same}")


if __name__ == "__main__":
    main()
