"""Runtime v2 protocol tests without mpiexec: every rank an object on a thread of this
process, talking through the loopback channel (the mpiexec tests run the MPI channel).

The sessions run as under mpiexec (rank 0 writes a real HDF5 trace and checkpoint); only
the channel differs. Configurations are tiny so that each test takes well under a second
of work beyond the first Numba load.
"""

from __future__ import annotations

import copy
import threading
import time

import numpy as np
import pytest

from mpigrad.config import RunConfig
from mpigrad.errors import UsageError
from mpigrad.runtime import EXIT_REQUEUE
from mpigrad.runtime.plan.layout import Layout, Segment, pieces_of, plan_shards
from mpigrad.runtime.run.session import run_other_rank, run_parameter_server
from mpigrad.runtime.roles.stopping import StopFlag
from mpigrad.runtime.wire import FrameError, FrameHeader, PeerTimeout
from mpigrad.runtime.wire.loopback import LoopbackNetwork
from mpigrad.trace import load

BASE = dict(model_opts={"fc_sizes": [64, 64]}, min_quantize_size=2000, iterations=6, batch_size=8,
            net_mode="virtual", compute_time=0.01, eval_every=0, progress_every=0, checksum_every=2,
            seed=5, lr=0.01)


class StopAfter(StopFlag):
    """A stop request that arrives when rank 0 asks for the ``calls``-th time."""

    def __init__(self, calls: int):
        super().__init__()
        self.calls = calls
        self.signal_name = None

    def requested(self, *args) -> bool:
        self.calls -= 1
        if self.calls < 0:
            self.signal_name = "SIGUSR1"
        return self.signal_name is not None


#: After a rank's error, how long the others may go on (to report it, as rank 0 does) before
#: the world is aborted, as ``mpigrad train`` aborts a real one (its ranks would otherwise
#: wait out their timeout): counted from the latest error.
ABORT_AFTER = 2.0


