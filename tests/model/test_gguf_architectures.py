"""GGUF files of every family berth reads, written from tiny random transformers models the way
llama.cpp's converter writes them (tests/support/gguf_files.py), read back with berth: the config must be
the model's config and every weight the model's weight, under its Hugging Face name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.gguf_files import (
    FAMILIES,
    Q,
    llama3_rope_factors,
    random_model,
    tokenizer_fields,
    write_gguf,
    write_metadata,
)
from tests.support.models import assert_config_equal
from worker.model.base import ModelLoadError
from worker.model.gguf.index import read_index
from worker.model.gguf.loader import gguf_weights
from worker.model.loader import load_config, load_model

QUANTISED = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K]
# worst rounding error as a fraction of a tensor's largest magnitude, with slack for the float16
# scales: half a step of float16's and bfloat16's mantissas, of Q8_0's 255 levels and Q4_1's 16
# levels a block; Q4_0 clips its top level, so a whole step of 16
ROUNDING = {Q.F16: 2.0 ** -11, Q.BF16: 2.0 ** -8, Q.Q8_0: 1.1 / 254, Q.Q4_0: 1.1 / 8, Q.Q4_1: 1.1 / 15}


@pytest.fixture(scope="module")
def smol_tokenizer_fields(smol_path):
    return tokenizer_fields(smol_path)


@pytest.fixture(scope="module")
def written(tmp_path_factory, smol_tokenizer_fields):
    """Each case as an F32 file with the default model's tokenizer: case -> (model, path, expected)."""
    out = {}
    for case, (arch, _, _) in FAMILIES.items():
        model = random_model(case)
        path = tmp_path_factory.mktemp(case) / f"tiny-{case}.gguf"
        out[case] = model, path, write_gguf(path, model, arch, tokenizer=smol_tokenizer_fields)
    return out


def assert_weights(loaded, model, expected, exact: bool):
    hf_names = {n for n in model.state_dict() if not (model.config.tie_word_embeddings and n == "lm_head.weight")}
    assert set(loaded) == hf_names
    for name, tensor in model.state_dict().items():
        if name in hf_names:
            assert loaded[name].shape == tensor.shape and loaded[name].dtype == torch.float32, name
            assert torch.equal(loaded[name], torch.from_numpy(expected[name])), name
            if exact:
                assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("case", list(FAMILIES))
def test_family_reads_back_exactly(written, case):
    model, path, expected = written[case]
    config = load_config(str(path))
    assert_config_equal(config, model.config)
    assert_weights(gguf_weights(read_index(path), config, torch.float32), model, expected, exact=True)


def test_load_model_gives_config_weights_and_tokenizer(written, smol_path):
    """The whole load of one family (the tokenizer's conversion is the slow part: once is enough)."""
    from worker.model.tokenizer import load_tokenizer

    model, path, expected = written["qwen2"]
    loaded = load_model(str(path), torch.float32)
    assert_config_equal(loaded.config, model.config)
    assert_weights(loaded.weights, model, expected, exact=True)
    text = "GGUF files of every family, read back by berth: <|im_start|>user"
    assert loaded.tokenizer(text)["input_ids"] == load_tokenizer(smol_path)(text)["input_ids"]
    assert loaded.tokenizer.chat_template == load_tokenizer(smol_path).chat_template


@pytest.mark.parametrize("shape, factor", [((4096, 32, 8, 128), 8.0), ((2048, 32, 8, 64), 32.0)],
                         ids=["llama-3.1-8b", "llama-3.2-1b"])
def test_llama3_rope_scaling_of_real_shapes(tmp_path, shape, factor):
    """The rope_scaling of Llama 3.1 and 3.2 files (header and rope_freqs only: no weights needed)."""
    import gguf
    from transformers import LlamaConfig

    hidden, heads, kv_heads, head_dim = shape
    config = LlamaConfig(vocab_size=128256, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=16,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192))
    path = tmp_path / "llama3.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    write_metadata(writer, config, "llama")
    writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert load_config(str(path)).rope_parameters == config.rope_parameters


@pytest.fixture(scope="module")
def quant_model():
    """Llama, 256 wide: every weight's rows hold whole K-quant super-blocks of 256; the embeddings
    span more than one dequantisation chunk of the 8-bit and 4-bit types."""
    return random_model("llama", hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=1000)


@pytest.mark.parametrize("qtype", QUANTISED, ids=lambda q: q.name)
def test_quantised_weights_read_back(tmp_path, quant_model, smol_tokenizer_fields, qtype):
    """Each type reads back as gguf's reference dequantisation of the stored bytes, rows unpermuted;
    the types gguf can quantise are written from the model's weights and must be within their
    rounding error of them (Q4_K and Q6_K, which it cannot quantise, are random blocks)."""
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    token_ids = [field for field in smol_tokenizer_fields if field[0].endswith("_token_id")]
    expected = write_gguf(path, quant_model, "llama", qtype, tokenizer=token_ids)
    config = load_config(str(path))
    assert_config_equal(config, quant_model.config)
    weights = gguf_weights(read_index(path), config, torch.float32)
    assert_weights(weights, quant_model, expected, exact=False)
    if qtype in ROUNDING:
        for name, tensor in quant_model.state_dict().items():
            error = (weights[name] - tensor).abs().max().item()
            assert 0 < error <= ROUNDING[qtype] * tensor.abs().max().item() or tensor.dim() == 1, name


def test_index_matches_gguf_reader(tmp_path, quant_model):
    """berth's header read against the gguf package's reader (on a file without a vocabulary, where
    the reader is quick)."""
    import gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(path, quant_model, "llama", Q.Q4_K)
    reader, index = gguf.GGUFReader(str(path)), read_index(path)
    assert {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")} == dict(index.metadata)
    assert [(t.name, t.tensor_type, tuple(int(d) for d in reversed(t.shape)), t.data_offset) for t in reader.tensors] \
        == [(t.name, t.ggml_type, t.shape, t.offset) for t in index.tensors.values()]


def test_unsupported_architecture_is_named(tmp_path):
    import gguf

    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"'gemma2' is not supported; berth reads llama, qwen2, qwen3, phi3"):
        load_config(str(path))


def test_cut_short_file_is_a_load_error(tmp_path, written):
    path = tmp_path / "cut.gguf"
    path.write_bytes(written["qwen3"][1].read_bytes()[:5000])  # inside the vocabulary
    with pytest.raises(ModelLoadError, match="cut short or damaged"):
        load_config(str(path))


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "phi3", "phi3-longrope"])
def test_engine_on_a_gguf_file_matches_transformers(written, case, smol_path, text_ids):
    """The GGUF reading and the model together: berth's greedy tokens and logits on each family's
    file against transformers' model it was written from. The 40-token prompt runs past phi3's
    32-token window (the file's ``attention.sliding_window``) in chunks of 16."""
    from tests.support.exactness import check_against_hf
    from tests.support.models import cut_prompts
    from worker.engine.engine import Engine
    from worker.model.base import LoadedModel
    from worker.model.tokenizer import load_tokenizer

    model, path, _ = written[case]
    config = load_config(str(path))
    loaded = LoadedModel(config, gguf_weights(read_index(path), config, torch.float32), load_tokenizer(smol_path),
                         str(path))
    engine = Engine(loaded=loaded, kv_memory="16MiB", max_num_batched_tokens=16, block_size=16)
    if case == "phi3":
        assert config.sliding_window == 32 and engine.max_model_len == 16384
    check_against_hf(model.eval(), engine, cut_prompts(text_ids, [1, 7, 15, 40]), generate_every=3, new_tokens=8)
