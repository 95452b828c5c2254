"""The order of one iteration, written once.

Ranks 0..S-1 are servers (rank 0 also the scheduler and MDP server), ranks S..S+P-1 workers.
Every role (:class:`~.worker.Worker`, :class:`~.server.ShardServer` for ranks 1..S-1,
:class:`~.server.ParameterServer` for rank 0) implements the phases below, and
:func:`run_iteration` calls them in this order on every rank; the messages are laid out in
:mod:`.wire.messages`.

=============  ==============================  ===========================  ==============================
phase          worker                          server s > 0                 rank 0
=============  ==============================  ===========================  ==============================
``begin``      forward + backward (the loop)   -                            start the iteration's clock
``losses``     send LossReport to rank 0       -                            gather the P losses, check them
``control``    receive Control (world bcast)   receive Control              policy decides bits; broadcast
``gradients``  encode one frame per shard,     receive + decode-add its     the same for shard 0
               send frame s to server s        shard's P frames (rank order)
``broadcast``  receive every shard's frame,    average, re-encode, bcast    the same for shard 0, and
               decode it into the update       its shard                    receive + decode every shard
``gradients2`` two-round codecs only           as rank 0, its shard         receive + add the P Q_i
               (powersgd): send Q_i=M_i^T P^                                frames (rank order)
``broadcast2`` two-round codecs only: get Q,   average, bcast its Q         average, bcast Q, apply
               apply P^ Q^T, keep the error                                 P^ Q^T to its replica
``reports``    -                               send ServerReport to 0       gather the S - 1 reports
``buffers``    when due (evaluation, stop or   receive the average          gather, average, broadcast
               end) and the model has          (world bcast)                the BatchNorm statistics
               buffers: send BufferStats to 0,                              (off both clocks)
               receive the average
``end``        SGD step; stop if told          stop if told                 SGD step; IterationRecord
=============  ==============================  ===========================  ==============================

Colocated servers (``--servers colocated``): no separate server ranks; each worker also runs
the "server s > 0" column for its own shard (its ``gradients`` posts the frames for the other
shards, aggregates its own shard meanwhile, then waits for its sends; in ``broadcast`` it
sends its re-encoded shard to every other worker and decodes the others' as they arrive,
point to point; it sends its ServerReport in ``reports``). Rank 0 takes part in neither gradient round: it gathers the P reports, and
when the buffers are due it receives the first worker's parameters after that worker's SGD
step (message 9, in ``end``), off both clocks.

Two-round codecs (``--codec powersgd``, :mod:`.lowrank`), from the codec's ``start``
iteration on: ``gradients``/``broadcast`` carry round 1 (worker: P_i = M_i Q for each
low-rank layer and the other layers as float32; each server, for the layers of its shard:
sum in rank order, average, orthogonalise each P, broadcast P^ and the other layers'
average), then ``gradients2``/``broadcast2`` round 2 (each server: the Q_i of its layers,
summed, averaged, broadcast; rank 0 decodes every shard's, as in round 1); the update is
written in ``broadcast2``, on the workers and on rank 0. With colocated servers each worker
runs the server's part for its shard in both rounds, and rank 0 takes part in neither.
Before ``start``, and for every other codec, those two phases do nothing. With the codec's
menus (``ranks``/``widths``) every rank selects the iteration's factor plan from the
Control's setting codes in ``control`` (``LowRank.select``, which checks them), and after an
iteration whose Control says ``measure`` the workers send rank 0 their setting errors in
``reports`` (message 11), which rank 0 receives there for the policy's next decision.

The pipelined iteration (``--pipeline``, colocated servers, :mod:`.pipeline`): a worker's
``begin`` runs the forward pass only, so ``losses`` goes before backward; its ``control``
does nothing and ``gradients`` runs backward, taking the Control when the first bucket is
ready, sending each bucket's frames as backward produces them, then serving its shard and
taking every shard's average bucket by bucket (applying each bucket's update as it is
complete); ``broadcast`` does nothing and ``reports`` adds message 10 (backward's times).
Rank 0's phases are the colocated ones; it charges the whole iteration in ``reports``.

The Control ahead (``control = "ahead"``, the default): where the policy knows iteration m's
bits before its losses (``Policy.bits_ahead``: fixed, schedule, MQGrad between its steps),
rank 0's ``losses`` broadcasts the Control first (the workers are still computing), then
gathers the losses and has the policy decide from the whole observation, which must give the
announced bits; its ``control`` then does nothing. The workers' order is unchanged: their
Control is in when they ask for it. ``control = "paper"`` keeps the round trip on every
iteration (MQGrad's Alg. 1). The trace's ``steps/control_ahead`` says which iterations went
ahead; the clock charges neither the losses nor the Control on those.

Workers and shard servers share :class:`FollowerRole` (their ``buffers`` phase and loop).

After an iteration whose Control says CHECKPOINT_AFTER (``--checkpoint-every``), every rank
sends its state to rank 0 (``session``), which writes the checkpoint; then all go on.
"""

from __future__ import annotations

from ..exchange.buffers import sync_due
from ..wire import CHECKPOINT_AFTER

PHASES = ("losses", "control", "gradients", "broadcast", "gradients2", "broadcast2", "reports", "buffers")


def run_iteration(role, m: int):
    """Run iteration m on this rank (``role.iteration`` is m until its ``end`` moves it on);
    return what the role's ``end`` returns. With ``role.phase_log`` (a
    :class:`~.phaselog.PhaseLog`), the end of each phase is logged, and the iteration's
    start unless the loop logged it (a worker's, before its compute)."""
    role.iteration = m
    log = getattr(role, "phase_log", None)
    if log is None:
        role.begin(m)
        for phase in PHASES:
            getattr(role, phase)(m)
        return role.end(m)
    if "start" not in log.times:  # else recorded by the loop before its batch (recipe.py)
        log.record("start")
    role.begin(m)
    log.record("begin")
    for phase in PHASES:
        getattr(role, phase)(m)
        log.record(phase)
    result = role.end(m)
    log.record("end")
    clock = getattr(role, "clock", None)
    log.flush(m, dict(clock.phases) if clock is not None else None)
    return result


def run_until_stopped(role, start: int, iterations: int, on_checkpoint=None) -> bool:
    """A worker's or shard server's loop: True when rank 0 asked to stop (checkpoint);
    ``on_checkpoint()`` runs after each iteration that rank 0 marks CHECKPOINT_AFTER."""
    for m in range(start, iterations):
        if run_iteration(role, m):
            return True
        if on_checkpoint is not None and role.control_msg.command == CHECKPOINT_AFTER:
            on_checkpoint()
    return False


class FollowerRole:
    """What the roles that follow rank 0's Control (workers, shard servers) share: sync the
    model's buffers when the command makes it due, and loop until told to stop. A subclass
    sets ``config``, ``control_msg`` and ``buffer_sync``."""

    def gradients2(self, m: int) -> None:
        """The second round's up half (two-round codecs); nothing for a role outside it."""

    def broadcast2(self, m: int) -> None:
        """The second round's down half (two-round codecs); nothing for a role outside it."""

    def buffers(self, m: int) -> None:
        if sync_due(self.config, m, self.control_msg.command):
            self.buffer_sync.run(m)

    def run(self, start_iteration: int = 0, on_checkpoint=None) -> bool:
        """Iterate until the end or until rank 0 asks to stop; True when stopped for requeue.
        ``on_checkpoint()`` runs after each iteration rank 0 marks for a periodic checkpoint."""
        return run_until_stopped(self, start_iteration, self.config.iterations, on_checkpoint)
