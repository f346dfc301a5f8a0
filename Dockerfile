# syntax=docker/dockerfile:1
# Two images from one file (build targets):
#   slim  python:3.11-slim + CPU torch: the artifact store, the API and the builder (CPU producer)
#         docker build --target slim -t redknot-mla:0.1.0 .
#   cuda  NVIDIA CUDA runtime + CUDA torch (cu130): the TP inference workers (and a GPU builder)
#         docker build --target cuda -t redknot-mla:0.1.0-cuda .
# Each final stage copies a ready virtual environment from its build stage, so no compiler, pip cache or
# build context is left in the image. Both run as the unprivileged user redknot (uid 10001) and carry a
# HEALTHCHECK whose target each service sets with REDKNOT_HEALTHCHECK (deploy/healthcheck.py).

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
ARG TORCH_VERSION=2.13.0

# ------------------------------------------------------------------------------------------------ slim
FROM ${PYTHON_IMAGE} AS slim-build
ARG TORCH_VERSION
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the CPU index, so the project's `torch>=` requirement never pulls a CUDA build
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime ./runtime
COPY services ./services
RUN pip install . && pip check

FROM ${PYTHON_IMAGE} AS slim
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    REDKNOT_HEALTHCHECK=http://127.0.0.1:8000/healthz
RUN useradd --create-home --uid 10001 --user-group redknot \
    && mkdir -p /data /models /work && chown redknot:redknot /data /models /work
COPY --from=slim-build /opt/venv /opt/venv
COPY --chmod=0755 deploy/healthcheck.py /usr/local/bin/redknot-healthcheck
USER 10001:10001
WORKDIR /home/redknot
EXPOSE 8000 50051 9464 9465
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 CMD ["redknot-healthcheck"]
CMD ["redknot", "api", "serve", "--listen", "0.0.0.0:8000"]

# ------------------------------------------------------------------------------------------------ cuda
FROM ${CUDA_IMAGE} AS cuda-build
ARG TORCH_VERSION
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime ./runtime
COPY services ./services
RUN pip install . && pip check

FROM ${CUDA_IMAGE} AS cuda
ENV DEBIAN_FRONTEND=noninteractive
# python3: the venv's interpreter links to it. gcc and python3-dev: Triton compiles its small CUDA launcher
# (C, including Python.h) on first use of a kernel. The CUDA user-space libraries come with the torch wheels.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --user-group redknot \
    && mkdir -p /data /models /work && chown redknot:redknot /data /models /work
COPY --from=cuda-build /opt/venv /opt/venv
COPY --chmod=0755 deploy/healthcheck.py /usr/local/bin/redknot-healthcheck
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    REDKNOT_DEVICE=cuda REDKNOT_HEALTHCHECK=http://127.0.0.1:8100/healthz
USER 10001:10001
WORKDIR /home/redknot
EXPOSE 8100 9465
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 CMD ["redknot-healthcheck"]
CMD ["redknot", "worker", "--tp", "8", "--listen", "0.0.0.0:8100"]
