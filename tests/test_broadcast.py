"""The servers' broadcast (runtime/exchange/broadcast.py): one message per frame (its length, then the
frame, in one buffer) where every rank knows its size, the length first where the data sets
it. The bytes and results are those of the two-message protocol: tests/test_reference_traces.py
replays runs recorded before bit for bit, under mpiexec, as do the two-server tests of
tests/test_train_mpi.py and (MPICH and Open MPI) tests/test_checkpoint_mpi.py."""

from __future__ import annotations

import numpy as np
import pytest

from mpigrad.runtime.exchange.broadcast import broadcast_frames
from mpigrad.runtime.wire import FrameError, FrameLength, ReceiveBuffers
from mpigrad.runtime.wire.loopback import LoopbackChannel
from mpigrad.trace import load
from test_runtime_loopback import run


def _record_broadcasts(monkeypatch) -> dict[int, list]:
    """Every rank's broadcast calls, each as the kinds of its items: "length" (int64[1]),
    "message" (a length and the frame it announces, in one buffer), "frame" (uint8)."""
    calls: dict[int, list] = {}
    original = LoopbackChannel.broadcast

    def kind(buf):
        if buf.dtype == np.int64 and buf.size == 1:
            return "length"
        if buf.dtype != np.uint8:
            return "other"
        return "message" if buf.size > 8 and buf[:8].view(np.int64)[0] == buf.size - 8 else "frame"

    def broadcast(self, items, describe):
        result = original(self, items, describe)
        calls.setdefault(self.rank, []).append([kind(buf) for buf, _ in items])  # as received
        return result

    monkeypatch.setattr(LoopbackChannel, "broadcast", broadcast)
    return calls


@pytest.mark.parametrize("codec, options, per_iteration", [
    # Fixed-width codes: each server's length and frame in one message, one call per iteration.
    ("uniform", {"policy": "fixed", "bits": 3}, [["message", "message"]]),
    ("fp32", {"policy": "fixed"}, [["message", "message"]]),
    # Elias's stream: the lengths first, then the frames.
    ("qsgd", {"policy": "fixed", "bits": 4, "codec_opts": {"coding": "elias"}}, [["length", "length"], ["frame", "frame"]]),
])
def test_a_worker_takes_each_iteration_broadcast_in_as_few_messages_as_the_sizes_allow(tmp_path, monkeypatch, codec,
                                                                                      options, per_iteration):
    calls = _record_broadcasts(monkeypatch)
    code, errors, config = run(tmp_path, servers=2, workers=2, codec=codec, **options)
    assert code == 0 and not errors, errors
    worker = [kinds for kinds in calls[2] if kinds != ["other"]]  # less the Control (int64[3 + L])
    assert worker == per_iteration * config.iterations
    # The length still travels: the bytes broadcast are the frame's and its 8.
    tr = load(config.trace)
    assert (tr.servers.filter(like="bytes_out").to_numpy() > FrameLength.NBYTES).all()


def test_a_powersgd_worker_takes_each_round_in_one_message(tmp_path, monkeypatch):
    calls = _record_broadcasts(monkeypatch)
    code, errors, config = run(tmp_path, servers=2, workers=2, codec="powersgd", policy="fixed",
                               codec_opts={"rank": 2, "start": 2})
    assert code == 0 and not errors, errors
    worker = [kinds for kinds in calls[2] if kinds != ["other"]]
    assert worker == [["message", "message"]] * (2 + 2 * (config.iterations - 2))  # fp32 rounds, then P and Q


class _Wire:
    """A channel stand-in that delivers ``lengths`` into the length part of each message."""

    def __init__(self, lengths, known=()):
        self.lengths, self.known, self.calls = lengths, set(known), []

    def broadcast(self, items, describe):
        self.calls.append(items)
        for buf, s in items:
            if buf.dtype == np.int64:
                buf[0] = self.lengths[s]
            elif buf.size == 8 + self.lengths[s] or s in self.known:  # a message: its length first
                buf[:8].view(np.int64)[0] = self.lengths[s]


def test_a_length_that_differs_from_the_computed_size_is_a_frame_error():
    lengths = {0: FrameLength.buffer(), 1: FrameLength.buffer()}
    buffers = ReceiveBuffers([0, 1])
    frames = broadcast_frames(_Wire({0: 100, 1: 60}, known=[0]), [0, 1], [100, None], lengths, buffers, None,
                              lambda: "")
    assert [f.size for f in frames.values()] == [100, 60]  # server 1's size came first
    with pytest.raises(FrameError, match="server 0 announced a broadcast frame of 99 bytes where its codecs fix 100"):
        broadcast_frames(_Wire({0: 99, 1: 60}, known=[0]), [0, 1], [100, None], lengths, buffers, None, lambda: "")


def test_a_server_whose_frame_is_not_the_size_its_codecs_fix_stops_before_sending():
    wire = _Wire({})
    with pytest.raises(FrameError, match="server 1 encoded a frame of 10 bytes where its codecs fix 12"):
        broadcast_frames(wire, [1], {1: 12}, {1: FrameLength.buffer()}, ReceiveBuffers(), (1, np.zeros(8 + 10, np.uint8)), lambda: "")
    assert wire.calls == []
