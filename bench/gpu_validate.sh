#!/usr/bin/env bash
# Everything issue #3 needs a GPU for, in one run on a CUDA machine (see bench/GPU.md):
# the CUDA tests, the whole model against llama.cpp's reference on CUDA, and the benchmarks.
# Writes logs and JSON results under ${OUT:-./gpu-results}.
#
# Expects: torch + triton installed; the wheels the machine lacks in .whl/ (optional);
# the default model's GGUF at $LOCALLLM_TEST_MODEL (optional: the slow reference tests
# need it); llama.cpp's reference outputs from tests/data/reference (or $LOCALLLM_REFERENCE_DIR).
set -uo pipefail
OUT=${OUT:-./gpu-results}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
# The package layout maps kernels/ to localllm.kernels; without an install, link it.
[ -e localllm/kernels ] || ln -s ../kernels localllm/kernels

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/machine.txt"

# 1. Kernels, runtime and the reference comparisons natively on CUDA.
python3 -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest-cuda.log"

# 2. Benchmarks: the default model (when present) and an 8B-class synthetic file.
if [ -n "${LOCALLLM_TEST_MODEL:-}" ]; then
  python3 -m localllm.cli bench "$LOCALLLM_TEST_MODEL" --json 2>&1 | tee "$OUT/bench-gemma3-270m.json"
  LOCALLLM_CUDA_GRAPHS=0 python3 -m localllm.cli bench "$LOCALLLM_TEST_MODEL" --json 2>&1 \
    | tee "$OUT/bench-gemma3-270m-nographs.json"
fi
python3 -m localllm.cli bench --synthetic llama3-8b --quant Q4_K_M --json 2>&1 \
  | tee "$OUT/bench-llama3-8b-q4km.json"
python3 bench/bench_kernels.py 2>&1 | tee "$OUT/bench-kernels.txt"
# 3. The static profile of the same Triton build, next to the measured figures.
python3 bench/kernel_profile.py --arch 90 89 --all --out "$OUT/profile" --json 2>&1 \
  | tee "$OUT/kernel-profile.txt"
