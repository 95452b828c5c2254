"""The codecs on a CUDA device: Numba CUDA kernels that write the host codecs' frames.

A device codec wraps a host codec of the same config (:mod:`mpigrad.codecs`): the same
header, the same payload layout, so a frame encoded on a GPU decodes on a CPU and the
reverse. Its kernels read and write device arrays (``numba.cuda`` arrays, or torch CUDA
tensors through ``cuda.as_cuda_array``); only the 40-byte header is written on the host.

    codec = device_codec(get_codec({"id": "uniform", "bits": 4, "bucket_size": 512}))
    nbytes = codec.encode(x_dev, frame_dev)           # header + payload, on the device
    codec.decode(frame_host[:40], payload_dev, out_dev, accumulate=True)

Which codecs have a device twin, and how close each is to its host codec, is
``DEVICE_CODECS`` (docs/codecs.rst, "On a GPU"): fp32, fp16, uniform, qsgd with
norm="max" and TernGrad with clip=0 are bit-identical (their scales are ranges or max |g|,
integer reductions of the float32 bit patterns that any order gets right, and their draws
are the host's counter-based stream); sign, TernGrad's 2.5 sigma clip and qsgd's l2 norm
agree within float noise (their scales come from float64 sums, which the host adds in a
fixed sequential order that no parallel reduction reproduces: the float32 scale can differ
in its last bit, rarely, and the codes agree wherever the scales do). qsgd's variable-length
(Elias) coding, mcgq, powersgd and plugins have no twin (:func:`host_only` says why), and
run on the host. A frame of several
pieces of these codecs goes through a fixed number of launches whatever its pieces
(:mod:`.table`: at most 3 to encode, error memory included, 2 to decode); the runtime's
device path encodes and decodes every frame so. Importing this
package needs nothing beyond mpigrad; :func:`load_cuda` imports ``numba.cuda`` and refuses in one line, naming the
extra, where it is missing or broken. Under ``NUMBA_ENABLE_CUDASIM=1`` the same kernels run
in Numba's CUDA simulator (how CI tests them, without a GPU).
"""

from __future__ import annotations

from ..base import HEADER_SIZE, CodecError
from ..parts import BUILTIN_CODECS, parts_of, resolve

#: The extra that installs the device codecs' dependency.
CUDA_EXTRA = 'pip install -e ".[cuda]"'

#: codec id -> how the device twin's frames compare with the host codec's, for every codec
#: whose row in :data:`mpigrad.codecs.parts.BUILTIN_CODECS` names a device twin (its
#: ``device_agreement``; the table says why float64 sums are within float noise).
DEVICE_CODECS = {parts.codec_id: parts.device_agreement for parts in BUILTIN_CODECS if parts.device}


def host_only(codec) -> str | None:
    """Why host ``codec`` has no device twin (one line), or None when it has one."""
    if codec.codec_id not in DEVICE_CODECS:
        return (f"codec {codec.codec_id!r} has no GPU kernels (those that do: "
                f"{', '.join(sorted(DEVICE_CODECS))}); it runs on the host")
    if codec.checksum:
        return (f"{codec.codec_id}: checksum=True needs the payload on the host for its CRC; "
                "it runs on the host")
    if codec.codec_id == "qsgd" and codec.coding != "fixed":
        return (f"qsgd: coding={codec.coding!r} (variable-length) has no GPU kernels (coding='fixed' "
                "has); it runs on the host")
    return None


#: ``MPIGRAD_DEVICE_THREADS=N``: the kernels' threads per block (:func:`threads_per_block`).
THREADS_VARIABLE = "MPIGRAD_DEVICE_THREADS"


def threads_per_block(simulator: bool) -> int:
    """The kernels' threads per block: ``MPIGRAD_DEVICE_THREADS`` (a power of two, 32 to
    1024), else 256 on a GPU and 32 in the simulator (where every thread is a Python thread);
    CodecError (one line) for any other value. Read once, when the kernels are imported; so
    that tests run the GPU's geometry (256 threads, 8192-element chunks) in the simulator."""
    import os

    text = os.environ.get(THREADS_VARIABLE, "")
    if not text:
        return 32 if simulator else 256
    if not text.isdigit() or int(text) not in (32, 64, 128, 256, 512, 1024):
        raise CodecError(f"{THREADS_VARIABLE}={text!r}: threads per block must be a power of two from 32 to 1024")
    return int(text)


