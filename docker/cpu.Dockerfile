#
# ISAGI CPU image: the web app (`isagi web`) on the embedded default model
# (SmolLM2-135M-Instruct on llama.cpp), no GPU needed. The GPU image is
# docker/Dockerfile, a separate file, so that building this one never builds
# or pulls anything of the GPU image (the legacy builder builds every stage of
# a file).
#
#   docker build -f docker/cpu.Dockerfile -t isagi:cpu .
#   docker/build.sh cpu        # the same, with the machine's wheels in docker/wheels/
#
# BASE_IMAGE is a Debian 12 (bookworm) image with Python 3.11: the official
# python image by default; docker/base.sh makes a local one
# (isagi-base:bookworm) where Docker Hub cannot be reached. No BuildKit-only
# syntax: the legacy builder (Debian's docker.io, no buildx) builds this file.
#
# Wheels in docker/wheels/ (the build context) are used where they fit:
# torch's CPU build and llama-cpp-python (docker/install-deps.sh). Without
# them torch comes from TORCH_INDEX and llama.cpp is compiled in the build
# stage, whose compilers never reach the image.

ARG BASE_IMAGE=python:3.11-slim-bookworm

# ------------------------------------------------------------------ build --
FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv
COPY pyproject.toml docker/install-deps.sh /tmp/build/
COPY docker/wheels /tmp/wheels
RUN sh /tmp/build/install-deps.sh cpu

# -------------------------------------------------------------------- app --
FROM ${BASE_IMAGE} AS app
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GRADIO_ANALYTICS_ENABLED=False \
    HF_HUB_DISABLE_TELEMETRY=1 \
    ISAGI_HOME=/data \
    HF_HOME=/models/hf \
    ISAGI_HOST=0.0.0.0 \
    ISAGI_PORT=7860 \
    ISAGI_DEVICE=cpu \
    ISAGI_MODEL=default \
    ISAGI_BACKEND=llamacpp

# tini forwards SIGTERM so `docker stop` shuts the server down cleanly;
# libgomp1 is llama.cpp's OpenMP runtime. The local base has both already.
# An unprivileged user owns the two volumes: Docker copies this ownership
# into a fresh named volume on first mount.
# hadolint ignore=DL3008
RUN if ! dpkg -s tini libgomp1 >/dev/null 2>&1; then \
      apt-get update \
      && apt-get install -y --no-install-recommends tini libgomp1 \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
 && groupadd --system --gid 10001 isagi \
 && useradd --system --uid 10001 --gid isagi --create-home --home-dir /home/isagi --shell /usr/sbin/nologin isagi \
 && mkdir -p /data /models/hf \
 && chown -R isagi:isagi /data /models

# 1. The dependencies, installed in the build stage from pyproject.toml alone.
COPY --from=build /opt/venv /opt/venv

# 2. The source tree, installed without touching the dependencies: a change
#    of the code rebuilds only these layers.
WORKDIR /opt/isagi
COPY pyproject.toml README.md ./
COPY isagi ./isagi
COPY storage ./storage
COPY app ./app
RUN pip install --no-cache-dir --no-deps --no-build-isolation . \
 && rm -rf build ./*.egg-info

USER 10001:10001
VOLUME ["/data", "/models"]

EXPOSE 7860
# The embedded model needs no download or calibration (its profile ships
# with ISAGI); another model (ISAGI_MODEL) calibrates on its first start.
HEALTHCHECK --interval=10s --timeout=5s --start-period=900s --retries=3 \
  CMD ["python", "-c", "import json, os, sys, urllib.request; r = urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('ISAGI_PORT', '7860'), timeout=5); sys.exit(0 if r.status == 200 and json.load(r).get('status') == 'ok' else 1)"]

ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["isagi", "web"]
