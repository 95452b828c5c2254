"""The precision of a hierarchical exchange's slices inside a node (``--intra-codec``,
:mod:`.hierarchical`): what a node's workers send each other in its reduce-scatter and
all-gather. Only what crosses a NIC goes through mpigrad's codecs; inside the node a cheap,
exact-size format."""

from __future__ import annotations

import numpy as np

from ...errors import UsageError

__all__ = ["IntraCodec"]


class IntraCodec:
    """The precision of the slices inside a node: ``fp32`` (exact), ``fp16`` (IEEE half,
    rounded to nearest even) or ``bf16`` (the top 16 bits of a float32, rounded to nearest
    even). ``encode(values, out)`` writes ``values`` (float32) into ``out`` (``buffer(n)``);
    ``decode(buf)`` gives float32 values."""

    def __init__(self, name: str):
        if name not in ("fp32", "fp16", "bf16"):
            raise UsageError(f"intra_codec must be one of fp32, fp16, bf16, got {name!r}")
        self.name = name
        self.dtype = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16}[name]

    def nbytes(self, n: int) -> int:
        """The bytes of ``buffer(n)``: one slice of ``n`` values as it goes to another worker."""
        return n * np.dtype(self.dtype).itemsize

    def buffer(self, n: int) -> np.ndarray:
        return np.empty(n, self.dtype)

    def encode(self, values: np.ndarray, out: np.ndarray) -> None:
        if self.name == "bf16":
            bits = values.view(np.uint32)
            rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
            nan = np.isnan(values)
            np.right_shift(rounded, np.uint32(16), out=rounded)
            out[:] = rounded
            out[nan] = 0x7FC0  # a NaN stays one (rounding could carry it into infinity)
        else:
            with np.errstate(over="ignore"):  # beyond fp16's range: infinity, as torch's cast gives
                out[:] = values

    def decode(self, buf: np.ndarray) -> np.ndarray:
        if self.name == "bf16":
            return (buf.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return buf.astype(np.float32, copy=False)
