"""Stopping and detokenizing, as vLLM's ``v1/engine/detokenizer.py`` and stop checker: whether a
sample's newest token ends it (stop id, complete grammar, stop string, length), and a finished
sample's text as its result shows it."""

from __future__ import annotations

from worker.engine.request import Sequence, shown_text


def may_finish(seq: Sequence, token: int, max_model_len: int) -> bool:
    """Whether ``finish_reason`` can be anything but None for this token: most rows of a step go on, and
    this asks, cheaply, only what each of its conditions needs (a stop id, a grammar, stop strings, a length).
    A new stop condition goes in both."""
    request = seq.request
    p = request.params
    length = len(seq.token_ids) + seq.inflight
    return (token in request.stop_set or seq.matcher is not None or bool(p.stop)
            or length - seq.num_prompt_tokens >= p.max_tokens or length >= max_model_len)


def finish_reason(seq: Sequence, token: int, tokenizer, max_model_len: int) -> str | None:
    p = seq.request.params
    if token in seq.request.stop_set and seq.num_output_tokens > p.min_tokens:
        return "stop"
    if seq.matcher is not None and seq.matcher.is_terminated():
        return "stop"
    if p.stop and cut_at_stop_string(seq, tokenizer):
        return "stop"
    if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def cut_at_stop_string(seq: Sequence, tokenizer) -> bool:
    """Whether the output now holds a stop string (and where the text ends). Checked after
    every token: only the last tokens are decoded (a new match ends in the newest token, and a
    character takes at most 4 byte tokens), and the whole output only to place a match, which
    ends the sequence; decoding it all every step would be quadratic in its length."""
    stops = seq.request.params.stop
    ids = seq.output_token_ids
    window = 4 * max(map(len, stops)) + 8
    if len(ids) > window:
        tail = tokenizer.decode(ids[-window:], skip_special_tokens=True)
        if not any(s in tail for s in stops):
            return False
    text = tokenizer.decode(ids, skip_special_tokens=True)
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        seq.stop_text_end = min(hits)
    return bool(hits)


def final_text(seq: Sequence, tokenizer) -> str:
    """A finished sample's text, as its result shows it: without the stop token that ended it,
    cut where a stop string began."""
    return shown_text(tokenizer, seq.output_token_ids, shown_tokens(seq), seq.stop_text_end)


def shown_tokens(seq: Sequence) -> int:
    """How many of a finished sample's output tokens its text shows: all but the stop token that ended it."""
    ids = seq.output_token_ids
    return len(ids) - 1 if seq.finish_reason == "stop" and ids and ids[-1] in seq.request.stop_set else len(ids)
