"""Rank 0's checkpoint state: what its checkpoint holds (the replica, the policy, the
clocks, the broadcast compressor's counters, the shard plan), and its checks on resume.
:class:`Rank0State` is a part of :class:`~.server.ParameterServer`."""

from __future__ import annotations

import numpy as np
import torch

from ...costmodel import CostModel
from ...errors import UsageError
from ..exchange.build import shard_chunks

__all__ = ["Rank0State"]


class Rank0State:
    """Rank 0's checkpoint state (``state_dict``, ``load_state_dict``) and the trace's
    record of the shards and the cost model."""

    def state_dict(self) -> dict:
        # The previous average feeds only policies that read gradients (Observation.gradients):
        # for the others it would double the checkpoint for nothing.
        keep_update = self.has_previous and self.policy.uses_gradients and not self.mixed
        errors = self.setting_errors  # measured, for the next decision (PowerSGD with menus)
        return {"setting_errors": torch.from_numpy(errors.copy()) if errors is not None else None,
                "iteration": self.iteration,
                # a script's model is the script's to save (rank 0 applies no update to it)
                "replica": None if self.script else self.replica.state_dict(),
                "policy": self.policy.state_dict(),
                "compressor": self.compressor.state_dict() if self.compressor is not None else None,
                "clocks": self.clock.clocks.state_dict(), "last_iteration_ms": self.last_iteration_ms,
                "last_comm_ms": self.last_comm_ms, "last_bytes": self.last_bytes,
                "bytes_total": self.bytes_total, "last_eval": self.last_eval,
                "cost_model": self.cost_attrs()["cost_model"],
                "previous_average": torch.from_numpy(self.average.copy()) if keep_update else None,
                "shard_plan": self.shard_plan(), "update": self.replica.update_state_dict()}

    def shard_record(self) -> dict:
        """The trace's record of the layout's cut and shards: the ``--shard-chunk`` setting,
        the chunk sizes it resolved to, each shard's pieces as (offset, size), and a
        hierarchical exchange's slices (``slice_bytes``: bytes of each local rank's slice
        inside a node, at ``--intra-codec``; what ``trace retime`` charges them with)."""
        slices = getattr(self.exchange, "slice_bytes", None)
        return {"setting": self.config.shard_chunk, **self.chunks.to_dict(), "pieces": self.shard_plan(),
                **({"slice_bytes": list(slices)} if slices is not None else {})}

    def shard_plan(self) -> list[list[tuple[int, int]]]:
        """Each shard's pieces as (offset, size): which server holds which piece's codec
        counters and error memory, so that a checkpoint is resumed onto the same plan."""
        return [[(piece.offset, piece.size) for piece in shard.pieces] for shard in self.shards]

    def check_shard_plan(self, state: dict) -> None:
        """UsageError (one line) where the checkpoint's shards are not this run's. A checkpoint
        from before the plan was saved was written while --shard-chunk cut only the quantized
        layers: refused where the small layers are cut now and servers hold state apart."""
        saved = state.get("shard_plan")
        if saved is None:
            chunk, rest = shard_chunks(self.config, self.replica.layout, self.servers).rest, self.replica.layout.rest.size
            if chunk and rest > chunk and self.servers > 1:
                raise UsageError(f"--resume: this checkpoint was written by an mpigrad whose --shard-chunk {chunk} "
                                 f"kept the small layers ({rest} elements) whole, and this one cuts them, so the "
                                 "servers' shards differ: resume it with the mpigrad that wrote it")
            return
        if [[tuple(piece) for piece in shard] for shard in saved] != self.shard_plan():
            raise UsageError("--resume: the checkpoint's shards are not this run's (another mpigrad's layout "
                             "rule): resume it with the mpigrad that wrote it")

    def load_state_dict(self, state: dict) -> None:
        self.check_shard_plan(state)
        self.iteration = int(state["iteration"])
        if not self.script:  # a script's model is the script's to load, on every rank
            self.replica.load_state_dict(state["replica"])
        if self.exchange.updates_replica:  # colocated, the workers keep the optimizer (rank 0 applies no update)
            self.replica.load_update_state_dict(state.get("update"))
        self.policy.load_state_dict(state["policy"])
        errors = state.get("setting_errors")
        self.setting_errors = errors.numpy().astype(np.float64) if errors is not None else None
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"])
        self.saved_clocks = dict(state["clocks"])
        self.last_iteration_ms = float(state["last_iteration_ms"])
        self.last_comm_ms, self.last_bytes = float(state.get("last_comm_ms", 0.0)), int(state.get("last_bytes", 0))
        self.bytes_total = int(state["bytes_total"])
        self.last_eval = state["last_eval"]
        recorded = state.get("cost_model")
        if recorded is not None and self.clock.local_costs is not None:
            # The run goes on with the model it began with (the file may have changed since).
            model, work = self.clock.local_costs
            if recorded != model.to_dict():
                self.clock.local_costs = (CostModel.from_dict(recorded, source="of the checkpoint"), work)
                self.clock._local_memo.clear()
                self.log(f"mpigrad: the cost model {model.source} has changed since the run began; "
                         "going on with the one it began with (from the checkpoint)")
        if state["previous_average"] is not None:
            self.average[:] = state["previous_average"].numpy()
            self.has_previous = True

    def cost_attrs(self) -> dict:
        """The trace's record of the local-work charge: the model and what it charges (None, None
        when the clock charges none)."""
        if self.clock.local_costs is None:
            return {"cost_model": None, "local_work": None}
        model, work = self.clock.local_costs
        return {"cost_model": model.to_dict(), "local_work": work.to_dict()}