class DeviceUnavailable(CodecError):
    """numba-cuda is missing or broken, or no device (and no simulator) is there."""


def load_cuda():
    """``numba.cuda``, ready to launch kernels (a GPU, or the simulator under
    ``NUMBA_ENABLE_CUDASIM=1``); DeviceUnavailable, one line naming the extra, otherwise.
    numba-cuda itself is required: without it numba answers ``from numba import cuda`` with
    its own deprecated CUDA target, which these kernels are not written for."""
    import importlib.util

    if importlib.util.find_spec("numba_cuda") is None:
        raise DeviceUnavailable(f"the GPU codecs need numba-cuda, which is not installed: {CUDA_EXTRA}")
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


def device_codec(codec, stream=None):
    """The device twin of host ``codec`` (a :class:`~mpigrad.codecs.Codec`), launching on
    ``stream`` (a stream, a callable giving the stream at each launch, or None: numba's
    default stream; :class:`~.codecs.DeviceCodec`); CodecError naming the codecs that have
    one when it has none, or saying why this config of a codec that has one runs on the host
    (:func:`host_only`). The twin's class is the one the codec's row of
    :data:`mpigrad.codecs.parts.BUILTIN_CODECS` names."""
    reason = host_only(codec)
    if reason:
        raise CodecError(reason)
    load_cuda()
    return resolve(parts_of(codec.codec_id).device)(codec, stream)


def warm_up_kernels(codecs, stream=None, to_device=None) -> int:
    """Launch every table kernel (:mod:`.table`) the device path runs for ``codecs`` (host
    codec objects; those with no twin, :func:`host_only`, are skipped): a frame of one piece
    per codec encoded, decoded and decoded-added by table, of a short piece and of one longer
    than a chunk (under the simulator, where nothing compiles and a simulated thread is slow,
    the short one only: it launches every kernel too), so that Numba compiles them (or loads
    them from its cache) at the call. ``stream``: as :func:`device_codec`'s (the twins' and the
    kernels' launches); ``to_device(array)``: a host NumPy array as a device array the kernels
    take, on ``stream`` (default: ``numba.cuda.to_device``, a blocking copy). Queued, not waited
    for: the caller synchronises its stream. Returns the number of codecs launched for."""
    import numpy as np

    cuda = load_cuda()
    from . import kernels as k
    from .table import FrameTable, TableKernels

    if to_device is None:
        to_device = cuda.to_device
    stream_source = stream if callable(stream) else (lambda: stream if stream is not None else cuda.default_stream())
    twins = [device_codec(codec, stream) for codec in codecs if not host_only(codec)]
    for n in (37, k.CHUNK + 37)[:1 if k.SIMULATOR else 2] if twins else ():  # a tail; more than one chunk
        table_kernels = TableKernels(cuda, stream_source)
        status = cuda.to_device(np.zeros(k.STATUS_SLOTS, np.int32))
        encode, decode, pos = FrameTable(encode=True), FrameTable(encode=False), 0
        for i, twin in enumerate(twins):
            header = encode.add_encode(twin, i * n, n, pos + HEADER_SIZE)
            decode.add_decode(twin, header, i * n, pos + HEADER_SIZE)
            pos += HEADER_SIZE + header.payload_len
        x = to_device(np.linspace(-1.0, 1.0, n * len(twins), dtype=np.float32))
        frame = to_device(np.zeros(pos, np.uint8))
        table_kernels.encode(encode, to_device(encode.array()), x, frame, status)
        table = to_device(decode.array())
        for accumulate in (False, True):
            table_kernels.decode(decode, table, frame, x, accumulate, status)
    return len(twins)


__all__ = ["CUDA_EXTRA", "DEVICE_CODECS", "DeviceUnavailable", "device_codec", "host_only", "load_cuda",
           "threads_per_block", "THREADS_VARIABLE", "warm_up_kernels"]
