"""The ranks other than rank 0 (workers and shard servers): building a follower's role with
its checkpoint state and its start-up exchange with rank 0, a script's checkpoint handed to
the first worker, and the error a follower reports to rank 0 (:class:`RankFailure`)."""

from __future__ import annotations

import pickle
import socket

from ..roles.shard import ShardServer
from ..roles.worker import Worker


def deliver_checkpoint(channel, contents: dict | None = None):
    """A script's checkpoint (:class:`mpigrad.Session`): rank 0 sends ``contents``
    (``checkpoint.contents``) to the first worker and returns their size in bytes; every
    other rank takes part and receives them (the first worker) or None."""
    if channel.rank == 0:
        payload = pickle.dumps(contents, protocol=pickle.HIGHEST_PROTOCOL)  # once: its size is the log's
        channel.scatter_object([payload if rank == channel.workers[0] else None for rank in range(channel.size)])
        return len(payload)
    payload = channel.scatter_object(None)
    return None if payload is None else pickle.loads(payload)


class RankFailure(RuntimeError):
    """A worker's or shard server's error (its text unchanged), raised from the original by
    :func:`run_other_rank` with the iteration it happened in. ``report()`` sends it to rank 0
    (message 8) and waits for rank 0 to close the trace "failed" and end the run."""

    def __init__(self, error: Exception, channel, iteration: int):
        super().__init__(str(error) or type(error).__name__)
        self.channel, self.iteration = channel, iteration

    def report(self) -> None:
        self.channel.report_error(self.iteration, str(self))


def follower_role(config, channel, model=None, recipe=None):
    """Build this worker's or shard server's role (a worker's around ``model``, with
    ``mpigrad train``'s ``recipe`` or a script's without; a shard server's around a script's
    ``model`` when given), load its checkpoint state on resume, and take part in the start-up
    exchange with rank 0 (:func:`run_parameter_server`); return the role, the iteration to
    start from and rank 0's number of iterations."""
    if not channel.is_worker:
        role = ShardServer(config, channel, model)
        if config.resume:
            role.load_state_dict(channel.scatter_object(None))
    else:
        role = Worker(config, channel, model, recipe)
        if config.resume:
            role.load_state_dict(*channel.scatter_object(None))
    channel.gather_object((socket.gethostname(), getattr(role, "device_warm_up_s", None)))
    start, iterations = channel.bcast_object(None)
    return role, start, iterations
