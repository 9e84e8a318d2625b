"""Reading the default model's GGUF file: berth's header index and chunked dequantisation against
the gguf package's own ``GGUFReader`` and ``gguf.quants.dequantize``, measured in the same run.

    python benchmarks/gguf_loading.py [--model PATH.gguf] [--repeat 3]

Prints seconds (best of ``--repeat``) and ratios, with the CPU name. Each step runs after the
imports it needs, so the figures are the work itself, not Python's start-up.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time

import torch


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a GGUF file (default: the default model)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    import gguf

    from worker.config import default_model_path
    from worker.gguf_index import read_index
    from worker.gguf_loader import gguf_config, gguf_weights
    from worker.gguf_tensors import open_data, read_tensor
    from worker.model_loader import load_config, load_model

    path = args.model or default_model_path()
    index = read_index(path)
    gguf_config(index)  # imports the transformers config class
    reader = gguf.GGUFReader(path)
    data = open_data(path)
    n = args.repeat
    print(f"{path}\n{cpu_name()}, torch threads {torch.get_num_threads()}")

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

    config = gguf_config(index)
    for dtype in (torch.float32, torch.bfloat16):
        t_weights = best(lambda: gguf_weights(index, config, dtype), n)
        print(f"weights: gguf_weights {str(dtype).removeprefix('torch.')} {t_weights:.2f}s")
    print(f"load_model float32 (tokenizer cached after the first): {best(lambda: load_model(path, torch.float32), n):.2f}s")


if __name__ == "__main__":
    main()
