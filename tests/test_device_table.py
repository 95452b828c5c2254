"""A frame's pieces by table (mpigrad/codecs/device/table.py): three launches encode a frame
of uniform (any bits, buckets, rounding), sign, TernGrad, QSGD, float32 and fp16 pieces into
the per-piece twins' bytes (the host codecs' where scales come from ranges), whatever the
number of pieces; two decode one, writing or adding, with the host's values; a corrupted
scale, a code the format forbids or a NaN is flagged as the per-piece twins flag it."""

from __future__ import annotations

import numpy as np
import pytest

from mpigrad.codecs import HEADER_SIZE, get_codec
from mpigrad.codecs.base import header_bytes
from mpigrad.codecs.device import device_codec, load_cuda
from mpigrad.codecs.device import kernels as k
from mpigrad.counters import snapshot
from mpigrad.codecs.device.table import FrameTable, TableKernels

pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered in:RuntimeWarning")]

cuda = load_cuda()

#: A frame's pieces: (codec config, size). Sizes cross a full block of 4096 codes and a
#: tail, several buckets and chunks (k.CHUNK values), a bucket straddling blocks.
PIECES = [
    ({"id": "uniform", "bits": 3}, 4200),
    ({"id": "fp32"}, 37),
    ({"id": "uniform", "bits": 1, "bucket_size": 1000}, 2 * k.CHUNK + 5),
    ({"id": "uniform", "bits": 2, "rounding": "stochastic", "seed": 11, "bucket_size": 700}, 1500),
    ({"id": "uniform", "bits": 8, "bucket_size": 3000}, 8300),
    ({"id": "fp32"}, 1),
    ({"id": "uniform", "bits": 7, "rounding": "stochastic", "seed": 3}, 1),
    ({"id": "fp16"}, 3000),   # normal, subnormal and zero halves (the gradient's scales span e^-8..e^2)
    ({"id": "fp16"}, 1),
]


#: Sign, TernGrad and QSGD pieces beside uniform and float32 ones: scales from sums (sign's
#: mean |x|, TernGrad's clip, QSGD's l2 norm) and from ranges (unclipped TernGrad, QSGD's
#: max norm), buckets of several chunks, tails, a bucket straddling a block's end.
SCALED = [
    ({"id": "sign", "bucket_size": 1000}, 2 * k.CHUNK + 5),
    ({"id": "terngrad", "seed": 9}, 1300),                                   # clip 2.5
    ({"id": "uniform", "bits": 3, "bucket_size": 300}, 700),
    ({"id": "terngrad", "clip": 0, "bucket_size": 700, "seed": 2}, 1500),
    ({"id": "qsgd", "bits": 3, "norm": "l2", "bucket_size": 2000, "seed": 4}, 4500),  # a full block
    ({"id": "fp32"}, 7),
    ({"id": "qsgd", "bits": 4, "seed": 5}, 37),                              # max norm
    ({"id": "qsgd", "levels": 5, "bucket_size": 1000, "seed": 6}, 2 * k.CHUNK + 1),
    ({"id": "sign"}, 1),
]
#: The pieces whose device frames are the host's bit for bit (scales from ranges, or none).
EXACT = [config["id"] in ("uniform", "fp32") or config.get("norm") == "max" or config.get("clip") == 0
         or (config["id"] == "qsgd" and "norm" not in config) for config, _ in SCALED]


def gradient(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-8, 2, n))).astype(np.float32)
    x[::97] = 0.0
    return x


def layout(pieces):
    """The codecs, the pieces' offsets in the flat values and their frame positions."""
    codecs = [get_codec(config) for config, _ in pieces]
    offsets = np.concatenate(([0], np.cumsum([n for _, n in pieces])))
    return codecs, offsets


def host_frames(codecs, offsets, x) -> list[np.ndarray]:
    """Each piece's host frame."""
    return [codec.encode(x[offsets[i]:offsets[i + 1]]) for i, codec in enumerate(codecs)]


def host_frame(codecs, offsets, x) -> np.ndarray:
    """The pieces' host frames one after another (as a compressor lays them out)."""
    return np.concatenate(host_frames(codecs, offsets, x))


def table_encode(codecs, offsets, x):
    """The frame by table, its launches and its headers."""
    twins = [device_codec(codec) for codec in codecs]
    table, pos, headers = FrameTable(encode=True), 0, []
    for i, twin in enumerate(twins):
        header = table.add_encode(twin, int(offsets[i]), int(offsets[i + 1] - offsets[i]), pos + HEADER_SIZE)
        headers.append((pos, header))
        pos += HEADER_SIZE + header.payload_len
    out = cuda.device_array(pos, np.uint8)
    status = cuda.to_device(np.zeros(k.STATUS_SLOTS, np.int32))
    before = snapshot()
    TableKernels(cuda, cuda.default_stream).encode(table, cuda.to_device(table.array()), cuda.to_device(x), out,
                                                   status)
    launches = (snapshot() - before).launches
    frame = out.copy_to_host()
    for start, header in headers:
        frame[start:start + HEADER_SIZE] = header_bytes(header)
    return frame, launches, status.copy_to_host()


