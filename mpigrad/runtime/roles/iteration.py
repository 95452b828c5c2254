"""The order of one iteration, written once.

Ranks 0..S-1 are servers (rank 0 also the scheduler and MDP server), ranks S..S+P-1 workers.
Every role (:class:`~.worker.Worker`, :class:`~.shard.ShardServer` for ranks 1..S-1,
:class:`~.server.ParameterServer` for rank 0) implements the phases below, and
:func:`run_iteration` calls them in this order on every rank; the messages are laid out in
:mod:`.wire.messages`. What every way of aggregating shares (the losses, the Control, the
buffers, the SGD step, rank 0's policy and record) is the roles' own; the exchange's part
of ``control``, ``gradients``, ``broadcast``, ``gradients2``, ``broadcast2`` and
``reports``, and rank 0's charges of the clock for them, are the side of the run's way of
aggregating that each role drives (``role.exchange``, :mod:`..exchange.way`), chosen from
the config at one place (:func:`..exchange.ways.choose_exchange`). The table is separate
servers' (:mod:`..exchange.servers`: S = 1, the star, or S sharded):

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
``reports``    -                               send ServerReport to 0       gather the S - 1 reports;
                                                                            charge the clock
``buffers``    when due (evaluation, stop or   receive the average          gather, average, broadcast
               end) and the model has          (world bcast)                the BatchNorm statistics
               buffers: send BufferStats to 0,                              (off both clocks)
               receive the average
``end``        SGD step; stop if told          stop if told                 SGD step; IterationRecord
=============  ==============================  ===========================  ==============================

The other ways, each in its file under ``runtime/exchange/``, which says what it changes:

- colocated servers (``--servers colocated``, :mod:`..exchange.colocated`): no separate
  server ranks; each worker also runs the "server s > 0" column for its own shard, point to
  point with the other workers, and rank 0 takes part in neither gradient round: it
  gathers the P reports, and takes the first worker's parameters when the buffers are due;
- the pipelined iteration (``--pipeline``, colocated servers, :mod:`..exchange.pipeline`):
  a worker's ``begin`` runs the forward pass only, so ``losses`` goes before backward; its
  ``control`` and ``broadcast`` do nothing and ``gradients`` runs backward, taking the
  Control when the first bucket is ready and exchanging bucket by bucket; ``reports`` adds
  message 10 (backward's times); rank 0 charges the whole iteration in ``reports``;
- the hierarchical exchange (``--exchange hierarchical``, nodes of several workers,
  :mod:`..exchange.hierarchical`): colocated, with a reduce-scatter inside each node
  (message 12) before ``gradients``' frames, which go within each local rank, and an
  all-gather inside each node after ``broadcast``; pipelined (``--pipeline``,
  :mod:`..exchange.hierarchical_pipeline`) it runs in ``gradients`` as the pipelined
  iteration does, each bucket's reduce-scatter and frame from backward's hooks, its average
  and all-gather after backward;
- two-round codecs (``--codec powersgd``, :mod:`..exchange.tworounds` around one of the
  above, the factors in :mod:`..exchange.lowrank`): before the codec's ``start`` iteration
  the inner way's; from it on, ``gradients``/``broadcast`` carry round 1 (P) and
  ``gradients2``/``broadcast2`` round 2 (Q), the update written in ``broadcast2``; every rank
  selects the iteration's factor plan in ``control``, and after an iteration whose Control
  says ``measure`` the workers send rank 0 their setting errors in ``reports`` (message 11).
  For every other codec those two phases do nothing.

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
