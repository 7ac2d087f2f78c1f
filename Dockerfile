# syntax=docker/dockerfile:1.7
# The captioning service as a container image (docker/README.md: build, run, scaling).
#
# One Dockerfile, two images; BASE_IMAGE picks the base because base images cannot be pulled everywhere:
#   CPU:  BASE_IMAGE=debian:bookworm-slim (default; `make container` builds a local debootstrapped bookworm instead)
#   GPU:  BASE_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04 — torch 2.14.1 (cu130) and onnxruntime-gpu bring their
#         CUDA 13 libraries as wheels, so the base only needs the driver hook of the NVIDIA container toolkit.
# Both bases provide python3 (>= 3.11) from their distribution's packages.
#
# Package-index configuration is a build *secret* (`--secret id=pip.conf`, `id=pip-constraints`, `id=ca-bundle`):
# it is mounted under /run/secrets for the one RUN that installs dependencies and never lands in a layer.
ARG BASE_IMAGE=debian:bookworm-slim

# -- runtime base: the interpreter and the non-root user, nothing else ---------------------------------------------
FROM ${BASE_IMAGE} AS runtime-base
ARG APP_UID=10001
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
 && groupadd --system --gid "${APP_UID}" captioner \
 && useradd --system --uid "${APP_UID}" --gid "${APP_UID}" --home-dir /tmp --no-create-home \
      --shell /usr/sbin/nologin captioner

# -- requirements: the dependency list of pyproject.toml, so the dependency layer is rebuilt only when it changes ---
FROM runtime-base AS requirements
COPY pyproject.toml /src/pyproject.toml
RUN python3 -c "import tomllib; deps = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']['dependencies']; print(*deps, sep='\n')" > /requirements.txt

# -- builder: a virtual environment with the dependencies, then the project itself ---------------------------------
FROM runtime-base AS builder
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=requirements /requirements.txt /requirements.txt
# The secrets are optional: without them pip uses PyPI. With them it uses the build machine's index settings.
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=pip-constraints --mount=type=secret,id=ca-bundle \
    if [ -s /run/secrets/pip.conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip.conf; fi; \
    if [ -s /run/secrets/pip-constraints ]; then export PIP_CONSTRAINT=/run/secrets/pip-constraints; fi; \
    if [ -s /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi; \
    pip install --no-cache-dir -r /requirements.txt
COPY pyproject.toml README.md LICENSE /src/
COPY models /src/models
COPY service /src/service
# the project's own code: no dependency resolution (done above); its build backend (setuptools) comes from the index
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=pip-constraints --mount=type=secret,id=ca-bundle \
    if [ -s /run/secrets/pip.conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip.conf; fi; \
    if [ -s /run/secrets/pip-constraints ]; then export PIP_CONSTRAINT=/run/secrets/pip-constraints; fi; \
    if [ -s /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi; \
    pip install --no-cache-dir --no-deps /src

# -- final image ------------------------------------------------------------------------------------------------------
FROM runtime-base AS service
ARG APP_UID=10001
COPY --from=builder /opt/venv /opt/venv
# Baked-in checkpoints (the default); or mount your own read-only over /app/weights. Owned by root and not
# writable by the service user: the service only reads them.
COPY weights /app/weights
WORKDIR /app
# Every setting is a CAPTIONER_* variable (README, "Settings"); these are the container's defaults.
# ONNX exports and matplotlib's cache go to /tmp, so a read-only root filesystem plus a tmpfs on /tmp works.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib \
    CAPTIONER_HOST=0.0.0.0 \
    CAPTIONER_PORT=8000 \
    CAPTIONER_WEIGHTS_DIR=/app/weights \
    CAPTIONER_ONNX_DIR=/tmp/onnx \
    CAPTIONER_DRAIN_TIMEOUT_S=30
USER ${APP_UID}:${APP_UID}
EXPOSE 8000
# liveness only (the process answers); readiness (/readyz) is for the orchestrator's traffic decisions
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s --retries=3 \
  CMD ["python3", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('CAPTIONER_PORT', '8000'), timeout=2)"]
ENTRYPOINT ["captioner", "serve"]
