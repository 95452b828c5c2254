"""The codecs on a CUDA device: Numba CUDA kernels that write the host codecs' frames.

A device codec wraps a host codec of the same config (:mod:`mpigrad.codecs`): the same
header, the same payload layout, so a frame encoded on a GPU decodes on a CPU and the
reverse. Its kernels read and write device arrays (``numba.cuda`` arrays, or torch CUDA
tensors through ``cuda.as_cuda_array``); only the 40-byte header is written on the host.

    codec = device_codec(get_codec({"id": "uniform", "bits": 4, "bucket_size": 512}))
    nbytes = codec.encode(x_dev, frame_dev)           # header + payload, on the device
    codec.decode(frame_host[:40], payload_dev, out_dev, accumulate=True)

Which codecs have a device twin, and how close each is to its host codec, is
``DEVICE_CODECS`` (docs/codecs.rst, "On a GPU"). Importing this package needs nothing
beyond mpigrad; :func:`load_cuda` imports ``numba.cuda`` and refuses in one line, naming the
extra, where it is missing or broken. Under ``NUMBA_ENABLE_CUDASIM=1`` the same kernels run
in Numba's CUDA simulator (how CI tests them, without a GPU).
"""

from __future__ import annotations

from ..base import CodecError

#: The extra that installs the device codecs' dependency.
CUDA_EXTRA = 'pip install -e ".[cuda]"'

#: codec id -> how the device twin's frames compare with the host codec's.
DEVICE_CODECS = {
    "fp32": "bit-identical",
    "fp16": "bit-identical",
    "uniform": "bit-identical (nearest and stochastic rounding)",
    "sign": "within float noise: the per-bucket mean |g| is summed in another order "
            "(float64, then rounded to float32: equal in nearly every bucket)",
}


class DeviceUnavailable(CodecError):
    """numba-cuda is missing or broken, or no device (and no simulator) is there."""


def load_cuda():
    """``numba.cuda``, ready to launch kernels (a GPU, or the simulator under
    ``NUMBA_ENABLE_CUDASIM=1``); DeviceUnavailable, one line naming the extra, otherwise."""
    try:
        from numba import cuda
    except Exception as exc:  # ImportError, or numba-cuda breaking at import (numpy 2.5)
        raise DeviceUnavailable(f"the GPU codecs need numba-cuda ({CUDA_EXTRA}); importing it failed: "
                                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    try:
        available = cuda.is_available()
    except Exception as exc:
        raise DeviceUnavailable(f"numba-cuda cannot reach the GPU ({type(exc).__name__}: {exc}); "
                                f"check the driver, or reinstall with {CUDA_EXTRA}") from None
    if not available:
        raise DeviceUnavailable("numba-cuda sees no CUDA device (the driver or CUDA_VISIBLE_DEVICES), "
                                "so the GPU codecs cannot run")
    return cuda


def device_codec(codec, stream=0):
    """The device twin of host ``codec`` (a :class:`~mpigrad.codecs.Codec`), launching on
    ``stream``; CodecError naming the codecs that have one when it has none."""
    if codec.codec_id not in DEVICE_CODECS:
        raise CodecError(f"codec {codec.codec_id!r} has no GPU kernels (those that do: "
                         f"{', '.join(sorted(DEVICE_CODECS))}); it runs on the host")
    load_cuda()
    from . import codecs

    return codecs.DEVICE_CLASSES[codec.codec_id](codec, stream)


__all__ = ["CUDA_EXTRA", "DEVICE_CODECS", "DeviceUnavailable", "device_codec", "load_cuda"]
