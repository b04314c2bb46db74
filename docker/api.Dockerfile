# llmjobs API (and the CPU worker of the laptop trial): Python 3.11, torch 2.13.0 CPU build, PostgreSQL + Redis clients.
# Build from the repository root:  docker build -f docker/api.Dockerfile -t llmjobs/api:0.1.0 .
FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LLMJOBS_VAR_DIR=/var/lib/llmjobs \
    LLMJOBS_HOST=0.0.0.0 \
    LLMJOBS_PORT=8000

WORKDIR /opt/llmjobs

# torch first, from the CPU index: the API never imports it, the CPU worker's engine does (no CUDA libraries).
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu

COPY pyproject.toml README.md alembic.ini ./
COPY app ./app
COPY core ./core
COPY worker ./worker
COPY cli ./cli
COPY llmjobs ./llmjobs
COPY engine ./engine
COPY migrations ./migrations
# Editable install: the migrations are found next to the sources (core.db uses <repo>/migrations).
RUN pip install --no-cache-dir -e ".[postgres,redis]" \
    && useradd --system --uid 10001 --create-home --home-dir /var/lib/llmjobs llmjobs \
    && mkdir -p /data && chown llmjobs /data

USER 10001
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --retries=5 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
CMD ["llmjobs", "api"]
