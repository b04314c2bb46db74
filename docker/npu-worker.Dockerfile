# llmjobs worker for Ascend NPU hosts: Huawei's CANN image (toolkit + kernels, Python 3.11) with torch 2.13.0 and the
# matching torch-npu 2.13.0. Pick the CANN tag that Ascend's torch-npu compatibility table lists for torch-npu 2.13.0
# and your chips (910B / 910C), e.g. --build-arg CANN_IMAGE=ascendai/cann:<version>-910b-ubuntu22.04-py3.11.
# Build from the repository root:  docker build -f docker/npu-worker.Dockerfile -t llmjobs/npu-worker:0.1.0 .
ARG CANN_IMAGE=ascendai/cann:8.3.rc1-910b-ubuntu22.04-py3.11
FROM ${CANN_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    LLMJOBS_VAR_DIR=/var/lib/llmjobs \
    LLMJOBS_WORKER_DEVICE_TYPE=npu

WORKDIR /opt/llmjobs

# The CPU build of torch: on Ascend the device code comes from torch-npu and CANN. pyyaml, decorator, attrs and
# psutil are torch-npu's and CANN's Python-side needs.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu \
    && pip install --no-cache-dir torch-npu==2.13.0 pyyaml==6.0.2 decorator==5.1.1 attrs==24.2.0 psutil==6.1.0

COPY pyproject.toml README.md alembic.ini ./
COPY app ./app
COPY core ./core
COPY worker ./worker
COPY cli ./cli
COPY llmjobs ./llmjobs
COPY engine ./engine
COPY migrations ./migrations
RUN pip install --no-cache-dir -e ".[postgres,redis]"

# The CANN environment (ASCEND_HOME_PATH, LD_LIBRARY_PATH, ...) is set by set_env.sh; the entrypoint sources it.
# Runs as root: the NPU device files (/dev/davinci*, /dev/davinci_manager, /dev/hisi_hdc, /dev/devmm_svm) need it.
SHELL ["/bin/bash", "-c"]
ENTRYPOINT ["/bin/bash", "-c", "source /usr/local/Ascend/ascend-toolkit/set_env.sh && exec \"$@\"", "--"]
CMD ["llmjobs", "worker", "--device-type", "npu"]
