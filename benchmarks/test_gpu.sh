#!/usr/bin/env bash
# `make test-gpu`: the tests marked gpu, then the GPU benchmark set, all output in one report file.
# Runs with the machine's own Python (GPU_PYTHON, default python3: a GPU container's CUDA torch), not the
# CPU venv; the project's other dependencies must be importable there (see README, "GPU").
set -u
python=${GPU_PYTHON:-python3}
report=${1:-results/gpu_report.txt}
if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "make test-gpu: $python sees no CUDA GPU (torch.cuda.is_available() is false); run it on a GPU machine" >&2
    exit 2
fi
mkdir -p "$(dirname "$report")"
status=$(mktemp)
{
    echo "GPU report, $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    "$python" -c "import torch, transformers, megatron.core as m; print('torch', torch.__version__, '| transformers', \
transformers.__version__, '| megatron-core', m.__version__)" 2>&1
    echo "=== tests marked gpu"
    PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$python" -m pytest -q -ra -s -p no:cacheprovider -m gpu tests/gpu
    echo "tests $?" >> "$status"
    echo "=== GPU benchmarks"
    PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$python" benchmarks/run_bench.py --set gpu --threads 8
    echo "benchmarks $?" >> "$status"
} 2>&1 | tee "$report"
echo "$(tr '\n' ' ' < "$status")-> $report"
! grep -qv ' 0$' "$status"
