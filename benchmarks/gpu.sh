#!/usr/bin/env bash
# The benchmark suite on a GPU machine: same variants, same protocol,
# --device gpu (no CPU-only XLA flags, no PyTorch CPU peer).
#
#   bash benchmarks/gpu.sh [OUT_DIR] [extra run.py flags...]
#
# Needs a CUDA build of jaxlib (e.g. pip install -U "jax[cuda12]") and the
# library installed (pip install -e .). Writes OUT_DIR/results.{json,md}.
set -euo pipefail
cd "$(dirname "$0")/.."

out="${1:-results/benchmarks/gpu}"
shift || true

if ! python -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')"; then
  echo "gpu.sh: JAX sees no GPU (backend: $(python -c 'import jax; print(jax.default_backend())'))." >&2
  echo "Install a CUDA jaxlib, e.g. pip install -U \"jax[cuda12]\"." >&2
  exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true

# Let XLA allocate on demand so the memory numbers are the step's own, not
# the default 75% preallocation.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
python benchmarks/run.py --device gpu --sections steps,optimizer \
  --api both --out "$out" "$@"
# The sharded fused step on however many GPUs are present (issue 6).
python benchmarks/sharded.py --device gpu
