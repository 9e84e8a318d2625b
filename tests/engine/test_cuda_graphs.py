"""CUDA graphs of decode steps (``worker.engine.cuda_graphs``).

On any machine: which bucket a step's rows take, how the persistent inputs are loaded and padded (the
padding rows touch only the scratch block, and leave the real rows' hidden states as an unpadded pass
gives them), and that the CPU never takes the graph path. With a CUDA GPU (marker ``cuda``, run by
``benchmarks/gpu_check.py``): graph replay against eager on the default model and a random tiny Llama,
greedy tokens and logits, plain and fp8 KV caches. Run the ``cuda`` tests apart from tests/kernels, whose
module turns the Triton interpreter on for the whole process."""

from __future__ import annotations

import os

import pytest
import torch

from worker.engine import cuda_graphs
from worker.engine.cuda_graphs import DecodeInputs, bucket_for, bucket_sizes, decode_only, reason_not_to
from worker.engine.engine import Engine
from worker.engine.model_runner import ModelRunner
from worker.engine.request import SamplingParams
from worker.model.decoder import StepInput

cuda_only = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU, and the Triton kernels compiled (not tests/kernels' interpreter)")


# ---- on any machine

def test_buckets_are_powers_of_two_to_8_then_multiples_of_16_up_to_max_num_seqs():
    assert bucket_sizes(256) == (1, 2, 4, 8, *range(16, 257, 16))
    assert bucket_sizes(100)[-3:] == (80, 96, 100)
    assert bucket_sizes(3) == (1, 2, 3)
    assert bucket_sizes(1) == (1,)


@pytest.mark.parametrize("max_rows", [1, 5, 16, 100, 256])
def test_a_step_takes_the_smallest_bucket_that_holds_its_rows(max_rows):
    sizes = bucket_sizes(max_rows)
    for rows in range(1, max_rows + 1):
        bucket = bucket_for(rows, sizes)
        assert bucket >= rows and bucket in sizes
        assert all(s < rows for s in sizes if s < bucket)
        assert bucket - rows < cuda_graphs.BUCKET_STEP
    assert bucket_for(max_rows + 1, sizes) is None


def test_only_cuda_with_triton_attention_takes_graphs():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert reason_not_to(True, cuda, "triton") is None
    assert "CUDA" in reason_not_to(True, cpu, "cpu")
    assert "Triton" in reason_not_to(True, cuda, "torch")  # the reference reads context lengths on the host
    assert "off" in reason_not_to(False, cuda, "triton")


def _step(ids, positions, slots, tables, lens, logits_rows, *, prefill=False) -> StepInput:
    width = max(len(t) for t in tables)
    i64, i32 = torch.int64, torch.int32
    n = len(ids)
    return StepInput(
        input_ids=torch.tensor(ids, dtype=i64), positions=torch.tensor(positions, dtype=i64),
        slot_mapping=torch.tensor(slots, dtype=i64), num_decode=n - 2 if prefill else n,
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=i32),
        decode_context_lens=torch.tensor(lens, dtype=i32), prefill_query_start_loc=torch.zeros(1, dtype=i32),
        prefill_block_tables=torch.zeros(0, 1, dtype=i32), prefill_context_lens=torch.zeros(0, dtype=i32),
        logits_rows=torch.tensor(logits_rows, dtype=i64))


def test_only_decode_steps_without_pooled_rows_are_graphed():
    step = _step([5, 6, 7], [3, 20, 40], [3, 36, 72], [[0], [1, 2], [4, 5, 6]], [4, 21, 41], [0, 1, 2])
    assert decode_only(step)
    assert not decode_only(_step([5, 6, 7], [3, 20, 40], [3, 36, 72], [[0], [1, 2], [4, 5, 6]], [4, 21, 41],
                                 [0, 1, 2], prefill=True))
    step.num_pooled = 1
    assert not decode_only(step)


