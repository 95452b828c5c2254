"""The device path's compressor (runtime/exchange/device.py) against the host compressor: the same
frames from a gradient in (simulated) device memory, the same error memory, the same
decode-and-add, the same checkpoint state. In CI the kernels run in Numba's simulator over
CPU tensors (conftest); MPIGRAD_TEST_GPU=1 on a GPU machine runs them on CUDA tensors."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mpigrad.codecs import CodecError, get_codec
from mpigrad.codecs.device import kernels as k, load_cuda
from mpigrad.runtime.exchange.compressor import GradientCompressor
from mpigrad.runtime.exchange.device import DeviceGradientCompressor, device_path
from mpigrad.runtime.plan.layout import Layout, Segment, pieces_of, plan_shards
from mpigrad.runtime.wire.messages import FrameHeader
from mpigrad.feedback import ErrorFeedback, FeedbackError

pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")]

DEVICE = torch.device("cuda" if os.environ.get("MPIGRAD_TEST_GPU") == "1" else "cpu")
LAYOUT = Layout((Segment("conv", 0, 5000), Segment("fc", 5000, 4200)), Segment("small layers", 9200, 300), 9500)
#: A layout the simulator runs quickly, for the tests that count or record rather than cover sizes.
SMALL = Layout((Segment("conv", 0, 300), Segment("fc", 300, 200)), Segment("small layers", 500, 40), 540)


def compressors(config, feedback=None, servers=2, chunk=0, layout=LAYOUT):
    pieces = pieces_of(layout, chunk)
    shards = plan_shards(layout, servers, lambda p: p.size, chunk)
    seeds = {p.index: 100 + p.index for p in pieces if p.quantized}

    def make():  # feedback: "MODE" or "MODE@DECAY"
        mode, _, decay = (feedback or "").partition("@")
        memory = ErrorFeedback(mode=mode, decay=float(decay or 1)) if feedback else None
        return GradientCompressor(pieces, get_codec(config), seeds, memory)

    host, mirrored = make(), make()
    return host, DeviceGradientCompressor(mirrored, DEVICE), shards


def gradient(seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(LAYOUT.total) * 0.01).astype(np.float32)


@pytest.mark.parametrize("config, feedback", [
    ({"id": "uniform", "bits": 2, "bucket_size": 512}, None),
    ({"id": "uniform", "bits": 3, "rounding": "stochastic", "seed": 1}, "residual"),
    ({"id": "uniform", "bits": 2, "bucket_size": 300}, "accumulate@0.9"),   # by table, memory fused
    ({"id": "fp16"}, None),
    ({"id": "sign", "bucket_size": 1024}, "accumulate"),
    ({"id": "qsgd", "bits": 3, "bucket_size": 2048}, "residual"),
    ({"id": "fp16"}, "residual"),
    ({"id": "fp16"}, "residual@0.9"),
    ({"id": "fp16"}, "accumulate@0.9"),
    ({"id": "fp32"}, "accumulate"),
])
def test_device_frames_and_error_memory_follow_the_host_ones(config, feedback):
    host, device, shards = compressors(config, feedback)
    exact = config["id"] != "sign"
    for it in range(3):
        g = gradient(it)
        if config["id"] in ("fp16", "fp32"):  # values that code to 0 (fp16: below 2^-25), for ACCUMULATE's rule
            g[it::7] = 0.0
            g[it + 1::11] *= np.float32(1e-7)
        bits = [2 + it, 4]
        for shard in shards:
            ours = device.encode(torch.from_numpy(g).to(DEVICE), bits, shard).copy()
            theirs = host.encode(g, bits, shard)
            if exact:
                assert np.array_equal(ours, theirs), (it, shard.server)
            else:
                assert ours.size == theirs.size
    state, want = device.state_dict(), host.state_dict()
    assert state["calls"] == want["calls"]
    if feedback:
        for key, memory in want["feedback"]["memory"].items():
            if exact:  # bit for bit: -0.0 is not 0.0 here
                assert state["feedback"]["memory"][key].tobytes() == memory.tobytes(), key
            else:
                np.testing.assert_allclose(state["feedback"]["memory"][key], memory, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("config", [{"id": "uniform", "bits": 4, "bucket_size": 700}, {"id": "fp32"}])
def test_device_decode_adds_every_shard_as_the_host_does(config):
    host, device, shards = compressors(config, servers=2, chunk=3000)
    want = gradient(9)
    ours = torch.from_numpy(want.copy()).to(DEVICE)
    for seed, shard in enumerate(shards):
        frame = host.encode(gradient(seed), [3, 5], shard).copy()
        host.decode(frame, shard, want, accumulate=True)
        device.decode(frame, shard, ours, accumulate=True)
    assert np.array_equal(ours.cpu().numpy(), want)


def test_a_non_finite_gradient_is_refused_as_on_the_host():
    host, device, shards = compressors({"id": "uniform", "bits": 4})
    g = gradient(1)
    g[6000] = np.inf
    with pytest.raises(CodecError) as theirs:
        for shard in shards:
            host.encode(g, [4, 4], shard)
    with pytest.raises(CodecError) as ours:
        for shard in shards:
            device.encode(torch.from_numpy(g).to(DEVICE), [4, 4], shard)
    assert str(ours.value) == str(theirs.value)


def test_a_corrupt_frame_is_refused():
    host, device, shards = compressors({"id": "uniform", "bits": 4})
    frame = host.encode(gradient(2), [4, 4], shards[0]).copy()
    frame[-1] ^= 0xFF  # a code: decodes, but the payload has no CRC; the scales then
    out = torch.zeros(LAYOUT.total, device=DEVICE)
    device.decode(frame, shards[0], out)
    first = FrameHeader.size(len(shards[0].pieces)) + 40  # the first piece's first (lo, hi)
    frame[first:first + 4] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
    with pytest.raises(CodecError, match="corrupted payload"):
        device.decode(frame, shards[0], out)


def test_a_piece_whose_header_gives_another_length_is_refused_as_on_the_host():
    """The kernels write a header's n values where the piece has its own size: a frame whose
    piece encodes one value more (another layout's) is refused before any launch."""
    other = Layout((Segment("conv", 0, 5000), Segment("fc", 5000, 4201)), Segment("small layers", 9201, 299), 9500)
    sender, _, (shard,) = compressors({"id": "uniform", "bits": 4}, servers=1, layout=other)
    frame = sender.encode(gradient(3), [4, 4], shard).copy()
    host, device, (ours,) = compressors({"id": "uniform", "bits": 4}, servers=1)
    with pytest.raises(CodecError) as theirs:
        host.decode(frame, ours, gradient(0))
    out = torch.zeros(LAYOUT.total, device=DEVICE)
    with pytest.raises(CodecError) as mine:
        device.decode(frame, ours, out, accumulate=True)
    assert str(mine.value) == str(theirs.value) == "out= holds 4200 elements, buffer encodes 4201"
    assert not out.any()


def test_deferred_decodes_wait_for_nothing_and_their_status_is_read_once():
    """The runtime's compressors (``on_device``) share one status and leave their decodes'
    to ``check_decodes``, once per iteration: a decode then waits for nothing, takes staging
    buffers of its own until that read, and a corrupt frame is raised by the read (or by an
    encode's wait, if one comes first) in one line that says when it was decoded."""
    from mpigrad.counters import snapshot
    from mpigrad.runtime.exchange.device import DeviceStatus, check_decodes

    config = {"id": "uniform", "bits": 4}
    host, _, shards = compressors(config, layout=SMALL)
    status = DeviceStatus(load_cuda(), DEVICE)
    mirrored = GradientCompressor(host.pieces, get_codec(config), {p.index: 100 + p.index for p in host.pieces
                                                                  if p.quantized})
    device = DeviceGradientCompressor(mirrored, DEVICE, status, defer_decode_checks=True)
    replica = SimpleNamespace(device_status=status)
    frames = [host.encode(gradient(seed)[:SMALL.total].copy(), [4, 4], shards[0]).copy() for seed in (1, 2)]
    want = np.zeros(SMALL.total, np.float32)
    out = torch.zeros(SMALL.total, device=DEVICE)
    before = snapshot()
    for i, frame in enumerate(frames):
        host.decode(frame, shards[0], want, accumulate=i > 0)
        device.decode(frame, shards[0], out, accumulate=i > 0)
    decoded = snapshot() - before
    assert decoded.synchronizations == 0 and len(status.pending) == 2
    assert len(device._host_staging) == 2 and len(device._staging) == 1  # a pinned staging buffer per frame
    before = snapshot()
    check_decodes(replica)
    checked = snapshot() - before
    assert checked.sites == {"sync: decodes' status": 1} and not status.pending
    assert np.array_equal(out.cpu().numpy(), want)
    check_decodes(replica)                          # nothing queued since: no wait
    assert (snapshot() - before).synchronizations == 1
    device.decode(frames[0], shards[0], out)
    assert len(device._host_staging) == 2          # after the read, the staging is reused
    first = FrameHeader.size(len(shards[0].pieces)) + 40  # the first piece's first (lo, hi): a NaN scale
    corrupt = frames[1].copy()
    corrupt[first:first + 4] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
    device.decode(corrupt, shards[0], out)          # queued: no error yet
    with pytest.raises(CodecError, match=r"^a frame decoded on the device since its status was last read \(once per "
                                         r"iteration, so the sender is not known\) is corrupt: uniform: corrupted payload"):
        check_decodes(replica)
    device.decode(corrupt, shards[0], out)
    with pytest.raises(CodecError, match="^a frame decoded on the device since .* is corrupt: uniform: corrupted"):
        device.encode(torch.from_numpy(gradient(3)[:SMALL.total].copy()).to(DEVICE), [4, 4], shards[0])
    device.decode(frames[0], shards[0], out)        # the status was cleared after each error
    check_decodes(replica)


def test_a_frame_is_copied_to_the_device_from_where_it_lies_or_not_at_all():
    """The runtime's compressors share the replica's ``FrameMemory``: a frame received into
    its pinned receive buffers (``ReceiveBuffers``) goes to the device straight from there,
    with only its table staged; a frame one of them encoded is decoded from the encode's
    device buffer, only its table copied; either decodes as the host does. A receive buffer
    written again before the status read waits for its copy (one synchronisation, counted);
    after the read, nothing."""
    from mpigrad.counters import snapshot
    from mpigrad.runtime.exchange.device import DeviceStatus, FrameMemory, check_decodes
    from mpigrad.runtime.wire import FrameLength, ReceiveBuffers

    config = {"id": "uniform", "bits": 4}
    host, _, shards = compressors(config, layout=SMALL)
    status = DeviceStatus(load_cuda(), DEVICE)
    memory = FrameMemory(status)
    seeds = {p.index: 100 + p.index for p in host.pieces if p.quantized}
    encoder, decoder = (DeviceGradientCompressor(GradientCompressor(host.pieces, get_codec(config), seeds), DEVICE,
                                                 status, defer_decode_checks=True, frame_memory=memory)
                        for _ in range(2))
    replica = SimpleNamespace(device_status=status)
    g = gradient(4)[:SMALL.total].copy()
    own = encoder.encode(torch.from_numpy(g).to(DEVICE), [4, 4], shards[0])
    want = np.zeros(SMALL.total, np.float32)
    host.decode(own.copy(), shards[0], want)
    out = torch.zeros(SMALL.total, device=DEVICE)
    before = snapshot()
    decoder.decode(own, shards[0], out)             # read where the encode left it
    resident = snapshot() - before
    check_decodes(replica)
    assert np.array_equal(out.cpu().numpy(), want)
    table_bytes = resident.bytes_to_device
    assert 0 < table_bytes < own.size and resident.synchronizations == 0

    buffers = ReceiveBuffers([1], memory)
    message = buffers.take(1, FrameLength.NBYTES + own.size)  # a broadcast's: the length, then the frame
    message[FrameLength.NBYTES:] = own
    frame = message[FrameLength.NBYTES:]
    out.zero_()
    before = snapshot()
    decoder.decode(frame, shards[0], out)           # copied from the receive buffer, 8 bytes in
    received = snapshot() - before
    assert received.bytes_to_device == own.size + table_bytes and received.synchronizations == 0
    check_decodes(replica)
    assert np.array_equal(out.cpu().numpy(), want)
    out.zero_()
    decoder.decode(frame, shards[0], out)           # again, its copy not yet covered by a read
    assert all(pinned.numel() == table_bytes for pinned in decoder._host_staging.values())  # the tables alone
    before = snapshot()
    buffers.take(1, 10)                             # written again before the status read: waits
    assert (snapshot() - before).sites == {"sync: receive buffer reused before the status read": 1}
    received_again(buffers, own, decoder, shards[0], out)
    check_decodes(replica)
    before = snapshot()
    buffers.take(1, 10)                             # after the read: free
    assert (snapshot() - before).synchronizations == 0
    if DEVICE.type != "cuda":  # an event not yet reached is what the wait waits for
        received_again(buffers, own, decoder, shards[0], out)
        located, _ = memory.locate(buffers[1][:own.size])
        assert located.event is None
        located.event = event = _Unfinished()
        buffers.take(1, 10)
        assert event.done
    check_decodes(replica)
    assert np.array_equal(out.cpu().numpy(), want)


def received_again(buffers, frame, decoder, shard, out) -> None:
    view = buffers.take(1, frame.size)
    view[:] = frame
    decoder.decode(view, shard, out)


def test_codecs_without_kernels_keep_the_host_path():
    pieces = pieces_of(LAYOUT)
    host = GradientCompressor(pieces, get_codec({"id": "mcgq"}), {p.index: 1 for p in pieces})
    with pytest.raises(CodecError, match="codec 'mcgq' has no GPU kernels"):
        DeviceGradientCompressor(host, DEVICE)
    assert not device_path(torch.device("cpu"))  # the simulator path is asked for by name only


def test_checkpoint_state_round_trips():
    config = {"id": "uniform", "bits": 3, "rounding": "stochastic", "bucket_size": 64}
    host, device, shards = compressors(config, "residual", layout=SMALL)
    for shard in shards:
        device.encode(torch.from_numpy(gradient(3)[:SMALL.total]).to(DEVICE), [3, 3], shard)
    state = device.state_dict()
    _, other, _ = compressors(config, "residual", layout=SMALL)
    other.load_state_dict(state)
    g = torch.from_numpy(gradient(4)[:SMALL.total]).to(DEVICE)
    for shard in shards:
        assert np.array_equal(other.encode(g, [3, 3], shard).copy(), device.encode(g, [3, 3], shard))
    # The state is the host memory's (the keys encoded so far), and one that does not fit the
    # layout's pieces is refused, not copied into the flat memory.
    assert state["feedback"]["memory"].keys() == host_state_keys(shards)
    key = next(iter(state["feedback"]["memory"]))
    state["feedback"]["memory"][key] = state["feedback"]["memory"][key][:-1]
    with pytest.raises(FeedbackError, match=f"error feedback memory {key!r}: not a quantized piece of this layout"):
        other.load_state_dict(state)


def host_state_keys(shards) -> set:
    """The error memory's keys after one encode of every shard: the quantized pieces'."""
    return {piece.index for shard in shards for piece in shard.pieces if piece.quantized}


def test_a_gpu_run_without_a_working_numba_cuda_is_refused_not_run_on_the_host(monkeypatch):
    """Every codec has kernels but numba-cuda fails: one line naming the extra and the way
    to the host path, not a silent fall-back many times slower; a codec without kernels
    keeps the host path without asking numba-cuda at all."""
    from types import SimpleNamespace

    import mpigrad.runtime.exchange.device as device_module
    from mpigrad.codecs.device import DeviceUnavailable

    def broken():
        raise DeviceUnavailable('the GPU codecs need numba-cuda (pip install -e ".[cuda]"); importing it failed: '
                                "AttributeError: module 'numpy' has no attribute 'row_stack'")

    monkeypatch.setenv("MPIGRAD_DEVICE_CODECS", "simulator")
    monkeypatch.setattr(device_module, "load_cuda", broken)
    replica = SimpleNamespace(device=DEVICE)  # the simulator asked for on the CPU; on a GPU its own path
    pieces = pieces_of(LAYOUT)
    uniform = GradientCompressor(pieces, get_codec({"id": "uniform", "bits": 4}), {p.index: 1 for p in pieces})
    with pytest.raises(DeviceUnavailable) as exc:
        device_module.on_device(replica, uniform)
    text = str(exc.value)
    assert 'pip install -e ".[cuda]"' in text and "MPIGRAD_DEVICE_CODECS=host" in text and "\n" not in text
    mcgq = GradientCompressor(pieces, get_codec({"id": "mcgq"}), {p.index: 1 for p in pieces})
    assert device_module.on_device(replica, mcgq) == [mcgq]


def test_what_a_frame_asks_of_the_host_is_counted():
    """The device path's launches, synchronisations and copies, counted at their call sites
    (mpigrad/counters.py): the same under the simulator as on a GPU, so these
    counts are the path's budget; a change that adds a launch or a synchronisation fails here
    (issue 46's figures: 3 synchronisations per frame each way at first, launches per piece;
    now one: the frame's bytes and its status copied asynchronously, waited for together; and
    a frame of uniform pieces, error memory and all, takes 3 launches to encode and 2 to
    decode, by table, whatever its pieces; 23 and 7 for this frame before)."""
    from mpigrad.counters import snapshot

    host, device, shards = compressors({"id": "uniform", "bits": 2, "bucket_size": 64}, "residual", servers=1,
                                       layout=SMALL)
    shard, = shards
    assert [(p.quantized, p.size) for p in shard.pieces] == [(True, 300), (True, 200), (False, 40)]
    g = torch.from_numpy(gradient(1)[:SMALL.total]).to(DEVICE)
    before = snapshot()
    device.encode(g, [2, 2], shard)           # the first encode allocates and builds the table
    first = snapshot() - before
    before = snapshot()
    frame = device.encode(g, [2, 2], shard).copy()
    encoded = snapshot() - before
    # The ranges' chunks (g compensated with the error memory on the way), the ranges into the
    # frame, every piece's codes (and the memory of what they coded): 3, for any pieces.
    assert encoded.sites == {"launch: numba": 3, "sync: frame and status": 1}, encoded.sites
    status = 4 * 4                     # the status slots, read once per frame (cleared only after a flag)
    # The table, copied to the device once: each piece's first thread (and the end), a row
    # per piece, per bucket (5 + 4 of 64) and per chunk (one per bucket), int64.
    pieces = 8 * k.PIECE_COLUMNS * 3
    table = 8 * (3 + 1) + pieces + 8 * k.BUCKET_COLUMNS * (5 + 4)
    chunks = 8 * k.CHUNK_COLUMNS * (5 + 4)
    assert first.bytes_to_device == table + chunks
    # Built once per shard and bits: at the same bits, deterministic rounding changes no byte
    # of it, so the next frames copy none (stochastic rounding: the piece rows, their keys).
    assert encoded.bytes_to_host == frame.size + status and encoded.bytes_to_device == 0
    out = torch.zeros(SMALL.total, device=DEVICE)
    before = snapshot()
    device.decode(frame, shard, out, accumulate=True)
    decoded = snapshot() - before
    assert decoded.synchronizations == decoded.sites["sync: frame and status"] == 1, decoded.sites
    # The frame and, after it (8-byte aligned), its table, in one copy.
    assert decoded.bytes_to_device == -(-frame.size // 8) * 8 + table and decoded.bytes_to_host == status
    assert decoded.launches == decoded.sites["launch: numba"] == 2   # every pair, then every piece's values
    assert "launches" in decoded.describe() and "to the device" in decoded.describe()
    _, device, (shard,) = compressors({"id": "uniform", "bits": 2, "bucket_size": 64, "rounding": "stochastic",
                                       "seed": 3}, "residual", servers=1, layout=SMALL)
    for bits, copied in (([2, 2], table + chunks), ([2, 2], pieces), ([3, 2], table + chunks),
                         ([2, 2], table + chunks), ([2, 2], pieces)):
        before = snapshot()
        device.encode(g, bits, shard)
        assert (snapshot() - before).bytes_to_device == copied, bits   # other bits: the whole table again
    # Sign with error feedback, by table too: its sums, the scales, the codes and the memory.
    _, device, (shard,) = compressors({"id": "sign", "bucket_size": 512}, "residual", servers=1, layout=SMALL)
    device.encode(g, [1, 1], shard)
    before = snapshot()
    device.encode(g, [1, 1], shard)
    encoded = snapshot() - before
    assert encoded.sites == {"launch: numba": 3, "sync: frame and status": 1}, encoded.sites
    # fp16 with error feedback, by table too: one launch (its pieces compensated, narrowed and
    # remembered in it), where it took per quantized piece its half store, the decode the
    # error memory needed and the memory's two torch operations (9 launches for this frame).
    _, device, (shard,) = compressors({"id": "fp16"}, "residual", servers=1, layout=SMALL)
    device.encode(g, [1, 1], shard)
    before = snapshot()
    device.encode(g, [1, 1], shard)
    encoded = snapshot() - before
    assert encoded.sites == {"launch: numba": 1, "sync: frame and status": 1}, encoded.sites


@pytest.mark.parametrize("config, feedback, launches", [
    ({"id": "uniform", "bits": 2}, ErrorFeedback("residual"), (3, 2)),
    ({"id": "sign"}, ErrorFeedback("residual"), (3, 2)),
    ({"id": "terngrad"}, None, (3, 2)),
    ({"id": "qsgd", "bits": 2}, None, (3, 2)),
    ({"id": "fp16"}, None, (1, 1)),   # float pieces only: one pass each way (DDP's fp16 hook's peer)
    ({"id": "fp16"}, ErrorFeedback("residual"), (1, 1)),
])
def test_resnet18s_frames_take_at_most_4_launches_each_way(monkeypatch, config, feedback, launches):
    """Issue 46's launch goal, counted on ResNet-18's own layout (min_quantize_size 1000, P = 2
    colocated, ``--shard-chunk auto``: 11.2 M values, 21 quantized layers cut into pieces),
    uniform 2-bit or sign with error feedback, TernGrad or QSGD: every frame of a worker's
    gradient is encoded in 3 launches and decoded in 2; fp16 in 1 and 1, where it took a
    launch per piece each way
    (launches counted, kernels not run: the simulator would take hours over 11 M values; the
    frames' bytes are the small layouts' tests')."""
    from mpigrad.codecs.device import codecs as device_codecs
    from mpigrad.counters import launched, snapshot
    from mpigrad.models import build_model
    from mpigrad.runtime.exchange.build import piece_bytes
    from mpigrad.runtime.plan.layout import resolve_chunks
    from mpigrad.runtime.exchange.replica import Replica

    monkeypatch.setattr(device_codecs, "launch_kernel", lambda kernel, *_: launched(kernel=kernel.py_func.__name__))
    layout = Replica(build_model("resnet18", input_shape=(3, 32, 32), num_classes=10, seed=0), 1000,
                     torch.device("cpu")).layout
    assert len(layout.quantized) == 21 and layout.total > 11_000_000
    codec = get_codec(config)
    chunks = resolve_chunks("auto", layout, 2)
    pieces, shards = pieces_of(layout, chunks), plan_shards(layout, 2, piece_bytes(codec), chunks)
    assert len([p for p in pieces if p.quantized]) > 21      # auto cut the large layers into pieces
    compressor = GradientCompressor(pieces, codec, {p.index: p.index for p in pieces if p.quantized}, feedback)
    device = DeviceGradientCompressor(compressor, DEVICE)
    g = torch.zeros(layout.total, device=DEVICE)
    bits = [2] * len(layout.quantized)
    for shard in shards:
        before = snapshot()
        frame = device.encode(g, bits, shard).copy()
        encoded = snapshot() - before
        before = snapshot()
        device.decode(frame, shard, g, accumulate=True)
        decoded = snapshot() - before
        assert (encoded.launches, decoded.launches) == launches, (len(shard.pieces), encoded.sites, decoded.sites)


def test_the_device_warm_up_launches_every_kernel_a_run_then_uses():
    """``warmup.warm_up_device`` launches the run's codecs' kernels before iteration 0 (on a
    GPU, where Numba compiles them); a compressor over a layout's pieces then launches none
    that it missed, and ``late_device_kernels`` names one that it did."""
    from mpigrad.counters import launched
    from mpigrad.runtime.exchange import warmup

    config = {"id": "uniform", "bits": 3, "rounding": "stochastic", "seed": 1}
    assert warmup.warm_up_device([get_codec(config), get_codec({"id": "fp32"})], DEVICE) > 0
    _, device, shards = compressors(config, "residual")
    out = torch.zeros(LAYOUT.total, dtype=torch.float32, device=DEVICE)
    for shard in shards:
        frame = device.encode(torch.from_numpy(gradient(0)).to(DEVICE), [2, 3], shard).copy()
        device.decode(frame, shard, out, accumulate=True)
    assert warmup.late_device_kernels() == []
    launched(kernel="a_kernel_the_warm_up_missed")
    assert warmup.late_device_kernels() == ["a_kernel_the_warm_up_missed"]


def test_the_energies_of_a_shards_pieces_are_read_with_one_synchronisation():
    """A shard cut into many pieces (``--shard-chunk auto``) reads its per-layer ||g||^2 with
    one synchronisation on the device path, and gets the host path's floats."""
    from types import SimpleNamespace

    from mpigrad.counters import snapshot
    from mpigrad.runtime.exchange.aggregator import ShardAggregator

    quantized = [p for p in pieces_of(LAYOUT, 1000) if p.quantized]
    shard = SimpleNamespace(quantized=quantized)
    g = gradient(3)
    want = ShardAggregator.update_energies(shard, g, 2)
    before = snapshot()
    got = ShardAggregator.update_energies(shard, torch.from_numpy(g.copy()).to(DEVICE), 2)
    spent = snapshot() - before
    assert len(quantized) == 10 and spent.synchronizations == 1 and spent.launches == 11
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert all(value > 0 for value in got)
    # Both energies of a serving worker's report: no synchronisation of their own, read
    # after the wait given (the iteration's one read of the device status), the same floats.
    shard.grad_sum = torch.from_numpy(gradient(4)).to(DEVICE)
    waits = []
    before = snapshot()
    pair = ShardAggregator.energy_pair(shard, torch.from_numpy(g.copy()).to(DEVICE), 2, lambda: waits.append(1))
    spent = snapshot() - before
    assert waits == [1] and spent.synchronizations == 0 and spent.launches == 2 * 10 + 2
    assert pair == (ShardAggregator.update_energies(shard, shard.grad_sum, 2), got)


def _record_streams(monkeypatch) -> list:
    """(what, stream) of every simulated kernel launch and device array copy from now on."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    seen = []
    launch = FakeCUDAKernel.__getitem__

    def configured(self, configuration):
        seen.append((self.fn.__name__, configuration[2] if len(configuration) > 2 else "none given"))
        return launch(self, configuration)

    monkeypatch.setattr(FakeCUDAKernel, "__getitem__", configured)
    for name in ("copy_to_device", "copy_to_host"):
        def copy(self, *args, stream=0, _name=name, _copy=getattr(FakeCUDAArray, name)):
            seen.append((_name, stream))
            return _copy(self, *args, stream=stream)

        monkeypatch.setattr(FakeCUDAArray, name, copy)
    return seen


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the simulator's streams (a GPU: the cuda-marked test below)")
def test_every_launch_and_copy_goes_on_the_stream_current_at_the_call(monkeypatch):
    """Kernels and copies follow the stream the caller made current, switched between calls
    after the compressor (and its codecs' twins) was built: none keeps one from construction."""
    from numba import cuda

    from mpigrad.runtime.exchange.device import simulated_stream

    small = SMALL
    host, device, shards = compressors({"id": "uniform", "bits": 3, "rounding": "stochastic", "seed": 1},
                                       "residual", layout=small)
    g = torch.from_numpy(gradient(1)[:small.total].copy())
    device.encode(g, [3, 3], shards[0])  # twins built on the default stream
    seen = _record_streams(monkeypatch)
    out = torch.zeros(small.total)
    for stream in (cuda.stream(), cuda.stream()):
        seen.clear()
        with simulated_stream(stream):
            frames = [device.encode(g, [3, 4], shard).copy() for shard in shards]
            for shard, frame in zip(shards, frames):
                device.decode(frame, shard, out, accumulate=True)
            first = FrameHeader.size(len(shards[0].pieces)) + 40  # a NaN scale: the status is cleared after it
            frames[0][first:first + 4] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
            with pytest.raises(CodecError, match="corrupted payload"):
                device.decode(frames[0], shards[0], out)
        kernels = {what for what, _ in seen if not what.startswith("copy_")}
        assert kernels and {"copy_to_device", "copy_to_host"} <= {what for what, _ in seen}
        wrong = [(what, s) for what, s in seen if s is not stream]
        assert not wrong, f"on another stream than the current one: {wrong[:5]}"
    with pytest.raises(RuntimeError, match="simulated_stream is the simulator's"):
        monkeypatch.setattr("mpigrad.runtime.exchange.device_stream.simulated", lambda: False)
        with simulated_stream(cuda.stream()):
            pass


@pytest.mark.cuda
def test_the_device_path_follows_a_side_stream_behind_a_long_kernel():
    """On a GPU: a side stream made current, a long kernel on it, then the gradient written
    on it. Kernels launched on any other stream would read the gradient before it is there:
    the frames would differ from those of the same path run on the default stream after a
    full synchronisation (the reference: so that the test is about the streams, not about
    the device's floats against the host's); and the decode-and-add, read back on the side
    stream, would miss the sums."""
    config = {"id": "uniform", "bits": 4, "bucket_size": 512}
    _, device, shards = compressors(config, "residual")
    _, host, _ = compressors(config, "residual")  # the reference: a device compressor, on the default stream
    side = torch.cuda.Stream()
    g = gradient(3)
    target = torch.zeros(LAYOUT.total, device=DEVICE)
    source = torch.from_numpy(g).to(DEVICE)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of spinning on the side stream
        target.copy_(source)
        frames = [device.encode(target, [4, 4], shard).copy() for shard in shards]
        out = torch.zeros(LAYOUT.total, device=DEVICE)
        torch.cuda._sleep(200_000_000)
        for shard, frame in zip(shards, frames):
            device.decode(frame, shard, out, accumulate=True)
        decoded = out.cpu().numpy()
    torch.cuda.synchronize()
    reference = torch.from_numpy(g).to(DEVICE)
    for shard, frame in zip(shards, frames):
        assert np.array_equal(frame, host.encode(reference, [4, 4], shard)), shard.server
    want = torch.zeros(LAYOUT.total, device=DEVICE)
    for shard, frame in zip(shards, frames):
        host.decode(frame, shard, want, accumulate=True)
    assert np.array_equal(decoded, want.cpu().numpy())


def test_a_workers_frames_for_every_shard_wait_for_the_device_once():
    """``encode_shards``: every shard's frame of one gradient queued, then one wait; the frames,
    the RNG draws and the error memory are those of one encode per shard (the host's)."""
    from mpigrad.counters import snapshot

    config = {"id": "uniform", "bits": 3, "rounding": "stochastic", "seed": 1}
    host, device, shards = compressors(config, "residual", layout=SMALL)
    assert len(shards) == 2
    for it in range(2):
        g = gradient(it)[:SMALL.total].copy()
        before = snapshot()
        frames = [frame.copy() for frame in device.encode_shards(torch.from_numpy(g).to(DEVICE), [3, 2], shards)]
        counted = snapshot() - before
        assert counted.synchronizations == counted.sites["sync: frame and status"] == 1, counted.sites
        want = host.encode_shards(g, [3, 2], shards)
        assert all(np.array_equal(ours, theirs) for ours, theirs in zip(frames, want)), it
    assert device.state_dict()["calls"] == host.state_dict()["calls"]


class _Unfinished:
    """A CUDA event the device has not reached yet, until it is waited for."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_queued_frames_are_the_encodes_and_ask_no_wait_until_taken():
    """``queue_shards`` (a pipelined backward's hooks): the frames, RNG draws and error memory
    of ``encode_shards``, with no synchronisation when queued; taken before the device is
    done they are refused, ``wait`` is the one synchronisation, and a non-finite gradient's
    flag comes out of ``frames()`` as the encode's CodecError."""
    from mpigrad.counters import snapshot

    config = {"id": "uniform", "bits": 3, "rounding": "stochastic", "seed": 1}
    host, device, shards = compressors(config, "residual", layout=SMALL)
    for it in range(2):
        g = gradient(it)[:SMALL.total].copy()
        before = snapshot()
        queued = device.queue_shards(torch.from_numpy(g).to(DEVICE), [3, 2], shards)
        assert (snapshot() - before).synchronizations == 0
        if DEVICE.type != "cuda":  # the simulator ran them at the call: an event not yet reached
            assert queued.event is None and queued.ready()
            queued.event = _Unfinished()
        with pytest.raises(RuntimeError, match="before the device did them"):
            queued.frames()
        before = snapshot()
        queued.wait()
        queued.wait()  # done: no second wait
        counted = snapshot() - before
        assert counted.synchronizations == counted.sites["sync: frames after backward"] == 1, counted.sites
        frames = [frame.copy() for frame in queued.frames()]
        want = host.encode_shards(g, [3, 2], shards)
        assert all(np.array_equal(ours, theirs) for ours, theirs in zip(frames, want)), it
    assert device.state_dict()["calls"] == host.state_dict()["calls"]
    g = gradient(5)[:SMALL.total].copy()
    g[310] = np.nan
    queued = device.queue_shards(torch.from_numpy(g).to(DEVICE), [3, 2], shards)
    queued.wait()
    with pytest.raises(CodecError) as ours:
        queued.frames()
    with pytest.raises(CodecError) as theirs:
        host.encode_shards(g, [3, 2], shards)
    assert str(ours.value) == str(theirs.value)
    assert not device.status.slots.copy_to_host().any()  # cleared with the error, as a wait clears them


def test_a_flag_of_one_queued_bucket_is_not_blamed_on_the_next():
    """Two buckets queued before either is taken (a pipelined backward's hooks, on a GPU): the
    first's NaN comes out of its own ``frames()``, and the second, finite, gives its frames,
    the host's (each queued read clears the slots behind it)."""
    config = {"id": "uniform", "bits": 3}
    host, device, shards = compressors(config, layout=SMALL)
    g = gradient(2)[:SMALL.total].copy()
    bad = g.copy()
    bad[[p.offset for p in shards[0].pieces if p.quantized][0]] = np.nan
    first = device.queue_shards(torch.from_numpy(bad).to(DEVICE), [3, 3], [shards[0]])
    second = device.queue_shards(torch.from_numpy(g).to(DEVICE), [3, 3], [shards[1]])
    first.wait()
    second.wait()
    with pytest.raises(CodecError, match="NaN or infinity"):
        first.frames()
    frame, = second.frames()
    assert np.array_equal(frame, host.encode(g, [3, 3], shards[1]))
