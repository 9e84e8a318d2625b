"""Offline generation: an OpenAI Batch request file in, an output file out, in one process.

    from jobs.hosting.generate import generate_file
    summary = generate_file("requests.jsonl", "results.jsonl", Settings(dtype="bfloat16"))

Good lines run through the engine with continuous batching; bad lines go to the errors file with
their line number, field and reason. Lines are read and checked by the jobs' own front door
(``jobs.lines.validate``: ``read_lines`` and ``LineValidator``), so ``berth generate`` and ``berth run``
accept the same lines and report the same errors; the validator takes the model's facts from the
engine, which loaded its tokenizer already.

Nothing finished is lost: each step's finished lines are appended to ``OUTPUT.partial`` as they come
(flushed), and only when every line is done is the output written, in input order, and put in place
(``os.replace``), the partial file removed. An interrupted run (Ctrl-C: ``GenerateInterrupted``) leaves
the partial file; ``resume=True`` keeps its lines and runs only the others. Progress counts tokens
(``work_estimate``), not finished requests, which with continuous batching mostly finish at the end.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from jobs.lines.batch_format import BatchLine, LineError, response_line
from jobs.lines.validate import LineValidator, ModelInfo, check_file_size, check_output, read_lines
from jobs.records.work_estimate import WorkEstimate
from worker.config import Settings
from worker.engine.engine import Engine, RequestRejected
from worker.frozen_heap import frozen_heap


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
    resumed: int = 0  # lines kept from an earlier, interrupted run

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


class GenerateInterrupted(Exception):
    """Ctrl-C stopped the run: ``summary`` says what was done; its lines are in ``partial``."""

    def __init__(self, summary: GenerateSummary, partial: Path):
        super().__init__(f"stopped: {summary.completed} of {summary.total} lines done")
        self.summary, self.partial = summary, partial


def partial_path(output_path: Path) -> Path:
    return output_path.with_name(output_path.name + ".partial")


def generate_file(input_path: str | Path, output_path: str | Path, settings: Settings | None = None, *,
                  errors_path: str | Path | None = None, engine: Engine | None = None,
                  progress: bool = True, resume: bool = False, stop: threading.Event | None = None) -> GenerateSummary:
    """Run every request line of ``input_path``; write responses to ``output_path``, in input order.

    Errors go to ``errors_path`` (default: ``<output>.errors.jsonl``), written only when a line failed.
    ``resume``: keep the lines of ``<output>.partial`` an interrupted run left, run the rest.
    ``GenerateInterrupted`` on Ctrl-C, with what was done kept in ``<output>.partial``; ``stop``, set by the
    caller's SIGINT handler, stops the run at its next step too, should a library have swallowed the
    KeyboardInterrupt (an extension that checks for signals and drops the error).
    """
    input_path, output_path = Path(input_path), Path(output_path)
    errors_path = Path(errors_path) if errors_path else output_path.with_suffix(".errors.jsonl")
    partial = partial_path(output_path)
    limits = settings or (engine.settings if engine is not None else Settings())
    check_file_size(input_path, limits.max_file_bytes)  # before the model loads
    check_output(output_path)
    kept = _read_partial(partial) if resume else {}
    engine = engine or Engine(settings)
    validator = LineValidator(ModelInfo.of_engine(engine, limits))
    errors: list[dict] = []
    pending: list[tuple[BatchLine, object]] = []
    order: list[str] = []  # every good line's custom_id, in input order
    with open(input_path, "rb") as f:
        for raw in read_lines(f):
            try:
                custom_id, url, request = validator.check(raw)
            except LineError as exc:
                errors.append(exc.to_error_line())
                continue
            order.append(custom_id)
            if custom_id not in kept:
                pending.append((BatchLine(raw.number, custom_id, url, {}), request))
    errors_path.unlink(missing_ok=True)  # an earlier run's: this run writes its own
    _write_errors(errors_path, errors)
    total = len(order) + len(errors)
    start = time.perf_counter()
    stats0 = (engine.stats.output_tokens, engine.stats.prompt_tokens_computed)
    lines_by_id = {req.request_id: line for line, req in pending}
    tool_calls = {req.request_id: req.params.tool_calls for _, req in pending}  # how each answer's calls are read
    estimate = WorkEstimate({req.request_id: req.params.max_tokens * req.params.n for _, req in pending})
    completed = len(kept)
    bar = _progress_bar(estimate.expected(), len(order), completed) if progress else None
    feed = iter(req for _, req in pending)
    window = 4 * engine.settings.max_num_seqs  # enough waiting work to fill every step, no more
    unfinished = len(pending)

    def summary() -> GenerateSummary:
        return GenerateSummary(total=total, completed=completed, failed=len(errors),
                               output_tokens=engine.stats.output_tokens - stats0[0],
                               prompt_tokens_computed=engine.stats.prompt_tokens_computed - stats0[1],
                               seconds=time.perf_counter() - start, output_path=str(output_path),
                               errors_path=str(errors_path) if errors else None, resumed=len(kept))

    try:
        with frozen_heap(), open(partial, "a" if resume else "w") as out:  # the collector skips start-up's heap
            while unfinished:
                if stop is not None and stop.is_set():
                    raise KeyboardInterrupt
                while engine.num_unfinished < window and (req := next(feed, None)) is not None:
                    try:
                        engine.add_request(req)
                    except RequestRejected as exc:  # too big for this engine's KV cache: the worker's outcome too
                        line = lines_by_id[req.request_id]
                        error = LineError(line.line, None, str(exc), line.custom_id, "request_rejected").to_error_line()
                        errors.append(error)
                        _write_errors(errors_path, [error], append=True)
                        order.remove(line.custom_id)
                        estimate.finished(req.request_id, 0, counted=False)
                        unfinished -= 1
                for result in engine.step():
                    answer = response_line(lines_by_id[result.request_id], result, engine.model_name,
                                           engine.tokenizer, tool_calls[result.request_id])
                    out.write(json.dumps(answer, ensure_ascii=False) + "\n")
                    estimate.finished(result.request_id, result.num_output_tokens)
                    completed += 1
                    unfinished -= 1
                out.flush()
                if bar is not None:
                    _redraw(bar, engine, estimate, stats0, start, completed)
    except KeyboardInterrupt:
        for request_id in lines_by_id:  # the engine may run other work after this (an API caller's)
            engine.abort(request_id)
        if bar is not None:
            bar.close()
        _write_errors(errors_path, errors)
        raise GenerateInterrupted(summary(), partial) from None
    if bar is not None:
        bar.close()
    _put_in_order(partial, output_path, order)
    _write_errors(errors_path, errors)
    return summary()


def _read_partial(partial: Path) -> dict[str, str]:
    """custom_id -> output line of an interrupted run's partial file; a last line cut short is dropped."""
    kept: dict[str, str] = {}
    if not partial.exists():
        return kept
    with open(partial, encoding="utf-8") as f:
        for text in f:
            try:
                kept[json.loads(text)["custom_id"]] = text if text.endswith("\n") else text + "\n"
            except (ValueError, KeyError, TypeError):
                continue  # written halfway when the run stopped
    with open(partial, "w", encoding="utf-8") as f:  # only whole lines: appended to from here
        f.writelines(kept.values())
    return kept


