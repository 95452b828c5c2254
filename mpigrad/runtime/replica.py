"""A model replica over flat parameter and gradient buffers, and the gradient frame codecs.

Every rank holds a replica built from the same seed. Parameters live in one flat tensor laid
out as [quantized layers in model order, then every small layer], and each ``p.grad`` is a
view into one flat gradient tensor, so backward writes straight into the buffer the encoder
reads and a decoded frame lands where the update reads it, with no gather or scatter copies.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

from ..codecs import Codec, get_codec
from .protocol import frame_capacity, frame_segments_offset, read_frame, write_frame_header


@dataclass(frozen=True)
class Segment:
    name: str
    offset: int
    size: int


@dataclass(frozen=True)
class Layout:
    """Where each communicated segment sits in the flat buffers."""

    quantized: tuple[Segment, ...]
    rest: Segment
    total: int

    @property
    def segments(self) -> tuple[Segment, ...]:
        return self.quantized + (self.rest,)


class Replica:
    """Model, flat buffers and the SGD update shared by server and workers."""

    def __init__(self, model: torch.nn.Module, min_quantize_size: int, device: torch.device):
        self.model = model.to(device)
        self.device = device
        params = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        big = [(n, p) for n, p in params if p.numel() >= min_quantize_size]
        small = [(n, p) for n, p in params if p.numel() < min_quantize_size]
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

    def gradient_to_host(self) -> np.ndarray:
        if self._device_update is not None:
            self._host_grad.copy_(self.flat_grad)
        return self.grad_host

    def apply_update(self, grad: np.ndarray, lr: float) -> None:
        """w <- w - lr * grad, for ``grad`` a host array in the flat layout."""
        update = torch.from_numpy(grad)
        if self._device_update is not None:
            update = self._device_update.copy_(update)
        self.flat.add_(update, alpha=-lr)

    def checksum(self) -> int:
        """CRC-32 of the parameters' bytes: replicas must agree bit for bit."""
        return zlib.crc32(self.flat.detach().cpu().numpy().view(np.uint8))

    def state_dict(self) -> dict:
        """Parameters and the model's buffers (BatchNorm statistics, see runtime/buffers.py)."""
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


class FrameEncoder:
    """Encode a flat gradient into one frame: per-layer codec buffers, small layers as fp32.

    Follows GRACE's order on each quantized layer: compensate -> encode -> update memory.
    Each layer keeps its own RNG stream (seeded from ``seeds[i]``) whose call counter
    survives bit changes. Each (layer, bits) codec instance keeps any adaptive state of its
    own (e.g. mcgq's dynamic K), and checkpoints carry every instance's ``state_dict``.
    Buffers are allocated once and grown only when more bits need more room.
    """

    def __init__(self, layout: Layout, codec: Codec, seeds: list[int], feedback=None):
        self.layout = layout
        self.base_config = codec.get_config()
        # A codec configured by its levels keeps them: the policy's bits do not apply.
        self.accepts_bits = codec.accepts_bits and "levels" not in self.base_config
        self.seeds = seeds
        self.calls = [0] * len(layout.quantized)
        self.feedback = feedback
        self.rest_codec = get_codec({"id": "fp32"})
        self._codecs: dict[tuple[int, int], Codec] = {}
        self._frame = np.empty(0, np.uint8)
        self._scratch = np.empty(max([s.size for s in layout.quantized], default=0), np.float32)

    def codec_for(self, layer: int, bits: int) -> Codec:
        key = (layer, bits if self.accepts_bits else 0)
        codec = self._codecs.get(key)
        if codec is None:
            config = dict(self.base_config)
            if self.accepts_bits:
                config.pop("levels", None)
                config["bits"] = bits
            if "seed" in config:
                config["seed"] = self.seeds[layer]
            codec = self._codecs[key] = get_codec(config)
        return codec

    def _capacity(self, bits: list[int]) -> int:
        sizes = [self.codec_for(i, b).max_encoded_size(s.size)
                 for i, (s, b) in enumerate(zip(self.layout.quantized, bits))]
        sizes.append(self.rest_codec.max_encoded_size(self.layout.rest.size))
        return frame_capacity(sizes)

    def encode(self, grad: np.ndarray, bits: list[int]) -> np.ndarray:
        """Frame (a view into a reused buffer) for flat gradient ``grad``; valid until next call."""
        capacity = self._capacity(bits)
        if self._frame.size < capacity:
            self._frame = np.empty(capacity, np.uint8)
        frame = self._frame
        pos = frame_segments_offset(len(self.layout.segments))
        lengths = []
        for i, (segment, b) in enumerate(zip(self.layout.quantized, bits)):
            g = grad[segment.offset:segment.offset + segment.size]
            codec = self.codec_for(i, b)
            p = self.feedback.compensate(i, g) if self.feedback else g
            codec.calls = self.calls[i]
            buf = codec.encode(p, out=frame[pos:])
            self.calls[i] = codec.calls
            if self.feedback:
                decoded = codec.decode(buf, out=self._scratch[:segment.size])
                self.feedback.update(i, p, decoded)
            lengths.append(buf.size)
            pos += buf.size
        rest = self.layout.rest
        buf = self.rest_codec.encode(grad[rest.offset:rest.offset + rest.size], out=frame[pos:])
        lengths.append(buf.size)
        return frame[:write_frame_header(frame, lengths, 0.0)]

    def state_dict(self) -> dict:
        # "calls" is the per-layer counter shared by all bit widths (it overrides each
        # instance's own count at encode); "codecs" is each instance's full state.
        state = {"calls": list(self.calls),
                 "codecs": [[layer, bits, codec.state_dict()] for (layer, bits), codec in self._codecs.items()]}
        if self.feedback:
            state["feedback"] = self.feedback.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if len(state["calls"]) != len(self.calls):
            raise ValueError("checkpoint has a different number of quantized layers")
        self.calls = list(state["calls"])
        for layer, bits, codec_state in state.get("codecs", ()):
            if not 0 <= layer < len(self.calls):
                raise ValueError(f"checkpoint holds codec state for quantized layer {layer}, "
                                 f"the model has {len(self.calls)}")
            self.codec_for(layer, bits).load_state_dict(codec_state)
        if self.feedback:
            self.feedback.load_state_dict(state["feedback"])


class FrameDecoder:
    """Decode frames of a given layout into flat arrays; every segment is validated."""

    def __init__(self, layout: Layout, codec: Codec):
        self.layout = layout
        self.codec = codec
        self.rest_codec = get_codec({"id": "fp32"})

    def decode(self, frame: np.ndarray, out: np.ndarray, *, accumulate: bool = False) -> float:
        """Decode into ``out`` (flat float32), or with ``accumulate`` add to it (each segment's
        ``codec.decode(..., accumulate=True)``: ``out + decoded`` bit for bit, no scratch pass);
        return the sender's encode seconds.

        A bad segment raises before it writes, but with ``accumulate`` the segments before it
        have already been added: a caller that gets an error must not use ``out``.
        """
        encode_seconds, buffers = read_frame(frame, len(self.layout.segments))
        for segment, buf in zip(self.layout.quantized, buffers):
            self.codec.decode(buf, out=out[segment.offset:segment.offset + segment.size],
                              accumulate=accumulate)
        rest = self.layout.rest
        self.rest_codec.decode(buffers[-1], out=out[rest.offset:rest.offset + rest.size],
                               accumulate=accumulate)
        return encode_seconds


def set_frame_encode_seconds(frame: np.ndarray, seconds: float) -> None:
    frame[8:16] = np.frombuffer(np.float64(seconds).tobytes(), np.uint8)
