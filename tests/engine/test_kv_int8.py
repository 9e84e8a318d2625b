"""The int8 KV cache (``kv_cache_dtype="int8"``) in the engine: more blocks in the same memory, the
default model's greedy output close to the exact cache's; the fp8_e4m3 rows, and a clear refusal
where fp8 cannot run. The kernels' own checks are in test_cpu_kernel.py and (Triton)
test_kernels.py; checkpoints of int8 blocks in test_checkpoint_resume.py."""

from __future__ import annotations

import inspect

import pytest
import torch

from kernels import kv_quant
from kernels.attention import select_ops
from tests.support.exactness import greedy_with
from worker.config import ConfigError, Settings
from worker.engine.engine import Engine
from worker.engine.model_runner import ModelRunner

TEXTS = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def both(smol_loaded):
    """The default model's greedy tokens with the exact cache and with int8, and the two engines."""
    return greedy_with(smol_loaded, "kv_cache_dtype", ("auto", "int8"), TEXTS)


def test_int8_holds_more_blocks_in_the_same_memory(both):
    engines, _ = both
    exact, int8 = engines["auto"].runner, engines["int8"].runner
    head_dim = exact.block_shape[-1]
    assert int8.block_shape[-1] == head_dim + 4 and int8.kv_dtype == torch.uint8
    assert int8.block_bytes * 4 * head_dim == exact.block_bytes * (head_dim + 4)  # 68 bytes a row against 256
    assert int8.num_blocks >= 3.7 * exact.num_blocks
    assert engines["int8"].fingerprint != engines["auto"].fingerprint


def test_default_model_int8_greedy_starts_as_the_exact_cache(both):
    """Greedy decoding from an int8 cache stays on the exact run's tokens at first; it may part later
    (it is not bit-exact: benchmarks/kv_int8.py measures how often)."""
    _, tokens = both
    for exact, int8 in zip(tokens["auto"], tokens["int8"]):
        assert len(int8) == 24
        assert int8[:4] == exact[:4]


def test_fp8_rows_round_trip_within_half_a_step():
    """fp8_e4m3: the same rows as int8, values in float8 e4m3 (3 mantissa bits: a step of 1/8 to 1/16 of
    a value, 2^-9 of the scale below 2^-6 of it), the largest stored as 448."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(50, 3, 64, generator=g) * torch.logspace(-3, 2, 50)[:, None, None]
    x[7] = 0.0
    rows = kv_quant.quantize(x, "fp8_e4m3")
    assert rows.dtype == torch.float8_e4m3fn and rows.shape == (50, 3, 68)
    back = kv_quant.dequantize(rows, torch.float32)
    scale = (x.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-30)
    step = torch.maximum(x.abs() / scale, torch.tensor(2.0 ** -6)).log2().floor().exp2() / 8 * scale
    assert ((back - x).abs() <= step / 2 + 1e-6 * x.abs()).all()
    assert torch.equal(back[7], torch.zeros(3, 64))
    torch.testing.assert_close(back.abs().amax(-1), x.abs().amax(-1), rtol=1e-6, atol=0)  # stored as 448
    assert (back - x).abs().max() > 0


def test_every_quantized_format_is_read_by_triton_on_cuda():
    """No kv_cache_dtype sends CUDA to the PyTorch path any more: ``select_ops`` takes none, and the
    engine test in test_kernels.py runs an int8 cache through the Triton kernels."""
    assert "kv_cache_dtype" not in inspect.signature(select_ops).parameters
    assert select_ops("auto", "cuda").name == "triton"


def test_fp8_refused_on_the_cpu_at_start():
    """Before the model is read (the path does not exist): the setting, and int8 to use instead."""
    with pytest.raises(ConfigError, match=r"kv_cache_dtype=fp8_e4m3 needs a CUDA GPU of compute capability 8\.9.*"
                                          r"runs on the CPU: use kv_cache_dtype=int8"):
        Engine(model="/nonexistent/model.gguf", device="cpu", kv_cache_dtype="fp8_e4m3")


@pytest.mark.parametrize("capability, refused", [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)])
def test_fp8_needs_compute_capability_8_9(monkeypatch, capability, refused):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    settings = Settings(kv_cache_dtype="fp8_e4m3")
    if refused:
        expected = rf"NVIDIA Test GPU \(compute capability {capability[0]}\.{capability[1]}\).*use kv_cache_dtype=int8"
        with pytest.raises(ConfigError, match=expected):
            settings.check_kv_cache_dtype("cuda:0")
    else:
        settings.check_kv_cache_dtype("cuda:0")
    Settings(kv_cache_dtype="int8").check_kv_cache_dtype("cpu")  # int8 runs everywhere


def test_fp8_blocks_move_as_bytes(tiny_loaded):
    """Copy-on-write, swap and checkpoints move an fp8 cache's blocks unchanged (the runner itself does
    not refuse fp8: ``Engine`` does, off CUDA)."""
    runner = ModelRunner(tiny_loaded, dtype=torch.float32, device=torch.device("cpu"), block_size=16,
                         kv_memory=4 << 20, attention_backend="torch", kv_cache_dtype="fp8_e4m3")
    k0 = runner.kv_caches[0][0]
    assert k0.dtype == torch.float8_e4m3fn and k0.shape[1:] == runner.block_shape
    data = runner.read_blocks([0, 1])
    data.view(torch.uint8).copy_(torch.randint(0, 0x7F, data.shape, dtype=torch.uint8))  # no NaN (0x7F)
    runner.write_blocks([3, 5], data)
    runner.copy_blocks([(5, 6)])
    back = runner.read_blocks([3, 5, 6])
    assert back.dtype == torch.float8_e4m3fn
    assert torch.equal(back.view(torch.uint8)[:, :, :2], data.view(torch.uint8))
    assert torch.equal(back.view(torch.uint8)[:, :, 2], data.view(torch.uint8)[:, :, 1])


def test_an_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Settings(kv_cache_dtype="int4")
