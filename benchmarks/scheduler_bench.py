"""The scheduler alone: steps per second of ``Scheduler.schedule`` (no model, no block copies), this
tree against a baseline checkout in the same run, rounds alternating so that a busy machine slows
both alike.

    git archive main worker | tar -x -C /tmp/berth-baseline
    python benchmarks/scheduler_bench.py --baseline /tmp/berth-baseline

Each case keeps the engine full: a backlog per tenant, the default budget (2,048 tokens) and seats
(256), and a fake model that gives every sequence that reached the end of its tokens a new one.
Only the CPU time inside ``schedule()`` is counted (process time: a busy machine makes it wait, not count).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# name: (tenants, prompt tokens, output tokens)
CASES = {
    "1 tenant, 256 decoding": (1, 64, 256),
    "4 tenants, 64 decoding each": (4, 64, 256),
    "16 tenants, 16 decoding each": (16, 64, 256),
    "prefill-heavy, 4 tenants (512-token prompts, 16 out)": (4, 512, 16),
}


def measure(tenants: int, prompt: int, out: int, warmup: int = 100, steps: int = 400) -> float:
    """Steps per second of ``schedule()`` on the tree first on ``sys.path``."""
    from worker.engine.block_manager import BlockManager
    from worker.engine.request import Request, SamplingParams, Sequence
    from worker.engine.scheduler import Scheduler

    sched = Scheduler(BlockManager(300_000, 16), 2048, 256)
    n = 0

    def add(tenant: str) -> None:
        nonlocal n
        n += 1
        req = Request(str(n), [n] + [7] * (prompt - 1), SamplingParams(max_tokens=out), tenant=f"t{tenant}")
        seq = Sequence(request=req, sample_index=0, token_ids=list(req.prompt_token_ids), num_prompt_tokens=prompt)
        req.sequences.append(seq)
        req.arrival_step = sched.step_count
        sched.add(seq)

    spent = 0.0
    for step in range(warmup + steps):
        while len(sched.waiting) < 64 * tenants:
            add(str(n % tenants))
        t0 = time.process_time()
        plan = sched.schedule()
        if step >= warmup:
            spent += time.process_time() - t0
        for seq, k in plan.scheduled:
            seq.num_computed_tokens += k
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(1)
                if seq.num_output_tokens == out:
                    sched.finish(seq)
    return steps / spent


def run_tree(tree: Path | None, case: str) -> float:
    tree = tree or Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); " \
           f"from scheduler_bench import measure, CASES; print(json.dumps(measure(*CASES[{case!r}])))"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="a checkout (or `git archive` of worker/) to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for case in CASES:
        ours, base = [], []
        for _ in range(args.rounds):
            ours.append(run_tree(None, case))
            if args.baseline:
                base.append(run_tree(args.baseline, case))
        line = f"{case:55s} this tree {max(ours):8.0f} steps/s"
        if base:
            line += f"   baseline {max(base):8.0f} steps/s   ({max(ours) / max(base):.2f}x)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