def test_a_step_is_copied_into_the_persistent_inputs_and_the_rest_of_its_bucket_padded():
    block_size, scratch = 16, 9
    inputs = DecodeInputs(max_rows=8, max_blocks=4, scratch_block=scratch, block_size=block_size,
                          device=torch.device("cpu"))
    three = _step([5, 6, 7], [3, 20, 40], [3, 36, 72], [[0], [1, 2], [4, 5, 6]], [4, 21, 41], [0, 1, 2])
    inputs.load(three, bucket=4)
    view = inputs.view(4)
    assert view.num_decode == 4 and view.input_ids.shape == (4,)
    assert view.input_ids.tolist() == [5, 6, 7, 0]
    assert view.positions.tolist() == [3, 20, 40, 0]
    assert view.slot_mapping.tolist() == [3, 36, 72, scratch * block_size]
    assert view.decode_context_lens.tolist() == [4, 21, 41, 1]
    assert view.decode_block_tables[:3, :3].tolist() == [[0, 0, 0], [1, 2, 0], [4, 5, 6]]
    assert view.decode_block_tables[3, 0] == scratch
    assert view.logits_rows.tolist() == [0, 1, 2, 3]
    # the views share the buffers: a replay reads what the next step loads
    assert view.input_ids.data_ptr() == inputs.input_ids.data_ptr()
    # a smaller step after a larger one: the rows that were real are padding again
    inputs.load(_step([9], [2], [130], [[8]], [3], [0]), bucket=2)
    two = inputs.view(2)
    assert two.input_ids.tolist() == [9, 0]
    assert two.slot_mapping.tolist() == [130, scratch * block_size]
    assert two.decode_context_lens.tolist() == [3, 1]
    assert two.decode_block_tables[:, 0].tolist() == [8, scratch]


