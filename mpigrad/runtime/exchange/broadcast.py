"""Message 4 (and 4b): the servers' broadcast of their re-encoded shards, in as few messages
as the frames' sizes allow.

A frame whose size every rank computes from the shard and the bits alone (its codecs'
``Codec.exact_size``) goes as one message: its ``FrameLength`` and the frame, back to back
in one buffer (the server encodes the frame after 8 bytes of room: no copy). The length
still travels, so the bytes on the wire are those of the two-message protocol, and every
receiver checks it against the size it computed. A frame whose size depends on the data
(Elias, MCGQ) is announced first: all such lengths in one round of broadcasts, then every
frame in the next.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..wire import Channel, FrameError, FrameLength, ReceiveBuffers


def broadcast_widths(bits: list[int], fixed: int | None) -> list[int]:
    """The widths a server re-encodes at: the iteration's ``bits``, or ``fixed`` for every
    layer when the broadcast has a width of its own (``--broadcast-codec``)."""
    return bits if fixed is None else [fixed] * len(bits)


def frame_sizes(compressor, shards, bits: list[int]) -> list[int | None]:
    """Each shard's broadcast frame size at ``bits`` where ``compressor``'s codecs fix it, else None."""
    return [compressor.exact_capacity(shard, bits) for shard in shards]


def broadcast_frames(channel: Channel, groups: list[int], sizes, lengths: dict[int, np.ndarray],
                     buffers: ReceiveBuffers, own: tuple[int, np.ndarray] | None,
                     describe: Callable[[], str]) -> dict[int, np.ndarray]:
    """Take part in the broadcast of server s's frame for each s in ``groups`` (group s, its
    root server s); return every frame by s, received ones as views of ``buffers.take(s,
    size)``. ``own``: (s, message) where this rank is server s, the message its
    ``FrameLength`` then its frame, ``lengths[s]`` holding the frame's size too.
    ``sizes[s]``: the frame size every rank computed, or None (its length is sent first).
    FrameError where this server's frame is not the size its codecs fix (before anything is
    sent: the check that matters, since under MPI a receiver whose size differs fails in the
    broadcast itself), or where a length that came differs from the computed one."""
    head = FrameLength.NBYTES
    if own is not None and sizes[own[0]] is not None and own[1].size != head + sizes[own[0]]:
        raise FrameError(f"server {own[0]} encoded a frame of {own[1].size - head} bytes where its codecs fix "
                         f"{sizes[own[0]]}")
    announced = [s for s in groups if sizes[s] is None]
    if announced:
        channel.broadcast([(lengths[s], s) for s in announced], describe)
    messages, items = {}, []
    for s in groups:
        if own is not None and s == own[0]:
            message = own[1]
        else:
            message = buffers.take(s, head + (int(lengths[s][0]) if sizes[s] is None else sizes[s]))
        messages[s] = message
        items.append((message if sizes[s] is not None else message[head:], s))
    channel.broadcast(items, describe)
    for s in groups:
        if sizes[s] is None:
            continue
        length = int(messages[s][:head].view(np.int64)[0])
        if length != sizes[s]:
            raise FrameError(f"server {s} announced a broadcast frame of {length} bytes where its codecs fix {sizes[s]}")
    return {s: message[head:] for s, message in messages.items()}
