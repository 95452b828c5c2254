"""Compiling before the clock starts: the warm-up, and a watch on what compiles after it.

Numba compiles a kernel (or loads it from its cache) the first time it is called with a
signature. A kernel first called inside an iteration puts its compile time into that
iteration's ``t_encode``/``t_decode`` and into the run's time to a target, on every rank
of a fresh node at once. :func:`warm_up` therefore runs every codec the run can use (each
width the policy may choose, PowerSGD's factor and rest codecs, the broadcast codec, error
feedback's scratch paths, float32) through encode, decode and accumulate on small arrays
of each shape class, before the first iteration; :class:`KernelWatch` then tells which
kernels still gained a signature during the run, so that a gap is seen, not guessed.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from ...codecs import Codec, get_codec
from ..plan.checks import base_codec, broadcast_codec

__all__ = ["warm_up", "warm_up_device", "run_codecs", "KernelWatch", "kernel_signatures", "late_device_kernels"]

#: Sizes the warm-up encodes: a short tail and more than one 4096-element block, so that the
#: Python paths to both kernels' shapes run (Numba compiles per signature, not per size).
_SIZES = (37, 4096 + 37)


def run_codecs(config) -> list[Codec]:
    """Every codec object this run may encode or decode with: the workers' codec at each
    width its policy may choose (PowerSGD: its factor, rest and menu codecs), the broadcast
    codec likewise unless its bits are fixed, and float32 (the small layers, warm-up
    iterations)."""
    from ...policies import get_policy

    codec = base_codec(config)
    down, down_bits = broadcast_codec(config)
    widths: tuple[int, ...] = ()
    if not codec.two_rounds:
        lowest, highest = get_policy(config.policy_config(), n_layers=1, seed=config.seed).bits_range()
        widths = tuple(range(lowest, highest + 1))
    codecs: list[Codec] = []
    for candidate in [*codec.wire_codecs(widths), *down.wire_codecs(widths if down_bits is None else ()),
                      get_codec({"id": "fp32"})]:
        if candidate not in codecs:
            codecs.append(candidate)
    return codecs


def warm_up(config, codecs: list[Codec] | None = None) -> float:
    """Compile (or load from Numba's cache) every kernel of ``codecs`` (default: the run's,
    :func:`run_codecs`); returns the seconds it took."""
    began = time.perf_counter()
    for codec in codecs if codecs is not None else run_codecs(config):
        for n in _SIZES:
            x = np.linspace(-1.0, 1.0, n, dtype=np.float32)
            buf = codec.encode(x)
            out = np.zeros(n, dtype=np.float32)
            codec.decode(buf, out)
            codec.decode(buf, out, accumulate=True)
    return time.perf_counter() - began


#: The device kernels launched by this process's device warm-up (None: it ran none).
_device_warmed: frozenset[str] | None = None


def warm_up_device(codecs: list[Codec], device) -> float:
    """Launch every device kernel of ``codecs`` (those with device twins, ``DEVICE_CODECS``)
    on ``device`` before the first iteration, the calls the device path makes
    (:func:`mpigrad.codecs.device.warm_up_kernels`: a frame of one piece per codec encoded,
    decoded and decoded-added by table), on the current stream, so that Numba compiles them
    (or loads them from its cache) here and not inside an iteration. Each worker runs its
    own, in parallel (each on its GPU); returns the seconds it took.
    :func:`late_device_kernels` then names any kernel first launched after it."""
    global _device_warmed
    import torch

    from ...codecs.device import load_cuda, warm_up_kernels
    from ...counters import kernels_launched
    from .device_stream import current_stream, device_view, synchronize

    began = time.perf_counter()
    cuda = load_cuda()
    warm_up_kernels(codecs, lambda: current_stream(cuda, device),
                    lambda array: device_view(cuda, torch.from_numpy(array).to(device)))
    synchronize(device)
    _device_warmed = kernels_launched()
    return time.perf_counter() - began


def late_device_kernels() -> list[str]:
    """The device kernels first launched after :func:`warm_up_device` (empty where it did not run)."""
    from ...counters import kernels_launched

    if _device_warmed is None:
        return []
    return sorted(kernels_launched() - _device_warmed)


def kernel_signatures() -> dict[str, frozenset]:
    """Each loaded mpigrad Numba kernel's compiled signatures, by qualified name."""
    from numba.core.dispatcher import Dispatcher

    found: dict[str, frozenset] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("mpigrad."):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, Dispatcher):
                func = value.py_func
                found[f"{func.__module__}.{func.__qualname__}"] = frozenset(value.signatures)
    return found


class KernelWatch:
    """The kernels compiled since it was made: :meth:`compiled` names each mpigrad kernel
    that gained a signature (or was first loaded) after the warm-up."""

    def __init__(self):
        self.before = kernel_signatures()

    def compiled(self) -> list[str]:
        return sorted(name for name, signatures in kernel_signatures().items()
                      if signatures - self.before.get(name, frozenset()))
