"""``stop_checker.may_finish``, the engine's cheap precheck a row, must be True wherever ``finish_reason``
would end the row: a condition added to one and not the other would let a sequence run past its stop."""

import itertools

from worker.engine import stop_checker
from worker.engine.request import Request, SamplingParams, Sequence


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


class _Matcher:
    def __init__(self, done):
        self.done = done

    def is_terminated(self):
        return self.done


def _seq(params, prompt, outputs, inflight, matcher):
    request = Request("r", list(range(1, prompt + 1)), params)
    request.stop_set = frozenset({2}) | frozenset(params.stop_token_ids)
    seq = Sequence(request, 0, list(request.prompt_token_ids) + outputs, prompt, inflight=inflight)
    seq.matcher = matcher
    return seq


def test_may_finish_holds_wherever_finish_reason_ends_a_row():
    tok, ended = _Tokenizer(), 0
    for max_tokens, min_tokens, stop, stop_ids, outputs, inflight, matcher, max_len, token in itertools.product(
            (1, 3, 8), (0, 2), ((), ("cd",)), ((), (5,)), ([0, 1], [2, 3, 2], [9] * 7), (0, 1),
            (None, _Matcher(False), _Matcher(True)), (6, 64), (2, 4, 5, 7)):
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), stop=list(stop),
                                stop_token_ids=list(stop_ids))
        seq = _seq(params, 3, outputs + [token], inflight, matcher)
        reason = stop_checker.finish_reason(seq, token, tok, max_len)
        ended += reason is not None
        if reason is not None:
            assert stop_checker.may_finish(seq, token, max_len), (reason, params, outputs, token, inflight)
    assert ended > 100  # the grid reaches every condition, not only the plain "go on"


def test_a_plain_row_that_goes_on_asks_nothing_more():
    seq = _seq(SamplingParams(max_tokens=100), 3, [7, 8], 0, None)
    assert not stop_checker.may_finish(seq, 9, 4096)
