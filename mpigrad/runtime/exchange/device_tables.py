"""The device compressor's encode tables: each shard's frame table at a choice of codecs
(:class:`EncodeTemplate`), built once and kept (:class:`EncodeTables`, the last
:data:`TEMPLATES_PER_SHARD` of each shard), so that a later frame only draws each stochastic
piece's next RNG key into it and copies to the device no more of it than the piece rows that
hold those keys. The tables themselves, and the kernels that run them, are
:mod:`mpigrad.codecs.device.table`'s.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import torch

from ...codecs import HEADER_SIZE
from ...counters import copied
from ..plan.layout import Shard
from .device_memory import device_buffer, pinned_buffer

__all__ = ["TEMPLATES_PER_SHARD", "EncodeTemplate", "EncodeTables"]


#: Encode tables kept per shard: one per choice of bits a policy returns to (a fixed policy
#: uses one; an adaptive one moves between neighbouring choices).
TEMPLATES_PER_SHARD = 8


@dataclasses.dataclass
class EncodeTemplate:
    """A shard's frame table at one choice of codecs (:meth:`EncodeTables.build`): the table,
    its int64 array, the pieces' (position, header), the frame's length, and per quantized
    piece (its index, codec, twin, and the slot of its RNG key in the array where it rounds
    stochastically, else None)."""

    table: object
    array: np.ndarray
    headers: list
    end: int
    draws: list

    @property
    def stochastic(self) -> bool:
        """Whether a piece's key changes from frame to frame."""
        return any(slot is not None for *_, slot in self.draws)

    def draw(self, calls: list[int], feedback) -> None:
        """The next frame's keys into the array, with the state an encode advances: each
        quantized piece's RNG counter (``calls``) and the error memory's record of it."""
        for index, codec, twin, slot in self.draws:
            codec.calls = calls[index]
            if slot is not None:
                self.table.write_key(self.array, slot, twin.next_key())
            calls[index] = codec.calls
            if feedback:
                feedback.remembered(index)


class EncodeTables:
    """The encode tables of one device compressor's frames, by shard (``(server, bucket)``):
    the last :data:`TEMPLATES_PER_SHARD` templates of each, by the identities of their codecs,
    and the pinned and device buffers that take each shard's table to the device (the
    template its device buffer holds known, so that an unchanged table is not copied again).
    ``table``: :mod:`mpigrad.codecs.device.table`; ``no_feedback``: the kernels' mode without
    error memory; ``view``: a tensor as the numba device array the kernels take."""

    def __init__(self, table, no_feedback: int, device: torch.device, view):
        self._table, self._no_feedback, self.device, self._view = table, no_feedback, device, view
        self._templates: dict = {}
        self._device_tables: dict = {}
        self._table_buffers: dict = {}
        self._host_table_buffers: dict = {}

    def template(self, shard: Shard, codecs, twins, pos: int, calls: list[int], feedback) -> EncodeTemplate:
        """The table of ``shard``'s frame at ``codecs`` (their ``twins``; the pieces from byte
        ``pos``), its keys drawn for this frame: built where this shard has none at these
        codecs (the least recently used of its templates dropped beyond
        :data:`TEMPLATES_PER_SHARD`), else the kept one with its keys drawn anew. Either way
        the pieces' RNG counters (``calls``) and the error memory's record (``feedback``)
        advance as every encode advances them."""
        templates = self._templates.setdefault((shard.server, shard.bucket), collections.OrderedDict())
        ident = tuple(map(id, codecs))
        template = templates.get(ident)
        if template is None:
            template = templates[ident] = self.build(shard, codecs, twins, pos, calls, feedback)
            if len(templates) > TEMPLATES_PER_SHARD:
                templates.popitem(last=False)
        else:
            templates.move_to_end(ident)
            template.draw(calls, feedback)
        return template

    def build(self, shard: Shard, codecs, twins, pos: int, calls: list[int], feedback) -> EncodeTemplate:
        """The table of ``shard``'s frame at ``codecs``, its keys drawn for this frame (the
        RNG counters and the error memory's record advanced as every encode advances them)."""
        table, headers = self._table.FrameTable(encode=True), []
        mode = feedback.kernel_mode if feedback else self._no_feedback
        draws = []
        for piece, codec, twin in zip(shard.pieces, codecs, twins):
            if piece.quantized:
                codec.calls = calls[piece.index]
                keys = table.key_count
                header = table.add_encode(twin, piece.offset, piece.size, pos + HEADER_SIZE, mode,
                                          feedback.decay if feedback else 1.0)
                draws.append((piece.index, codec, twin, keys if table.key_count > keys else None))
                calls[piece.index] = codec.calls
                if feedback:
                    feedback.remembered(piece.index)
            else:
                header = table.add_encode(twin, piece.offset, piece.size, pos + HEADER_SIZE)
            headers.append((pos, header))
            pos += HEADER_SIZE + header.payload_len
        draws = [(index, codec, twin, None if i is None else table.key_slot(i)) for index, codec, twin, i in draws]
        return EncodeTemplate(table, table.array(), headers, pos, draws)

    def on_device(self, template: EncodeTemplate, key):
        """An encode's table on the device (int64, a numba view), through the pinned buffer
        of ``key`` and one asynchronous copy (the encode waits before its next use): the
        whole table, or where the device buffer of ``key`` holds this template's already,
        only its section of piece rows (which holds the keys), and only if a key changed."""
        array, table = template.array, template.table
        pinned = pinned_buffer(self._host_table_buffers, key, array.nbytes, self.device)
        device = device_buffer(self._table_buffers, key, array.nbytes, self.device)
        start, stop = 0, array.size
        if self._device_tables.get(key) is template:
            start, stop = table.sections()["pieces"] if template.stochastic else (0, 0)
        self._device_tables.pop(key, None)  # until the copy is queued
        if stop > start:
            pinned[8 * start:8 * stop].numpy()[:] = array[start:stop].view(np.uint8)
            copied("to_device", 8 * (stop - start))
            device[8 * start:8 * stop].copy_(pinned[8 * start:8 * stop], non_blocking=True)
        self._device_tables[key] = template
        return self._view(device[:array.nbytes].view(torch.int64))
