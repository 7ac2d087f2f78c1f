# syntax=docker/dockerfile:1.7
# The captioning service as a container image (docker/README.md: build, run, scaling).
#
# One Dockerfile, two images; BASE_IMAGE picks the base because base images cannot be pulled everywhere, DEVICE
# what the image carries:
#   CPU:  BASE_IMAGE=debian:bookworm-slim DEVICE=cpu (the defaults; `make container` builds a local debootstrapped
#         bookworm-slim instead): CPU-only torch from TORCH_CPU_INDEX when the builder can reach it, else PyPI's
#         torch (which brings 4.3 GB of CUDA wheels a CPU never uses), and onnxruntime instead of onnxruntime-gpu.
#   GPU:  BASE_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04 DEVICE=cuda — torch 2.14.1 (cu130) and onnxruntime-gpu
#         bring their CUDA 13 libraries as wheels, so the base only needs the driver hook of the NVIDIA container
#         toolkit.
# Both bases provide python3 (>= 3.11) from their distribution's packages.
#
# Package-index configuration is a build *secret* (`--secret id=pip.conf`, `id=pip-constraints`, `id=ca-bundle`):
# it is mounted under /run/secrets for the one RUN that installs dependencies and never lands in a layer.
# TORCH_CPU_INDEX is the public PyTorch CPU wheel index (no credentials): an empty value skips it.
ARG BASE_IMAGE=debian:bookworm-slim
ARG DEVICE=cpu
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# -- runtime base: the interpreter and the non-root user, nothing else ---------------------------------------------
FROM ${BASE_IMAGE} AS runtime-base
ARG APP_UID=10001
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/* \
 && groupadd --system --gid "${APP_UID}" captioner \
 && useradd --system --uid "${APP_UID}" --gid "${APP_UID}" --home-dir /tmp --no-create-home \
      --shell /usr/sbin/nologin --no-log-init captioner

# -- requirements: pyproject.toml's serving dependencies, so the dependency layer is rebuilt only when they change -
FROM runtime-base AS requirements
ARG DEVICE
COPY pyproject.toml docker/requirements.py /src/
RUN python3 /src/requirements.py /src/pyproject.toml "${DEVICE}" /requirements
# the CPU-only torch installer `make setup` runs too
COPY docker/cpu_torch.sh /requirements/cpu_torch.sh
# the releases `make setup` installs and the test suite passed with (`make lock`), within pyproject.toml's ranges
COPY docker/constraints.txt /requirements/constraints.txt

# -- dependencies: a virtual environment with the serving dependencies (rebuilt only when they change) ------------
FROM runtime-base AS dependencies
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=requirements /requirements /requirements
ARG TORCH_CPU_INDEX
# The secrets are optional: without them pip uses PyPI. With them it uses the build machine's index settings.
# A CPU image first tries torch/torchvision from the CPU wheel index (no CUDA wheels); where that index cannot be
# reached (or TORCH_CPU_INDEX is empty) PyPI's torch comes with the rest, CUDA wheels included, and the build says so
# (docker/cpu_torch.sh; a GPU image's torch-cpu.txt is empty).
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=pip-constraints --mount=type=secret,id=ca-bundle \
    if [ -s /run/secrets/pip.conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip.conf; fi; \
    if [ -s /run/secrets/pip-constraints ]; then export PIP_CONSTRAINT=/run/secrets/pip-constraints; fi; \
    if [ -s /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi; \
    if [ -s /requirements/torch-cpu.txt ]; then \
      sh /requirements/cpu_torch.sh pip /requirements/torch-cpu.txt "${TORCH_CPU_INDEX}"; fi; \
    pip install --no-cache-dir -c /requirements/constraints.txt -r /requirements/serving.txt

# -- project: the project's own code alone, in /opt/project, so that editing it makes one small layer -------------
# (the final image copies /opt/venv and /opt/project separately: a change to the code leaves the multi-GB dependency
# layer as it was, in the build cache, the registry and every node that has pulled it). No dependency resolution
# (done above); its build backend (setuptools) comes from the index. The entry point lands in /opt/project/bin.
FROM dependencies AS project
COPY pyproject.toml README.md LICENSE /src/
COPY models /src/models
COPY service /src/service
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=pip-constraints --mount=type=secret,id=ca-bundle \
    if [ -s /run/secrets/pip.conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip.conf; fi; \
    if [ -s /run/secrets/pip-constraints ]; then export PIP_CONSTRAINT=/run/secrets/pip-constraints; fi; \
    if [ -s /run/secrets/ca-bundle ]; then export PIP_CERT=/run/secrets/ca-bundle; fi; \
    pip install --no-cache-dir --no-deps --target /opt/project /src

# -- environment: the dependencies as served. /opt/project goes on the path by a .pth file (not PYTHONPATH, which a
# user's `-e` could replace); what serving never uses leaves: pip itself (setuptools stays: torch declares it), and
# the test suites that numpy, sympy, networkx and matplotlib ship inside their packages.
FROM dependencies AS environment
RUN echo /opt/project > "$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/captioner-project.pth" \
 && pip uninstall --yes pip \
 && find /opt/venv/lib -depth -type d -name tests -path '*/site-packages/*' -exec rm -rf {} +

# -- final image ------------------------------------------------------------------------------------------------------
FROM runtime-base AS service
ARG APP_UID=10001
COPY --from=environment /opt/venv /opt/venv
# Baked-in checkpoints: the real-photo ones in /app/weights/flickr8k are served by default, the generated-scene
# ones in /app/weights on request (CAPTIONER_PREFIXED_WEIGHTS_DIRS='{"scenes-": "/app/weights"}'); or mount your
# own read-only over /app/weights. Owned by root and not writable by the service user: the service only reads them.
COPY weights /app/weights
# the code last: what changes most often is the smallest layer, and the one layer a code change replaces
COPY --from=project /opt/project /opt/project
WORKDIR /app
# Every setting is a CAPTIONER_* variable (README, "Settings"); these are the container's defaults.
# ONNX exports and matplotlib's cache go to /tmp, so a read-only root filesystem plus a tmpfs on /tmp works.
ENV PATH=/opt/project/bin:/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib \
    CAPTIONER_HOST=0.0.0.0 \
    CAPTIONER_PORT=8000 \
    CAPTIONER_WEIGHTS_DIR=/app/weights/flickr8k \
    CAPTIONER_ONNX_DIR=/tmp/onnx \
    CAPTIONER_DRAIN_TIMEOUT_S=30
USER ${APP_UID}:${APP_UID}
EXPOSE 8000
# liveness only (the process answers); readiness (/readyz) is for the orchestrator's traffic decisions
# start period: loading, ONNX export into the empty /tmp and warm-up (99 s to 10 min measured on 2 busy CPU cores)
HEALTHCHECK --interval=15s --timeout=3s --start-period=600s --retries=3 \
  CMD ["python3", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('CAPTIONER_PORT', '8000'), timeout=2)"]
ENTRYPOINT ["captioner", "serve"]
