# GPU image: NGC PyTorch (CUDA, NCCL, transformer-engine preinstalled) + aligner with its GPU extras.
# Not buildable on the CPU-only development machines; kept correct by reading (see README, "GPU").
#   docker build -t aligner .            # or --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:<tag>
#   docker run --gpus all --ipc=host -it aligner make test
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.01-py3
FROM ${BASE_IMAGE}

ARG INSTALL_TRTLLM=0
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/aligner

# Dependencies first, so code edits do not invalidate this layer. No constraints file here:
# the container's own torch (CUDA build) must stay; the package's ranges accept it.
COPY pyproject.toml README.md ./
COPY aligner/__init__.py aligner/__init__.py
COPY servers/__init__.py servers/__init__.py
RUN pip install --no-cache-dir -e ".[gpu,test]"
RUN if [ "$INSTALL_TRTLLM" = "1" ]; then pip install --no-cache-dir -e ".[trtllm]"; fi

COPY . .
# Fail the build early if the GPU stack is not importable.
RUN python -c "import torch, megatron.core, transformer_engine; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)"

CMD ["bash"]
