"""The GGUF weights cache (worker/model/gguf/weights_cache.py): a second load maps the weights the first
computed, bit for bit the same, without dequantising; a damaged file is ignored and rewritten; a changed
model file is never served its old weights; an unwritable folder only costs the cache. On a copy of a
tiny llama file with the default model's mix of tensors (Q4_1 layers, Q8_0 embeddings, F32 norms) and
tokenizer, in a cache folder of the test's own; one test runs the default model's file itself."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.gguf_files import SMALL, Q, random_model, tokenizer_fields, write_gguf
from worker.model.decoder import adjacent_rows
from worker.model.gguf import loader, weights_cache
from worker.model.gguf.index import read_index

LAYERS = 4
HIDDEN = SMALL["hidden_size"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, smol_path) -> Path:
    """A llama file laid out as the default model's, in miniature: tied Q8_0 embeddings, Q4_1 layer weights,
    F32 norms, plain rope, the default tokenizer."""
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    model = random_model("llama", num_hidden_layers=LAYERS, tie_word_embeddings=True, rope_scaling=None)
    write_gguf(path, model, "llama", Q.Q4_1, tokenizer=tokenizer_fields(smol_path),
               qtypes={"model.embed_tokens.weight": Q.Q8_0})
    return path


@pytest.fixture
def model(request, tmp_path, tiny_path, smol_path, monkeypatch) -> Path:
    """A copy of the tiny file, or of the default model's where the test asks for ``"default"`` (so it can
    be changed), and an empty cache folder."""
    monkeypatch.setenv("BERTH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(weights_cache, "_logged", set())
    path = tmp_path / "model.gguf"
    shutil.copy(smol_path if getattr(request, "param", "tiny") == "default" else tiny_path, path)
    return path


class Dequantiser:
    """``loader.read_tensor`` counted: how many tensors a load computed from the model file."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = loader.read_tensor

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(loader, "read_tensor", counted)


def load(path: Path, dtype=torch.float32) -> dict[str, torch.Tensor]:
    index = read_index(path)
    return loader.gguf_weights(index, loader.gguf_config(index), dtype)


def computed(path: Path, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """The weights straight from the model file, no cache involved."""
    index = read_index(path)
    config = loader.gguf_config(index)
    _, family = loader._family(index)
    return loader._gguf_weights(index, config, dtype, family, loader._used_tensors(index, family, config))


def tensor_count(path: Path) -> int:
    """How many tensors a load computes from the file: all of them (it has no rope factors)."""
    return len(read_index(path).tensors)


def cache_files(path: Path) -> list[Path]:
    return sorted((path.parent / "cache" / "weights").glob("*.safetensors"))


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


@pytest.mark.parametrize(("model", "dtype"), [("default", torch.float32), ("tiny", torch.bfloat16)],
                         indirect=["model"], ids=["default-float32", "tiny-bfloat16"])
def test_second_load_maps_the_first_ones_weights_without_dequantising(model, monkeypatch, dtype):
    first = load(model, dtype)
    [file] = cache_files(model)
    assert file.stat().st_size > sum(t.numel() * t.element_size() for t in first.values())
    dequantiser = Dequantiser(monkeypatch)
    second = load(model, dtype)
    assert dequantiser.calls == 0
    assert_same(second, first)
    assert_same(second, computed(model, dtype))
    assert dequantiser.calls == tensor_count(model)  # computed() did read the file: the counter counts
    assert cache_files(model) == [file]


def test_the_cache_file_is_safetensors(model):
    from safetensors.torch import load_file

    weights = load(model)
    [file] = cache_files(model)
    assert_same(load_file(file), weights)


def test_fused_parts_lie_back_to_back_so_the_decoder_views_them(model):
    load(model)
    weights = load(model)  # from the cache
    for i in (0, LAYERS - 1):
        p = f"model.layers.{i}."
        for parts in (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.gate_proj", "mlp.up_proj"]):
            tensors = [weights[f"{p}{m}.weight"] for m in parts]
            view = adjacent_rows(tensors)
            assert view is not None and view.data_ptr() == tensors[0].data_ptr()
            assert torch.equal(view, torch.cat(tensors))


def test_adjacent_rows_is_none_unless_back_to_back():
    flat = torch.arange(24.0)
    a, b, c = flat[:8].view(2, 4), flat[8:16].view(2, 4), flat[16:24].view(2, 4)
    assert torch.equal(adjacent_rows([a, b, c]), torch.cat([a, b, c]))
    assert adjacent_rows([a, c]) is None  # a gap
    assert adjacent_rows([b, a]) is None  # out of order
    assert adjacent_rows([a, torch.arange(8.0, 16.0).view(2, 4)]) is None  # another storage
    assert adjacent_rows([a, flat[8:16].view(4, 2)]) is None  # other rows


def truncate(file: Path) -> None:
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size // 2)


def scribble_header(file: Path) -> None:
    with open(file, "r+b") as f:
        f.seek(8)
        f.write(b"not json at all")


def empty(file: Path) -> None:
    file.write_bytes(b"")


def wrong_shape(file: Path) -> None:
    """A whole file whose header says one tensor has another shape (same bytes, still aligned: only the
    shape check can tell)."""
    data = file.read_bytes()
    length = int.from_bytes(data[:8], "little")
    norm = f'"model.norm.weight":{{"dtype":"F32","shape":[{HIDDEN}]'.encode()
    assert norm in data[8:8 + length]
    header = data[8:8 + length].replace(norm, norm.replace(b"[", b"[1,")).rstrip(b" ")
    header += b" " * (-(8 + len(header)) % weights_cache._HEADER_ALIGN)
    file.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + length:])


