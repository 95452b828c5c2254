"""mpigrad as a library: a script's own loop, with mpigrad's codecs, policies, servers,
network model and trace (docs/api.rst).

The same script runs on every rank (``mpiexec -n P+1 python -m mpi4py script.py``). Each
rank builds the same model and a :class:`Session` around it. Rank 0 (the scheduler, MDP
server and parameter server) and any separate shard servers call :meth:`Session.serve`,
which returns when the workers have finished; each worker runs the script's loop and calls
:meth:`Session.exchange` after ``loss.backward()``: the gradients go to the servers with the
run's codec and bits, and the decoded average comes back into every parameter's ``.grad``,
where the script's ``optimizer.step()`` reads it. The run is configured as ``mpigrad train``
is, by the same TOML files and keys (:meth:`RunConfig.from_sources`), less the keys the
script owns (:data:`SCRIPT_KEYS`: its model, data, optimizer, schedule and evaluation).

The iteration is the runtime's (:mod:`mpigrad.runtime.roles.iteration`): a worker's ``begin``
takes the script's loss instead of computing one, its ``end`` applies nothing, and rank 0
applies no update (the workers' optimizer is the script's): one protocol, one trace writer.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import zlib
from typing import Any

from .config import RunConfig
from .errors import UsageError
from .runtime.run.script import SCRIPT_KEYS, Exchanged

__all__ = ["Session", "Exchanged", "SCRIPT_KEYS", "script_config"]


#: Keys of ``mpigrad train`` that a :class:`Session` takes otherwise, each with how.
TRAIN_ONLY_KEYS = {
    "resume": "a Session resumes from the state the script saved: pass resume=STATE (Session.state_dict())",
    "checkpoint": "a Session writes no checkpoint file: the script saves Session.state_dict() with its own",
}


def script_config(config_file: str | None, options: dict[str, Any], model_name: str,
                  optimizer_name: str | None = None) -> tuple[RunConfig, list[str]]:
    """The run's config for a script: defaults, the TOML file, then ``options`` (the keys of
    ``mpigrad train``'s config files), checked as ``mpigrad train`` checks them; the keys the
    script owns (:data:`SCRIPT_KEYS`) are refused as ``options`` and dropped from the file
    (before the checks: what is dropped is not checked). Returns the config, whose ``model``,
    ``data`` and ``optimizer`` say ``script NAME``, and the file's dropped keys. UsageError
    (one line) on a bad option, a script's key or a key of :data:`TRAIN_ONLY_KEYS`."""
    from .runtime.plan.checks import check_options

    for key in options:
        if key in SCRIPT_KEYS:
            raise UsageError(f"{key}: the script's own (its model, data, optimizer and loop), not mpigrad.Session's: "
                             "drop the argument")
    config = RunConfig.from_sources(config_file, options)
    for key, how in TRAIN_ONLY_KEYS.items():
        if getattr(config, key):
            raise UsageError(f"{key if key in options else f'{config_file}: {key}'}: {how}")
    dropped = sorted(key for key in config.given if key in SCRIPT_KEYS)
    defaults = RunConfig()
    for key in SCRIPT_KEYS:
        setattr(config, key, getattr(defaults, key))
    config.given = frozenset(config.given - set(SCRIPT_KEYS))
    check_options(config)
    config.model, config.data = model_name, "script"
    config.optimizer = optimizer_name or "script"
    config.lr, config.weight_decay, config.eval_every = None, 0.0, 0  # the script's rate: not known here
    return config, dropped


def dropped_note(config_file: str, dropped: list[str]) -> str:
    """Rank 0's start-up note naming the keys of ``config_file`` that are the script's
    (``script_config``'s dropped keys), which the run does not use."""
    verb = "is" if len(dropped) == 1 else "are"
    return f"mpigrad: note: {config_file}'s {', '.join(dropped)} {verb} the script's in a Session: not used"