def test_padding_rows_change_neither_the_real_rows_nor_any_block_but_the_scratch_one(tiny_loaded):
    """The padded step a graph replays, run eagerly on the CPU: the real rows' hidden states are the
    unpadded step's, and the KV cache differs only in the scratch block."""
    runner = ModelRunner(tiny_loaded, dtype=torch.float32, device=torch.device("cpu"), block_size=16,
                         kv_memory=32 * 2**10 * 16, attention_backend="torch", max_seqs=8, max_model_len=128)
    assert runner.graphs is None
    scratch = runner.num_blocks - 1  # this runner has no spare block: its last one stands in
    gen = torch.Generator().manual_seed(0)
    for k, v in runner.kv_caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    lens = [4, 21, 41]
    tables = [[0], [1, 2], [4, 5, 6]]
    slots = [t[(n - 1) // 16] * 16 + (n - 1) % 16 for t, n in zip(tables, lens)]
    step = _step([5, 6, 7], [n - 1 for n in lens], slots, tables, lens, [0, 2])
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    eager = runner.model.forward(step, runner.kv_caches)
    after_eager = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        k.copy_(k0)
        v.copy_(v0)
    inputs = DecodeInputs(max_rows=8, max_blocks=8, scratch_block=scratch, block_size=16, device=torch.device("cpu"))
    inputs.load(step, bucket=4)
    padded = runner.model.forward(inputs.view(4), runner.kv_caches)
    torch.testing.assert_close(padded[[0, 2]], eager, rtol=1e-5, atol=1e-5)
    for (k, v), (ke, ve) in zip(runner.kv_caches, after_eager):
        assert torch.equal(k[:scratch], ke[:scratch]) and torch.equal(v[:scratch], ve[:scratch])
        assert not torch.equal(k[scratch], ke[scratch])  # the padding row wrote there, and only there


def test_the_cpu_never_takes_the_graph_path(tiny_loaded, text_ids, monkeypatch):
    def no_graphs(*args, **kwargs):
        raise AssertionError("decode graphs built on the CPU")

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "__init__", no_graphs)
    engine = Engine(loaded=tiny_loaded, device="cpu", cuda_graphs=True, kv_memory="8MiB", max_num_seqs=4)
    assert engine.runner.graphs is None
    assert engine.runner.kv_caches[0][0].shape[0] == engine.runner.num_blocks  # no scratch block either
    out = engine.generate([text_ids[:9], text_ids[20:25]], SamplingParams(max_tokens=4, temperature=0.0))
    assert [len(o.completions[0].token_ids) for o in out] == [4, 4]


# ---- with a CUDA GPU

def _recorded(engine: Engine) -> list[torch.Tensor]:
    """Each step's logits, copied to the host as the step makes them."""
    seen, execute = [], engine.runner.execute

    def recording(step):
        logits, pooled = execute(step)
        seen.append(logits.detach().float().cpu())
        return logits, pooled

    engine.runner.execute = recording
    return seen


# the default model in float32 only: in bfloat16, or through an fp8 cache, its greedy choices have near-ties
# that a padded batch's rounding may flip; the tiny model's weights are scaled up to have none
@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("model,dtype,kv_cache_dtype", [
    ("smol", "float32", "auto"), ("tiny", "float32", "auto"), ("tiny", "bfloat16", "auto"),
    ("tiny", "float32", "fp8_e4m3"), ("tiny", "bfloat16", "fp8_e4m3")])
def test_graph_replay_gives_eager_greedy_tokens_and_logits(request, model, dtype, kv_cache_dtype, text_ids):
    if kv_cache_dtype == "fp8_e4m3" and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 KV needs compute capability 8.9")
    loaded = request.getfixturevalue(f"{model}_loaded")
    prompts = [text_ids[i * 37: i * 37 + 5 + i * 3] for i in range(11)]  # 11 rows: bucket 16, padded
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs = {}
    for graphs in (False, True):
        engine = Engine(loaded=loaded, device="cuda", dtype=dtype, cuda_graphs=graphs, kv_cache_dtype=kv_cache_dtype,
                        kv_memory="256MiB", max_num_seqs=32, max_model_len=512, async_scheduling="off")
        logits = _recorded(engine)
        tokens = [o.completions[0].token_ids for o in engine.generate(prompts, params)]
        runs[graphs] = tokens, logits, engine
    (eager_tokens, eager_logits, eager), (graph_tokens, graph_logits, graphed) = runs[False], runs[True]
    assert eager.runner.graphs is None and graphed.runner.graphs is not None
    assert graphed.runner.graphs.broken is None
    assert graphed.runner.graphs.replays >= 20, "the decode steps did not replay graphs"
    assert set(graphed.runner.graphs.graphs) == {16}
    assert graph_tokens == eager_tokens
    assert len(graph_logits) == len(eager_logits)
    tolerance = 1e-3 if (dtype, kv_cache_dtype) == ("float32", "auto") else 1e-1
    for g, e in zip(graph_logits, eager_logits):
        torch.testing.assert_close(g, e, rtol=tolerance, atol=tolerance)


@pytest.mark.cuda
@cuda_only
def test_a_replay_is_the_eager_pass_over_the_same_padded_inputs(tiny_loaded):
    cuda = torch.device("cuda")
    runner = ModelRunner(tiny_loaded, dtype=torch.float32, device=cuda, block_size=16, kv_memory=2**24,
                         max_seqs=8, max_model_len=256)
    graphs = runner.graphs
    assert graphs is not None and graphs.inputs.scratch_block == runner.num_blocks
    gen = torch.Generator(device=cuda).manual_seed(0)
    for k, v in runner.kv_caches:
        k.normal_(generator=gen)
        v.normal_(generator=gen)
    lens = [4, 21, 41]
    tables = [[0], [1, 2], [4, 5, 6]]
    slots = [t[(n - 1) // 16] * 16 + (n - 1) % 16 for t, n in zip(tables, lens)]
    step = _step([5, 6, 7], [n - 1 for n in lens], slots, tables, lens, [0, 1, 2])
    step = StepInput(**{f: (getattr(step, f).to(cuda) if isinstance(getattr(step, f), torch.Tensor)
                            else getattr(step, f)) for f in step.__dataclass_fields__})
    replayed = graphs.run(step).clone()
    assert graphs.replays == 1 and set(graphs.graphs) == {4}
    graphs.inputs.load(step, 4)
    eager = runner.model.forward(graphs.inputs.view(4), runner.kv_caches)[:3]
    assert torch.equal(replayed, eager)
    # what the graphs do not take: a step past the largest bucket, a mixed step
    assert graphs.run(_step(*[[1] * 9] * 3, [[0]] * 9, [1] * 9, list(range(9)))) is None
    assert graphs.run(_step([5, 6, 7], [3, 20, 40], slots, tables, lens, [0, 1, 2], prefill=True)) is None
