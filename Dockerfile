# podkit's image: the same image for a RunPod template, `docker compose up` and CI's smoke stack.
# The base carries CUDA, torch and SGLang; podkit adds supervisor, git/psmisc/lsof and its own code.
# Python and its packages live in the image, never on /workspace (a network volume is slow).
# BASE_IMAGE is pinned here for GPU pods; the CPU tests build FROM a local base via --build-arg.
ARG BASE_IMAGE=lmsysorg/sglang:v0.5.5-cu126
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PODKIT_WORKSPACE=/workspace \
    HF_HOME=/workspace/.cache/huggingface

# git: the sync stage. psmisc/lsof: the same tools the reap stage is checked against, for people.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends git psmisc lsof procps ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# Layers from rarely to often changed: dependencies, then data, then code (one small last layer).
# py-spy: the watchdog dumps a hung trainer's Python stacks with it (needs CAP_SYS_PTRACE; without
# it the trainer's own faulthandler answers instead).
RUN python3 -m pip install "PyYAML>=6,<7" "supervisor>=4.2,<5" "py-spy>=0.3"
COPY entrypoint /entrypoint
COPY pyproject.toml README.md supervisord.conf /opt/podkit/
COPY configs /opt/podkit/configs
COPY runpod/template.yaml /opt/podkit/runpod/template.yaml
COPY src /opt/podkit/src
RUN python3 -m pip install --no-deps /opt/podkit

WORKDIR /workspace
ENTRYPOINT ["/entrypoint"]
# Healthy when both programs run, inference is ready and the trainer progresses (not merely
# "supervisord is alive"); the output names what is wrong.
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 CMD ["podkit", "status", "--health"]
