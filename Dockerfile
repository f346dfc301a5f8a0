# syntax=docker/dockerfile:1
# Slim CPU image for the runtime and (later) the store and API. GPU worker targets come with the deployment work.
FROM python:3.11-slim AS base
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY runtime ./runtime
COPY services ./services
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" && pip install .
RUN useradd --create-home --uid 10001 redknot
USER redknot
CMD ["redknot", "demo", "--workdir", "/tmp/demo"]