class Session:
    """One run of a script's own training loop over MPI, with mpigrad's method.

    ``Session(model, config=None, *, optimizer=None, resume=None, comm=None, **options)``,
    on every rank:

    - ``model``: the script's ``torch.nn.Module``, built alike on every rank (the same
      architecture and the same initial weights: a hash is checked here). The Session lays
      its parameters and gradients out in flat buffers (``p.data`` and ``p.grad`` become
      views), so build the optimizer over ``model.parameters()`` before or after.
    - ``config``: a TOML file of ``mpigrad train`` (its ``# ranks: N`` line is checked);
      ``options``: its keys (``policy="mqgrad"``, ``bits=2``, ``servers="colocated"``,
      ``trace="runs/a.h5"``, ``iterations=300``, ...), over the file's.
    - ``optimizer``: the script's, checked to hold only the model's parameters, its class
      name recorded in the trace.
    - ``resume``: the state a checkpoint gave (:meth:`state_dict`), on every rank alike.
    - ``comm``: the communicator (``MPI.COMM_WORLD``).

    Like ``mpigrad train`` it sets torch's and Numba's threads per rank (``threads``, else
    ``SLURM_CPUS_PER_TASK``, else 1) and catches SIGUSR1 and SIGTERM (a stop at the next
    iteration's end). When the run ends on this rank (its last exchange, ``serve()``'s
    return, :meth:`close`, an error) it puts back what it changed in the process: the thread
    counts and variables, TF32, the signals' handlers, the runtime's module state
    (``runtime/run/world.py``, ``ProcessState``; the global RNGs are the script's and stay
    as the script left them). So one process can run Session after Session, on
    ``MPI.COMM_WORLD`` or on a communicator split from it, as ``mpigrad sweep`` runs
    ``train`` runs; the one-line error hook stays installed (once per process).

    Collective: every rank constructs it with the same arguments. A bad option, a model that
    differs between ranks or an optimizer over other parameters raises :class:`UsageError`
    (one line) on every rank alike, before any work starts.

    From its construction on, an error of mpigrad's own (:func:`one_line_errors`) that ends
    the script prints as one line, ``mpigrad: rank R: error: MESSAGE`` on stderr, in place of
    its traceback (``MPIGRAD_DEBUG=1`` keeps the traceback); the process exits non-zero as
    with any uncaught exception. Other exceptions keep their tracebacks.
    """

    #: The process as the script had it before the Session (``ProcessState``), until ``_end``.
    _process = None

    def __init__(self, model, config: str | None = None, *, optimizer=None, resume: dict | None = None, comm=None,
                 **options: Any):
        from mpi4py import MPI

        from .runtime.run.world import ProcessState

        started = time.monotonic()
        self._process = ProcessState.taken()
        self._done = False
        try:
            self._start(MPI, model, config, optimizer, resume, comm, options, started)
        except BaseException:
            self._end()
            raise

    def _start(self, MPI, model, config, optimizer, resume, comm, options, started) -> None:  # noqa: N803
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        install_one_line_errors(self.rank)
        self.model = model
        config_file = config
        self.config, dropped = self._agreed_config(config_file, options, model, optimizer)
        config = self.config
        config.resume = resume is not None
        self._agree(_resume_problem(config.resume, self.comm))
        from .runtime.plan.environment import apply_thread_settings, threads_per_rank
        from .runtime.run.preflight import check_launch
        from .runtime.roles.stopping import StopFlag

        apply_thread_settings(threads_per_rank(config.threads))
        check_launch(config, self.comm, model)
        self._agree(_model_problem(model, self.comm))
        self._agree(_optimizer_problem(optimizer, model) if optimizer is not None else None)
        if config.resume:
            self._agree(_resume_state_problem(resume, config, self.comm) if self.rank == 0 else None)
        if dropped and self.rank == 0:
            print(dropped_note(config_file, dropped), flush=True)
        from .runtime.run.session import open_channel, warm_up_in_turn
        from .runtime.exchange.warmup import KernelWatch

        self._warm_up_s = warm_up_in_turn(config, self.comm)
        self._watch = KernelWatch()
        # On every rank, as under mpigrad train: a walltime signal (SIGUSR1, SIGTERM) sets a
        # flag that rank 0 reads once per iteration; the run stops at an iteration's end.
        self._stop = StopFlag(config.walltime, started).install()
        self._channel = channel = open_channel(config, self.comm)
        #: The number of workers P (ranks that run the loop), as DistributedSampler's num_replicas.
        self.workers = len(channel.workers)
        #: Whether this rank runs the training loop (else it serves: :meth:`serve`).
        self.is_worker = channel.is_worker
        #: This worker's index in 0..P-1 (DistributedSampler's rank), None on a serving rank.
        self.worker_index = channel.workers.index(self.rank) if self.is_worker else None
        #: The iteration the run starts at: the resumed state's, else 0 (skip the batches before it).
        self.start_iteration = int(resume["server"]["iteration"]) if resume is not None else 0
        self._resume = resume
        self._worker = None  # a worker's ScriptWorker, built at its first exchange (rank 0 serves by then)
        self._done = self._started = False
        atexit.register(self._at_exit)  # a worker that left the loop early; a serving rank that never served
        self._cpu, self._wall = time.process_time(), time.perf_counter()

    def _agreed_config(self, config_file, options, model, optimizer) -> tuple[RunConfig, list[str]]:
        """``script_config`` on every rank, a refusal raised on every rank alike."""
        problem = None
        try:
            optimizer_name = f"script {type(optimizer).__name__}" if optimizer is not None else None
            result = script_config(config_file, options, f"script {type(model).__name__}", optimizer_name)
        except UsageError as exc:
            problem = str(exc)
        self._agree(problem)
        return result

    @property
    def iterations(self) -> int:
        """The run's iterations: the number of :meth:`exchange` calls each worker makes (the
        config's ``iterations``). May be set before :meth:`serve` and the first exchange, on
        every rank alike (e.g. epochs times the batches of a sampler of ``workers`` parts)."""
        return self.config.iterations

    @iterations.setter
    def iterations(self, value: int) -> None:
        if self._started:
            raise UsageError("iterations: set it before serve() and the first exchange(), on every rank alike")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"iterations must be a whole number >= 1, got {value!r}")
        self.config.iterations = value

    def _agree(self, problem: str | None) -> None:
        """Raise one UsageError on every rank when any rank found a problem (the first's)."""
        problems = self.comm.allgather(problem)
        found = [(rank, text) for rank, text in enumerate(problems) if text]
        if found:
            rank, text = found[0]
            raise UsageError(text.replace("{rank}", str(rank)))

    # ---- rank 0 and the servers ---------------------------------------------------------
    def serve(self) -> int:
        """Rank 0: schedule, decide the bits, serve shard 0 and write the trace, until the
        workers have run every iteration; a shard server: serve its shard. Returns then (the
        script goes on) the exit code for the script: 0, or ``EXIT_REQUEUE`` (75) when the
        run stopped for a requeue (its state went to the first worker). A worker's failure
        ends the run: rank 0 closes the trace "failed" and raises the error naming it."""
        if self.is_worker:
            raise UsageError(f"rank {self.rank} is a worker: serve() is rank 0's and the shard servers' "
                             "(use session.is_worker)")
        from .runtime.run.session import report_late_kernels, run_other_rank, run_parameter_server

        self._started = True
        try:
            if self.rank == 0:
                log = lambda message: print(message, flush=True)  # noqa: E731
                return run_parameter_server(self.config, self._channel, self._stop, sys.argv, log, self._warm_up_s,
                                            model=self.model, resume_state=self._resume)
            return run_other_rank(self.config, self._channel, self.model)
        finally:
            report_late_kernels(self.rank, self._watch)  # before _end puts the warm-up record back
            self._end()

    # ---- a worker -----------------------------------------------------------------------
    def _worker_role(self):
        """This worker's ScriptWorker, built at its first exchange (with rank 0's start-up
        exchange, which rank 0 answers in :meth:`serve`: so the script may make its own
        collective calls between constructing the Session and serving). The worker waits
        for it up to the config's ``timeout`` (not the twice that a worker gives rank 0 inside
        the run), then raises PeerTimeout asking whether rank 0's script calls ``serve()``."""
        if not self.is_worker:
            raise UsageError(f"rank {self.rank} serves: exchange() and backward() are a worker's (use "
                             "session.is_worker)")
        if self._worker is None:
            from .runtime.run.script import ScriptWorker
            from .runtime.wire import PeerTimeout

            self._started = True
            channel = self._channel
            in_run, channel.timeout = channel.timeout, self.config.timeout
            try:
                self._worker = ScriptWorker(self.config, channel, self.model)
            except PeerTimeout as exc:
                raise PeerTimeout(f"{exc}: does the script call session.serve() on rank 0?") from None
            finally:
                channel.timeout = in_run
        return self._worker

    def exchange(self, loss) -> Exchanged:
        """After ``loss.backward()``: send this worker's gradients and ``loss`` (a tensor or a
        number: what the policy observes and the trace records), receive the decoded average
        of every worker's into each parameter's ``.grad`` (a parameter without a gradient
        counts as zero). Then step the optimizer. Call it ``iterations`` times per worker,
        once per ``loss.backward()``: a second exchange with no gradient accumulated since
        the last (its average still in ``.grad``) raises UsageError, and rank 0 ends the run
        naming it. The record's ``loss`` is this worker's own (:class:`Exchanged`)."""
        value = float(loss.detach().item() if hasattr(loss, "detach") else loss)
        cpu, wall = time.process_time() - self._cpu, time.perf_counter() - self._wall
        return self._finished(lambda: self._worker_role().exchange(value, cpu, wall))

    def backward(self, loss) -> Exchanged:
        """``loss.backward()`` and :meth:`exchange` in one call (a worker). In a pipelined run
        (``pipeline = true``, colocated servers) they overlap: each bucket of gradients goes to
        its server as backward produces it, and the averages come back into ``.grad`` before
        it returns; there, call this in place of ``loss.backward()`` and ``exchange``, and it
        starts from zero gradients (none accumulated by an earlier backward)."""
        if not self.config.pipeline:
            loss.backward()
            return self.exchange(loss)
        cpu, wall = time.process_time() - self._cpu, time.perf_counter() - self._wall
        return self._finished(lambda: self._worker_role().backward(loss, cpu, wall))

    def _finished(self, step) -> Exchanged:
        """Run one exchange (``step``) and keep the Session's account of it. On an error rank
        0 is told (unless it already was, or is gone, or the run is over), then it is raised."""
        from .runtime.wire import PeerTimeout

        try:
            record = step()
        except BaseException as exc:
            worker = self._worker
            if worker is not None and not (worker.reported or worker.over or isinstance(exc, PeerTimeout)):
                worker.leave(f"{type(exc).__name__}: {exc}" if not isinstance(exc, UsageError) else str(exc))
            self._end()
            raise
        self._cpu, self._wall = time.process_time(), time.perf_counter()
        if record.last or record.stop:
            from .runtime.run.session import report_late_kernels
            report_late_kernels(self.rank, self._watch)  # before _end puts the warm-up record back
            self._end()
        return record

    def state_dict(self) -> dict | None:
        """The first worker (``worker_index`` 0), after an exchange that returned
        ``checkpoint``: the run's state after that iteration (rank 0's policy, clocks and
        trace position, every worker's and server's codec and error-feedback state), to save
        with the script's model, optimizer and schedule as they are after that iteration's
        ``optimizer.step()``, and to pass back as ``Session(..., resume=STATE)``. None on any
        other rank; UsageError before the first checkpoint."""
        if self.worker_index != 0:
            return None
        if self._worker is None or self._worker.state is None:
            raise UsageError("state_dict(): no checkpoint yet (an exchange returns checkpoint=True after one: "
                             "set checkpoint_every, or wait for a walltime stop)")
        return self._worker.state

    def exit(self, code: int) -> None:
        """End this process with ``code``, together with every other rank: a barrier, then
        MPI_Finalize, then exit (as ``mpigrad train`` ends: Python's own exit handlers do not
        run; stdout and stderr are flushed). Call it on every rank for the requeue's
        ``EXIT_REQUEUE`` (75), after the first worker saved the checkpoint: under ``python -m
        mpi4py`` a ``sys.exit(75)`` aborts the job at once, perhaps while the first worker is
        still writing it. It finalizes MPI_COMM_WORLD whatever ``comm`` was. Does not return."""
        from .runtime.run.launch import end_together

        self._end()
        end_together(self.comm, int(code))

    def close(self) -> None:
        """End this rank's part. A worker that has not run every iteration left the loop
        early: rank 0 is told (it ends the run with a line naming the worker and closes the
        trace "failed"), and UsageError is raised here. A serving rank (rank 0, a shard
        server) that never called :meth:`serve` raises UsageError saying so (the workers
        would wait for it). Called at exit when not called: there a serving rank's refusal
        ends every rank (MPI_Abort, exit 2) after its line."""
        if not self.is_worker:
            ended = self._done
            self._end()
            if not (self._started or ended):
                raise UsageError(f"the script on rank {self.rank} ended without calling session.serve(), which "
                                 "serves the workers: call it where not session.is_worker")
            return
        if self._done:
            self._end()
            return
        self._end()
        done = self._worker.iteration if self._worker is not None else self.start_iteration
        text = (f"worker rank {self.rank} left the training loop after {done} of {self.iterations} iterations "
                "(each worker calls exchange() iterations times)")
        from .runtime.run.script import leave_run

        leave_run(self._channel, done, text)
        raise UsageError(text)

    def _end(self) -> None:
        """The run is over on this rank: no exit hook, and the process as before the Session."""
        self._done = True
        atexit.unregister(self._at_exit)
        if self._process is not None:
            self._process.restore(rng=False)
            self._process = None

    def _at_exit(self) -> None:
        if self._done or _uncaught:  # an uncaught exception ends the script: it said why
            return
        try:
            self.close()
        except UsageError as exc:
            _say(f"mpigrad: rank {self.rank}: error: {exc}")
            if not self.is_worker:  # the workers wait for this rank: end them, with this line only
                from .runtime.run.launch import abort_world
                abort_world(self.comm, 2)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if error is not None and not self.is_worker:  # the error says what happened, not a missing serve()
            self._end()
            return
        if error is not None and not self._done and self.is_worker:
            # The script's error inside the loop: rank 0 names it and closes the trace "failed".
            from .runtime.run.script import leave_run

            self._end()
            done = self._worker.iteration if self._worker is not None else self.start_iteration
            leave_run(self._channel, done, f"{type(error).__name__}: {error}")
            return
        self.close()


