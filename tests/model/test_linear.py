"""The model's linear layers (oneDNN with weights reordered once, where PyTorch has oneDNN) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.model.linear import make_linear


@pytest.mark.parametrize("rows", [1, 7, 256, 300])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (50, 33)])
def test_float32_matches_f_linear_at_float32_accuracy(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, in_features, generator=g) * 0.05
    x = torch.randn(rows, in_features, generator=g)
    exact = F.linear(x.double(), weight.double())
    got = make_linear(weight)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    assert (got.double() - exact).abs().max() < 1e-4  # a bfloat16 product would be off by ~1e-2


def test_bfloat16_matches_f_linear_within_one_rounding():
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(576, 1536, generator=g) * 0.05).bfloat16()
    x = torch.randn(40, 1536, generator=g).bfloat16()
    torch.testing.assert_close(make_linear(weight)(x).float(), F.linear(x, weight).float(), atol=2e-2, rtol=1.6e-2)


def test_other_dtypes_take_f_linear():
    weight = torch.randn(8, 4, dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(make_linear(weight)(x), F.linear(x, weight))


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_a_bias_is_added(dtype, tolerance):
    g = torch.Generator().manual_seed(2)
    weight = (torch.randn(96, 64, generator=g) * 0.05).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(5, 64, generator=g).to(dtype)
    exact = F.linear(x.double(), weight.double(), bias.double())
    assert (make_linear(weight, bias)(x).double() - exact).abs().max() < tolerance
    assert (make_linear(weight)(x).double() - exact).abs().max() > 0.5  # the bias is what makes the difference


def test_the_multiply_is_chosen_and_logged_once_for_all_layers(caplog, monkeypatch):
    from worker.model import linear

    linear.multiply_path.cache_clear()
    with caplog.at_level("INFO", logger="worker.model.linear"):
        for _ in range(12):  # a model's worth of layers
            make_linear(torch.randn(32, 16))
    said = [r.getMessage() for r in caplog.records if r.name == "worker.model.linear"]
    assert len(said) == 1 and said[0].startswith("linear layers (torch.float32): ")


@pytest.mark.parametrize("flags,warned", [({"avx2", "fma"}, True), ({"avx512f", "avx512_bf16"}, False),
                                          ({"amx_bf16"}, False)])
def test_bfloat16_without_bfloat16_instructions_says_so_once(caplog, monkeypatch, flags, warned):
    from worker.model import linear

    monkeypatch.setattr(linear, "cpu_flags", lambda: flags)
    linear.multiply_path.cache_clear()
    try:
        with caplog.at_level("INFO", logger="worker.model.linear"):
            for _ in range(5):
                make_linear(torch.randn(32, 16).bfloat16())
        emulated = [r.getMessage() for r in caplog.records if "no bfloat16 instructions" in r.getMessage()]
        assert len(emulated) == (1 if warned else 0)
        if warned:
            assert "BERTH_DTYPE=float32" in emulated[0]
    finally:
        linear.multiply_path.cache_clear()  # the real flags for the tests after
