"""``--codec powersgd --codec-opt factor_bits=B,rest_bits=B``: PowerSGD's factors, and the
layers it does not compress, through mpigrad's ``uniform`` (or ``fp16``) codec.

The options and their one-line refusals; the factor frames (sizes the layout predicts, a
frozen golden frame, a NumPy twin of the decode, a fuzzed decoder in a subprocess); the
error memory measured against what every rank applies; loopback runs (bytes, S = 2 and
colocated bit for bit; stop/resume is tests/test_powersgd.py's) and one real ``mpiexec``
run that trains.
"""

from __future__ import annotations

import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import fuzz_tally, run_mpi
from mpigrad.codecs import CodecError, get_codec
from mpigrad.runtime.exchange.lowrank import orthogonalize
from mpigrad.runtime.wire import FrameHeader, FrameLength
from mpigrad.trace import load
from test_powersgd import POWERSGD, paper_cnn_shapes
from test_runtime_loopback import run

FUZZ = Path(__file__).with_name("fuzz_lowrank.py")
Q8 = dict(POWERSGD, codec_opts={"rank": 2, "factor_bits": 8, "rest_bits": 8})


def uniform_bytes(n: int, bits: int) -> int:
    """One uniform buffer, one range: header, (lo, hi), the codes."""
    return 40 + 8 + (n * bits + 7) // 8


def expected_frames(shapes, rank, factor_bits, rest_bits):
    """(round-1 frame, round-2 frame) of a worker, in bytes, from the layout and the widths."""
    codec = get_codec({"id": "powersgd", "rank": rank})
    low = [codec.matrix_shape(s) for s in shapes if codec.compresses(s)]
    rest = sum(int(np.prod(s)) for s in shapes if not codec.compresses(s))
    size = {32: lambda n: 40 + 4 * n, 16: lambda n: 40 + 2 * n}.get
    factor = size(factor_bits) or (lambda n: uniform_bytes(n, factor_bits))
    rest_buf = size(rest_bits) or (lambda n: uniform_bytes(n, rest_bits))
    first = FrameHeader.size(len(low) + 1) + sum(factor(n * min(n, m, rank)) for n, m in low) + rest_buf(rest)
    second = FrameHeader.size(len(low)) + sum(factor(m * min(n, m, rank)) for n, m in low)
    return first, second, len(low)


# ---- the options ---------------------------------------------------------------------------
def test_widths_round_trip_and_pick_the_codecs():
    codec = get_codec({"id": "powersgd", "rank": 2, "factor_bits": 4, "rest_bits": 16})
    assert get_codec(codec.get_config()) == codec
    assert codec.factor_codec().get_config() == {"id": "uniform", "bits": 4, "rounding": "nearest", "bucket_size": None}
    assert codec.rest_codec().codec_id == "fp16" and codec.rest_memory and codec.fixed_bits == 4
    plain = get_codec({"id": "powersgd", "rank": 2})
    # float32 stays out of the config (traces of float32 factors read as before) and is the codec itself
    assert plain.get_config() == {"id": "powersgd", "rank": 2, "min_compression_rate": 2.0, "start": 0}
    assert plain.factor_codec() is plain and plain.rest_codec().codec_id == "fp32" and not plain.rest_memory


@pytest.mark.parametrize("name", ["factor_bits", "rest_bits"])
@pytest.mark.parametrize("value", [0, 9, 12, 33, "8", True, 8.0])
def test_a_bad_width_is_one_line(name, value):
    with pytest.raises(CodecError, match=f"powersgd: {name} must be") as info:
        get_codec({"id": "powersgd", name: value})
    assert "\n" not in str(info.value)


