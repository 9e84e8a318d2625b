"""A job's tail (issue 37): one job of mixed-length requests run by the engine with ``tail_first`` off
and on, in one process on the same weights. Prints, for each, the time from the job's 90% of requests
done to 100%, and the whole job's time, and names the CPU.

The requests' prompts come from the seeded workload (``benchmarks.workload``); their output lengths are
a mix of ``LENGTHS`` drawn from the seed, with ``ignore_eos``, so the lengths ``max_tokens`` predicts are
the lengths run, and both runs make the same tokens. Started in queue order, a long request admitted
late runs on while the batch empties around it; with the tail first, the job's longest waiting requests
start first once they fit in the batch (``worker.engine.job_tail``).

    python benchmarks/job_tail.py                      # 256 requests, 64 seats
    python benchmarks/job_tail.py --requests 64 --seats 16
"""

from __future__ import annotations

import argparse
import random
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

LENGTHS = (8, 16, 32, 128)  # output tokens: mostly short, a quarter long


def run(loaded, settings: Settings, prompts: list[list[int]], lengths: list[int]) -> tuple[float, float]:
    """(seconds from 90% of the requests done to 100%, seconds for the whole job)."""
    engine = Engine(settings, loaded=loaded)
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(Request(str(i), list(prompt), SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                                   job="job", deadline=time.time() + 86400))
    done: list[float] = []
    start = time.perf_counter()
    while engine.has_unfinished():
        done += [time.perf_counter() - start for _ in engine.step()]
    assert len(done) == len(prompts)
    ninety = done[int(0.9 * len(done)) - 1]
    return done[-1] - ninety, done[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--seats", type=int, default=64, help="max_num_seqs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    path = default_model_path()
    loaded = load_model(path, DTYPES[args.dtype])
    prompts = make_workload(loaded.tokenizer, args.requests, args.seed).prompts
    rng = random.Random(args.seed)
    lengths = [rng.choice(LENGTHS) for _ in prompts]
    machine = machine_info(Settings(threads=args.threads).resolved_threads())  # the engines' threads
    print(f"{machine_line(machine)}; {args.requests} requests, output lengths {LENGTHS} ({sum(lengths)} tokens), "
          f"{args.seats} seats, {args.dtype}, model {Path(path).name}")
    for tail_first in (False, True):
        settings = Settings(model=path, dtype=args.dtype, threads=args.threads, max_num_seqs=args.seats,
                            tail_first=tail_first)
        tail, whole = run(loaded, settings, prompts, lengths)
        print(f"tail_first={str(tail_first):5}  90% -> 100%: {tail:6.1f} s   whole job: {whole:6.1f} s")


if __name__ == "__main__":
    main()
