"""The hierarchical exchange (``--exchange hierarchical``, runtime/exchange/hierarchical.py)
and the nodes' network model (clockmodel ``Nodes``): only what crosses a node's NIC goes
through the codecs, every replica stays identical (the run's checksums every iteration),
fp32 trains as the flat exchange does, the clock charges NICs shared by a node's flows, and
``trace retime`` re-charges a run on other nodes. Real runs: 2 nodes of 2 workers under
MPICH and Open MPI."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from conftest import SMALL_RUN, run_mpi
from mpigrad.analysis.retime import retime
from mpigrad.clockmodel import IterationTraffic, LinkModel, Nodes
from mpigrad.config import RunConfig
from mpigrad.errors import UsageError
from mpigrad.runtime.exchange.intra import IntraCodec
from mpigrad.trace import TraceError, load
from test_exchanges import run

COLOCATED = dict(servers="colocated", policy="fixed")


def _run(tmp_path, name, **options):
    folder = tmp_path / name
    folder.mkdir()
    codes, errors, config = run(folder, {**COLOCATED, **options}, workers=4)
    assert not errors, errors
    assert codes[0] == 0
    trace = load(config.trace)
    assert trace.complete and len(trace.steps) == 4
    return trace, config


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """P = 4 workers, fp32 and 4 bits, flat (one and two workers per node) and hierarchical
    (2 nodes of 2), on the loopback channel; each run checks its replicas every iteration."""
    tmp = tmp_path_factory.mktemp("hierarchical")
    return {name: _run(tmp, name, **options) for name, options in {
        "fp32 flat": dict(codec="fp32"),
        "fp32 flat 2x2": dict(codec="fp32", ranks_per_node=2, exchange="flat"),
        "fp32 hierarchical": dict(codec="fp32", ranks_per_node=2, exchange="hierarchical"),
        "4-bit flat": dict(bits=4),
        "4-bit flat 2x2": dict(bits=4, ranks_per_node=2, exchange="flat"),
        "4-bit hierarchical": dict(bits=4, ranks_per_node=2, exchange="hierarchical"),
        "4-bit hierarchical bf16": dict(bits=4, ranks_per_node=2, exchange="hierarchical", intra_codec="bf16"),
        "4-bit hierarchical fp16 residual": dict(bits=4, ranks_per_node=2, exchange="hierarchical", intra_codec="fp16",
                                                 error_feedback="residual"),
        "4-bit hierarchical int8": dict(bits=4, ranks_per_node=2, exchange="hierarchical", intra_codec="int8"),
    }.items()}


def test_fp32_hierarchical_trains_as_the_flat_exchange(runs):
    """The same average, summed in another order: the losses agree to float32 rounding."""
    flat, hierarchical = runs["fp32 flat"][0], runs["fp32 hierarchical"][0]
    np.testing.assert_allclose(hierarchical.steps["loss"], flat.steps["loss"], rtol=1e-6)
    np.testing.assert_allclose(runs["4-bit hierarchical"][0].steps["loss"], flat.steps["loss"], rtol=1e-3)


def test_only_frames_across_nodes_go_through_the_codecs(runs):
    """Worker w encodes frames only of the shards of its local rank (its own, which crosses
    no link, and the other node's); the ServerReports say 0 for the rest, and the NIC carries
    half the flat exchange's bytes."""
    trace, config = runs["4-bit hierarchical"]
    frames = trace.array("servers", "frame_bytes")  # [row, shard s, worker w]
    for s in range(4):
        for w in range(4):
            sends = w % 2 == s % 2
            assert (frames[:, s, w] > 0).all() if sends else (frames[:, s, w] == 0).all(), (s, w)
    flat = runs["fp32 flat 2x2"][0].steps
    hierarchical = runs["fp32 hierarchical"][0].steps
    assert (hierarchical["bytes_nic"] * 2 == flat["bytes_nic"]).all()
    shards = runs["fp32 hierarchical"][0].attrs["shards"]
    slices = shards["slice_bytes"]
    assert len(slices) == 2 and sum(slices) == 4 * sum(size for pieces in shards["pieces"] for _, size in pieces)
    # reduce-scatter and all-gather: each of the 2 nodes sends (L - 1) slices each way
    assert (hierarchical["bytes_intra"] == 2 * 2 * 1 * sum(slices)).all()
    bf16 = runs["4-bit hierarchical bf16"][0]
    assert bf16.attrs["shards"]["slice_bytes"] == [n // 2 for n in slices]
    assert (bf16.steps["bytes_intra"] * 2 == hierarchical["bytes_intra"]).all()


def test_half_precision_inside_nodes_keeps_the_replicas_identical(runs):
    """fp16 and bf16 slices (and error feedback across): every run passed its checksums
    every iteration (a replica that differed would have ended it), and trains close by."""
    fp32 = runs["4-bit hierarchical"][0].steps["loss"]
    for name in ("4-bit hierarchical bf16", "4-bit hierarchical fp16 residual"):
        trace = runs[name][0]
        assert trace.config["checksum_every"] == 1
        np.testing.assert_allclose(trace.steps["loss"], fp32, rtol=1e-3)


def test_int8_inside_nodes_keeps_the_replicas_identical(runs):
    """int8 slices: a quarter of fp32's bytes inside the node (1 + 4/256 bytes a value), every
    rank's parameters the same at every iteration's checksum, and training close to fp32's."""
    fp32 = runs["4-bit hierarchical"][0]
    trace = runs["4-bit hierarchical int8"][0]
    values = [n // 4 for n in fp32.attrs["shards"]["slice_bytes"]]
    slices = trace.attrs["shards"]["slice_bytes"]
    assert slices == [n + 4 * -(-n // 256) for n in values]
    assert (trace.steps["bytes_intra"] == 2 * 2 * 1 * sum(slices)).all()
    assert trace.config["checksum_every"] == 1 and trace.config["intra_codec"] == "int8"
    sums = trace.array("checksums", "checksum")  # [row, rank]: rank 0's is the first worker's
    assert len(sums) == 4 and (sums == sums[:, :1]).all()
    assert len(set(sums[:, 0])) == 4  # the parameters moved every iteration
    np.testing.assert_allclose(trace.steps["loss"], fp32.steps["loss"], rtol=1e-3)


def test_one_worker_per_node_records_no_node_columns(runs):
    flat = runs["4-bit flat"][0]
    assert not {"bytes_nic", "bytes_intra", "t_nic", "t_intra"} & set(flat.steps.columns)
    assert RunConfig(lr=0.1, servers="colocated").link_model().nodes is None
    assert RunConfig(lr=0.1, servers="colocated", ranks_per_node=2).link_model().nodes == Nodes(2, 10e9, 5e-6)


# ---- the slices' precision: NumPy against torch's own conversions ---------------------------
def test_intra_codecs_round_as_torch_does():
    rng = np.random.default_rng(3)
    values = np.concatenate([rng.standard_normal(5000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 5000),
                             np.array([0.0, -0.0, 1.0, 65504.0, 3.4e38, -3.4e38, np.inf, -np.inf, 1e-40,
                                       1.00390625, 1.01171875], np.float32)]).astype(np.float32)
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        codec = IntraCodec(name)
        buf = codec.buffer(values.size)
        codec.encode(values, buf)
        expected = torch.from_numpy(values).to(dtype).to(torch.float32).numpy()
        np.testing.assert_array_equal(codec.decode(buf), expected, err_msg=name)
        assert buf.nbytes == 2 * values.size
    nan = IntraCodec("bf16")
    buf = nan.buffer(2)
    nan.encode(np.array([np.nan, np.float32(np.frombuffer(np.uint32(0x7F800001).tobytes(), np.float32)[0])],
                        np.float32), buf)
    assert np.isnan(nan.decode(buf)).all()
    exact = IntraCodec("fp32")
    buf = exact.buffer(values.size)
    exact.encode(values, buf)
    np.testing.assert_array_equal(exact.decode(buf), values)
    with pytest.raises(UsageError, match="intra_codec must be one of fp32, fp16, bf16, int8, got 'int4'"):
        IntraCodec("int4")


# ---- int8 slices: block-wise absmax scaling, against a twin written here ---------------------
def _int8_twin(x: np.ndarray, block: int = 256) -> tuple[bytes, np.ndarray]:
    """The bytes (little-endian float32 scales, then int8 values) and the decoded values of
    ``x`` at int8, block by block in plain float32 scalars."""
    scales, codes, decoded = [], [], []
    for start in range(0, x.size, block):
        part = x[start:start + block]
        top = np.float32(np.abs(part).max())
        if not np.isfinite(top):
            scale, q = np.float32(np.nan), np.zeros(part.size, np.int8)
        else:
            scale = np.float32(top / np.float32(127))
            with np.errstate(over="ignore"):
                if not np.isfinite(np.float32(127) * scale):  # float32's largest: one step down
                    scale = np.nextafter(scale, np.float32(0))
            quotient = part / (scale if scale > 0 else np.float32(1))
            q = np.clip(np.rint(quotient), -127, 127).astype(np.int8)
        scales.append(scale)
        codes.append(q)
        decoded.append(q.astype(np.float32) * scale)
    data = np.array(scales, "<f4").tobytes() + np.concatenate(codes or [np.zeros(0, np.int8)]).tobytes()
    return data, np.concatenate(decoded or [np.zeros(0, np.float32)]).astype(np.float32)


def _int8_values(n: int, seed: int) -> np.ndarray:
    """Normal values whose magnitude changes block by block, with zeros, ties and extremes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    x *= (10.0 ** rng.integers(-30, 30, -(-n // 64))).repeat(64)[:n].astype(np.float32)
    specials = np.array([0.0, -0.0, 127.0, 0.5, 1.5, 2.5, -2.5, 1e-40, 3.4028235e38, -3.4028235e38], np.float32)
    k = min(n, specials.size)
    x[:k] = specials[:k]
    return x


@pytest.mark.parametrize("n", [1, 3, 255, 256, 257, 1000, 3 * 256 + 1, 20_000])
def test_int8_slices_are_the_twins_block_scaled_bytes(n):
    """Bit for bit the twin's bytes and values, for n below one block, a multiple and not;
    each value within half its block's step (and float32's rounding of x / s and q * s)."""
    codec = IntraCodec("int8")
    x = _int8_values(n, seed=n)
    buf = codec.buffer(n)
    assert buf.dtype == np.uint8 and buf.size == codec.nbytes(n) == n + 4 * -(-n // 256)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        codec.encode(x, buf)
        decoded = codec.decode(buf)
    data, expected = _int8_twin(x)
    assert buf.tobytes() == data
    np.testing.assert_array_equal(decoded, expected)
    assert decoded.dtype == np.float32 and decoded.shape == (n,)
    scales = np.frombuffer(data[:4 * -(-n // 256)], "<f4").astype(np.float64).repeat(256)[:n]
    error = np.abs(x.astype(np.float64) - decoded)
    assert (error <= scales * (0.5 + 2e-5) + 2.0 ** -143).all()
    again = IntraCodec("int8")  # another rank: the same bytes decode the same
    received = again.buffer(n)
    received[:] = buf
    np.testing.assert_array_equal(again.decode(received), decoded)
    into = np.full(n, np.nan, np.float32)
    assert again.decode(received, out=into) is into
    np.testing.assert_array_equal(into, decoded)


def test_int8_zeros_stay_zeros_and_non_finite_blocks_decode_to_nan():
    """A block of zeros decodes to zeros; a block with a NaN or an infinity decodes to NaN
    throughout (not finite, for the run's checks), its neighbours as if alone."""
    codec = IntraCodec("int8")
    n = 5 * 256 + 7
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    x[256:512] = 0
    x[600], x[3 * 256 + 9], x[-1] = np.nan, np.inf, -np.inf
    buf = codec.buffer(n)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        codec.encode(x, buf)
        decoded = codec.decode(buf)
    assert (decoded[256:512] == 0).all() and not np.signbit(decoded[256:512]).any()
    assert np.isnan(decoded[512:768]).all() and np.isnan(decoded[768:1024]).all() and np.isnan(decoded[-7:]).all()
    for start, stop in ((0, 256), (1024, 1280)):
        alone = codec.buffer(stop - start)
        codec.encode(x[start:stop].copy(), alone)
        np.testing.assert_array_equal(decoded[start:stop], codec.decode(alone))
    np.testing.assert_array_equal(decoded, _int8_twin(x)[1])
    empty = codec.buffer(0)
    codec.encode(np.zeros(0, np.float32), empty)
    assert empty.size == 0 and codec.decode(empty).shape == (0,)


def test_int8_sizes_come_from_the_buffer_never_the_wire():
    """n from len(buf) (nbytes strictly increases with n); a length no slice has, or a
    buffer of another n or dtype, is refused; scales from the wire are only multiplied."""
    codec = IntraCodec("int8")
    sizes = {codec.nbytes(n): n for n in range(3000)}
    assert len(sizes) == 3000
    for nbytes in range(max(sizes)):
        if nbytes in sizes:
            assert codec.values_in(nbytes) == sizes[nbytes]
        else:
            with pytest.raises(UsageError, match=f"{nbytes} bytes are no int8 slice"):
                codec.values_in(nbytes)
    with pytest.raises(UsageError, match="3 bytes are no int8 slice"):
        codec.decode(np.zeros(3, np.uint8))
    with pytest.raises(UsageError, match="a uint8 buffer of 265 bytes"):
        codec.encode(np.zeros(257, np.float32), codec.buffer(256))
    with pytest.raises(UsageError, match="a uint8 buffer"):
        codec.decode(codec.buffer(10).view(np.int8))
    garbage = np.random.default_rng(2).integers(0, 256, codec.nbytes(700), dtype=np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert codec.decode(garbage).shape == (700,)


# ---- the nodes' network model --------------------------------------------------------------
def _frames(P: int, L: int, frame: int, hierarchical: bool) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(frame if w != s and (not hierarchical or w % L == s % L) else 0 for w in range(P))
                 for s in range(P))


@pytest.mark.parametrize("P, L", [(4, 2), (8, 2), (8, 4), (16, 4)])
def test_a_flat_exchange_puts_L_times_more_on_a_nic_than_the_hierarchical(P, L):
    """Issue 62's arithmetic: a node's NIC carries L(P - L) frames of the flat exchange's
    gradient round, and L(N - 1) of the hierarchical one's (N = P / L nodes), each worker
    paying the latency of its own messages across while the bytes share the NIC."""
    frame, rate, latency = 1000, 1e6, 1e-3
    link = LinkModel(rate, latency, nodes=Nodes(L, 1e9, 0.0))
    N = P // L
    flat = link.node_gradients(_frames(P, L, frame, False))
    hierarchical = link.node_gradients(_frames(P, L, frame, True))
    assert flat.nic_bytes == P * (P - L) * frame and hierarchical.nic_bytes == P * (N - 1) * frame
    assert flat.nic_seconds == pytest.approx((P - L) * latency + L * (P - L) * frame / rate)
    assert hierarchical.nic_seconds == pytest.approx((N - 1) * latency + L * (N - 1) * frame / rate)
    assert flat.intra_bytes == P * (L - 1) * frame and hierarchical.intra_bytes == 0
    # broadcasts: a shard's average to every other worker, or to its local rank's
    flat_down = link.node_broadcasts(P, [frame] * P)
    down = link.node_broadcasts(P, [frame] * P, hierarchical=True)
    assert flat_down.nic_bytes == P * (P - L) * frame and down.nic_bytes == P * (N - 1) * frame


def test_one_worker_per_node_is_the_per_link_model():
    """With L = 1 the nodes' model gives the per-link model's charge (to rounding; runs at
    L = 1 do not use it at all: ``link_model().nodes`` is None)."""
    P, frame = 5, 1234
    traffic = IterationTraffic(40, 100, _frames(P, 1, frame, False), (frame + 8,) * P, colocated=True)
    plain = LinkModel(1e6, 2e-4)
    nodes = LinkModel(1e6, 2e-4, nodes=Nodes(1, 1e9, 0.0))
    assert nodes.comm_seconds(traffic) == pytest.approx(plain.comm_seconds(traffic), rel=1e-12)


def test_the_intra_node_collectives_go_at_the_intra_rate():
    nodes = Nodes(4, 1e9, 1e-5)
    part = nodes.intra([4000, 4000, 4000, 2000], workers=8)
    # local rank j receives slice j from 3 others, one after another; it sends 3 slices of others
    assert part.intra_seconds == pytest.approx(max(3 * (1e-5 + 4000 / 1e9), 2 * (1e-5 + 4000 / 1e9)
                                                   + (1e-5 + 2000 / 1e9)))
    assert part.nic_bytes == 0 and part.intra_bytes == 2 * 3 * 14000


def test_the_config_refuses_what_nodes_do_not_run_with():
    for options, message in [
        (dict(ranks_per_node=2), "--ranks-per-node L > 1 is built for --servers colocated"),
        (dict(exchange="hierarchical"), "--exchange hierarchical needs --servers colocated"),
        (dict(servers="colocated", ranks_per_node=2, pipeline=True, exchange="flat"),
         "--pipeline with --ranks-per-node L > 1 is built on the hierarchical exchange only"),
        (dict(servers="colocated", ranks_per_node=2, bandwidth="1MB/s@0s,2MB/s@5s"), "a schedule or --link-bandwidth"),
        (dict(servers="colocated", ranks_per_node=2, broadcast="tree"), "drop --broadcast"),
    ]:
        with pytest.raises(UsageError, match=message):
            RunConfig(lr=0.1, **options).validate()


# ---- trace retime on nodes -------------------------------------------------------------------
def test_retime_recharges_a_run_on_its_own_and_on_other_nodes(runs, tmp_path):
    """A run re-charged on its own network and nodes gives its own t_comm to the last bit; a
    flat run's messages are the same on any nodes, so re-charged on another L it gives the
    run on those nodes; a hierarchical run is refused any other L."""
    for name in ("4-bit hierarchical", "4-bit flat 2x2", "4-bit hierarchical bf16", "4-bit hierarchical int8"):
        trace, config = runs[name]
        out = tmp_path / f"{name.replace(' ', '-')}.h5"
        retime(config.trace, out, bandwidth=config.bandwidth)
        again = load(out)
        np.testing.assert_array_equal(again.steps["t_comm"], trace.steps["t_comm"])
        np.testing.assert_array_equal(again.steps["bytes_nic"], trace.steps["bytes_nic"])
    flat1, flat2 = runs["4-bit flat"], runs["4-bit flat 2x2"]
    to_one = tmp_path / "to-one.h5"
    summary = retime(flat2[1].trace, to_one, bandwidth=flat2[1].bandwidth, ranks_per_node=1)
    assert "nodes of 2 workers" in summary
    np.testing.assert_array_equal(load(to_one).steps["t_comm"], flat1[0].steps["t_comm"])
    assert "bytes_nic" not in load(to_one).steps.columns
    to_two = tmp_path / "to-two.h5"
    retime(flat1[1].trace, to_two, bandwidth=flat1[1].bandwidth, ranks_per_node=2)
    np.testing.assert_array_equal(load(to_two).steps["t_comm"], flat2[0].steps["t_comm"])
    np.testing.assert_array_equal(load(to_two).steps["bytes_nic"], flat2[0].steps["bytes_nic"])
    with pytest.raises(TraceError, match="a hierarchical run's messages depend on its 2 workers per node"):
        retime(runs["4-bit hierarchical"][1].trace, tmp_path / "no.h5", bandwidth=1e7, ranks_per_node=4)
    with pytest.raises(TraceError, match="3 workers per node do not divide its 4 workers"):
        retime(flat1[1].trace, tmp_path / "no.h5", bandwidth=1e7, ranks_per_node=3)


# ---- real runs: 2 nodes of 2 workers ---------------------------------------------------------
@pytest.mark.each_mpi
@pytest.mark.parametrize("pipeline", [[], ["--pipeline"], ["--pipeline", "--intra-codec", "int8"]],
                         ids=["sequential", "pipelined", "pipelined-int8"])
def test_two_nodes_of_two_workers_under_mpi(tmp_path, mpi_env, pipeline):
    """A launched run of 2 x 2 workers, sequential or pipelined (with 8 bits inside the node
    too, each bucket's message in blocks of its own): the declared nodes win over MPI's one
    node (a note says so), auto takes the hierarchical exchange, MQGrad chooses the NICs'
    bits, every replica agrees every iteration, and the trace records the nodes."""
    trace_path = tmp_path / "run.h5"
    result = run_mpi(5, ["train", "--servers", "colocated", "--ranks-per-node", "2", "--iterations", "12",
                         "--batch-size", "8", "--checksum-every", "1", "--trace", str(trace_path), *pipeline,
                         *SMALL_RUN], mpi_env)
    assert result.returncode == 0, result.stderr + result.stdout[-2000:]
    assert "--ranks-per-node 2 declares 2 node(s) of 2 worker(s); MPI sees 1 node(s)" in result.stdout
    assert ("nodes: 2 of 2 worker(s) (from --ranks-per-node 2); node 0: ranks 0-2; node 1: ranks 3, 4; rank 0, "
            "the scheduler, on node 0; exchange: hierarchical") in result.stdout
    trace = load(trace_path)
    assert trace.complete and len(trace.steps) == 12
    assert trace.config["exchange"] == "hierarchical" and trace.config["ranks_per_node"] == 2
    assert trace.config["pipeline"] == ("--pipeline" in pipeline)
    assert trace.config["intra_codec"] == ("int8" if "int8" in pipeline else "fp32")
    assert trace.attrs["topology"] == {"workers": 4, "ranks_per_node": 2, "nodes": 2,
                                                   "source": "declared", "rank0_node": 0}
    assert (trace.steps["bytes_nic"] > 0).all() and (trace.steps["bytes_intra"] > 0).all()
    assert all(math.isfinite(x) for x in trace.steps["loss"])


def test_bad_nodes_are_refused_before_any_iteration(tmp_path, mpi_env):
    """One line and exit 2 from the launch checks, before any rank trains."""
    for args, message in [
        (["--ranks-per-node", "3"], "--ranks-per-node 3 does not divide the 4 workers"),
        (["--ranks-per-node", "4", "--exchange", "hierarchical"], "--exchange hierarchical on one node"),
    ]:
        result = run_mpi(5, ["train", "--servers", "colocated", *args, "--iterations", "2",
                             "--trace", str(tmp_path / "bad.h5"), *SMALL_RUN], mpi_env)
        assert result.returncode == 2, result.stderr
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and message in lines[0], result.stderr
        assert not (tmp_path / "bad.h5").exists()


def test_retime_takes_the_nodes_on_its_command_line(runs, tmp_path, capsys):
    from mpigrad.cli import main

    flat1 = runs["4-bit flat"][1]
    out = tmp_path / "cli.h5"
    assert main(["trace", "retime", flat1.trace, "--bandwidth", "10MB/s", "--ranks-per-node", "2", "--intra-bandwidth", "1GB/s",
                 "-o", str(out)]) == 0
    assert "nodes of 2 workers (inside: 1GB/s)" in capsys.readouterr().out
    assert load(out).config["intra_bandwidth"] == 1e9


@pytest.mark.parametrize("options", [
    dict(policy="adaptive", bits=4, policy_opts={"interval": 2}),
    dict(policy="mqgrad", bits=4),
    dict(policy="accordion", bits=4),
    dict(policy="aimd", bits=4),
    dict(policy="lgreco", codec="uniform", bits=4, policy_opts={"interval": 2}),
    dict(policy="adaptive", bits=4, policy_opts={"interval": 2}, error_feedback="residual", intra_codec="bf16"),
], ids=["adaptive", "mqgrad", "accordion", "aimd", "lgreco", "adaptive-residual-bf16"])
def test_every_policy_chooses_the_bits_across_nodes(tmp_path, options):
    """Each bit-choosing policy on 2 x 2 hierarchical (4 iterations: adaptive moves 4 -> 6
    bits in them, the others keep their first choice): the Control's bits are what cross the
    NICs (a row of fewer bits carries no more bytes), every replica agrees every iteration
    (the checksums), and only the slices' frames cross the NICs."""
    trace, _ = _run(tmp_path, options["policy"], ranks_per_node=2, exchange="hierarchical", checksum_every=1,
                    **options)
    assert trace.config["policy"] == options["policy"] and trace.checksums.shape[0] == 4
    bits = trace.steps.filter(like="bits_layers").to_numpy()
    assert ((bits >= 1) & (bits <= 32)).all()
    frames = trace.array("servers", "frame_bytes")
    assert all((frames[:, s, w] == 0).all() for s in range(4) for w in range(4) if w % 2 != s % 2)
    nic = trace.steps["bytes_nic"].to_numpy()
    if options["policy"] == "adaptive":
        assert len(set(bits[:, 0])) > 1 and len(set(nic)) > 1
    for a in range(4):
        for b in range(4):
            if (bits[a] <= bits[b]).all():
                assert nic[a] <= nic[b] * 1.01, (a, b, bits.tolist(), nic.tolist())
