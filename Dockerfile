# One image for engine, router and operator; the Deployments differ only in args.
#   docker build -t pagefleet:dev .                                   (CPU torch, the default)
#   docker build --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#                --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t pagefleet:cuda .
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

# CUDA base images ship no python; slim images already have it.
RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv && \
        rm -rf /var/lib/apt/lists/*; \
    fi && \
    python3 -m venv /opt/pagefleet && \
    /opt/pagefleet/bin/pip install --no-cache-dir --upgrade pip && \
    /opt/pagefleet/bin/pip install --no-cache-dir --index-url ${TORCH_INDEX} torch==${TORCH_VERSION} && \
    groupadd --gid 10001 pagefleet && \
    useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin pagefleet

WORKDIR /src
COPY pyproject.toml README.md ./
COPY pagefleet pagefleet
COPY engine engine
COPY router router
COPY operator operator
# kopf for the operator; everything else comes from pyproject
RUN /opt/pagefleet/bin/pip install --no-cache-dir . kopf && rm -rf /src

ENV PATH=/opt/pagefleet/bin:$PATH \
    PAGEFLEET_CACHE=/cache \
    HF_HOME=/cache/hf \
    PYTHONUNBUFFERED=1 \
    OMP_WAIT_POLICY=PASSIVE
WORKDIR /
USER 10001:10001
EXPOSE 8000 8080
HEALTHCHECK NONE
ENTRYPOINT ["pagefleet"]
CMD ["--help"]