@pytest.mark.parametrize("damage", [truncate, scribble_header, empty, wrong_shape], ids=lambda f: f.__name__)
def test_a_damaged_cache_file_is_ignored_and_rewritten(model, monkeypatch, caplog, damage):
    want = load(model)
    [file] = cache_files(model)
    size = file.stat().st_size
    damage(file)
    dequantiser = Dequantiser(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=weights_cache.__name__):
        got = load(model)
    assert dequantiser.calls == tensor_count(model)
    assert_same(got, want)
    assert "weights cache" in caplog.text and str(file) in caplog.text
    assert file.stat().st_size == size  # rewritten whole
    dequantiser.calls = 0
    assert_same(load(model), want)
    assert dequantiser.calls == 0


def test_a_changed_model_file_is_not_served_the_old_weights(model, monkeypatch):
    """Same size, new content and time: the weights are the new file's."""
    old = load(model)
    index = read_index(model)
    info = index.tensors["blk.1.attn_q.weight"]
    assert info.ggml_type == Q.Q4_1
    with open(model, "r+b") as f:  # one Q4_1 block's bytes (20) changed in place
        f.seek(info.offset)
        block = bytearray(f.read(20))
        f.seek(info.offset)
        f.write(bytes(b ^ 0x5A for b in block[:2]) + bytes(block[2:4]) + bytes(255 - b for b in block[4:]))
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    dequantiser = Dequantiser(monkeypatch)
    new = load(model)
    assert dequantiser.calls == tensor_count(model)
    assert_same(new, computed(model))
    assert not torch.equal(new["model.layers.1.self_attn.q_proj.weight"], old["model.layers.1.self_attn.q_proj.weight"])
    assert len(cache_files(model)) == 1  # the same file, rewritten


@pytest.mark.parametrize("change", ["mtime", "size"])
def test_a_touched_or_grown_model_file_is_read_again(model, monkeypatch, change):
    load(model)
    stat = model.stat()
    if change == "mtime":
        os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    else:
        with open(model, "ab") as f:
            f.write(b"\0" * 32)
        os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the size alone differs
    dequantiser = Dequantiser(monkeypatch)
    load(model)
    assert dequantiser.calls == tensor_count(model)
    dequantiser.calls = 0
    load(model)
    assert dequantiser.calls == 0


def test_an_unwritable_cache_folder_costs_only_the_cache(model, monkeypatch, caplog, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("BERTH_CACHE_DIR", str(blocker))
    want = computed(model)
    with caplog.at_level(logging.WARNING, logger=weights_cache.__name__):
        assert_same(load(model), want)
        assert_same(load(model), want)
    warnings = [r for r in caplog.records if "cannot write the weights cache" in r.getMessage()]
    assert len(warnings) == 1 and "BERTH_CACHE_DIR" in warnings[0].getMessage()  # once, with what to do


def test_a_model_already_in_the_dtype_is_not_cached(tmp_path, monkeypatch):
    """An F32 file read as float32 is mapped as it lies: a cache would only double it."""
    monkeypatch.setenv("BERTH_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "f32.gguf"
    write_gguf(path, random_model("qwen2"), "qwen2")
    load(path)
    assert cache_files(path) == []
    load(path, torch.bfloat16)
    assert len(cache_files(path)) == 1


def test_entries_of_removed_model_files_are_pruned_on_the_next_write(model, tmp_path):
    load(model)
    [old] = cache_files(model)
    other = tmp_path / "other.gguf"
    shutil.copy(model, other)
    model.unlink()
    stale_temp = old.parent / ".tmp-left-by-a-crash.safetensors"
    stale_temp.write_bytes(b"x")
    os.utime(stale_temp, (0, 0))
    load(other)
    files = cache_files(other)
    assert old not in files and stale_temp not in files and len(files) == 1


def test_weights_are_mapped_copy_on_write(model):
    """Writing into a mapped weight never changes the cache file (nor another worker's weights)."""
    load(model)
    weights = load(model)
    [file] = cache_files(model)
    before = file.read_bytes()
    weights["model.norm.weight"].add_(1.0)
    del weights
    assert file.read_bytes() == before
    assert np.array_equal(load(model)["model.norm.weight"].numpy(), computed(model)["model.norm.weight"].numpy())
