"""Shared fixtures: the default model (ours and transformers' reading of the same GGUF file), a tiny
random Llama with grouped-query attention and untied embeddings, and prompts cut from real text."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch

from tests.jobs_support import pg_url, queue_prefix, tiny_engine  # noqa: E402,F401 (the jobs tests' fixtures)
from tests.s3_support import s3_endpoint, s3_url  # noqa: E402,F401 (an S3 server for the storage tests)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def smol_path() -> str:
    from worker.config import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smol_loaded(smol_path):
    from worker.model_loader import load_model

    return load_model(smol_path, torch.float32)


@pytest.fixture(scope="session")
def hf_smol(smol_path):
    """transformers' own reading of the GGUF file: an independent check of our loader."""
    from transformers import AutoModelForCausalLM

    p = Path(smol_path)
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smol_path) -> Path:
    """A random 2-layer Llama, GQA 4:2, untied embeddings, saved as a safetensors folder with the
    default model's tokenizer (read without its weights). Weights are scaled up so that greedy
    choices are not near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from worker.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(smol_path)
    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=2048, tie_word_embeddings=False, rope_theta=10000.0,
                         initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_loaded(tiny_llama_dir):
    from worker.model_loader import load_model

    return load_model(str(tiny_llama_dir), torch.float32)


@pytest.fixture(scope="session")
def hf_tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def text_ids(smol_loaded) -> list[int]:
    """Token ids of real English prose and code: the standard library's argparse module."""
    text = Path(argparse.__file__).read_text()
    return smol_loaded.tokenizer(text, add_special_tokens=False)["input_ids"]


def cut_prompts(text_ids: list[int], lengths: list[int], stride: int = 997) -> list[list[int]]:
    """Prompts of the given lengths from different places of the text."""
    return [text_ids[(i * stride) % (len(text_ids) - n): (i * stride) % (len(text_ids) - n) + n]
            for i, n in enumerate(lengths)]
