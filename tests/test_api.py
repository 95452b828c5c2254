"""The library API (mpigrad.Session) without mpiexec: its config rule, its checks, and a
script's loop on the loopback channel against ``mpigrad train``'s own (tests/test_api_mpi.py
runs scripts under mpiexec)."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from mpigrad.api import (SCRIPT_KEYS, Session, _model_problem, _optimizer_problem, _resume_problem, dropped_note,
                         script_config)
from mpigrad.codecs import get_codec
from mpigrad.config import RunConfig
from mpigrad.data import ShardSampler
from mpigrad.errors import UsageError
from mpigrad.runtime.exchange.build import build_config_model, load_data
from mpigrad.runtime.run.script import ScriptWorker
from mpigrad.runtime.run.script import Exchanged
from mpigrad.runtime.run.session import run_other_rank, run_parameter_server
from mpigrad.runtime.run.startup import config_description
from mpigrad.runtime.roles.stopping import StopFlag
from mpigrad.runtime.wire.loopback import LoopbackNetwork
from mpigrad.trace import load

from conftest import REPO

FIX2 = str(REPO / "examples" / "compare" / "fix2.toml")


def test_importing_mpigrad_loads_neither_torch_nor_mpi():
    out = subprocess.run([sys.executable, "-c", "import sys, mpigrad; print(sorted(m for m in ('torch', 'mpi4py.MPI', "
                          "'numba') if m in sys.modules))"], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    import mpigrad

    assert mpigrad.Session.__module__ == "mpigrad.api" and mpigrad.UsageError is UsageError


def test_a_config_file_gives_its_method_and_leaves_the_scripts_keys_out():
    config, dropped = script_config(FIX2, {"trace": "t.h5", "iterations": 7}, "script Net", "script AdamW")
    assert (config.policy, config.bits, config.codec, config.iterations) == ("fixed", 2, "uniform", 7)
    assert config.compute_time == 0.05 and config.bandwidth == 10e6  # the network model, as train reads it
    assert {"model", "data", "lr", "batch_size", "weight_decay", "eval_every", "model_opts"} <= set(dropped)
    assert (config.model, config.data, config.optimizer) == ("script Net", "script", "script AdamW")
    assert config.lr is None and config.eval_every == 0 and config.weight_decay == 0.0
    assert not set(config.given) & set(SCRIPT_KEYS)


@pytest.mark.parametrize("options, message", [
    ({"optimizer": "adamw"}, "optimizer: the script's own"),
    ({"lr": 0.1}, "lr: the script's own"),
    ({"pipeline": True}, "pipeline needs servers = colocated"),
    ({"resume": True}, "resume: a Session resumes from the state the script saved: pass resume=STATE"),
    ({"checkpoint": "a.ckpt"}, "checkpoint: a Session writes no checkpoint file"),
    ({"policy": "nope"}, "nope"),
    ({"bitz": 2}, "unknown option 'bitz'"),
    ({"servers": "colocated", "codec": "uniform", "bits": 40}, "bits must be in 1..32"),
])
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(UsageError, match=message) as info:
        script_config(None, options, "script Net")
    assert "\n" not in str(info.value)


class OneRank:
    """A communicator of one rank whose rank 0 held ``reference`` (for the model check)."""

    def __init__(self, reference=None):
        self.reference = reference

    def Get_rank(self):
        return 1

    def bcast(self, value, root=0):
        return self.reference


def _crc(model) -> int:
    class Keep(OneRank):
        def bcast(self, value, root=0):
            self.seen = value
            return value

    comm = Keep()
    comm.Get_rank = lambda: 0
    assert _model_problem(model, comm) is None
    return comm.seen


def test_a_model_built_otherwise_than_rank_0s_is_named():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    reference = _crc(model)
    assert _model_problem(model, OneRank(reference)) is None
    torch.manual_seed(1)
    assert "differs from rank 0's" in _model_problem(torch.nn.Linear(4, 3), OneRank(reference))
    torch.manual_seed(0)
    assert "differs" in _model_problem(torch.nn.Linear(4, 2), OneRank(reference))


def test_the_model_check_reads_every_dtype_and_0_d_buffers():
    """BatchNorm's num_batches_tracked is a 0-d int64 buffer; bf16 parameters have no NumPy dtype."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Linear(4, 2).bfloat16())
    reference = _crc(model)
    assert _model_problem(model, OneRank(reference)) is None
    with torch.no_grad():
        model[1].num_batches_tracked += 1
    assert "differs" in _model_problem(model, OneRank(reference))


