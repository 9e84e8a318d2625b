"""When to speculate: auto drafts while few sequences run and their drafts are accepted, shrinking k step
by step as the batch grows (no cliff); never a row whose token is in flight, never past max_tokens; a
sequence whose drafts are refused whole sits out more steps each time."""

from __future__ import annotations

import pytest

from worker.engine.request import Request, SamplingParams, SeqStatus, Sequence
from worker.engine.speculative.policy import MAX_K, MAX_REST, DraftState, SpeculationPolicy, parse


def test_parse():
    assert parse("off") == ("off", 0) and parse("auto") == ("auto", MAX_K) and parse("ngram:5") == ("ngram", 5)
    for bad in ("on", "ngram:0", "ngram:33", "ngram", "suffix:3"):
        with pytest.raises(ValueError):
            parse(bad)


def test_auto_k_shrinks_with_the_batch_and_with_rejections_without_a_cliff():
    by_running = [SpeculationPolicy._auto_k(0.9, 0.3 + 0.7 * (r - 1) / 16) for r in range(1, 18)]
    assert by_running[0] == MAX_K and by_running[-1] == 0
    assert all(a >= b for a, b in zip(by_running, by_running[1:]))  # never grows as more run
    assert all(a - b <= 2 for a, b in zip(by_running, by_running[1:])), by_running  # steps, not a cliff
    assert [SpeculationPolicy._auto_k(p, 0.3) for p in (1.0, 0.9, 0.6, 0.29)] == [MAX_K, MAX_K, 2, 0]
    state = DraftState()
    for _ in range(6):
        state.observe(4, 0)
    assert state.acceptance < 0.3  # its drafts keep failing: it stops drafting
    for _ in range(6):
        state.observe(4, 4)
    assert state.acceptance > 0.9


def _decoding(params: SamplingParams, prompt: list[int], output: list[int]) -> Sequence:
    seq = Sequence(Request("r", prompt, params), 0, prompt + output, len(prompt))
    seq.status, seq.num_computed_tokens = SeqStatus.RUNNING, len(prompt) + len(output) - 1
    return seq


def _policy(spec: str) -> SpeculationPolicy:
    return SpeculationPolicy(spec, max_running=4, max_model_len=1000, block_size=4, max_num_batched_tokens=64)


REPEATS = [1, 2, 3, 4, 5, 6, 7, 8] * 3


def test_who_drafts():
    greedy = SamplingParams(temperature=0, max_tokens=50)
    rows = {"greedy": _decoding(greedy, REPEATS, [1, 2]),
            "seeded": _decoding(SamplingParams(temperature=0.8, max_tokens=50), REPEATS, [1, 2]),
            "penalty": _decoding(SamplingParams(temperature=0, repetition_penalty=1.2, max_tokens=50), REPEATS, [1, 2]),
            "short": _decoding(SamplingParams(temperature=0, max_tokens=4), REPEATS, [1, 2, 3]),
            "prefill": _decoding(greedy, REPEATS, [])}
    rows["prefill"].num_computed_tokens = 5
    drafts = _policy("ngram:4").draft(list(rows.values()), free_blocks=100)
    assert drafts.seqs == [rows["greedy"], rows["seeded"], rows["penalty"]] and rows["greedy"].draft == [3, 4, 5, 6]
    assert drafts.keep_on_host
    assert all(not s.draft for name, s in rows.items() if name not in ("greedy", "seeded", "penalty"))
    # max_tokens 4 with 3 out: the next token is its last, no room for a draft (with the bonus token)
    rows["short"].request = Request("r", REPEATS, SamplingParams(temperature=0, max_tokens=6))
    assert _policy("ngram:4").draft([rows["short"]], 100).seqs and rows["short"].draft == [4, 5]


def test_a_token_in_flight_is_never_drafted_after_but_keeps_the_step_on_the_host():
    seq = _decoding(SamplingParams(temperature=0, max_tokens=50), REPEATS, [1, 2])
    seq.inflight, seq.num_computed_tokens = 1, seq.num_computed_tokens + 1  # its newest token sampled, unread
    drafts = _policy("ngram:4").draft([seq], 100)
    assert drafts.seqs == [] and seq.draft == [] and drafts.keep_on_host


