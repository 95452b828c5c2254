"""A worker of a script's own loop (:class:`mpigrad.Session`): the script computes the loss
and the gradients and steps its own optimizer; :meth:`ScriptWorker.exchange` runs one
iteration of the protocol (:mod:`.iteration`) in between, on any channel (MPI, or the
loopback of the in-process tests). ``mpigrad train``'s workers run the same loop with
mpigrad's recipe (:mod:`.recipe`)."""

from __future__ import annotations

import dataclasses

from ...counters import launched, synchronized
from ...errors import UsageError
from ..roles.iteration import run_iteration
from .follower import RankFailure, deliver_checkpoint, follower_role
from ..wire import CHECKPOINT_AFTER, STOP_AFTER, PeerTimeout

__all__ = ["SCRIPT_KEYS", "Exchanged", "ScriptWorker", "leave_run", "script_keys_unused", "script_record"]

#: The keys of a run's config that belong to the script in a :class:`Session`: its model,
#: data, batches, loss, optimizer, schedule, augmentation, precision and evaluation. Given as
#: keyword arguments they are refused; in a config file they are left out, and rank 0 names
#: them in a start-up note. The model's device is the script's (where its parameters are).
SCRIPT_KEYS = ("model", "model_opts", "data", "data_dir", "data_opts", "batch_size", "lr", "weight_decay",
               "weight_decay_in", "optimizer", "optimizer_opts", "lr_schedule", "lr_schedule_opts", "lr_warmup",
               "lr_scaling", "augment", "augment_opts", "autocast", "momentum_correction", "eval_every",
               "eval_samples", "device", "share_gpu", "tf32")

#: The script's keys a script's trace still records as the config has them: they name the script's.
_SCRIPT_NAMED = ("model", "data", "optimizer")


def script_keys_unused(config: dict) -> dict:
    """A script's run's config dict (:class:`mpigrad.Session`) as it is recorded: each key
    the script owns (:data:`SCRIPT_KEYS`) None, not used by mpigrad whatever the
    config file or the defaults said, but ``model``, ``data`` and ``optimizer``, which say
    ``script NAME``."""
    return {key: None if key in SCRIPT_KEYS and key not in _SCRIPT_NAMED else value for key, value in config.items()}


def script_record(config):
    """A copy of a script's run's ``config`` whose ``to_dict()`` (what its trace records as
    its config) is :func:`script_keys_unused`'s; its attributes are the config's, which the
    trace's other attributes read. The checkpoint's identity keeps the config's own dict."""
    import copy

    recorded = copy.copy(config)
    recorded.to_dict = lambda: script_keys_unused(config.to_dict())
    return recorded


@dataclasses.dataclass(frozen=True)
class Exchanged:
    """What one exchange did on this worker."""

    #: The iteration (0-based: the trace's ``iteration`` column) whose gradients were
    #: exchanged; :attr:`iterations_done` counts as rank 0's lines do.
    iteration: int
    #: This worker's own loss as it reported it (not the workers' mean: that is rank 0's,
    #: the trace's ``steps.loss``, which the workers are not sent).
    loss: float
    #: The bits per quantized layer rank 0 chose for the iteration (the policy's Control).
    bits: tuple[int, ...]
    #: Whether it was the run's last iteration (``iterations``).
    last: bool
    #: Whether rank 0 checkpointed after it (``checkpoint_every``, or a stop): the first
    #: worker then holds the run's state (``Session.state_dict()``) for the script to save
    #: with its model and optimizer.
    checkpoint: bool = False
    #: Whether the run stops after it (a walltime signal or ``walltime``): the script saves
    #: the checkpoint and exits ``EXIT_REQUEUE`` (75) on every rank.
    stop: bool = False

    @property
    def iterations_done(self) -> int:
        """The iterations the run has done after this one (``iteration + 1``): rank 0's count
        in its lines (``checkpoint after iteration N``, ``stopped after iteration N``) and the
        ``start_iteration`` of a run resumed from a checkpoint taken here."""
        return self.iteration + 1