def test_resuming_on_some_ranks_only_is_named():
    assert _resume_problem(True, OneRank(True)) is None
    assert "resumes (resume=STATE) and rank 0 does not" in _resume_problem(True, OneRank(False))
    assert "does not resume and rank 0 does" in _resume_problem(False, OneRank(True))


def test_an_optimizer_over_other_parameters_is_named():
    model, other = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    assert _optimizer_problem(torch.optim.SGD(model.parameters(), lr=0.1), model) is None
    assert "not the model's" in _optimizer_problem(torch.optim.SGD(other.parameters(), lr=0.1), model)
    assert "not a torch.optim optimizer" in _optimizer_problem(object(), model)


BASE = dict(model_opts={"fc_sizes": [64, 64]}, min_quantize_size=2000, iterations=6, batch_size=8,
            net_mode="virtual", compute_time=0.01, eval_every=0, progress_every=0, checksum_every=2,
            seed=5, lr=0.05, weight_decay=0.0, codec="uniform", policy="fixed", bits=3, error_feedback="residual")


def _train(tmp_path, servers, name, pipeline=False):
    """``mpigrad train``'s own loop (plain SGD), every rank on a thread of the loopback."""
    config = RunConfig(**{**BASE, "servers": servers, "pipeline": pipeline, "trace": str(tmp_path / name)})
    net = LoopbackNetwork(3, 2 if servers == "colocated" else 1, timeout=20.0, colocated=servers == "colocated")
    errors = {}

    def rank_main(rank):
        try:
            if rank == 0:
                run_parameter_server(config, net.channel(0), StopFlag(), ["test"], lambda line: None)
            else:
                run_other_rank(config, net.channel(rank))
        except BaseException as exc:  # noqa: BLE001
            errors[rank] = exc

    _join([threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(3)])
    assert not errors, errors
    return load(tmp_path / name)


def _script(tmp_path, servers, name, pipeline=False):
    """The same method from a script's loop: its own torch.optim.SGD, its own batches (the
    same as train's sampler draws), the gradients exchanged by ScriptWorker (pipelined: its
    backward runs the script's backward, bucket by bucket)."""
    train_config = RunConfig(**{**BASE, "servers": servers})
    dataset = load_data(train_config)
    method = {k: v for k, v in BASE.items() if k not in SCRIPT_KEYS}
    config, _ = script_config(None, {**method, "servers": servers, "pipeline": pipeline,
                                     "trace": str(tmp_path / name)}, "script CNN", "script SGD")
    colocated = servers == "colocated"
    net = LoopbackNetwork(3, 2 if colocated else 1, timeout=20.0, colocated=colocated)
    models = [build_config_model(train_config, dataset) for _ in range(3)]
    errors, losses = {}, {1: [], 2: []}

    def rank_main(rank):
        try:
            if rank == 0:
                run_parameter_server(config, net.channel(0), StopFlag(), ["test"], lambda line: None,
                                     model=models[0])
                return
            model = models[rank]
            worker = ScriptWorker(config, net.channel(rank), model)
            if pipeline:  # a pipelined run's exchange is its backward
                with pytest.raises(UsageError, match="pipeline: call session.backward"):
                    worker.exchange(0.0, 0.0, 0.0)
            optimizer = torch.optim.SGD(model.parameters(), lr=BASE["lr"])
            sampler = ShardSampler(len(dataset.train_y), rank - 1, 2, BASE["batch_size"], BASE["seed"])
            for _ in range(config.iterations):
                idx = sampler.next_batch()
                x, y = torch.from_numpy(dataset.train_x[idx]), torch.from_numpy(dataset.train_y[idx])
                optimizer.zero_grad()
                loss = model.loss(model(x), y, 0.0)
                if pipeline:
                    record = worker.backward(loss, 0.0, 0.0)
                else:
                    loss.backward()
                    record = worker.exchange(loss.item(), 0.0, 0.0)
                losses[rank].append(record.loss)
                optimizer.step()
            assert record.last and record.bits == (3,) * len(record.bits)
        except BaseException as exc:  # noqa: BLE001
            errors[rank] = exc

    _join([threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(3)])
    assert not errors, errors
    return load(tmp_path / name), losses


def _join(threads):
    for t in threads:
        t.start()
    for t in threads:
        t.join(80)