def one_line_errors() -> tuple[type[BaseException], ...]:
    """The classes of mpigrad's own errors, each a one-line message: :class:`UsageError`, a
    silent peer (``PeerTimeout``), a peer's report on rank 0 (``PeerFailed``: "worker rank 2
    failed at iteration 1: ..."), a rank's failure (``RankFailure``) and a run's
    (``TrainingError``: a non-finite loss)."""
    from .errors import TrainingError
    from .runtime.run.follower import RankFailure
    from .runtime.wire import PeerFailed, PeerTimeout

    return UsageError, PeerTimeout, PeerFailed, RankFailure, TrainingError


#: Whether an exception reached the top of the script since :func:`install_one_line_errors`.
_uncaught = False


def _say(line: str) -> None:
    """``line`` on stderr in one write (the launcher interleaves the ranks' writes)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def install_one_line_errors(rank: int) -> None:
    """Install, once per process, a ``sys.excepthook`` that prints an uncaught error of
    :func:`one_line_errors` as ``mpigrad: rank RANK: error: MESSAGE`` (unless
    ``MPIGRAD_DEBUG`` is set) and hands every other exception to the hook before it."""
    previous = sys.excepthook
    if getattr(previous, "mpigrad_rank", None) is not None:
        return

    def hook(kind, error, traceback) -> None:
        global _uncaught
        _uncaught = True
        if issubclass(kind, one_line_errors()) and not os.environ.get("MPIGRAD_DEBUG"):
            _say(f"mpigrad: rank {rank}: error: {error}")
            return
        previous(kind, error, traceback)

    hook.mpigrad_rank = rank
    sys.excepthook = hook


def _resume_problem(resume: bool, comm) -> str | None:
    """A line where this rank resumes and rank 0 does not, or the other way round."""
    if resume == comm.bcast(resume if comm.Get_rank() == 0 else None, root=0):
        return None
    return ("rank {rank} " + ("resumes (resume=STATE) and rank 0 does not" if resume else
                              "does not resume and rank 0 does (resume=STATE)") + ": pass the same state on every rank")


def _resume_state_problem(state, config: RunConfig, comm) -> str | None:
    """Rank 0's line where ``state`` is not a checkpoint of this run (its format, method or
    world size), else None."""
    from .runtime.measure import checkpoint

    try:
        checkpoint.check(state, checkpoint.identity(config.to_dict(), comm.Get_size()), "the state given")
        int(state["server"]["iteration"])
    except UsageError as exc:
        return str(exc)
    except (KeyError, TypeError, ValueError):
        return "resume: the state given is not the state of an mpigrad run (Session.state_dict())"
    return None


def _model_problem(model, comm) -> str | None:
    """A line for rank 0 where this rank's model differs from rank 0's (names, shapes or
    initial values of its parameters and buffers), else None. Collective (a bcast)."""
    import torch

    crc = 0
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        crc = zlib.crc32(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode(), crc)
        # The bytes as torch holds them (any dtype, 0-d buffers such as BatchNorm's count too).
        crc = zlib.crc32(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
    reference = comm.bcast(crc if comm.Get_rank() == 0 else None, root=0)
    if crc == reference:
        return None
    return ("the model on rank {rank} differs from rank 0's (its parameters' names, shapes or initial values): "
            "build it alike on every rank, after the same torch.manual_seed")


def _optimizer_problem(optimizer, model) -> str | None:
    """A line where ``optimizer`` holds a parameter that is not one of ``model``'s."""
    own = {id(p) for p in model.parameters()}
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        return "optimizer= on rank {rank} is not a torch.optim optimizer (it has no param_groups)"
    for group in groups:
        for p in group["params"]:
            if id(p) not in own:
                return ("the optimizer on rank {rank} holds a parameter that is not the model's: build it over "
                        "model.parameters() of the model given to the Session")
    return None