def _put_in_order(partial: Path, output_path: Path, order: list[str]) -> None:
    """The partial file's lines in input order, written beside the output and moved over it at once."""
    lines = _read_partial(partial)
    tmp = output_path.with_name(output_path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(lines[custom_id] for custom_id in order if custom_id in lines)
    os.replace(tmp, output_path)
    partial.unlink()


def _write_errors(path: Path, errors: list[dict], append: bool = False) -> None:
    """The errors file in line order (``append``: these after those already written); none without errors."""
    if not errors:
        return
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for e in sorted(errors, key=lambda e: e["error"]["line"]):
            f.write(json.dumps(e, ensure_ascii=False) + "\n")


def _progress_bar(expected_tokens: int, requests: int, done: int):
    from tqdm import tqdm

    bar = tqdm(total=expected_tokens, unit="tok", desc="tokens", dynamic_ncols=True, unit_scale=True)
    bar.set_postfix_str(f"{done}/{requests} requests", refresh=False)
    return bar


def _redraw(bar, engine: Engine, estimate: WorkEstimate, stats0: tuple[int, int], start: float,
            completed: int) -> None:
    """Tokens made against the tokens expected (``WorkEstimate``): the bar's rate and ETA are the engine's.
    Drawn at most five times a second (a step may take milliseconds)."""
    now = time.perf_counter()
    if now - getattr(bar, "drawn_at", 0.0) < 0.2:
        return
    bar.drawn_at = now
    made = engine.stats.output_tokens - stats0[0]
    running = {rid: sum(s.num_output_tokens for s in r.sequences) for rid, r in engine.requests.items()}
    bar.total = max(estimate.expected(running), made)
    bar.n = made
    elapsed = max(time.perf_counter() - start, 1e-9)
    prefill = (engine.stats.prompt_tokens_computed - stats0[1]) / elapsed
    bar.set_postfix_str(f"{completed} requests done, prefill {prefill:,.0f} tok/s", refresh=False)
    bar.refresh()