def test_auto_stops_with_many_running_and_off_never_drafts():
    seqs = [_decoding(SamplingParams(temperature=0, max_tokens=50), REPEATS, [1, 2]) for _ in range(5)]
    assert _policy("auto").draft(seqs, 100).seqs == []  # 5 running, max_running 4
    assert _policy("auto").draft(seqs[:1], 100).seqs == seqs[:1]
    assert len(seqs[0].draft) == SpeculationPolicy._auto_k(DraftState().acceptance, 0.3) == 4  # the prior's k
    seqs[0].draft = []
    assert _policy("off").draft(seqs[:1], 100).seqs == []


def test_drafts_never_take_the_blocks_running_sequences_need():
    seqs = [_decoding(SamplingParams(temperature=0, max_tokens=50), REPEATS, [1, 2]) for _ in range(2)]
    # 2 running: two blocks kept for their next tokens, one left: one draft of 4 tokens fits
    drafts = _policy("ngram:4").draft(seqs, free_blocks=3)
    assert len(drafts.seqs) == 1


def test_steps_with_drafts_keep_to_few_row_counts():
    from worker.engine.speculative.policy import BUCKET, excess_rows

    assert [excess_rows(r, 16) for r in (1, BUCKET, BUCKET + 3, 3 * BUCKET, 3 * BUCKET + 5)] == [0, 0, 3, 0, 5]
    assert excess_rows(3 * BUCKET + 5, 4) == 0  # too few draft tokens to reach the bucket: left as it is


def test_the_step_cost_is_fitted_from_steps_of_different_sizes():
    from worker.engine.speculative.step_cost import StepCost

    cost = StepCost()
    for _ in range(20):
        cost.observe(16, 0.028 + 0.0018 * 16)
    assert cost.fit() is None  # one size only: a and b cannot be told apart
    for rows in [1, 4, 8, 16, 24, 32] * 5:
        cost.observe(rows, 0.028 + 0.0018 * rows)
    a, b = cost.fit()
    assert a == pytest.approx(0.028, rel=1e-6) and b == pytest.approx(0.0018, rel=1e-6)
    for rows in [1, 4, 8, 16, 24, 32] * 60:  # the machine got slower: the old steps are forgotten
        cost.observe(rows, 2 * (0.028 + 0.0018 * rows))
    a, b = cost.fit()
    assert a == pytest.approx(0.056, rel=0.01) and b == pytest.approx(0.0036, rel=0.01)


def _fitted(a: float, b: float, max_running: int = 64) -> SpeculationPolicy:
    policy = SpeculationPolicy("auto", max_running=max_running, max_model_len=1000, block_size=4,
                               max_num_batched_tokens=4096)
    for rows in [1, 8, 16, 32, 64] * 4:
        policy.observe(rows, a + b * rows)
    return policy


def _drafted(policy: SpeculationPolicy, running: int, acceptance: float = 0.9) -> list[int]:
    seqs = [_decoding(SamplingParams(temperature=0, max_tokens=50), REPEATS, [1, 2]) for _ in range(running)]
    for seq in seqs:
        seq.spec = DraftState(accepted=acceptance, tried=1.0)
    policy.draft(seqs, free_blocks=10_000)
    return [len(seq.draft) for seq in seqs]


def test_auto_drafts_what_the_measured_step_cost_pays_for_without_a_cliff():
    """On a CPU (a step of the default model: 28 ms plus 1.8 ms a row) drafts shrink token by token as
    more sequences run; on a device whose rows cost little beside the step (a GPU's decode), many
    sequences still draft their longest; drafts that fail are not drafted however cheap."""
    cpu = _fitted(0.028, 0.0018)
    per_seq = [sum(_drafted(cpu, r)) / r for r in (1, 2, 4, 8, 16, 24, 32, 48, 64)]
    assert per_seq[0] == MAX_K and per_seq[-1] < 2.5, per_seq
    assert all(a >= b for a, b in zip(per_seq, per_seq[1:])), per_seq
    assert all(a - b <= 2.5 for a, b in zip(per_seq, per_seq[1:])), per_seq  # steps, not a cliff

    def rate(running: int, k: int, a: float = 0.028, b: float = 0.0018, p: float = 0.9) -> float:
        return running * sum(p ** j for j in range(k + 1)) / (a + b * running * (k + 1))

    for running in (8, 24, 64):  # the chosen k does as well as the best uniform k
        ks = _drafted(cpu, running)
        best = max(rate(running, k) for k in range(MAX_K + 1))
        assert rate(running, round(sum(ks) / running)) >= 0.97 * best, (running, ks)
    gpu = _fitted(0.007, 0.000005)
    assert _drafted(gpu, 64) == [MAX_K] * 64
    assert _drafted(gpu, 8, acceptance=0.05) == [0] * 8


