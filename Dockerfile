# hyper_parallel training image. The default build runs the default job on CPU:
#   docker build -t hyper_parallel .
#   docker run --rm -v "$PWD/outputs:/app/outputs" hyper_parallel            # 2 CPU ranks
#   docker run --rm -e NPROC=4 hyper_parallel training.steps=50 parallel=hsdp
#
# Build arguments (see docs/recipes.md, "Docker"):
#   BASE_IMAGE       a Python 3.10+ image. CUDA: a PyTorch CUDA runtime image that already has
#                    torch>=2.13 (then TORCH_SPEC=""). Ascend: an image with CANN, torch and
#                    torch_npu installed (then TORCH_SPEC="" and EXTRAS="[npu]").
#   TORCH_SPEC       the torch requirement to install; empty: keep the base image's torch.
#   TORCH_INDEX_URL  where TORCH_SPEC comes from (default: the CPU wheels).
#   EXTRAS           pip extras of hyper_parallel, e.g. "[npu]" or "[tensorboard]".
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    OMP_NUM_THREADS=1

WORKDIR /app
RUN if [ -n "${TORCH_SPEC}" ]; then \
        python -m pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"; \
    fi
COPY pyproject.toml README.md ./
COPY hyper_parallel ./hyper_parallel
# Editable: the recipes find configs/ next to the package. The constraint keeps the torch installed
# above (or the base image's): pyproject's torch range would let pip's resolver, when it backtracks
# through the extras, replace it by the newest release in the range (a multi-GB CUDA build).
RUN python -c "from importlib.metadata import version; print('torch==' + version('torch'))" \
        > /tmp/torch-constraint.txt \
    && python -m pip install -c /tmp/torch-constraint.txt -e ".${EXTRAS}"
COPY configs ./configs
COPY recipes ./recipes
COPY scripts ./scripts

# scripts/train.sh uses torchrun from PATH here (no .venv in the image); env NPROC, NNODES,
# RDZV_ENDPOINT, MAX_RESTARTS configure it; arguments are Hydra overrides.
ENTRYPOINT ["/app/scripts/train.sh"]
CMD []
