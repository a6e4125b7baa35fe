# syntax=docker/dockerfile:1
#
# The difftape service image: `difftape serve` with the data dir on the /data volume.
#
#   CPU (default)   docker build -t difftape:cpu .
#   CUDA            docker build -t difftape:cuda --target cuda .
#   Podman/Buildah  podman build -t difftape:cpu .          (same file, same stages)
#   run             docker run -d -p 127.0.0.1:8000:8000 -v difftape-data:/data difftape:cpu
#                   docker run -d --gpus all -p 127.0.0.1:8000:8000 -v difftape-data:/data difftape:cuda
#   first token     docker exec <container> difftape token create alice --data-dir /data
#
# The image is chosen by naming its final stage (`--target cpu|cuda`; `cpu` is the last stage,
# so a plain build makes it). Stage names are never computed from a build argument
# (`FROM build-${TARGET}`): Podman 4.3 / Buildah 1.28 look such a name up as an image and fail.
# BuildKit and Buildah both build only the stages the chosen target needs, so a CPU build never
# pulls the CUDA images.
#
# Behind a TLS-inspecting proxy or with a private index, pip takes them at build time:
#   --secret id=pip_ca,src=/etc/ssl/certs/ca-certificates.crt   (a CA bundle, not kept in a layer)
#   --build-arg PIP_INDEX_URL=https://... --build-arg PIP_EXTRA_INDEX_URL=https://...
# Where no registry is reachable, any Debian/Ubuntu image with python3 (>= 3.11) and
# python3-venv serves as PYTHON_IMAGE: deploy/image/README.md makes one with debootstrap.
#
# Stages: build-<target> holds compilers and headers and fills a virtual environment in
# /opt/venv; base-<target> is the slim runtime base; the final stages copy only /opt/venv onto
# it, so the image that runs has no compiler, no pip cache and no source tree.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# The CUDA stages use Ubuntu 24.04 because its system Python (3.12) meets requires-python
# (>= 3.11); Ubuntu 22.04's is 3.10. Any 12.x tag with -runtime/-devel on ubuntu24.04 works.
ARG CUDA_IMAGE_VERSION=12.6.3
ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:${CUDA_IMAGE_VERSION}-runtime-ubuntu24.04
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:${CUDA_IMAGE_VERSION}-devel-ubuntu24.04

# ---------------------------------------------------------------------------------------------
# Build stages
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build-cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
ARG PIP_INDEX_URL PIP_EXTRA_INDEX_URL
RUN python3 -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kernels kernels
COPY server server
COPY client client
COPY deploy/image/pip-install.sh /usr/local/bin/pip-install
# A regular (not editable) install: the package lands in site-packages, /src is left behind.
# `postgres`: the image can point its gateway at a PostgreSQL database (DIFFTAPE_DATABASE_URL);
# `ray`: its gateway can run sessions on a Ray cluster (--cluster), and it serves as the
# cluster's node image (deploy/kuberay.yaml).
RUN --mount=type=secret,id=pip_ca sh /usr/local/bin/pip-install ".[server,postgres,ray]"

FROM ${CUDA_DEVEL_IMAGE} AS build-cuda
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 DEBIAN_FRONTEND=noninteractive
# pycuda (the `cuda` extra) ships no Linux wheels: it is compiled here against the CUDA headers,
# linking libcuda through the toolkit's stub (the real libcuda.so.1 comes from the host driver,
# injected by the NVIDIA Container Toolkit at run time).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/*
ENV CUDA_ROOT=/usr/local/cuda LIBRARY_PATH=/usr/local/cuda/lib64/stubs
ARG PIP_INDEX_URL PIP_EXTRA_INDEX_URL
RUN python3 -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kernels kernels
COPY server server
COPY client client
COPY deploy/image/pip-install.sh /usr/local/bin/pip-install
RUN --mount=type=secret,id=pip_ca sh /usr/local/bin/pip-install ".[server,postgres,ray,cuda]"

# ---------------------------------------------------------------------------------------------
# Runtime bases
# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base-cpu
ENV DIFFTAPE_ARCH=cpu

FROM ${CUDA_RUNTIME_IMAGE} AS base-cuda
# Only the interpreter: the venv copied from build-cuda points at this same /usr/bin/python3.12.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/*
ENV DIFFTAPE_ARCH=cuda NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility

