"""Offline generation: an OpenAI Batch request file in, an output file out, in one process.

    from jobs.hosting.generate import generate_file
    summary = generate_file("requests.jsonl", "results.jsonl", Settings(dtype="bfloat16"))

Good lines run through the engine with continuous batching; bad lines go to the errors file with
their line number, field and reason. Output lines come in input order, written as soon as every
line before them is done. Lines are read and checked by the jobs' own front door
(``jobs.lines.validate``: ``read_lines`` and ``LineValidator``), so ``berth generate`` and ``berth run``
accept the same lines and report the same errors; the validator takes the model's facts from the
engine, which loaded its tokenizer already.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from jobs.lines.batch_format import BatchLine, LineError, response_line
from jobs.lines.validate import LineValidator, ModelInfo, check_file_size, read_lines
from worker.config import Settings
from worker.engine.engine import Engine, RequestRejected


@dataclass
class GenerateSummary:
    total: int
    completed: int
    failed: int
    output_tokens: int
    prompt_tokens_computed: int
    seconds: float
    output_path: str
    errors_path: str | None

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def generate_file(input_path: str | Path, output_path: str | Path, settings: Settings | None = None, *,
                  errors_path: str | Path | None = None, engine: Engine | None = None,
                  progress: bool = True) -> GenerateSummary:
    """Run every request line of ``input_path``; write responses to ``output_path``.

    Errors go to ``errors_path`` (default: ``<output>.errors.jsonl``), which is written only when a
    line failed.
    """
    input_path, output_path = Path(input_path), Path(output_path)
    errors_path = Path(errors_path) if errors_path else output_path.with_suffix(".errors.jsonl")
    limits = settings or (engine.settings if engine is not None else Settings())
    check_file_size(input_path, limits.max_file_bytes)  # before the model loads
    engine = engine or Engine(settings)
    validator = LineValidator(ModelInfo.of_engine(engine, limits))
    errors: list[dict] = []
    pending: list[tuple[BatchLine, object]] = []
    with open(input_path, "rb") as f:
        for raw in read_lines(f):
            try:
                custom_id, url, request = validator.check(raw)
            except LineError as exc:
                errors.append(exc.to_error_line())
                continue
            pending.append((BatchLine(raw.number, custom_id, url, {}), request))
    total = len(pending) + len(errors)
    start = time.perf_counter()
    stats0 = (engine.stats.output_tokens, engine.stats.prompt_tokens_computed)
    lines_by_id = {req.request_id: line for line, req in pending}
    tool_calls = {req.request_id: req.params.tool_calls for _, req in pending}  # how each answer's calls are read
    order = [req.request_id for _, req in pending]
    done: dict[str, dict | None] = {}  # None: the engine refused it
    written = completed = 0
    bar = _progress_bar(len(pending)) if progress else None
    feed = iter(req for _, req in pending)
    window = 4 * engine.settings.max_num_seqs  # enough waiting work to fill every step, no more
    with open(output_path, "w") as out:
        while written < len(order):
            while engine.num_unfinished < window and (req := next(feed, None)) is not None:
                try:
                    engine.add_request(req)
                except RequestRejected as exc:  # too big for this engine's KV cache: the worker's outcome too
                    line = lines_by_id[req.request_id]
                    errors.append(LineError(line.line, None, str(exc), line.custom_id, "request_rejected")
                                  .to_error_line())
                    done[req.request_id] = None
            for result in engine.step():
                done[result.request_id] = response_line(lines_by_id[result.request_id], result, engine.model_name,
                                                        engine.tokenizer, tool_calls[result.request_id])
                if bar is not None:
                    bar.update(1)
            while written < len(order) and order[written] in done:
                if (answer := done.pop(order[written])) is not None:
                    out.write(json.dumps(answer, ensure_ascii=False) + "\n")
                    completed += 1
                written += 1
            if bar is not None:
                _show_rates(bar, engine, stats0, start)
    if bar is not None:
        bar.close()
    if errors:
        with open(errors_path, "w") as f:
            for e in sorted(errors, key=lambda e: e["error"]["line"]):
                f.write(json.dumps(e, ensure_ascii=False) + "\n")
    return GenerateSummary(total=total, completed=completed, failed=len(errors),
                           output_tokens=engine.stats.output_tokens - stats0[0],
                           prompt_tokens_computed=engine.stats.prompt_tokens_computed - stats0[1],
                           seconds=time.perf_counter() - start, output_path=str(output_path),
                           errors_path=str(errors_path) if errors else None)


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="requests", dynamic_ncols=True)


def _show_rates(bar, engine: Engine, stats0: tuple[int, int], start: float) -> None:
    elapsed = max(time.perf_counter() - start, 1e-9)
    decode = (engine.stats.output_tokens - stats0[0]) / elapsed
    prefill = (engine.stats.prompt_tokens_computed - stats0[1]) / elapsed
    bar.set_postfix_str(f"prefill {prefill:,.0f} tok/s, decode {decode:,.0f} tok/s", refresh=False)
