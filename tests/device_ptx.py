"""Compile every device kernel to PTX for real GPUs, without one (tests/test_device_codecs.py).

Run as ``python tests/device_ptx.py SIGNATURES.json`` in a process *without* Numba's CUDA
simulator: for each (kernel, argument types) the runtime launched (recorded under the
simulator by the test) and each compute capability of ``CCS``, numba-cuda compiles the
kernel to PTX through NVVM (the ``nvidia-cuda-nvcc-cu12`` and ``nvidia-cuda-nvrtc-cu12``
wheels); prints one JSON line: per kernel and capability, the PTX's length and its count of
float32 fused multiply-adds (``fma.rn.f32``), which would make the device's float32
arithmetic differ from the host's. numba-cuda asks the driver for the current device's
capability when it compiles a device function a kernel calls; with no driver here, that one
lookup is answered with the capability being compiled for.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

#: Ampere (A100) and Hopper (H100, H200): the GPUs of the clusters mpigrad is run on.
CCS = ((8, 0), (9, 0))


def numba_type(spec):
    import numpy as np
    from numba import from_dtype, types

    if isinstance(spec, list):  # ["array", dtype, ndim]
        return types.Array(from_dtype(np.dtype(spec[1])), spec[2], "C")
    return getattr(types, spec)


def main(path: str) -> None:
    import numba.cuda.dispatcher as dispatcher
    from numba import cuda

    import mpigrad.codecs.device.kernels as kernels

    launches = json.loads(open(path).read())
    result = {}
    for cc in CCS:
        dispatcher.get_current_device = lambda cc=cc: SimpleNamespace(compute_capability=cc)
        for name, signature in launches:
            kernel = getattr(kernels, name)
            ptx, _ = cuda.compile_ptx(kernel.py_func, tuple(numba_type(s) for s in signature), cc=cc)
            result[f"{name} sm_{cc[0]}{cc[1]} {signature}"] = {"bytes": len(ptx), "fma_f32": ptx.count("fma.rn.f32")}
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