# ---------------------------------------------------------------------------------------------
# The images: `cuda`, then `cpu` (the last stage, built by default). The two stages below are
# the same instructions over their own base and build stage; tests/service/test_deploy_files.py
# checks that they stay so.
# ---------------------------------------------------------------------------------------------
FROM base-cuda AS cuda
ARG APP_UID=10001
LABEL org.opencontainers.image.title="difftape" \
      org.opencontainers.image.description="difftape compile-and-execute service (cuda)" \
      org.opencontainers.image.licenses="Apache-2.0"

# A fixed, unprivileged UID/GID (the Kubernetes manifests and compose file name the same one).
# Its home is the data dir, so anything that writes under ~ lands on the volume, not the image.
RUN groupadd --system --gid "${APP_UID}" difftape \
 && useradd --system --uid "${APP_UID}" --gid difftape --home-dir /data --no-create-home \
            --shell /usr/sbin/nologin difftape \
 && mkdir -p /data \
 && chown difftape:difftape /data \
 && chmod 0750 /data

COPY --from=build-cuda /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/data \
    DIFFTAPE_DATA_DIR=/data

# Sessions' database, compiled-code cache, saved fields and tokens live here: mount a volume
# (a fresh named volume inherits the difftape ownership set above; a bind mount must be
# chown'ed to ${APP_UID} by hand).
VOLUME ["/data"]
WORKDIR /data
# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER ${APP_UID}:${APP_UID}

EXPOSE 8000

# Liveness only (the process answers HTTP); readiness (/readyz) is for load balancers and
# Kubernetes. urllib raises on connection errors and on any non-2xx status, so the exit code
# is the verdict; no curl in the image.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/livez' % os.environ.get('DIFFTAPE_PORT', '8000'), timeout=4)"]

# Inside a container the server must listen on 0.0.0.0: the container's own loopback is not
# reachable from the host, and `docker run -p` / a Kubernetes Service forward to the
# container's network interface. Who may reach it is decided outside, where the port is
# published: compose publishes on the host's 127.0.0.1 only, Kubernetes uses a ClusterIP
# Service. (Run outside a container, `difftape serve` binds 127.0.0.1 by default.)
# Other settings come from DIFFTAPE_* variables; extra flags can be appended after the image.
ENTRYPOINT ["difftape", "serve", "--host", "0.0.0.0", "--data-dir", "/data"]

FROM base-cpu AS cpu
ARG APP_UID=10001
LABEL org.opencontainers.image.title="difftape" \
      org.opencontainers.image.description="difftape compile-and-execute service (cpu)" \
      org.opencontainers.image.licenses="Apache-2.0"

# A fixed, unprivileged UID/GID (the Kubernetes manifests and compose file name the same one).
# Its home is the data dir, so anything that writes under ~ lands on the volume, not the image.
RUN groupadd --system --gid "${APP_UID}" difftape \
 && useradd --system --uid "${APP_UID}" --gid difftape --home-dir /data --no-create-home \
            --shell /usr/sbin/nologin difftape \
 && mkdir -p /data \
 && chown difftape:difftape /data \
 && chmod 0750 /data

COPY --from=build-cpu /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/data \
    DIFFTAPE_DATA_DIR=/data

# Sessions' database, compiled-code cache, saved fields and tokens live here: mount a volume
# (a fresh named volume inherits the difftape ownership set above; a bind mount must be
# chown'ed to ${APP_UID} by hand).
VOLUME ["/data"]
WORKDIR /data
# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER ${APP_UID}:${APP_UID}

EXPOSE 8000

# Liveness only (the process answers HTTP); readiness (/readyz) is for load balancers and
# Kubernetes. urllib raises on connection errors and on any non-2xx status, so the exit code
# is the verdict; no curl in the image.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/livez' % os.environ.get('DIFFTAPE_PORT', '8000'), timeout=4)"]

# Inside a container the server must listen on 0.0.0.0: the container's own loopback is not
# reachable from the host, and `docker run -p` / a Kubernetes Service forward to the
# container's network interface. Who may reach it is decided outside, where the port is
# published: compose publishes on the host's 127.0.0.1 only, Kubernetes uses a ClusterIP
# Service. (Run outside a container, `difftape serve` binds 127.0.0.1 by default.)
# Other settings come from DIFFTAPE_* variables; extra flags can be appended after the image.
ENTRYPOINT ["difftape", "serve", "--host", "0.0.0.0", "--data-dir", "/data"]
