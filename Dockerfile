# Training image for GPU nodes: the pinned requirements.txt in a virtualenv, the project in /app, run as a
# non-root user, with cli.py as the entry point. Build it once per node (or push it to a registry):
#
#   docker build --build-arg UID="$(id -u)" -t lightning-ddp .
#
# PyPI's Linux torch wheel pinned in requirements.txt (2.13.0) is built for CUDA 13.0 and brings its own
# CUDA runtime, cuDNN and NCCL; the CUDA base image adds the NVIDIA container settings and the driver
# check (CUDA 13.0 needs driver 580 or newer and a GPU of compute capability 7.5 or newer). For an older
# driver or GPU, pick a CUDA 12 build of the same torch version from PyTorch's index and the matching base:
#
#   docker build --build-arg CUDA_VERSION=12.6.3 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 -t lightning-ddp .
ARG CUDA_VERSION=13.0.0
ARG UBUNTU_VERSION=24.04
FROM nvidia/cuda:${CUDA_VERSION}-base-ubuntu${UBUNTU_VERSION}

ARG CUDA_VERSION
# An extra package index holding torch builds for another CUDA version; empty: PyPI's build.
ARG TORCH_INDEX_URL=""
# The user id that owns what training writes into mounted volumes; give your own with --build-arg UID.
ARG UID=1000

# iproute2 gives scripts/run_ddp_train.sh `ip` and `ss`; procps gives ps and top for looking inside.
# libibverbs1 and ibverbs-providers are the verbs library and its drivers that NCCL loads for InfiniBand and
# RoCE (with `docker run --device /dev/infiniband`); without them it falls back to TCP sockets.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv iproute2 procps \
        libibverbs1 ibverbs-providers \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The same requirements.txt as everywhere else, so every node and every image runs the same versions.
COPY requirements.txt /tmp/requirements.txt
RUN python3 -m venv "$VIRTUAL_ENV" \
    && PIP_EXTRA_INDEX_URL="$TORCH_INDEX_URL" pip install -r /tmp/requirements.txt \
    && torch_cuda=$(python -c 'import torch; print(torch.version.cuda)') \
    && if [ "$torch_cuda" != "${CUDA_VERSION%.*}" ]; then \
        echo "error: torch is built for CUDA $torch_cuda, the base image has CUDA $CUDA_VERSION." \
            "Set the CUDA_VERSION and TORCH_INDEX_URL build args to match." >&2; \
        exit 1; \
    fi

# Ubuntu's images come with a user "ubuntu" holding uid 1000.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --create-home --uid "$UID" --shell /bin/bash trainer

WORKDIR /app
COPY . .
# Training writes logs and checkpoints to /app/logs (mount a volume there to keep them) and the seq2seq
# corpus to /app/cache. Only these belong to the user: the code stays root's, so training cannot change it.
RUN mkdir -p logs cache && chown trainer:trainer logs cache

USER ${UID}
# `docker run IMAGE fit -c configs/ddp.yaml ...` runs cli.py; the multi-node launcher runs with
# `--entrypoint /app/scripts/run_ddp_train.sh`.
ENTRYPOINT ["python", "cli.py"]
CMD ["fit", "-c", "configs/ddp.yaml"]