def run(tmp_path, servers=1, workers=2, stop=None, timeout=20.0, name="run.h5", **options):
    """Run every rank's session on its own thread; return (rank 0's exit code, errors by rank
    (ranks still waiting when the world was aborted: :class:`WorldAborted`), config)."""
    config = RunConfig(**{**BASE, **options, "servers": servers, "trace": str(tmp_path / name)})
    colocated = servers == "colocated"
    net = LoopbackNetwork(config.non_worker_ranks() + workers, workers if colocated else servers, timeout=timeout,
                          colocated=colocated)
    errors: dict[int, BaseException] = {}
    codes: dict[int, int] = {}
    failed = threading.Condition()
    last_error = [None]

    def rank_main(rank):
        try:
            channel = net.channel(rank)
            if rank == 0:
                codes[0] = run_parameter_server(config, channel, stop or StopFlag(), ["test"],
                                                lambda message: None)
            else:
                codes[rank] = run_other_rank(config, channel)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors[rank] = exc
            with failed:
                last_error[0] = time.monotonic()
                failed.notify_all()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(net.size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout * 4
    with failed:
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            if last_error[0] is not None and time.monotonic() - last_error[0] >= ABORT_AFTER:
                net.abort("a rank failed")
                break
            failed.wait(0.05)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return codes.get(0), errors, config


def straight_and_resumed(tmp_path, stop_after: int, **options):
    """One run straight through and one stopped after iteration ``stop_after`` (exit 75, a
    trace marked stopped and a checkpoint) then resumed; their traces, loaded."""
    code, errors, straight = run(tmp_path, name="straight.h5", **options)
    assert code == 0 and not errors, errors
    code, errors, stopped = run(tmp_path, name="stopped.h5", stop=StopAfter(stop_after), **options)
    assert code == EXIT_REQUEUE and not errors, errors
    assert load(stopped.trace).status == "stopped" and stopped.checkpoint_path.exists()
    code, errors, _ = run(tmp_path, name="stopped.h5", resume=True, **options)
    assert code == 0 and not errors, errors
    return load(straight.trace), load(stopped.trace)


def test_a_full_run_traces_every_iteration_with_bytes_per_server(tmp_path):
    code, errors, config = run(tmp_path, servers=2, workers=2)
    assert code == 0 and not errors, errors
    tr = load(config.trace)
    assert list(tr.steps["iteration"]) == list(range(6)) and tr.complete
    servers = tr.servers
    assert servers.filter(like="bytes_in").shape[1] == 2
    # What the workers sent adds up to what the servers received, and to the steps' bytes_up.
    np.testing.assert_array_equal(servers.filter(like="bytes_in").sum(axis=1),
                                  tr.workers.filter(like="bytes_sent").sum(axis=1))
    np.testing.assert_array_equal(tr.steps["bytes_up"], tr.workers.filter(like="bytes_sent").sum(axis=1) + 2 * 40)
    assert (servers.filter(like="bytes_out").to_numpy() > 0).all()


def test_sharded_servers_give_the_single_server_run_bit_for_bit(tmp_path):
    """With whole layers (``--shard-chunk 0``) S servers give one server's run bit for bit."""
    options = dict(codec="qsgd", policy="adaptive", bits=3, error_feedback="residual", shard_chunk=0)
    code1, errors1, one = run(tmp_path, servers=1, workers=2, name="s1.h5", **options)
    code2, errors2, two = run(tmp_path, servers=2, workers=2, name="s2.h5", **options)
    assert code1 == code2 == 0 and not errors1 and not errors2, (errors1, errors2)
    a, b = load(one.trace), load(two.trace)
    np.testing.assert_array_equal(a.steps["loss"], b.steps["loss"])
    np.testing.assert_array_equal(a.workers.filter(like="loss"), b.workers.filter(like="loss"))
    np.testing.assert_array_equal(a.checksums.to_numpy(), b.checksums.to_numpy())
    np.testing.assert_array_equal(a.policy.filter(like="error").to_numpy(), b.policy.filter(like="error").to_numpy())


@pytest.mark.parametrize("policy", ["adaptive", "lgreco"])
def test_colocated_servers_give_the_single_server_run_bit_for_bit(tmp_path, policy):
    """Every worker serving a shard changes where frames are summed, not what: the same
    losses, bits, parameters and policy records as one server (lgreco reads the average), with
    whole layers (``--shard-chunk 0``; auto cuts them, which changes a scaled codec's numbers)."""
    options = dict(codec="qsgd", policy=policy, bits=3, error_feedback="residual", eval_every=3, shard_chunk=0)
    code1, errors1, one = run(tmp_path, servers=1, workers=3, name="s1.h5", **options)
    code2, errors2, col = run(tmp_path, servers="colocated", workers=3, name="col.h5", **options)
    assert code1 == code2 == 0 and not errors1 and not errors2, (errors1, errors2)
    a, b = load(one.trace), load(col.trace)
    for column in ("loss", "bits"):
        np.testing.assert_array_equal(a.steps[column], b.steps[column], err_msg=column)
    np.testing.assert_array_equal(a.workers.filter(like="loss"), b.workers.filter(like="loss"))
    np.testing.assert_array_equal(a.checksums.to_numpy(), b.checksums.to_numpy())
    np.testing.assert_array_equal(a.policy.to_numpy(), b.policy.to_numpy())
    np.testing.assert_allclose(a.steps.filter(like="norm_ratio").to_numpy(),
                               b.steps.filter(like="norm_ratio").to_numpy(), rtol=1e-6)
    # rank 0 evaluates the parameters the workers hold (received after their SGD step)
    np.testing.assert_array_equal(a.eval["test_loss"], b.eval["test_loss"])
    # each node's link carries its frames for the other shards, not one server's all
    assert b.servers.filter(like="bytes_in").shape[1] == 3 and len(b.policy)
    frames = b.servers.filter(like="frame_bytes").to_numpy().reshape(len(b.servers), 3, 3)
    local = np.trace(frames, axis1=1, axis2=2)
    np.testing.assert_array_equal(b.workers.filter(like="bytes_sent").sum(axis=1), frames.sum(axis=(1, 2)) - local)
    assert (b.steps["bytes_up"] < a.steps["bytes_up"]).all()
    assert (b.steps["sim_time"] < a.steps["sim_time"]).all()


@pytest.mark.parametrize("servers", [2, "colocated"])
def test_stop_and_resume_continue_the_straight_run(tmp_path, servers):
    options = dict(codec="qsgd", policy="mqgrad", bits=2, error_feedback="residual", servers=servers)
    a, b = straight_and_resumed(tmp_path, 2, **options)
    for column in ("loss", "bits", "bytes_up", "bytes_down", "sim_time"):
        np.testing.assert_array_equal(a.steps[column], b.steps[column], err_msg=column)
    np.testing.assert_array_equal(a.checksums.to_numpy(), b.checksums.to_numpy())


def test_periodic_checkpoints_carry_every_servers_state_and_a_crash_resumes_from_the_newest(
        tmp_path, monkeypatch):
    """--checkpoint-every with S = 2: every rank (the shard server included) sends its state
    after each marked iteration; a shard server that dies loses only what came after."""
    from mpigrad.runtime.measure import checkpoint
    from mpigrad.runtime.roles import shard

    options = dict(codec="qsgd", policy="mqgrad", bits=2, error_feedback="residual", servers=2)
    code, errors, straight = run(tmp_path, name="straight.h5", **options)
    assert code == 0 and not errors, errors

    original = kill_shard_server_at(monkeypatch, 5)
    code, errors, crashed = run(tmp_path, name="crashed.h5", timeout=5.0, checkpoint_every=2, **options)
    assert str(errors[1]) == "server lost" and isinstance(errors[0], PeerTimeout)
    assert (load(crashed.trace).status, load(crashed.trace).attrs["last_iteration"]) == ("failed", 4)
    newest = checkpoint.read(crashed.checkpoint_path)
    older = checkpoint.read(checkpoint.previous_path(crashed.checkpoint_path))
    assert (newest["server"]["iteration"], older["server"]["iteration"]) == (4, 2)
    assert len(newest["servers"]) == 1 and len(newest["workers"]) == 2
    # The shard server's codec counters (its pieces encoded once per iteration) and memory.
    assert [max(c["servers"][0]["compressor"]["calls"]) for c in (newest, older)] == [4, 2]
    assert "feedback" in newest["servers"][0]["compressor"]

    monkeypatch.setattr(shard.ShardServer, "reports", original)
    code, errors, _ = run(tmp_path, name="crashed.h5", resume=True, checkpoint_every=2, **options)
    assert code == 0 and not errors, errors
    a, b = load(straight.trace), load(crashed.trace)
    assert b.complete and list(b.steps["iteration"]) == list(range(6))
    for column in ("loss", "bits", "bytes_up", "bytes_down", "sim_time"):
        np.testing.assert_array_equal(a.steps[column], b.steps[column], err_msg=column)
    np.testing.assert_array_equal(a.checksums.to_numpy(), b.checksums.to_numpy())
    assert not checkpoint.exists(crashed.checkpoint_path)


def test_a_worker_that_dies_is_named_by_rank_0(tmp_path, monkeypatch):
    monkeypatch.setenv("MPIGRAD_INJECT_FAULT", "raise:3:2")
    code, errors, config = run(tmp_path, servers=1, workers=3, timeout=1.0)
    assert "injected fault at iteration 2" in str(errors[3])
    assert isinstance(errors[0], PeerTimeout)
    assert str(errors[0]) == "worker rank(s) 3 sent no loss for iteration 2 within 1 s"
    tr = load(config.trace)  # rank 0 closed it: failed, why, and the last whole iteration
    assert (tr.status, tr.attrs["error"], tr.attrs["last_iteration"]) == ("failed", str(errors[0]), 1)
    assert list(tr.steps["iteration"]) == [0, 1]


def kill_shard_server_at(monkeypatch, iteration: int):
    """Make shard servers raise "server lost" in iteration ``iteration``; return the original phase."""
    from mpigrad.runtime.roles import shard

    original = shard.ShardServer.reports

    def dying(self, m):
        if m == iteration:
            raise RuntimeError("server lost")
        original(self, m)

    monkeypatch.setattr(shard.ShardServer, "reports", dying)
    return original


def test_a_shard_server_that_dies_is_named_by_rank_0(tmp_path, monkeypatch):
    kill_shard_server_at(monkeypatch, 1)
    code, errors, _ = run(tmp_path, servers=2, workers=2, timeout=1.0)
    assert str(errors[1]) == "server lost"
    assert str(errors[0]) == "server rank(s) 1 sent no report for iteration 1 within 1 s"


@pytest.mark.parametrize("fault, rank, message", [
    ("nan-loss:2:1", 0, "worker rank 2 computed a non-finite loss (nan) at iteration 1"),
    ("nan-grad:3:2", 1, "worker rank 3 computed a non-finite gradient at iteration 2"),
])
def test_non_finite_values_stop_the_run_naming_the_worker(tmp_path, monkeypatch, fault, rank, message):
    monkeypatch.setenv("MPIGRAD_INJECT_FAULT", fault)
    code, errors, _ = run(tmp_path, servers=2, workers=2, timeout=1.0)
    assert message in str(errors[rank]), errors


def test_frames_are_checked_before_any_codec_reads_them():
    frame = np.zeros(FrameHeader.capacity([8, 8]), np.uint8)
    length = FrameHeader.write(frame, [8, 8], 0.25)
    encode_seconds, views = FrameHeader.read(frame[:length], 2)
    assert encode_seconds == 0.25 and [v.size for v in views] == [8, 8]
    with pytest.raises(FrameError, match="expected 3"):
        FrameHeader.read(frame[:length], 3)
    with pytest.raises(FrameError, match="do not fill"):
        FrameHeader.read(frame[:length - 1], 2)
    with pytest.raises(FrameError, match="shorter than its header"):
        FrameHeader.read(frame[:10], 2)


def test_error_reports_carry_the_iteration_and_the_text_and_are_checked():
    from mpigrad.runtime.wire import ErrorReport

    buf = ErrorReport(7, "injected fault é" + "x" * 2000).pack()
    report = ErrorReport.unpack(buf)
    assert report.iteration == 7 and report.text.startswith("injected fault é")
    assert len(report.text.encode()) <= ErrorReport.MAX_TEXT
    with pytest.raises(FrameError, match="bad error report"):
        ErrorReport.unpack(buf[4:])


def test_shards_are_layer_aligned_and_balanced_by_bytes():
    layout = Layout((Segment("a", 0, 600), Segment("b", 600, 300), Segment("c", 900, 300)),
                    Segment("small layers", 1200, 50), 1250)
    shards = plan_shards(layout, 2, lambda p: p.size)
    assert [[p.layer for p in s.pieces] for s in shards] == [[0, -1], [1, 2]]   # largest first, ties to the lower server
    assert sum(s.elements for s in shards) == 1250
    one = plan_shards(layout, 1, lambda p: p.size)
    assert [p.layer for p in one[0].pieces] == [0, 1, 2, -1]
    # Cutting large layers is explicit, and then a 600-element layer can be split.
    assert [p.size for p in pieces_of(layout, 250)] == [250, 250, 100, 250, 50, 250, 50, 50]
    chunked = plan_shards(layout, 3, lambda p: p.size, chunk=250)
    assert sorted(s.elements for s in chunked) == [350, 400, 500]


def test_shard_chunk_cuts_the_small_layers_too_so_that_they_balance():
    """At 2 bits a float32 piece of small layers outweighs the quantized layers: whole, it
    loads one server with most of the bytes; cut, the servers share it."""
    layout = Layout((Segment("a", 0, 1600), Segment("b", 1600, 1600)), Segment("small layers", 3200, 600), 3800)
    pieces = pieces_of(layout, 250)
    assert [(p.layer, p.size) for p in pieces[-3:]] == [(-1, 250), (-1, 250), (-1, 100)]
    assert [p.index for p in pieces] == list(range(len(pieces)))
    assert sum(p.size for p in pieces if not p.quantized) == 600
    two_bits = lambda p: p.size * 4 if p.layer < 0 else p.size // 4  # noqa: E731 - float32 small layers, 2-bit codes
    loads = sorted(sum(two_bits(p) for p in s.pieces) for s in plan_shards(layout, 4, two_bits, chunk=100))
    assert loads[-1] <= 1.1 * sum(loads) / 4, loads
    whole = sorted(sum(two_bits(p) for p in s.pieces) for s in plan_shards(layout, 4, two_bits))
    assert whole[-1] == 2400  # the uncut float32 piece alone, against 800 for the rest together


def test_auto_keeps_whole_layers_with_one_server_and_gives_several_even_shares():
    """``--shard-chunk auto``: one server, whole layers (the paper's layout); several, each
    class (quantized, small layers) cut and dealt by elements, so that every server holds an
    even share of both, and the bytes stay even at any width (float32 to 2 bits)."""
    from mpigrad.runtime.plan.layout import AUTO, AUTO_MIN_CHUNK, Chunks, resolve_chunks

    big = Layout((Segment("fc1", 0, 65536), Segment("fc2", 65536, 2097152)), Segment("small layers", 2162688, 127690),
                 2290378)
    assert resolve_chunks(AUTO, big, 1) == Chunks()
    assert resolve_chunks(AUTO, big, 4, whole_layers=True) == Chunks()
    assert resolve_chunks(1000, big, 4) == Chunks(1000, 1000)
    for servers in (2, 3, 4, 8):
        chunks = resolve_chunks(AUTO, big, servers)
        assert chunks.by_class and chunks.quantized % 1024 == 0 and chunks.quantized >= AUTO_MIN_CHUNK
        shards = plan_shards(big, servers, lambda p: p.size, chunks)
        assert sorted(p.index for s in shards for p in s.pieces) == list(range(len(pieces_of(big, chunks))))
        for bits in (32, 8, 2):
            size = lambda p: p.size * bits // 8 if p.quantized else 4 * p.size  # noqa: E731
            loads = [sum(size(p) for p in s.pieces) for s in shards]
            assert max(loads) <= 1.1 * sum(loads) / servers, (servers, bits, loads)
        whole = plan_shards(big, servers, lambda p: p.size)
        assert max(s.elements for s in whole) == 2097152  # fc2 alone: the layout auto replaces
    # a small model's layers stay whole: no piece is cut below AUTO_MIN_CHUNK
    small = Layout((Segment("a", 0, 9000),), Segment("small layers", 9000, 500), 9500)
    assert [p.size for p in pieces_of(small, resolve_chunks(AUTO, small, 4))] == [9000, 500]


def test_shard_chunk_reads_auto_or_a_number_and_refuses_the_rest():
    from mpigrad.config import parse_shard_chunk

    assert RunConfig().shard_chunk == "auto"
    assert parse_shard_chunk("auto") == "auto" and parse_shard_chunk("4096") == 4096 and parse_shard_chunk(0) == 0
    for bad in ("-1", -1, "big", 1.5, True):
        with pytest.raises(UsageError, match="shard_chunk must be auto .*got"):
            parse_shard_chunk(bad)


def test_auto_cuts_change_no_number_in_float32(tmp_path):
    """fp32 colocated with the default cut (auto) gives the one-server run bit for bit, and
    the trace records the cut and each shard's pieces."""
    options = dict(codec="fp32", policy="fixed", iterations=4)
    code1, errors1, one = run(tmp_path, servers=1, workers=2, name="one.h5", **options)
    code2, errors2, auto = run(tmp_path, servers="colocated", workers=2, name="auto.h5", **options)
    assert code1 == code2 == 0 and not errors1 and not errors2, (errors1, errors2)
    a, b = load(one.trace), load(auto.trace)
    np.testing.assert_array_equal(a.steps["loss"], b.steps["loss"])
    np.testing.assert_array_equal(a.checksums.to_numpy(), b.checksums.to_numpy())
    shards = b.attrs["shards"]
    assert shards["setting"] == "auto" and shards["quantized"] > 0 and len(shards["pieces"]) == 2
    pieces = [tuple(p) for shard in shards["pieces"] for p in shard]
    assert sum(size for _, size in pieces) == b.attrs["parameters"] and len(pieces) > 3
    elements = [sum(size for _, size in shard) for shard in shards["pieces"]]
    assert max(elements) <= 1.2 * sum(elements) / 2, elements


def test_cutting_the_small_layers_changes_no_number(tmp_path):
    """float32 everywhere: colocated servers with the small layers (2506 elements) cut into
    500-element pieces give the one-server run's losses and parameters bit for bit."""
    options = dict(codec="fp32", policy="fixed", eval_every=3)
    code1, errors1, one = run(tmp_path, servers=1, workers=3, name="one.h5", **options)
    code2, errors2, cut = run(tmp_path, servers="colocated", workers=3, name="cut.h5", shard_chunk=500, **options)
    assert code1 == code2 == 0 and not errors1 and not errors2, (errors1, errors2)
    a, b = load(one.trace), load(cut.trace)
    np.testing.assert_array_equal(a.steps["loss"], b.steps["loss"])
    np.testing.assert_array_equal(a.checksums.to_numpy(), b.checksums.to_numpy())
    np.testing.assert_array_equal(a.eval["test_loss"], b.eval["test_loss"])


def test_batchnorm_statistics_reach_rank_0_with_one_server_and_with_two(tmp_path):
    """The buffers phase: rank 0 evaluates with the workers' averaged BatchNorm statistics,
    the same bit for bit with S = 2 (shard servers take part in the world broadcast)."""
    options = dict(model="resnet20", model_opts={}, iterations=4, eval_every=2, eval_samples=64, bits=4,
                   policy="fixed", shard_chunk=0)
    code1, errors1, one = run(tmp_path, servers=1, workers=2, name="bn1.h5", **options)
    code2, errors2, two = run(tmp_path, servers=2, workers=2, name="bn2.h5", **options)
    assert code1 == code2 == 0 and not errors1 and not errors2, (errors1, errors2)
    a, b = load(one.trace), load(two.trace)
    np.testing.assert_array_equal(a.eval["test_loss"], b.eval["test_loss"])
    # Without the averaged statistics rank 0 would evaluate with the initial ones; a run
    # with GroupNorm (no buffers, nothing sent) evaluates otherwise.
    code3, errors3, group = run(tmp_path, servers=2, workers=2, name="gn.h5",
                                **{**options, "model_opts": {"norm": "group"}})
    assert code3 == 0 and not errors3, errors3
    assert list(a.eval["iteration"]) == [1, 3] and list(load(group.trace).eval["iteration"]) == [1, 3]


def test_stop_and_resume_carry_the_batchnorm_statistics(tmp_path):
    options = dict(model="resnet20", model_opts={}, iterations=4, eval_every=4, eval_samples=64, bits=4,
                   policy="fixed", servers=2)
    a, b = straight_and_resumed(tmp_path, 1, **options)
    np.testing.assert_array_equal(a.steps["loss"], b.steps["loss"])
    np.testing.assert_array_equal(a.eval["test_loss"], b.eval["test_loss"])


@pytest.mark.parametrize("servers", [1, 2, "colocated"])
def test_norm_every_computes_the_energies_only_on_its_iterations_and_changes_nothing_else(tmp_path, monkeypatch,
                                                                                         servers):
    from mpigrad.runtime.exchange.aggregator import ShardAggregator

    calls = []
    for name in ("energies", "update_energies"):
        original = getattr(ShardAggregator, name)
        monkeypatch.setattr(ShardAggregator, name,
                            lambda self, *a, _original=original, _name=name: calls.append(_name) or _original(self, *a))
    code, errors, every = run(tmp_path, servers=servers, name="every.h5", policy="fixed", bits=3)
    assert code == 0 and not errors, errors
    assert calls
    calls.clear()
    code, errors, third = run(tmp_path, servers=servers, name="third.h5", policy="fixed", bits=3, norm_every=3)
    assert code == 0 and not errors, errors
    with_calls = len(calls)
    calls.clear()
    code, errors, never = run(tmp_path, servers=servers, name="never.h5", policy="fixed", bits=3, norm_every=0)
    assert code == 0 and not errors, errors
    assert calls == [] and with_calls > 0
    every, third, never = load(every.trace), load(third.trace), load(never.trace)
    ratios = third.steps.filter(like="norm_ratio").to_numpy()
    due = third.steps["iteration"].to_numpy() % 3 == 0
    np.testing.assert_array_equal(ratios[due], every.steps.filter(like="norm_ratio").to_numpy()[due])
    assert ratios.shape[1] == 3 and np.isfinite(ratios[due]).all() and np.isnan(ratios[~due]).all()
    assert np.isnan(never.steps.filter(like="norm_ratio").to_numpy()).all()
    for other in (third, never):
        for column in ("loss", "bits", "bytes_up", "bytes_down", "sim_time"):
            np.testing.assert_array_equal(other.steps[column], every.steps[column])


def test_a_checkpoint_whose_shards_differ_is_refused_on_resume(tmp_path):
    """Servers hold their pieces' codec counters and error memory apart, so a resume must
    find the shards the checkpoint was written with. A checkpoint of an mpigrad whose
    --shard-chunk kept the small layers whole (it saved no plan) is refused in one line
    where this one cuts them; so is one whose saved plan differs."""
    from mpigrad.errors import UsageError
    from mpigrad.runtime.measure import checkpoint

    options = dict(codec="fp32", policy="fixed", shard_chunk=500)
    code, errors, stopped = run(tmp_path, servers="colocated", workers=3, name="old.h5", stop=StopAfter(2), **options)
    assert code == EXIT_REQUEUE and not errors, errors
    whole = checkpoint.read(stopped.checkpoint_path)
    plan = whole["server"]["shard_plan"]
    assert sum(size for shard in plan for _, size in shard) == 113098 and len(plan) == 3
    for edit, message in ((lambda server: server.pop("shard_plan"), "kept the small layers (2506 elements) whole"),
                          (lambda server: server["shard_plan"].reverse(), "the checkpoint's shards are not this run's")):
        state = copy.deepcopy(whole)
        edit(state["server"])
        checkpoint.save(stopped.checkpoint_path, state["identity"], state["server"], state["workers"], state["servers"])
        code, errors, _ = run(tmp_path, servers="colocated", workers=3, name="old.h5", resume=True, timeout=2,
                              **options)
        assert isinstance(errors.get(0), UsageError) and message in str(errors[0]), errors
        assert "\n" not in str(errors[0])


def test_momentum_correction_in_float32_is_the_optimizers_heavy_ball_momentum(tmp_path):
    """Each worker encoding its velocity u <- 0.9 u + g, averaged and applied by plain SGD, is
    SGD with momentum 0.9 on the averaged gradient: the same losses to float rounding (the
    average of velocities and the velocity of averages round differently)."""
    options = dict(codec="fp32", policy="fixed", bits=32, iterations=8)
    code1, errors1, corrected = run(tmp_path, name="mc.h5", momentum_correction=0.9, **options)
    code2, errors2, heavy = run(tmp_path, name="sgdm.h5", optimizer_opts={"momentum": 0.9}, **options)
    code3, errors3, plain = run(tmp_path, name="sgd.h5", **options)
    assert code1 == code2 == code3 == 0 and not (errors1 or errors2 or errors3), (errors1, errors2, errors3)
    a, b, c = (load(config.trace).steps["loss"].to_numpy() for config in (corrected, heavy, plain))
    np.testing.assert_allclose(a, b, rtol=2e-6)
    assert np.abs(a[3:] - c[3:]).min() > 1e-4      # and momentum did change the run
    from mpigrad.analysis.summary import recipe_line

    assert recipe_line(load(corrected.trace).config).startswith("sgd momentum correction 0.9")


@pytest.mark.parametrize("servers", [1, "colocated"])
def test_momentum_correction_with_error_feedback_stops_and_resumes_bit_for_bit(tmp_path, servers):
    """The velocity is worker state: a checkpoint carries it, and a stopped and resumed run
    is the straight one; colocated servers give the one-server run."""
    options = dict(codec="qsgd", policy="adaptive", bits=3, error_feedback="residual", momentum_correction=0.5,
                   servers=servers, shard_chunk=0)
    a, b = straight_and_resumed(tmp_path, 3, **options)
    for column in ("loss", "bits", "bytes_up", "bytes_down"):
        np.testing.assert_array_equal(a.steps[column], b.steps[column], err_msg=column)
    np.testing.assert_array_equal(a.checksums.to_numpy(), b.checksums.to_numpy())
    if servers == "colocated":
        code, errors, one = run(tmp_path, name="one.h5", **{**options, "servers": 1})
        assert code == 0 and not errors, errors
        np.testing.assert_array_equal(load(one.trace).steps["loss"], a.steps["loss"])
    code, errors, off = run(tmp_path, name="off.h5", **{**options, "momentum_correction": 0.0})
    assert code == 0 and not errors, errors
    assert not np.array_equal(load(off.trace).steps["loss"], a.steps["loss"])


def test_a_one_server_checkpoint_written_with_shard_chunk_0_resumes_under_auto():
    """Before auto became the default, checkpoints recorded ``shard_chunk = 0``: with one
    server auto is the same layout, so the identity is the same; with several it is not."""
    from mpigrad.runtime.measure import checkpoint

    before = {**RunConfig().to_dict(), "shard_chunk": 0}
    assert checkpoint.identity(RunConfig().to_dict(), 3) == checkpoint.identity(before, 3)
    colocated = {**before, "servers": "colocated"}
    assert checkpoint.identity({**colocated, "shard_chunk": "auto"}, 3) != checkpoint.identity(colocated, 3)
