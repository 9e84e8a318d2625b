"""Deadlines (issue 37, must-show 2): two jobs of one tenant, a 24-hour job A added first and a 1-hour job B
added a few steps later, behind it. With deadlines B finishes first; this measures that A loses no throughput
overall: the whole run's output tokens/s against the same two jobs with one deadline (both 24 hours, so no
reordering: B waits behind A, as in plain FIFO), in one process on the same weights, the two orderings
alternating.

The engine is driven directly (``Engine.add_request`` and ``Engine.step``, as ``job_tail.py`` does): no
database, no queue, no worker. What the queue adds (a request message's priority from its job's urgency) is
covered by tests/jobs/hosting/test_deadlines_embedded.py; here only the engine's waiting queue orders by
deadline (``worker/engine/waiting_queue.py``). Each run is a new engine (its own KV and prefix cache) warmed
up by a short generation.

Prompts come from the seeded workload (``benchmarks.workload``): A gets the first ``--a`` requests, B the
next ``--b``. Output lengths are drawn uniformly from ``--lengths`` with the same seed, greedy with
``ignore_eos``, so both orderings make the same tokens, which is checked request by request. B is added
after A's ``--b-after``-th step. Times are seconds from A's adding; a job finishes when its last request
does; tokens/s is all output tokens over the last request's finish. The steps each run took are printed
too (the admission order sets them, not the load): they say how full the batches were, not how long the
run took, as a CPU step's time grows with its batch. ``--rounds`` runs each ordering more times, alternating
which goes first, and reports medians.

    python benchmarks/deadlines.py             # A 192 + B 32 requests, 64 seats, 16-128 tokens, one run each
                                               # (about 4 minutes on 2 cores)
    python benchmarks/deadlines.py --quick     # A 24 + B 8, 8 seats, 8-32 tokens, 1 round
    python benchmarks/deadlines.py --quick --model DIR   # a safetensors folder or a GGUF file
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks.machine import machine_info, machine_line
from benchmarks.workload import make_workload
from worker.config import Settings, default_model_path
from worker.engine.engine import DTYPES, Engine
from worker.engine.request import Request, SamplingParams
from worker.model.loader import load_model

DAY, HOUR = 86400.0, 3600.0
ORDERINGS = ("same", "deadlines")  # B's deadline: A's (24 h), or 1 h


def run(loaded, settings: Settings, jobs: dict[str, list[tuple[list[int], int]]], b_after: int,
        deadlines: bool) -> tuple[dict, dict[str, list[int]]]:
    """One run: A added, B added after A's ``b_after``-th step (deadline 1 h with ``deadlines``, else A's 24 h),
    stepped until both finish. Its figures, and each request's output token ids."""
    engine = Engine(settings, loaded=loaded)
    engine.generate([jobs["A"][0][0][:16]], SamplingParams(max_tokens=4, temperature=0))  # warm-up

    def add(job: str, deadline: float) -> None:
        for i, (prompt, n) in enumerate(jobs[job]):
            engine.add_request(Request(f"{job}{i}", list(prompt),
                                       SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                                       job=job, deadline=deadline))

    day = time.time() + DAY  # one value for both jobs when they share it: the same deadline slot
    add("A", day)
    start = time.perf_counter()
    arrived = {"A": 0.0}
    done: dict[str, list[float]] = {"A": [], "B": []}
    outputs: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished() or "B" not in arrived:
        if steps == b_after and "B" not in arrived:
            add("B", time.time() + HOUR if deadlines else day)
            arrived["B"] = time.perf_counter() - start
        for out in engine.step():
            assert out.error is None, (out.request_id, out.error)
            done[out.request_id[0]].append(time.perf_counter() - start)
            outputs[out.request_id] = list(out.completions[0].token_ids)
        steps += 1
    tokens = sum(map(len, outputs.values()))
    assert len(outputs) == sum(map(len, jobs.values())) and tokens == sum(n for j in jobs.values() for _, n in j)
    wall = max(max(d) for d in done.values())
    figures = {"steps": steps, "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
               "jobs": {job: {"arrived_s": arrived[job], "finished_s": max(d), "took_s": max(d) - arrived[job],
                              "half_done_s": d[(len(d) - 1) // 2]}
                        for job, d in done.items()}}
    return figures, outputs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", type=int, default=None, help="job A's (24 h) requests (default 192, quick 24)")
    p.add_argument("--b", type=int, default=None, help="job B's (1 h) requests (default 32, quick 8)")
    p.add_argument("--seats", type=int, default=None, help="max_num_seqs (default 64, quick 8)")
    p.add_argument("--lengths", default=None, help="output tokens, drawn uniformly from A-B (default 16-128, "
                   "quick 8-32)")
    p.add_argument("--b-after", type=int, default=None, help="B is added after A's N-th step (default 8, quick 4)")
    p.add_argument("--rounds", type=int, default=None, help="each ordering this many times, alternating which "
                   "runs first (default 1)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--model", default="", help="a GGUF file or a safetensors folder (default: SmolLM2-135M)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default: benchmarks/results/deadlines[-quick].json)")
    args = p.parse_args(argv)
    for name, full, quick in (("a", 192, 24), ("b", 32, 8), ("seats", 64, 8), ("lengths", "16-128", "8-32"),
                              ("b_after", 8, 4), ("rounds", 1, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    try:
        lo, hi = (int(x) for x in args.lengths.split("-"))
        assert 1 <= lo <= hi
    except (ValueError, AssertionError):
        p.error(f"--lengths takes A-B (1 <= A <= B), not {args.lengths!r}")
    args.lengths = (lo, hi)
    args.model = args.model or default_model_path()
    args.out = args.out or Path(__file__).parent / "results" / f"deadlines{'-quick' if args.quick else ''}.json"
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    loaded = load_model(args.model, DTYPES[args.dtype])
    prompts = make_workload(loaded.tokenizer, args.a + args.b, args.seed).prompts
    rng = random.Random(args.seed)
    lengths = [rng.randint(*args.lengths) for _ in prompts]
    jobs = {"A": list(zip(prompts[:args.a], lengths[:args.a])), "B": list(zip(prompts[args.a:], lengths[args.a:]))}
    settings = Settings(model=args.model, dtype=args.dtype, threads=args.threads, max_num_seqs=args.seats)
    machine = machine_info(settings.resolved_threads())
    print(f"{machine_line(machine)}\nA (24 h) {args.a} requests, B {args.b} requests added after A's step "
          f"{args.b_after}; output {args.lengths[0]}-{args.lengths[1]} tokens ({sum(lengths)} in all), "
          f"{args.seats} seats, {args.dtype}, model {Path(args.model).name}; {args.rounds} round(s)", flush=True)
    runs: dict[str, list[dict]] = {o: [] for o in ORDERINGS}
    first: dict[str, list[int]] | None = None
    same_tokens = True
    for r in range(args.rounds):
        for ordering in (ORDERINGS if r % 2 == 0 else ORDERINGS[::-1]):
            figures, outputs = run(loaded, settings, jobs, args.b_after, ordering == "deadlines")
            first = first or outputs
            figures["same_tokens_as_first_run"] = outputs == first
            same_tokens &= outputs == first
            runs[ordering].append(figures)
            a, b = figures["jobs"]["A"], figures["jobs"]["B"]
            print(f"  round {r + 1} {ordering:9}: A finished {a['finished_s']:6.1f} s, B {b['finished_s']:6.1f} s "
                  f"(added {b['arrived_s']:.1f} s), {figures['tokens_per_s']:6.1f} tok/s, {figures['steps']} steps",
                  flush=True)
    median = {o: {"tokens_per_s": statistics.median(f["tokens_per_s"] for f in fs),
                  "A_finished_s": statistics.median(f["jobs"]["A"]["finished_s"] for f in fs),
                  "B_finished_s": statistics.median(f["jobs"]["B"]["finished_s"] for f in fs)}
              for o, fs in runs.items()}
    same, dl = median["same"], median["deadlines"]
    summary = {
        "tokens_per_s_ratio": dl["tokens_per_s"] / same["tokens_per_s"],  # deadlines / same deadline
        "round_ratios": [d["tokens_per_s"] / s["tokens_per_s"] for s, d in zip(runs["same"], runs["deadlines"])],
        # set by the admission order (and the KV cache), not the load; fewer steps are fuller batches, not less time
        "steps": {o: statistics.median(f["steps"] for f in fs) for o, fs in runs.items()},
        "b_first_with_deadlines": all(f["jobs"]["B"]["finished_s"] < f["jobs"]["A"]["finished_s"]
                                      for f in runs["deadlines"]),
        "b_finished_s": {o: m["B_finished_s"] for o, m in median.items()},
        "a_finished_s": {o: m["A_finished_s"] for o, m in median.items()},
        "outputs_identical": same_tokens,
    }
    print(f"median of {args.rounds}: same deadline {same['tokens_per_s']:.1f} tok/s, A {same['A_finished_s']:.1f} s, "
          f"B {same['B_finished_s']:.1f} s; deadlines {dl['tokens_per_s']:.1f} tok/s, A {dl['A_finished_s']:.1f} s, "
          f"B {dl['B_finished_s']:.1f} s")
    print(f"tokens/s deadlines / same deadline: {summary['tokens_per_s_ratio']:.3f} (rounds: "
          f"{', '.join(f'{x:.3f}' for x in summary['round_ratios'])}); steps {summary['steps']['same']:.0f} against "
          f"{summary['steps']['deadlines']:.0f}; B first with deadlines: "
          f"{summary['b_first_with_deadlines']}, B finished {dl['B_finished_s']:.1f} s against "
          f"{same['B_finished_s']:.1f} s ({dl['B_finished_s'] / same['B_finished_s']:.2f}x)")
    print(f"outputs identical between the orderings: {same_tokens} ({len(first or {})} requests)")
    report = {"machine": machine, "model": args.model, "dtype": args.dtype, "threads": args.threads, "seed": args.seed,
              "a": args.a, "b": args.b, "seats": args.seats, "lengths": list(args.lengths), "b_after": args.b_after,
              "output_tokens": sum(lengths), "rounds": args.rounds, "quick": args.quick, "runs": runs,
              "median": median, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
