"""The device path's error memory: :class:`DeviceFeedback`, the host's
:class:`~mpigrad.feedback.ErrorFeedback` kept in device memory, which the frame tables' kernels
compensate and update in place (:mod:`.device_tables`), with the host memory's state_dict.
"""

from __future__ import annotations

import numpy as np
import torch

from ...feedback import ErrorFeedback, FeedbackError

__all__ = ["DeviceFeedback"]


class DeviceFeedback:
    """The error memory of :class:`~mpigrad.feedback.ErrorFeedback` in device memory, with
    the same float operations (so the same memory, bit for bit) and the same state_dict.
    Hyperparameters: the host memory's mode and decay, the pieces (their places in the flat
    gradient). State: the memory and the compensated gradient, each one flat device tensor
    laid out as the gradient (the table kernels compensate and remember in place), and the
    keys compensated so far, in order (the host memory's keys)."""

    def __init__(self, host: ErrorFeedback, device: torch.device, pieces):
        self.mode, self.decay, self.device = host.mode, host.decay, device
        self.places = {p.index: (p.offset, p.size) for p in pieces if p.quantized}
        total = max((offset + size for offset, size in self.places.values()), default=0)
        #: e, and p = g + decay * e, where the gradient's pieces are.
        self.memory = torch.zeros(total, dtype=torch.float32, device=device)
        self.compensated = torch.empty(total, dtype=torch.float32, device=device)
        self.used: dict[int, None] = {}

    @property
    def kernel_mode(self) -> int:
        """The mode as the table kernels take it (``kernels.RESIDUAL`` or ``ACCUMULATE``)."""
        from ...codecs.device import kernels

        return kernels.RESIDUAL if self.mode == "residual" else kernels.ACCUMULATE

    def error(self, key: int) -> torch.Tensor:
        offset, size = self.places[key]
        return self.memory[offset:offset + size]

    def remembered(self, key: int) -> None:
        """Record that ``key``'s memory is in use (compensated and updated by the table kernels)."""
        self.used.setdefault(key, None)

    def state_dict(self) -> dict:
        return {"mode": self.mode, "decay": self.decay,
                "memory": {key: self.error(key).cpu().numpy().copy() for key in self.used}}

    def load_state_dict(self, state: dict) -> None:
        host = ErrorFeedback(self.mode, self.decay)
        host.load_state_dict(state)  # its checks
        for key in host.keys():  # all checked before any is loaded
            error = host.error(key)
            if key not in self.places or error.shape != (self.places[key][1],) or error.dtype != np.float32:
                raise FeedbackError(f"error feedback memory {key!r}: not a quantized piece of this layout, or "
                                    "not its size (float32)")
        self.memory.zero_()
        self.used = {}
        for key in host.keys():
            self.error(key).copy_(torch.from_numpy(host.error(key).copy()))
            self.remembered(key)
