"""Reading the default model's GGUF file: berth's header index and torch dequantisation against
the gguf package's own ``GGUFReader`` and ``gguf.quants``, measured in the same run.

    python benchmarks/gguf_loading.py [--model PATH.gguf] [--repeat 3] [--dequant-only]

Prints seconds (best of ``--repeat``) and ratios, with the CPU name. Each step runs after the
imports it needs, so the figures are the work itself, not Python's start-up.

Dequantisation is timed in rounds that run every variant once (best of ``--repeat`` rounds), so a
neighbour's load on a shared machine hits all of them alike: the file's quantised tensors with
gguf.quants (whole tensors, and berth's former chunked driver) against worker.model.gguf.dequant in
float32 and bfloat16 at several chunk sizes; then the same for a Q4_K_M-style model: the default
model's shapes as random Q4_K blocks (Q6_K for token_embd, attn_v and ffn_down, as llama.cpp's
Q4_K_M does for those), built in memory, since gguf.quants cannot quantise K-quants.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks.machine import machine_line

if TYPE_CHECKING:
    import numpy as np


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def rounds(variants: dict, repeat: int) -> dict[str, float]:
    """Best seconds of each variant over ``repeat`` rounds, each round running every variant once."""
    times = {name: [] for name in variants}
    for _ in range(repeat):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def q4_k_m_blocks(index, seed: int = 0) -> list[tuple[str, np.ndarray]]:
    """(type, uint8 blocks) for each 2-D tensor of ``index``: random bytes with float16 scales of
    a real file's size (d and dmin around 1e-3)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for name, info in index.tensors.items():
        if len(info.shape) != 2:
            continue
        six = any(part in name for part in ("token_embd", "attn_v", "ffn_down"))
        type_size, scales = (210, (208,)) if six else (144, (0, 2))
        blocks = rng.integers(0, 256, size=(info.shape[0] * info.shape[1] // 256, type_size), dtype=np.uint8)
        for at in scales:
            blocks[:, at:at + 2] = (rng.uniform(1e-4, 1e-2, blocks.shape[0]).astype(np.float16).view(np.uint8)
                                    .reshape(-1, 2))
        out.append(("Q6_K" if six else "Q4_K", blocks))
    return out


def dequant_figures(index, data, repeat: int) -> None:
    import gguf
    import numpy as np

    import worker.model.gguf.dequant as dq
    from worker.model.gguf.tensors import _dequantise

    Q = gguf.GGMLQuantizationType
    files = {"file": []}
    for info in index.tensors.values():
        name = Q(info.ggml_type).name
        if name in dq.BLOCK_TYPES:
            block_size, type_size = gguf.GGML_QUANT_SIZES[Q(info.ggml_type)]
            n = int(np.prod(info.shape))
            files["file"].append((name,
                                  data[info.offset:info.offset + n // block_size * type_size].reshape(-1, type_size)))
    files["Q4_K_M-style"] = q4_k_m_blocks(index)
    for label, tensors in files.items():
        kinds = sorted({t for t, _ in tensors})
        values = sum(b.shape[0] * dq.BLOCK_TYPES[t].block_size for t, b in tensors)
        variants = {
            "gguf.quants whole": lambda: [getattr(gguf.quants, t).dequantize_blocks(b) for t, b in tensors],
            "gguf.quants 4096-block chunks (berth before)": lambda: [
                _dequantise(getattr(gguf.quants, t), b, torch.float32) for t, b in tensors],
        }
        for dtype in (torch.float32, torch.bfloat16):
            for chunk in (1 << 40, 1 << 21, 1 << 19, 1 << 17):
                variants[f"torch {str(dtype).removeprefix('torch.')} chunk {'whole' if chunk > 1 << 30 else chunk}"] = (
                    lambda dtype=dtype, chunk=chunk: [
                        dq.dequantise(t, torch.from_numpy(b), dtype, chunk) for t, b in tensors])
        best_times = rounds(variants, repeat)
        base = best_times["gguf.quants whole"]
        print(f"dequantise {label} ({'/'.join(kinds)}, {len(tensors)} tensors, {values / 1e6:.0f}M values), "
              f"best of {repeat} rounds:")
        for name, t in best_times.items():
            print(f"  {name:46s} {t:.3f}s  {base / t:5.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a GGUF file (default: the default model)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dequant-only", action="store_true", help="only the dequantisation figures")
    args = parser.parse_args()

    import gguf

    from worker.config import default_model_path
    from worker.model.gguf.index import read_index
    from worker.model.gguf.loader import gguf_config, gguf_weights
    from worker.model.gguf.tensors import open_data, read_tensor
    from worker.model.loader import load_config, load_model

    path = args.model or default_model_path()
    index = read_index(path)
    if args.dequant_only:
        print(f"{path}\n{machine_line()}")
        dequant_figures(index, open_data(path), args.repeat)
        return
    gguf_config(index)  # imports the transformers config class
    reader = gguf.GGUFReader(path)
    data = open_data(path)
    n = args.repeat
    print(f"{path}\n{machine_line()}")

    t_reader = best(lambda: gguf.GGUFReader(path), n)
    t_index = best(lambda: read_index(path), n)
    t_config = best(lambda: load_config(path), n)
    print(f"header:  GGUFReader {t_reader:.3f}s  berth index {t_index:.3f}s  ({t_reader / t_index:.0f}x)  "
          f"load_config {t_config:.3f}s")

    t_gguf = best(lambda: [gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors], n)
    t_ours = best(lambda: [read_tensor(data, t, torch.float32) for t in index.tensors.values()], n)
    params = sum(int(t.n_elements) for t in reader.tensors)
    print(f"tensors: gguf.quants.dequantize {t_gguf:.2f}s  berth read_tensor {t_ours:.2f}s  "
          f"({t_gguf / t_ours:.1f}x)  [{params / 1e6:.0f}M values as float32]")

    dequant_figures(index, data, n)
    config = gguf_config(index)
    for dtype in (torch.float32, torch.bfloat16):
        t_weights = best(lambda: gguf_weights(index, config, dtype), n)
        print(f"weights: gguf_weights {str(dtype).removeprefix('torch.')} {t_weights:.2f}s")
    print("load_model float32 (tokenizer cached after the first): "
          f"{best(lambda: load_model(path, torch.float32), n):.2f}s")


if __name__ == "__main__":
    main()