def test_a_frame_by_table_is_the_host_codecs_frames_in_three_launches():
    codecs, offsets = layout(PIECES)
    host = [get_codec(config) for config, _ in PIECES]
    x = gradient(int(offsets[-1]), 0)
    expected = host_frame(host, offsets, x)
    frame, launches, status = table_encode(codecs, offsets, x)
    assert not status.any()
    assert frame.tobytes() == expected.tobytes()
    assert launches == 3
    # The stochastic codecs drew their next stream, as the host's: the next frame too.
    expected, (frame, _, _) = host_frame(host, offsets, x), table_encode(codecs, offsets, x)
    assert frame.tobytes() == expected.tobytes()


#: Many small pieces (a block's tail each): the launches do not grow with their number.
MANY = [({"id": "uniform", "bits": 1 + i % 8, **({"bucket_size": 64 * (i % 3)} if i % 3 else {})}, 40 + 13 * i)
        for i in range(12)] + [({"id": "fp32"}, 5)]


def test_one_piece_and_many_pieces_take_the_same_launches():
    for pieces in (PIECES[:1], MANY):
        codecs, offsets = layout(pieces)
        x = gradient(int(offsets[-1]), 1)
        expected = host_frame([get_codec(config) for config, _ in pieces], offsets, x)
        frame, launches, _ = table_encode(codecs, offsets, x)
        assert frame.tobytes() == expected.tobytes() and launches == 3


def table_decode(codecs, offsets, pieces, start, accumulate):
    """``pieces`` (each piece's frame) decoded by table from their concatenation."""
    twins = [device_codec(codec) for codec in codecs]
    table, pos = FrameTable(encode=False), 0
    for i, (twin, piece) in enumerate(zip(twins, pieces)):
        table.add_decode(twin, twin.check(piece), int(offsets[i]), pos + HEADER_SIZE)
        pos += piece.size
    frame = np.concatenate(pieces)
    out = cuda.to_device(start)
    status = cuda.to_device(np.zeros(k.STATUS_SLOTS, np.int32))
    before = snapshot()
    TableKernels(cuda, cuda.default_stream).decode(table, cuda.to_device(table.array()), cuda.to_device(frame),
                                                   out, accumulate, status)
    return out.copy_to_host(), (snapshot() - before).launches, status.copy_to_host()


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("kinds", ["uniform and float", "sign, terngrad and qsgd"])
def test_a_frame_decodes_by_table_into_the_host_values_in_two_launches(kinds, accumulate):
    codecs, offsets = layout(PIECES if kinds == "uniform and float" else SCALED)
    x = gradient(int(offsets[-1]), 2)
    pieces = host_frames(codecs, offsets, x)
    start = gradient(x.size, 3)
    expected = start.copy()
    for i, (codec, piece) in enumerate(zip(codecs, pieces)):
        codec.decode(piece, out=expected[offsets[i]:offsets[i + 1]], accumulate=accumulate)
    values, launches, status = table_decode(codecs, offsets, pieces, start, accumulate)
    assert not status.any() and launches == 2
    assert values.tobytes() == expected.tobytes()


def test_a_nan_and_a_corrupted_pair_are_flagged():
    codecs, offsets = layout(PIECES[:3])
    x = gradient(int(offsets[-1]), 4)
    x[offsets[2] + 5] = np.nan
    _, _, status = table_encode(codecs, offsets, x)
    assert status[k.ERR_NONFINITE] == 1
    x[offsets[2] + 5] = 1.0
    x[offsets[1]] = np.inf  # a float32 piece's
    _, _, status = table_encode(codecs, offsets, x)
    assert status[k.ERR_NONFINITE] == 1
    pieces = host_frames(codecs, offsets, gradient(int(offsets[-1]), 5))
    pieces[2][HEADER_SIZE + 4:HEADER_SIZE + 8] = np.array([-1e30], np.float32).view(np.uint8)  # hi below lo
    _, _, status = table_decode(codecs, offsets, pieces, np.zeros(x.size, np.float32), False)
    assert status[k.ERR_BAD_SCALE] == 1