@pytest.mark.parametrize("servers, pipeline", [(1, False), ("colocated", False), ("colocated", True)])
def test_a_scripts_loop_with_torch_sgd_is_mpigrad_trains_run_bit_for_bit(tmp_path, servers, pipeline):
    """The seam: the decoded average lands in ``.grad`` and torch's SGD steps with it, as
    train's own plain SGD does; every loss, byte and checksum of the trace is the same
    (pipelined too: the buckets' averages stay in ``.grad`` until the script steps)."""
    own = _train(tmp_path, servers, "train.h5", pipeline)
    script, losses = _script(tmp_path, servers, "script.h5", pipeline)
    for column in ("loss", "bytes_up", "bytes_down", "sim_time"):
        np.testing.assert_array_equal(own.steps[column].to_numpy(), script.steps[column].to_numpy(), err_msg=column)
    for table in ("workers", "checksums"):
        left, right = getattr(own, table), getattr(script, table)
        for column in left.columns:
            if column.startswith(("loss", "bytes", "checksum", "iteration")):
                np.testing.assert_array_equal(left[column].to_numpy(), right[column].to_numpy(), err_msg=column)
    np.testing.assert_array_equal(script.workers["loss_0"].to_numpy(), np.array(losses[1]))
    assert script.config["optimizer"] == "script SGD" and script.status == "complete"


@pytest.mark.quick
def test_trace_map_takes_a_scripts_run_whose_rate_is_the_scripts(tmp_path):
    from mpigrad.analysis.maps import SCRIPT_RATE, map_cells, map_rows

    trace, _ = _script(tmp_path, 1, "script.h5")
    assert trace.config["lr"] is None
    # The script's keys are recorded as not used (None), not as train's defaults; its names stay.
    assert all(trace.config[key] is None for key in SCRIPT_KEYS if key not in ("model", "data", "optimizer"))
    assert (trace.config["model"], trace.config["optimizer"]) == ("script CNN", "script SGD")
    assert trace.config["batch_size"] is None and trace.config["codec"] == "uniform"
    [cell] = map_cells([trace], target_loss=100.0, smooth=1)  # reached at once
    assert list(cell.times) == [SCRIPT_RATE] and cell.times[SCRIPT_RATE][5] > 0
    [row] = map_rows([cell])
    assert row["best_lr"] == SCRIPT_RATE and row["reached"] == "1/1"


@pytest.mark.parametrize("servers, pipeline", [(1, False), ("colocated", True)])
def test_mpigrad_trains_workers_run_the_librarys_loop(tmp_path, monkeypatch, servers, pipeline):
    """One path (issue 45 item 4): each of ``mpigrad train``'s workers exchanges every
    iteration through the ScriptWorker a script's Session drives (its ``exchange``, or
    pipelined ``backward_read``, the part of ``backward`` after the loss is read), with no
    compute of the Worker's own."""
    calls = {}
    original = ScriptWorker._run

    def counted(self, m, *args):
        assert self.recipe is not None  # train's: its recipe, its update rule
        calls.setdefault(self.channel.rank, []).append(m)
        return original(self, m, *args)

    monkeypatch.setattr(ScriptWorker, "_run", counted)
    trace = _train(tmp_path, servers, "train.h5", pipeline)
    assert calls == {1: list(range(6)), 2: list(range(6))}
    assert trace.status == "complete" and list(trace.steps["iteration"]) == list(range(6))


def test_dir_of_mpigrad_shows_the_api_it_loads_on_first_use():
    import mpigrad

    assert {"Session", "Exchanged", "UsageError", "EXIT_REQUEUE", "__version__"} <= set(dir(mpigrad))
    assert "__getattr__" in dir(mpigrad)  # and the module's own globals


def test_the_note_on_the_scripts_keys_agrees_with_their_number():
    assert dropped_note("a.toml", ["batch_size"]) == ("mpigrad: note: a.toml's batch_size is the script's in a "
                                                      "Session: not used")
    assert "a.toml's batch_size, lr are the script's" in dropped_note("a.toml", ["batch_size", "lr"])


def test_the_config_line_leaves_out_the_bits_a_codec_does_not_take_and_the_scripts_keys():
    fp32 = RunConfig(codec="fp32", bits=2)
    assert " bits=" not in f" {config_description(fp32, get_codec({'id': 'fp32'}))}"
    uniform = RunConfig(codec="uniform", bits=2)
    assert " bits=2 " in f" {config_description(uniform, get_codec({'id': 'uniform', 'bits': 2}))} "
    config, _ = script_config(None, {"trace": "t.h5"}, "script Net")
    line = f" {config_description(config, get_codec({'id': 'uniform', 'bits': 2}), script=True)} "
    assert " batch_size=" not in line and " lr=" not in line and " model=script Net " in line, line
    assert " batch_size=32 " in f" {config_description(RunConfig())} "  # train's line keeps them


