"""A model replica over flat parameter and gradient buffers.

Every rank holds a replica built from the same seed. Parameters live in one flat tensor laid
out as [quantized layers in model order, then every small layer], and each ``p.grad`` is a
view into one flat gradient tensor, so backward writes straight into the buffer the encoder
reads and a decoded frame lands where the update reads it, with no gather or scatter copies.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from ...counters import copied, launched, synchronized
from ...optim import LearningRate, UpdateRule
from ..plan.layout import Layout, Segment


#: What a model without ``quantized_parameters()`` quantizes by default.
DEFAULT_MIN_QUANTIZE_SIZE = 10_000


def quantization_rule(model: torch.nn.Module, min_quantize_size: int | None, codec=None):
    """Which parameters are quantized: those of at least ``min_quantize_size`` elements, or
    with None the model's ``quantized_parameters()`` (the paper CNN: the layers the paper
    quantizes); a model without that method (ResNets, plugins) quantizes every tensor of at
    least ``DEFAULT_MIN_QUANTIZE_SIZE`` elements. A low-rank ``codec`` (``powersgd``) picks
    its own: every matrix (a convolution viewed as one) that its rule compresses."""
    if codec is not None and codec.two_rounds:
        return lambda p: codec.compresses(p.shape)
    if min_quantize_size is None and hasattr(model, "quantized_parameters"):
        chosen = {id(p) for p in model.quantized_parameters()}
        return lambda p: id(p) in chosen
    if min_quantize_size is None:
        min_quantize_size = DEFAULT_MIN_QUANTIZE_SIZE
    return lambda p: p.numel() >= min_quantize_size


class Replica:
    """Model, flat buffers and the SGD update shared by server and workers."""

    def __init__(self, model: torch.nn.Module, min_quantize_size: int | None, device: torch.device, codec=None):
        """Quantized: every parameter of at least ``min_quantize_size`` elements, or with
        None the model's ``quantized_parameters()`` (the layers the paper quantizes); with a
        low-rank ``codec``, the matrices it compresses (``quantization_rule``)."""
        self.model = model.to(device)
        self.device = device
        params = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        quantize = quantization_rule(self.model, min_quantize_size, codec)
        big = [(n, p) for n, p in params if quantize(p)]
        small = [(n, p) for n, p in params if not quantize(p)]
        total = sum(p.numel() for _, p in params)
        self.flat = torch.empty(total, dtype=torch.float32, device=device)
        self.flat_grad = torch.zeros(total, dtype=torch.float32, device=device)
        segments, offset = [], 0
        for name, p in big + small:
            n = p.numel()
            self.flat[offset:offset + n].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset:offset + n].view_as(p)
            p.grad = self.flat_grad[offset:offset + n].view_as(p)
            segments.append(Segment(name, offset, n))
            offset += n
        #: Each trainable parameter's gradient view of ``flat_grad``, in the model's order.
        self.grad_views = [p.grad for _, p in params]
        n_big = len(big)
        rest_offset = segments[n_big].offset if n_big < len(segments) else total
        self.layout = Layout(tuple(segments[:n_big]), Segment("small layers", rest_offset, total - rest_offset), total)
        if device.type == "cpu":
            # Zero-copy: the codecs read the gradient and write the update in place.
            self.grad_host = self.flat_grad.numpy()
            self.update_host = self.grad_host
            self._device_update = None
        else:
            # Pinned host buffers and one device buffer, allocated once.
            self._host_grad = torch.empty(total, dtype=torch.float32, pin_memory=True)
            self._host_update = torch.empty(total, dtype=torch.float32, pin_memory=True)
            self._device_update = torch.empty(total, dtype=torch.float32, device=device)
            self.grad_host = self._host_grad.numpy()
            self.update_host = self._host_update.numpy()

        #: The optimizer and the schedule (use_update_rule); None: plain SGD at the rate given.
        self.rule: UpdateRule | None = None
        self.rate: LearningRate | None = None
        #: Whether the codecs read the gradient and write the update in device memory (the
        #: device path, runtime/exchange/device.py): set by :meth:`use_device_codecs`.
        self.codecs_on_device = False
        self.update_device: torch.Tensor | None = None
        #: The status its device compressors flag into (runtime/exchange/device.py ``on_device``), else None.
        self.device_status = None
        #: The host buffers its device compressors' frames lie in (runtime/exchange/device.py ``FrameMemory``), else None.
        self.frame_memory = None

    def use_device_codecs(self) -> None:
        """From now on the codecs read ``flat_grad`` and write ``update_device`` where they
        live (:meth:`codec_gradient`, :attr:`codec_update`, :meth:`step`)."""
        self.codecs_on_device = True
        self.update_device = self._device_update if self._device_update is not None else self.flat_grad

    def codec_gradient(self, pieces=None):
        """What the codecs encode: the flat gradient in device memory (the device path), else
        its host copy (``gradient_to_host``; with ``pieces``, of those pieces' elements only:
        a pipelined bucket's)."""
        return self.flat_grad if self.codecs_on_device else self.gradient_to_host(pieces)

    @property
    def codec_update(self):
        """Where the codecs decode the update: ``update_device`` or ``update_host``."""
        return self.update_device if self.codecs_on_device else self.update_host

    def use_update_rule(self, rule: UpdateRule, rate: LearningRate) -> None:
        """Apply updates with ``rule`` (the optimizer, one per piece) at ``rate``'s rates
        (:meth:`lr`) instead of plain SGD at the rate each call passes."""
        self.rule, self.rate = rule, rate

    def lr(self, m: int, default: float) -> float:
        """Iteration ``m``'s learning rate: the schedule's, or ``default`` without one."""
        return default if self.rate is None else self.rate.at(m)

    def update_state_dict(self) -> dict | None:
        """The update rule's and the schedule's state (None for plain SGD at a constant rate)."""
        if self.rule is None or (self.rule.plain and self.rate.constant):
            return None
        return {"rule": self.rule.state_dict(), "rate": self.rate.state_dict()}

    def load_update_state_dict(self, state: dict | None) -> None:
        if state is None:
            return
        self.rule.load_state_dict(state["rule"])
        self.rate.load_state_dict(state["rate"])

    def step(self, lr: float, offset: int = 0, size: int | None = None) -> None:
        """Apply the decoded update at rate ``lr`` (plain SGD: w <- w - lr * update; else the
        update rule's optimizer), on ``size`` elements from ``offset`` (all by default; else
        whole pieces), from wherever the codecs decoded it."""
        if not self.codecs_on_device:
            self.apply_update(self.update_host, lr, offset, size)
            return
        end = self.flat.numel() if size is None else offset + size
        self._apply(self.update_device, lr, offset, end)

    def update_to_gradient(self) -> None:
        """Put the decoded update where each parameter's ``.grad`` is (``flat_grad``), for an
        optimizer that is not the replica's (a script's, :class:`mpigrad.Session`). On the CPU
        the codecs decode into that buffer already; a GPU replica's update is copied."""
        if self.codecs_on_device:
            if self.update_device is not self.flat_grad:
                launched("torch")  # the copy
                self.flat_grad.copy_(self.update_device)
        elif self._device_update is not None:
            copied("to_device", 4 * self.flat.numel())
            # From the pinned buffer, on the current stream: the script's optimizer, queued
            # after it on the same stream, reads .grad once the copy is done.
            self.flat_grad.copy_(self._host_update, non_blocking=True)

    def _apply(self, update: torch.Tensor, lr: float, offset: int, end: int) -> None:
        if self.codecs_on_device:
            launched("torch")  # plain SGD's add_ (an update rule's step counted as one: fused)
        if self.rule is None:
            self.flat[offset:end].add_(update[offset:end], alpha=-lr)
        else:
            self.rule.apply(self.flat, update, lr, offset, end)

    def gradient_to_host(self, pieces=None) -> np.ndarray:
        """The flat gradient in host memory (the CPU's own buffer, or a pinned copy of a
        device replica's); with ``pieces`` (objects with ``offset`` and ``size``) only their
        elements are copied, the rest of the copy is stale."""
        if self._device_update is not None:
            if pieces is None:
                self._host_grad.copy_(self.flat_grad)
            else:
                for piece in pieces:
                    end = piece.offset + piece.size
                    self._host_grad[piece.offset:end].copy_(self.flat_grad[piece.offset:end])
        return self.grad_host

    def apply_update(self, grad: np.ndarray, lr: float, offset: int = 0, size: int | None = None) -> None:
        """Apply ``grad``, a host array in the flat layout, as :meth:`step` applies the decoded
        update; with ``offset`` and ``size``, on those elements only (the pipelined iteration,
        a bucket at a time)."""
        end = self.flat.numel() if size is None else offset + size
        if self._device_update is not None:
            self._device_update[offset:end].copy_(torch.from_numpy(grad[offset:end]))
            self._apply(self._device_update, lr, offset, end)
        else:
            self._apply(torch.from_numpy(grad), lr, offset, end)

    def checksum(self) -> int:
        """CRC-32 of the parameters' bytes: replicas must agree bit for bit."""
        if self.codecs_on_device:
            copied("to_host", 4 * self.flat.numel())
            synchronized("checksum")  # the parameters copied to the host
        return zlib.crc32(self.flat.detach().cpu().numpy().view(np.uint8))

    def state_dict(self) -> dict:
        """Parameters and the model's buffers (BatchNorm statistics, see runtime/exchange/buffers.py)."""
        return {"flat": self.flat.detach().cpu().clone(),
                "buffers": {name: b.detach().cpu().clone() for name, b in self.model.named_buffers()}}

    def load_state_dict(self, state: dict) -> None:
        flat = state["flat"]
        if flat.numel() != self.flat.numel():
            raise ValueError(f"checkpoint holds {flat.numel()} parameters, the model has {self.flat.numel()}")
        buffers = dict(self.model.named_buffers())
        saved = state.get("buffers", {})
        if set(saved) != set(buffers) or any(saved[k].shape != b.shape for k, b in buffers.items()):
            raise ValueError("checkpoint holds other model buffers than the model has")
        self.flat.copy_(flat.to(self.device))
        with torch.no_grad():
            for name, b in buffers.items():
                b.copy_(saved[name])