def test_the_jobs_index_drafts_where_the_sequences_own_ngrams_match_less():
    policy, greedy = _policy("ngram:4"), SamplingParams(temperature=0, max_tokens=50)
    policy.jobs.feed("t", "j", [40, 41, 42, 43, 44, 45, 46, 47, 48])

    def line(prompt, output, tenant="t", job="j"):
        seq = _decoding(greedy, prompt, output)
        seq.request.tenant, seq.request.job = tenant, job
        return seq

    rows = {"own none": line([1, 2, 3], [42, 43]),  # its own n-grams have nothing: the job's
            "job longer": line([44, 99, 7, 40], [41, 42, 43, 44]),  # own (44,) vs the job's 5 tokens
            "job as long": line([43, 99, 7], [41, 42, 43]),  # own (43,) vs the job's 3: no more than its own may
            "other tenant": line([1, 2, 3], [42, 43], tenant="u"),
            "no job": line([1, 2, 3], [42, 43], job=None)}
    drafts = _policy_draft(policy, rows)
    assert drafts == {"own none": ([44, 45, 46, 47], True), "job longer": ([45, 46, 47, 48], True),
                      "job as long": ([99, 7, 41, 42], False), "other tenant": ([], False), "no job": ([], False)}
    assert _policy("off").jobs is None  # speculation off: no index kept, nothing fed


def _policy_draft(policy: SpeculationPolicy, rows: dict[str, Sequence]) -> dict[str, tuple[list[int], bool]]:
    policy.draft(list(rows.values()), free_blocks=100)
    return {name: (seq.draft, seq.spec.from_job) for name, seq in rows.items()}


def test_a_sequence_whose_drafts_are_refused_whole_rests_longer_each_time():
    """Under auto a draft refused whole rests its sequence 1, 2, 4, ... steps (up to MAX_REST); a kept draft
    token ends the rests. ngram:K (tests, measurement) drafts every step whatever was refused."""
    policy, seq = _policy("auto"), _decoding(SamplingParams(temperature=0, max_tokens=500), REPEATS, [1, 2])

    def drafting_steps(steps: int, accepted: int) -> list[int]:
        drafted = []
        for step in range(steps):
            seq.draft = []
            if policy.draft([seq], 100).seqs:
                drafted.append(step)
                seq.spec.observe(len(seq.draft), min(accepted, len(seq.draft)))
        return drafted

    assert drafting_steps(16, 0) == [0, 2, 5, 10]  # rests of 1, 2 and 4 steps between, then 8
    assert seq.spec.next_rest == 16 and seq.spec.rest == 3  # 8 steps of rest after step 10, 5 of them sat out
    for _ in range(seq.spec.rest):
        policy.draft([seq], 100)
    seq.spec.accepted, seq.spec.tried = 3.0, 4.0  # its estimate back up (it fell below the bar meanwhile)
    assert drafting_steps(3, 1) == [0, 1, 2]  # a token kept: no rest
    assert seq.spec.next_rest == 1
    seq.spec.next_rest = MAX_REST
    seq.spec.observe(2, 0)
    assert seq.spec.rest == MAX_REST and seq.spec.next_rest == MAX_REST  # never more
    ngram, other = _policy("ngram:2"), _decoding(SamplingParams(temperature=0, max_tokens=500), REPEATS, [1, 2])
    for _ in range(3):
        other.draft = []
        assert ngram.draft([other], 100).seqs == [other]
        other.spec.observe(2, 0)
