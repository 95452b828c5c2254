#!/usr/bin/env bash
# A GPU node's first checks, in one go: what the node runs (GPU, driver, versions), the tests
# that need a real device (MPIGRAD_TEST_GPU=1: the `cuda` marker's, the device kernels and
# compressor compiled for the GPU, the device path's training runs against the host codecs),
# then the table of docs/gpu.rst (table.sh). Logs and traces go under OUT (default
# gpu-checks); each step has its own time limit, so that one hang leaves the others' results.
#   bash examples/gpu/checks.sh [OUT] [TEST_SECONDS] [TABLE_SECONDS]
set -uo pipefail
out=${1:-gpu-checks}
test_seconds=${2:-300}
table_seconds=${3:-300}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 - <<'PY' | tee -a "$out/gpu.txt"
import numpy, numba, torch, mpi4py.MPI as MPI, h5py
from numba import cuda
print("numpy", numpy.__version__, "numba", numba.__version__, "torch", torch.__version__,
      "h5py", h5py.__version__, "cuda available", torch.cuda.is_available())
print("numba-cuda sees", cuda.get_current_device().name, "| MPI:", MPI.Get_library_version().splitlines()[0])
PY
started=$SECONDS
MPIGRAD_TEST_GPU=1 timeout "$test_seconds" python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfEs \
    --durations=15 tests/test_device_codecs.py tests/test_device_compressor.py tests/test_replica.py \
    tests/test_device_path_mpi.py tests/test_gpu_binding.py 2>&1 | tee "$out/tests.log" | tail -n 60
echo "+ GPU tests: exit ${PIPESTATUS[0]} after $(( SECONDS - started )) s"
started=$SECONDS
timeout "$table_seconds" bash examples/gpu/table.sh "$out/table" 2>&1 | tee "$out/table.log" \
    | tail -n 80
echo "+ table.sh: exit ${PIPESTATUS[0]} after $(( SECONDS - started )) s"