def test_exchanged_counts_iterations_done_as_rank_0_does():
    record = Exchanged(4, 0.5, (2,), False, True, True)
    assert record.iteration == 4 and record.iterations_done == 5  # rank 0: "stopped after iteration 5"


def _one_worker_run(tmp_path, iterations: int, timeout: float = 20.0):
    """Rank 0 serving a script's fp32 run of ``iterations`` on the loopback (a thread), and
    the one worker's ScriptWorker around a small model, built after a first backward."""
    config, _ = script_config(None, {"codec": "fp32", "policy": "fixed", "iterations": iterations,
                                     "progress_every": 0, "trace": str(tmp_path / "t.h5")}, "script Linear")
    net = LoopbackNetwork(2, 1, timeout=timeout)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(torch.nn.Linear(6, 3))
    errors = {}

    def serve():
        try:
            run_parameter_server(config, net.channel(0), StopFlag(), ["test"], lambda line: None, model=models[0])
        except BaseException as exc:  # noqa: BLE001
            errors[0] = exc

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    model = models[1]
    x, y = torch.randn(8, 6, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])

    def backward() -> float:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss.item()

    loss = backward()
    return ScriptWorker(config, net.channel(1), model), model, backward, loss, thread, errors


def test_each_exchange_after_a_backward_is_taken_and_a_loop_past_the_iterations_is_named(tmp_path):
    """After a backward: into fresh gradients, into gradients zeroed in place, or gradients
    the script set itself (torch.autograd.grad). Past the run's iterations, the message says
    what likely happened (the loop runs more steps than session.iterations)."""
    worker, model, backward, loss, thread, errors = _one_worker_run(tmp_path, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert worker.exchange(loss, 0.0, 0.0).iteration == 0
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # the next backward accumulates into the .grad the exchange left
    assert worker.exchange(backward(), 0.0, 0.0).iteration == 1
    optimizer.step()
    loss = torch.nn.functional.cross_entropy(model(torch.ones(2, 6)), torch.tensor([0, 1]))
    for p, grad in zip(model.parameters(), torch.autograd.grad(loss, list(model.parameters()))):
        p.grad = grad  # no backward, but gradients of the script's own
    assert worker.exchange(loss.item(), 0.0, 0.0).last
    thread.join(30)
    assert not errors, errors
    backward()
    with pytest.raises(UsageError, match=r"^exchange\(\) called for iteration 4, but the run has 3 \(iterations\): "
                                         r"the loop runs more steps than session.iterations"):
        worker.exchange(0.0, 0.0, 0.0)


def test_a_second_exchange_without_a_backward_is_refused_at_once(tmp_path):
    """Not 30 doubled steps later, when the loop runs past the run's iterations: the second
    exchange of an iteration finds no gradient accumulated since the first and its average
    still in .grad."""
    worker, model, backward, loss, thread, errors = _one_worker_run(tmp_path, 60, timeout=2.0)
    worker.exchange(loss, 0.0, 0.0)
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    with pytest.raises(UsageError) as info:
        worker.exchange(loss, 0.0, 0.0)
    assert str(info.value).startswith("exchange() called twice without a backward() in between (iteration 1)")
    assert "\n" not in str(info.value) and worker.reported  # rank 0 was told
    thread.join(30)  # rank 0 (on the loopback, which shares no report) waits for the loss, then times out


def test_a_serving_rank_that_never_served_is_refused_at_close():
    session = Session.__new__(Session)
    session.rank, session.is_worker, session._done, session._started = 0, False, False, False
    with pytest.raises(UsageError, match=r"^the script on rank 0 ended without calling session.serve\(\)"):
        session.close()
    session._done, session._started = False, True  # it served: nothing to say
    session.close()


def test_mpigrads_own_errors_end_a_script_as_one_line_and_others_keep_their_traceback():
    script = ("import sys; from mpigrad.api import install_one_line_errors; from mpigrad.errors import UsageError; "
              "install_one_line_errors(3); raise (UsageError('bits must be in 1..32') if sys.argv[1] == 'own' "
              "else ValueError('the script s own'))")
    own = subprocess.run([sys.executable, "-c", script, "own"], capture_output=True, text=True)
    assert own.returncode == 1 and own.stderr == "mpigrad: rank 3: error: bits must be in 1..32\n", own.stderr
    other = subprocess.run([sys.executable, "-c", script, "other"], capture_output=True, text=True)
    assert other.returncode == 1 and other.stderr.startswith("Traceback") and "ValueError" in other.stderr
