# llmjobs worker for NVIDIA GPU hosts: torch 2.13.0 from PyPI (the Linux wheel bundles its CUDA and NCCL libraries,
# so the base needs no CUDA toolkit; the host needs the NVIDIA driver and the NVIDIA Container Toolkit).
# Build from the repository root:  docker build -f docker/cuda-worker.Dockerfile -t llmjobs/cuda-worker:0.1.0 .
FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LLMJOBS_VAR_DIR=/var/lib/llmjobs \
    LLMJOBS_WORKER_DEVICE_TYPE=cuda \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

WORKDIR /opt/llmjobs

RUN pip install --no-cache-dir torch==2.13.0

COPY pyproject.toml README.md alembic.ini ./
COPY app ./app
COPY core ./core
COPY worker ./worker
COPY cli ./cli
COPY llmjobs ./llmjobs
COPY engine ./engine
COPY migrations ./migrations
RUN pip install --no-cache-dir -e ".[postgres,redis]"

# Runs as root: torchrun's ranks need the GPUs' device files and shared memory (run with --ipc=host).
CMD ["llmjobs", "worker", "--device-type", "cuda"]