class ScriptWorker:
    """A worker role around the script's ``model`` (:class:`~.worker.Worker` with a model),
    built with rank 0's start-up exchange; :meth:`exchange` takes the script's gradients.

    With a ``recipe`` (:class:`~.recipe.Recipe`: ``mpigrad train``'s worker) the model is
    the config's and the replica applies the run's update rule in the exchange; its state is
    the checkpoint's (rank 0 writes the file), and a failure is raised as a
    :class:`RankFailure` for the launcher to report. Without one (a script's), the decoded
    average is left in ``.grad``, rank 0 delivers each checkpoint to the first worker, and a
    failure is reported to rank 0 here, then raised as it came."""

    def __init__(self, config, channel, model, recipe=None):
        self.config, self.channel, self.model, self.recipe = config, channel, model, recipe
        #: Whether rank 0 was told that this worker leaves (:meth:`leave`, a failure).
        self.reported = False
        # A script's is built at its first exchange, after its backward: the replica points
        # every .grad at its flat buffer, so the gradients backward made are kept and put back.
        made = [p.grad for p in model.parameters()]
        self.role, start, iterations = follower_role(config, channel, model, recipe)
        if recipe is None:
            for p, grad in zip(model.parameters(), made):
                p.grad = grad
        #: The iteration the run starts at (its checkpoint's, when resumed; else 0).
        self.start_iteration = self.role.iteration = start
        if iterations != config.iterations:
            raise UsageError(self.leave(f"worker rank {channel.rank} runs {config.iterations} iterations and rank 0 "
                                        f"{iterations}: set session.iterations alike on every rank"))
        self.params = [p for p in model.parameters() if p.requires_grad]
        #: The run's state after the last checkpoint (the first worker's; None elsewhere).
        self.state: dict | None = None
        #: Whether rank 0 stopped the run (a walltime signal): no exchange follows.
        self.stopped = False
        # A script's exchange() checks that a backward ran since the last one (_check_backward):
        # a hook on each parameter counts the gradients backward accumulated, and the .grad
        # tensors the last exchange left are kept (None before the first exchange).
        self._accumulated = 0
        self._left: list | None = None
        if recipe is None and self.role.pipeline is None:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._count_accumulation)

    def _count_accumulation(self, param) -> None:
        self._accumulated += 1

    def _check_backward(self) -> None:
        """UsageError where no backward ran since the last exchange: no parameter's gradient
        was accumulated since (its hook did not fire) and every ``.grad`` is still the tensor
        that exchange left there (or None), holding the average it wrote: exchanging it again
        would run another iteration on the same gradients. A ``.grad`` the script set
        itself, or gradients zeroed to None (then no gradient is found), are not refused here."""
        if self._left is None or self._accumulated:
            return
        grads = [p.grad for p in self.params]
        if any(g is not None for g in grads) and all(g is None or g is left for g, left in zip(grads, self._left)):
            raise UsageError(f"exchange() called twice without a backward() in between (iteration "
                             f"{self.role.iteration}): each iteration is one loss.backward(), then one exchange()")

    def backward(self, loss, cpu: float, wall: float) -> Exchanged:
        """A pipelined run's (``pipeline``, colocated servers) ``loss.backward()`` and the
        exchange of iteration ``iteration``: each bucket's frames go as backward produces it
        (:mod:`.pipeline`). ``cpu`` and ``wall`` are the script's seconds before it (the
        batch and the forward pass)."""
        if self.role.pipeline is None:
            raise UsageError("backward() is the pipelined run's (pipeline = true): call loss.backward(), then "
                             "exchange(loss)")
        self._check_open()
        self.zero_gradients()  # backward accumulates into the flat gradient
        for p, view in zip(self.params, self.role.replica.grad_views):
            p.grad = view
        return self.backward_read(loss, self.read_loss(loss), cpu, wall)

    def backward_read(self, loss, value: float, cpu: float, wall: float) -> Exchanged:
        """:meth:`backward` for a loop that zeroed the gradients (:meth:`zero_gradients`)
        before its forward pass and read the loss's ``value`` (:meth:`read_loss`) before
        timing its compute (``mpigrad train``'s), every ``.grad`` a view of the flat gradient."""
        if self.role.pipeline is None:
            raise UsageError("backward_read() is the pipelined run's (pipeline = true)")
        self._check_open()
        return self._run(self.role.iteration, value, cpu, wall, loss)

    def zero_gradients(self) -> None:
        """Zero the replica's flat gradient, which every parameter's ``.grad`` views."""
        replica = self.role.replica
        if replica.codecs_on_device:
            launched("torch")
        replica.flat_grad.zero_()

    def read_loss(self, loss) -> float:
        """The loss tensor's value (on a GPU, a host synchronisation: counted)."""
        if self.role.replica.codecs_on_device:
            synchronized("loss read")  # .item() of a device value
        return float(loss.detach().item())

    def _check_open(self) -> None:
        """UsageError for an exchange after the run stopped or past its iterations."""
        m = self.role.iteration
        if self.stopped:
            raise UsageError(f"exchange() after the run stopped (after iteration {m}, to be requeued): save the "
                             "state and exit 75 (mpigrad.EXIT_REQUEUE) on every rank")
        if m >= self.config.iterations:
            raise UsageError(f"exchange() called for iteration {m + 1}, but the run has {self.config.iterations} "
                             "(iterations): the loop runs more steps than session.iterations; end it there, or set "
                             "session.iterations to its steps on every rank")

    def exchange(self, loss: float, cpu: float, wall: float) -> Exchanged:
        """Iteration ``iteration``: this worker's gradients (each parameter's ``.grad``; a
        missing one counts as zero) and ``loss``, with the CPU and wall seconds the script's
        step took (the clock's compute); the decoded average comes back into ``.grad``.
        UsageError past the run's iterations; without any gradient, a second exchange
        without a backward in between (:meth:`_check_backward`), or on a failure, rank 0 is
        told (it names this rank and closes the trace "failed") and the error raised."""
        if self.role.pipeline is not None:
            raise UsageError("pipeline: call session.backward(loss) in place of loss.backward() and exchange(): "
                             "it sends each bucket as backward produces it")
        self._check_open()
        try:
            if self.recipe is None:
                self._check_backward()
            self._gather_gradients()
        except UsageError as exc:
            self.leave(str(exc))
            raise
        if self.recipe is None:
            self._left, self._accumulated = [p.grad for p in self.params], 0
        return self._run(self.role.iteration, loss, cpu, wall)

    def _run(self, m: int, loss: float, cpu: float, wall: float, tensor=None) -> Exchanged:
        """Iteration ``m`` of the protocol with the script's loss; then the checkpoint's
        exchange where rank 0 marked one."""
        self.role.take_computed(loss, cpu, wall, tensor)
        try:
            run_iteration(self.role, m)
        except (UsageError, PeerTimeout):
            raise
        except Exception as exc:
            if self.recipe is not None:  # mpigrad train's: the launcher reports it
                raise RankFailure(exc, self.channel, m) from exc
            self.reported = True
            RankFailure(exc, self.channel, m).report()
            raise
        command = self.role.control_msg.command
        saved = command in (CHECKPOINT_AFTER, STOP_AFTER)
        if saved:  # every rank's state to rank 0; a script's, the whole to the first worker (session.py)
            self.channel.gather_object(self.role.state_dict(), f"checkpoint state after iteration {m + 1}")
            if self.recipe is None:
                self.state = deliver_checkpoint(self.channel)
        self.stopped = command == STOP_AFTER
        bits = tuple(int(b) for b in self.role.control_msg.bits)
        return Exchanged(m, loss, bits, m + 1 == self.config.iterations, saved, command == STOP_AFTER)

    def _gather_gradients(self) -> None:
        """Every parameter's gradient into the replica's flat gradient, and ``.grad`` a view
        of it again (an optimizer's ``zero_grad()`` sets it to None; backward then allocates)."""
        missing = 0
        for p, view in zip(self.params, self.role.replica.grad_views):
            grad = p.grad
            if grad is None:
                missing += 1
                view.zero_()
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
            p.grad = view
        if missing == len(self.params):
            raise UsageError(f"exchange() found no gradient on any parameter at iteration {self.role.iteration}: "
                             "call loss.backward() before it")

    @property
    def iteration(self) -> int:
        """The next iteration to exchange (the number exchanged so far)."""
        return self.role.iteration

    @property
    def over(self) -> bool:
        """Whether the run has ended for this worker (its last iteration, or a stop)."""
        return self.stopped or self.role.iteration >= self.config.iterations

    def leave(self, text: str) -> str:
        """Tell rank 0 that this worker leaves before the run's end, saying ``text`` (rank 0
        ends the run with the line naming the worker and closes the trace "failed"); return
        ``text``."""
        self.reported = True
        leave_run(self.channel, self.role.iteration, text)
        return text


def leave_run(channel, iteration: int, text: str) -> None:
    """Tell rank 0 that this worker leaves at ``iteration``, saying ``text`` (it ends the
    run naming the worker and closes the trace "failed"; this rank waits for that end, or
    returns when it does not come)."""
    RankFailure(RuntimeError(text), channel, iteration).report()
