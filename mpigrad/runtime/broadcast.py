"""Message 4 (and 4b): the servers' broadcast of their re-encoded shards, in as few messages
as the frames' sizes allow.

A frame whose size every rank computes from the shard and the bits alone (its codecs'
``Codec.exact_size``) goes as one message: its ``FrameLength`` and the frame, two buffers
sent and received in place. The length still travels, so the bytes on the wire are those of
the two-message protocol, and every receiver checks it against the size it computed. A frame
whose size depends on the data (Elias, MCGQ) is announced first: all such lengths in one
round of broadcasts, then every frame in the next.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .wire import Channel, FrameError


def broadcast_widths(bits: list[int], fixed: int | None) -> list[int]:
    """The widths a server re-encodes at: the iteration's ``bits``, or ``fixed`` for every
    layer when the broadcast has a width of its own (``--broadcast-codec``)."""
    return bits if fixed is None else [fixed] * len(bits)


def frame_sizes(compressor, shards, bits: list[int]) -> list[int | None]:
    """Each shard's broadcast frame size at ``bits`` where ``compressor``'s codecs fix it, else None."""
    return [compressor.exact_capacity(shard, bits) for shard in shards]


def broadcast_frames(channel: Channel, groups: list[int], sizes: list[int | None],
                     lengths: dict[int, np.ndarray], buffers: dict[int, np.ndarray],
                     own: tuple[int, np.ndarray] | None, describe: Callable[[], str]) -> dict[int, np.ndarray]:
    """Take part in the broadcast of server s's frame for each s in ``groups`` (group s, its
    root server s); return every frame by s, received ones as views of ``buffers[s]`` (grown
    as needed). ``own``: (s, frame) where this rank is server s, its ``lengths[s]`` holding
    the frame's size. ``sizes[s]``: the size every rank computed, or None (sent first).
    FrameError where a length that came differs from the computed one."""
    if own is not None and sizes[own[0]] is not None and own[1].size != sizes[own[0]]:
        raise FrameError(f"server {own[0]} encoded a frame of {own[1].size} bytes where its codecs fix "
                         f"{sizes[own[0]]}")
    announced = [s for s in groups if sizes[s] is None]
    if announced:
        channel.broadcast([(lengths[s], s) for s in announced], describe)
    frames, items = {}, []
    for s in groups:
        if own is not None and s == own[0]:
            frame = own[1]
        else:
            size = int(lengths[s][0]) if sizes[s] is None else sizes[s]
            if buffers[s].size < size:
                buffers[s] = np.empty(size, np.uint8)
            frame = buffers[s][:size]
        frames[s] = frame
        items.append(((frame,) if sizes[s] is None else (lengths[s], frame), s))
    channel.broadcast([(parts[0] if len(parts) == 1 else parts, s) for parts, s in items], describe)
    for s in groups:
        if sizes[s] is not None and int(lengths[s][0]) != sizes[s]:
            raise FrameError(f"server {s} announced a broadcast frame of {int(lengths[s][0])} bytes where "
                             f"its codecs fix {sizes[s]}")
    return frames
