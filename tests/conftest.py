"""Shared fixtures: the default model (ours and transformers' reading of the same GGUF file), a tiny
random Llama with grouped-query attention and untied embeddings, and prompts cut from real text."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

# torch's OpenMP threads spin up to 300,000 rounds waiting for work (libgomp's default): on a machine
# whose cores are busy with other work, each engine step's many small parallel regions then wait for
# a thread that spins on a core someone else holds. Beside two busy loops on 2 cores the default
# model's exactness test took 335 s with the default, 91 s with 10,000 rounds, 100 s with
# OMP_WAIT_POLICY=PASSIVE; 41 s, 44 s and 52 s with the cores free. Read by libgomp when torch loads
# it, so before the first torch import; the engine workers the tests start inherit it.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.jobs_support import pg_url, queue_prefix, tiny_engine  # noqa: E402,F401 (the jobs tests' fixtures)
from tests.s3_support import s3_endpoint, s3_url  # noqa: E402,F401 (an S3 server for the storage tests)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def smol_path() -> str:
    from worker.config import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smol_loaded(smol_path):
    from worker.model.loader import load_model

    return load_model(smol_path, torch.float32)


@pytest.fixture(scope="session")
def hf_smol(smol_path):
    """transformers' own reading of the GGUF file: an independent check of our loader."""
    from transformers import AutoModelForCausalLM

    p = Path(smol_path)
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()


# The shape of every tiny test model: 2 layers, GQA 4:2, weights scaled up (initializer_range) so
# that greedy choices are not near-ties.
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, initializer_range=0.2,
                  bos_token_id=1, eos_token_id=2)


def save_tiny_model(config_class, model_class, tokenizer, path: Path, *, disk_dtype: torch.dtype | None = None,
                    max_shard_size: str | None = None, generation: dict | None = None, seed: int = 1234,
                    random_vectors: bool = False, **config_fields) -> Path:
    """A random model of ``TINY_SHAPE`` (and ``config_fields``) saved as a safetensors folder with
    the default model's tokenizer: in ``disk_dtype``, sharded past ``max_shard_size``, with
    ``generation`` set in its generation_config.json. ``random_vectors`` draws biases and norm
    weights too, which transformers starts at zeros and ones, where a bias left out or a norm's
    weight applied in the wrong place would change nothing."""
    torch.manual_seed(seed)
    model = model_class(config_class(**{"vocab_size": len(tokenizer), **TINY_SHAPE, **config_fields}))
    if random_vectors:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, 0.2)
                elif param.dim() == 1:
                    param.uniform_(0.5, 1.5)
    for key, value in (generation or {}).items():
        setattr(model.generation_config, key, value)
    if disk_dtype is not None:
        model = model.to(disk_dtype)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smol_tokenizer(smol_path):
    """The default model's tokenizer, read without its weights."""
    from worker.model.tokenizer import load_tokenizer

    return load_tokenizer(smol_path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A random 2-layer Llama, GQA 4:2, untied embeddings, saved as a safetensors folder with the
    default model's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return save_tiny_model(LlamaConfig, LlamaForCausalLM, smol_tokenizer, tmp_path_factory.mktemp("tiny-llama"),
                           tie_word_embeddings=False, rope_theta=10000.0)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_llama_dir):
    from worker.model.loader import load_model

    return load_model(str(tiny_llama_dir), torch.float32)


@pytest.fixture(scope="session")
def hf_tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def text_ids(smol_tokenizer) -> list[int]:
    """Token ids of real English prose and code: the standard library's argparse module."""
    text = Path(argparse.__file__).read_text()
    return smol_tokenizer(text, add_special_tokens=False)["input_ids"]


def cut_prompts(text_ids: list[int], lengths: list[int], stride: int = 997) -> list[list[int]]:
    """Prompts of the given lengths from different places of the text."""
    return [text_ids[(i * stride) % (len(text_ids) - n): (i * stride) % (len(text_ids) - n) + n]
            for i, n in enumerate(lengths)]