def test_the_help_lists_the_widths():
    done = subprocess.run([sys.executable, "-m", "mpigrad", "train", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert "factor_bits" in done.stdout and "rest_bits" in done.stdout


def test_the_trace_label_names_the_widths():
    from mpigrad.trace.reader import _method

    assert _method({"codec": {"id": "powersgd", "rank": 2}}) == "PowerSGD r2"
    assert _method({"codec": "powersgd", "codec_opts": {"rank": 2, "factor_bits": 8, "rest_bits": 8}}) == \
        "PowerSGD r2 (factors 8-bit, rest 8-bit)"


# ---- the frames ----------------------------------------------------------------------------
def lowrank_of(options: dict, worker: bool = True, fc_sizes=(64, 64)):
    from mpigrad.data import load_dataset
    from mpigrad.models import build_model
    from mpigrad.runtime.exchange.lowrank import LowRank
    from mpigrad.runtime.exchange.replica import Replica

    digits = load_dataset("digits", seed=5)
    codec = get_codec({"id": "powersgd", "rank": 2, **options})
    model = build_model("paper-cnn", input_shape=digits.input_shape, num_classes=digits.num_classes, seed=5,
                        fc_sizes=list(fc_sizes))
    layout = Replica(model, None, torch.device("cpu"), codec).layout
    return LowRank(model, layout, codec, seed=5, worker=worker), layout


def twin_uniform(x: np.ndarray, bits: int) -> np.ndarray:
    """NumPy twin of uniform's round-to-nearest decode(encode(x)), one range."""
    lo, hi = np.float32(x.min()), np.float32(x.max())
    if hi == lo:
        return x.copy()
    R = np.float32(2**bits - 1)
    q = np.rint((x - lo) * (R / (hi - lo)))
    return np.minimum(lo + q * ((hi - lo) / R), hi).astype(np.float32)


@pytest.mark.parametrize("factor_bits, rest_bits", [(8, 8), (4, 32), (2, 16), (32, 8)])
def test_frames_have_the_layouts_size_and_decode_to_the_quantized_factors(factor_bits, rest_bits):
    lowrank, layout = lowrank_of({"factor_bits": factor_bits, "rest_bits": rest_bits})
    shapes = paper_cnn_shapes()
    first, second, layers = expected_frames(shapes, 2, factor_bits, rest_bits)
    assert lowrank.frame_sizes([2] * layers) == ([first], [second])  # the policy's bits do not move them
    rng = np.random.default_rng(0)
    for compressor, shard, size, length in ((lowrank.compressor1, lowrank.round1, lowrank.p_size, first),
                                            (lowrank.compressor2, lowrank.round2, lowrank.q_size, second)):
        x = rng.standard_normal(size).astype(np.float32)
        frame = compressor.encode(x, [2] * layers, shard)
        assert frame.size == length
        out = np.full(size, np.nan, np.float32)
        compressor.decode(frame, shard, out)
        for piece in shard.pieces:
            part, got = x[piece.offset:piece.offset + piece.size], out[piece.offset:piece.offset + piece.size]
            bits = factor_bits if piece.quantized else rest_bits
            if bits == 32:
                np.testing.assert_array_equal(got, part)
            elif bits == 16:
                np.testing.assert_array_equal(got, part.astype(np.float16).astype(np.float32))
            else:
                np.testing.assert_allclose(got, twin_uniform(part, bits), rtol=0, atol=1e-6)
                step = (part.max() - part.min()) / (2**bits - 1)
                assert np.abs(got - part).max() <= step / 2 * (1 + 1e-5)


def test_the_factor_frame_is_frozen():
    """A round-1 frame of fixed input, 8-bit factors and rest: its bytes (CRC-32 of the
    frame less the encode-seconds field) are frozen; a change of the wire format shows here."""
    lowrank, _ = lowrank_of({"factor_bits": 8, "rest_bits": 8})
    x = ((np.arange(lowrank.p_size) * 7919) % 1000 - 500).astype(np.float32) * np.float32(1e-5)
    frame = lowrank.compressor1.encode(x, [0] * len(lowrank.layers), lowrank.round1).copy()
    frame[FrameHeader.ENCODE_SECONDS] = 0
    assert frame.size == expected_frames(paper_cnn_shapes(), 2, 8, 8)[0] == 1150
    assert zlib.crc32(frame.tobytes()) == 0xC60CBBBF


def test_mutated_factor_frames_only_raise_codec_or_frame_errors():
    tally = fuzz_tally(FUZZ, 20261124, 1200)
    assert {key.split(":")[0] for key in tally} == {"flip", "bytes", "truncate", "extend", "lengths", "swap"}
    assert sum(int(v) for k, v in tally.items() if k.endswith(":error")) > 300
    assert sum(int(v) for k, v in tally.items() if k.endswith(":ok")) > 50  # payload flips decode (no payload CRC)


# ---- the error memory ------------------------------------------------------------------------
def test_the_error_memory_is_measured_against_the_decoded_update():
    """One worker's iteration by hand (the server's average is its own factors): the update
    is the decoded P^ times the decoded Q^T, and e = M - update, rest layers included."""
    lowrank, layout = lowrank_of({"factor_bits": 4, "rest_bits": 8})
    server, _ = lowrank_of({"factor_bits": 4, "rest_bits": 8}, worker=False)
    grad = np.random.default_rng(1).standard_normal(layout.total).astype(np.float32)
    bits = [0] * len(lowrank.layers)

    def through_server(compressor, shard, vector, buf, transform=None):
        compressor.decode(compressor.encode(vector, bits, shard), shard, buf)  # up
        if transform:
            transform(buf)
        compressor.decode(compressor.encode(buf.copy(), bits, shard).copy(), shard, buf)  # down

    p_sent = lowrank.first_factors(grad).copy()
    through_server(server.compressor1, server.round1, p_sent, lowrank.p_buf, server.orthogonalizer(server.round1))
    p_hat = lowrank.p_buf.copy()
    through_server(server.compressor2, server.round2, lowrank.second_factors().copy(), lowrank.q_buf)
    update = np.zeros(layout.total, np.float32)
    lowrank.apply(update)
    for lay in lowrank.layers:
        p = torch.from_numpy(p_hat[lay.p_offset:lay.p_offset + lay.n * lay.r]).view(lay.n, lay.r)
        q = torch.from_numpy(lowrank.q_buf[lay.q_offset:lay.q_offset + lay.m * lay.r]).view(lay.m, lay.r)
        np.testing.assert_array_equal(update[lay.offset:lay.offset + lay.n * lay.m], (p @ q.t()).numpy().ravel())
    rest = slice(layout.rest.offset, layout.total)
    assert not np.array_equal(update[rest], grad[rest])  # 8-bit: the rest was quantized ...
    np.testing.assert_array_equal(lowrank.error, grad - update)  # ... and its error kept, as the factors'
    assert lowrank.memory_end == layout.total


def test_a_quantized_p_hat_stays_nearly_orthonormal():
    """Quantizing P^ after its orthogonalisation: the defect max |P^T P - I| on random
    n x 2 matrices, n = 10 .. 2048, measured 3e-4 to 3.9e-3 at 8 bits, 0.016 to 0.034 at 4."""
    generator = torch.Generator().manual_seed(0)
    for bits, bound in ((8, 5e-3), (4, 5e-2)):
        codec = get_codec({"id": "uniform", "bits": bits})
        for n in (10, 64, 1024, 2048):
            p = torch.randn(n, 2, generator=generator)
            orthogonalize(p)
            decoded = torch.from_numpy(codec.decode(codec.encode(p.numpy().ravel()))).view(n, 2)
            assert (decoded.t() @ decoded - torch.eye(2)).abs().max() < bound


def test_re_orthogonalising_the_decoded_p_hat_would_gain_little():
    """The one-step experiment of docs/codecs.rst: M low rank plus noise, P^ orthogonalised
    then quantized; the relative error of P^ (M^T P^)^T against float32 factors, with and
    without orthogonalising the decoded P^ again. Measured: 8 bits 0.0078 and 0.0078, 4 bits
    0.134 and 0.131, 2 bits 0.70 and 0.52 (n x m = 1024 x 2048)."""
    generator = torch.Generator().manual_seed(0)
    n, m = 1024, 2048
    M = (0.01 * torch.randn(n, m, generator=generator)
         + 0.1 * torch.randn(n, 1, generator=generator) @ torch.randn(1, m, generator=generator)
         + 0.03 * torch.randn(n, 1, generator=generator) @ torch.randn(1, m, generator=generator))
    q = torch.randn(m, 2, generator=generator)
    orthogonalize(q)
    p = M @ q
    orthogonalize(p)
    exact = p @ (M.t() @ p).t()
    errors = {}
    for bits in (8, 4, 2):
        codec = get_codec({"id": "uniform", "bits": bits})
        decoded = torch.from_numpy(codec.decode(codec.encode(p.numpy().ravel()))).view(n, 2)
        again = decoded.clone()
        orthogonalize(again)
        errors[bits] = [float((d @ (M.t() @ d).t() - exact).norm() / exact.norm()) for d in (decoded, again)]
    print(errors)
    assert errors[8][0] < 0.02 and errors[8][0] < 1.05 * errors[8][1]
    assert errors[4][0] < 0.2 and errors[4][0] < 1.1 * errors[4][1]
    assert errors[2][0] > 1.2 * errors[2][1]  # at 2 bits it would matter


# ---- loopback runs ---------------------------------------------------------------------------
def test_quantized_factors_train_with_the_bytes_the_layout_predicts(tmp_path):
    code, errors, config = run(tmp_path, iterations=50, lr=0.1, batch_size=16, **Q8)
    assert code == 0 and not errors, errors
    tr = load(config.trace)
    first, second, layers = expected_frames(paper_cnn_shapes(), 2, 8, 8)
    sent = tr.workers.filter(like="bytes_sent").to_numpy()
    assert (sent == first + second).all()
    P, control = 2, 8 * (3 + layers)
    np.testing.assert_array_equal(tr.steps["bytes_up"], P * (first + second) + P * 40)
    np.testing.assert_array_equal(tr.steps["bytes_down"], P * (control + first + second + 2 * FrameLength.NBYTES))
    assert (tr.steps.filter(like="bits").to_numpy() == 8).all()  # the factors' width
    assert tr.checksums.shape[0] > 0  # the replicas were compared (a mismatch stops the run)
    losses = tr.steps["loss"].to_numpy()
    assert np.isfinite(losses).all() and losses[-10:].mean() < losses[:10].mean() - 0.05  # float32 factors: same rule


@pytest.mark.parametrize("servers", [2, "colocated"])
def test_sharded_and_colocated_servers_give_the_single_server_run(tmp_path, servers):
    options = dict(Q8, codec_opts={"rank": 2, "start": 2, "factor_bits": 4, "rest_bits": 8}, iterations=8)
    code1, errors1, one = run(tmp_path, servers=1, name="s1.h5", **options)
    code2, errors2, other = run(tmp_path, servers=servers, name="s2.h5", **options)
    assert code1 == code2 == 0 and not errors1 and not errors2, (errors1, errors2)
    a, b = load(one.trace), load(other.trace)
    np.testing.assert_array_equal(a.steps["loss"], b.steps["loss"])
    np.testing.assert_array_equal(a.checksums.to_numpy(), b.checksums.to_numpy())


# ---- a real mpiexec run ----------------------------------------------------------------------
@pytest.mark.mpi
def test_mpiexec_run_trains_with_8_bit_factors_and_rest(tmp_path, mpi_env):
    trace = tmp_path / "psgd-q8.h5"
    result = run_mpi(3, ["train", "--trace", str(trace), "--model-opt", "fc_sizes=[256,256]", "--codec", "powersgd",
                         "--codec-opt", "rank=2", "--codec-opt", "factor_bits=8", "--codec-opt", "rest_bits=8",
                         "--policy", "fixed", "--iterations", "60", "--lr", "0.1", "--batch-size", "16",
                         "--eval-every", "0", "--progress-every", "30", "--compute-time", "50ms"], mpi_env)
    assert result.returncode == 0, result.stderr
    tr = load(trace)
    assert tr.complete and len(tr.steps) == 60
    losses = tr.steps["loss"].to_numpy()
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.15  # float32 factors: the same bound
    first, second, _ = expected_frames(paper_cnn_shapes((256, 256)), 2, 8, 8)
    assert (tr.workers.filter(like="bytes_sent").to_numpy() == first + second).all()
    assert tr.config["codec_opts"] == {"rank": 2, "factor_bits": 8, "rest_bits": 8}


# ---- the measurement of docs/peers.rst -------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.slow
def test_the_lowrank_comparison_runs_and_tabulates(tmp_path, mpi_env, world_relay):
    """examples/compare/lowrank.py --smoke: 2 methods, seed 1 at both rates, 4 iterations;
    the table's bytes are the trace's, and a second call runs nothing again."""
    script = Path(__file__).resolve().parents[1] / "examples" / "compare" / "lowrank.py"
    command = [sys.executable, str(script), "--out", str(tmp_path), "--smoke"]
    env = world_relay(mpi_env)  # its runs in this worker's world
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert sorted(p.name for p in tmp_path.glob("*.h5")) == [
        "fix2-100MBs-s1.h5", "fix2-10MBs-s1.h5", "psgd-f8-rest8-100MBs-s1.h5", "psgd-f8-rest8-10MBs-s1.h5"]
    table = (tmp_path / "lowrank.md").read_text()
    assert first.stdout.endswith(table)
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in table.splitlines()[2:]}
    assert set(rows) == {"Fix (2-bit)", "PowerSGD r2 (factors 8-bit, rest 8-bit)"}
    # 4 iterations, all before PowerSGD's start: float32 frames, the same as fix2's fp32 rest plus its FC layers
    trace = load(tmp_path / "fix2-10MBs-s1.h5")
    assert rows["Fix (2-bit)"][1] == str(int(trace.workers.filter(like="bytes_sent").to_numpy()[-1, 0]))
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout == table  # nothing run again