def test_a_half_beyond_its_range_is_flagged_as_the_per_piece_kernel_flags_it():
    pieces = [({"id": "fp16"}, 40), ({"id": "fp32"}, 3)]
    codecs, offsets = layout(pieces)
    x = gradient(int(offsets[-1]), 6)
    x[7] = 7e4  # beyond +-65504: a range error, not a non-finite one
    _, _, status = table_encode(codecs, offsets, x)
    assert status[k.ERR_RANGE] == 1 and status[k.ERR_NONFINITE] == 0
    x[7] = -np.inf
    _, _, status = table_encode(codecs, offsets, x)
    assert status[k.ERR_RANGE] == 1 and status[k.ERR_NONFINITE] == 1


def test_a_frame_of_float_pieces_takes_one_launch_each_way():
    pieces = [({"id": "fp16"}, 700), ({"id": "fp32"}, 9), ({"id": "fp16"}, 5)]
    codecs, offsets = layout(pieces)
    x = gradient(int(offsets[-1]), 7)
    frame, launches, status = table_encode(codecs, offsets, x)
    assert frame.tobytes() == host_frame(codecs, offsets, x).tobytes() and launches == 1 and not status.any()
    values, launches, status = table_decode(codecs, offsets, host_frames(codecs, offsets, x),
                                            np.zeros(x.size, np.float32), False)
    expected = np.concatenate([codec.decode(piece) for codec, piece in zip(codecs, host_frames(codecs, offsets, x))])
    assert values.tobytes() == expected.tobytes() and launches == 1 and not status.any()


@pytest.mark.skipif(not k.SIMULATOR, reason="calls a device function on the host: the simulator's")
def test_an_fp16_encodes_error_memory_widens_every_half_as_the_hosts_table():
    """``table_pack`` sets an fp16 piece's error memory from the half it stored, widened in the
    kernel (``_widen_half``): for every one of the 65536 halves, the host's float32, bit for bit."""
    from mpigrad.codecs.device.codecs import HALF_TO_FLOAT

    widened = np.array([k._widen_half.py_func(np.uint32(h)) for h in range(1 << 16)], np.float32)
    assert widened.view(np.int32).tobytes() == np.asarray(HALF_TO_FLOAT, np.float32).view(np.int32).tobytes()


def twin_frames(codecs, offsets, x) -> list[np.ndarray]:
    """Each piece's frame from its per-piece device twin."""
    frames = []
    for i, codec in enumerate(codecs):
        twin = device_codec(codec)
        out = cuda.device_array(twin.max_encoded_size(int(offsets[i + 1] - offsets[i])), np.uint8)
        size = twin.encode(cuda.to_device(x[offsets[i]:offsets[i + 1]]), out)
        frames.append(out.copy_to_host()[:size])
    return frames


def test_sign_terngrad_and_qsgd_pieces_by_table_are_their_twins_frames_in_three_launches():
    codecs, offsets = layout(SCALED)
    twins, host = [get_codec(config) for config, _ in SCALED], [get_codec(config) for config, _ in SCALED]
    for frame_number in range(2):  # the second frame: each stochastic piece's next stream
        x = gradient(int(offsets[-1]), 10 + frame_number)
        expected = twin_frames(twins, offsets, x)
        frame, launches, status = table_encode(codecs, offsets, x)
        assert not status.any() and launches == 3
        assert frame.tobytes() == np.concatenate(expected).tobytes()
        for i, (piece, theirs) in enumerate(zip(expected, host_frames(host, offsets, x))):
            if EXACT[i]:
                assert piece.tobytes() == theirs.tobytes(), SCALED[i]


@pytest.mark.parametrize("piece, damage, flag", [
    (1, "code", k.ERR_BAD_CODE),     # a TernGrad code 3
    (7, "code", k.ERR_BAD_CODE),     # a QSGD level above s = 5
    (0, "scale", k.ERR_BAD_SCALE),   # a negative sign scale
    (4, "scale", k.ERR_BAD_SCALE),   # a NaN QSGD scale
])
def test_a_code_or_scale_the_format_forbids_is_flagged_by_table(piece, damage, flag):
    codecs, offsets = layout(SCALED)
    pieces = host_frames(codecs, offsets, gradient(int(offsets[-1]), 14))
    frame = pieces[piece]
    if damage == "scale":
        frame[HEADER_SIZE:HEADER_SIZE + 4] = np.array([-1.0 if piece == 0 else np.nan], np.float32).view(np.uint8)
    else:  # the last byte of the codes (the tail's codes, MSB first): all ones
        frame[-1] = 0xFF
    _, _, status = table_decode(codecs, offsets, pieces, np.zeros(int(offsets[-1]), np.float32), False)
    assert status[flag] == 1
    assert status.sum() == 1
