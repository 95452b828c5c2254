"""``mpigrad train --check``: every check of a launch, in this process, without MPI: no rank
starts, and MPI is not initialised (``check_job`` imports the launch checks only after
telling mpi4py not to)."""

from __future__ import annotations

import os
from pathlib import Path

from ...config import AUTO, RunConfig
from ...errors import UsageError
from ..plan.checks import base_codec, check_options, check_trace, check_world
from ..plan.environment import _positive_int_variable
from ..plan.nodes import nodes_line, slurm_nodes_notes
from ..plan.topology import resolve_topology


def assumed_world(config: RunConfig, ranks: int | None, environ=os.environ) -> tuple[int | None, str]:
    """The world size ``--check`` assumes and where it comes from: ``--ranks``, else Slurm's
    ``SLURM_NTASKS`` (UsageError where the two differ: the job would be refused), else the
    config file's ``# ranks: N`` line; (None, why) when none says it."""
    slurm = _positive_int_variable(environ, "SLURM_NTASKS")
    if ranks is not None:
        if ranks < 1:
            raise UsageError(f"--ranks must be at least 1, got {ranks}")
        if slurm is not None and slurm != ranks:
            raise UsageError(f"--ranks {ranks} but SLURM_NTASKS={slurm}: the job would start {slurm} ranks")
        return ranks, "--ranks"
    if slurm is not None:
        return slurm, "SLURM_NTASKS"
    if config.declared_ranks:
        return config.declared_ranks[1], f"{config.declared_ranks[0]}'s '# ranks' line"
    return None, "unknown"


def check_job(config: RunConfig, ranks: int | None = None, environ=os.environ) -> list[str]:
    """``mpigrad train --check``: every check of a launch, in this process, without MPI (no
    rank starts): the options (``check_options``, as every launch), the trace path
    (``check_trace``), the world of the assumed size (``assumed_world``, ``check_world``),
    its nodes (``check_nodes``), the data, augmentation and model (as
    ``session.check_launch``), the layout with its pieces and shards, and the optimizer and
    schedule over those pieces (``train_replica``).
    Returns the report's lines; UsageError (one line) on the first problem. Not checked: what
    only the launched ranks know (the PMI, MPI's thread level, each rank's GPU, the nodes MPI
    finds), and, without an assumed size, the world."""
    check_options(config)
    check_trace(config)
    size, source = assumed_world(config, ranks, environ)
    if size is not None:
        check_world(config, size)
    nodes = check_nodes(config, size, environ)
    import mpi4py

    mpi4py.rc.initialize = False  # preflight imports MPI: not started here
    from ...data import DataError
    from ...data.augment import build_augmentation
    from ...models import check_model
    from ..exchange.build import build_config_model, build_shards, load_data, train_replica
    from .preflight import check_quantizes_something, check_resume_files

    try:
        dataset = load_data(config)
        build_augmentation(config.augment, config.augment_opts, dataset)
        model = check_model(config.model, input_shape=dataset.input_shape, num_classes=dataset.num_classes,
                            seed=config.seed, **config.model_opts)
        check_quantizes_something(config, model)
    except (DataError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if config.resume:
        check_resume_files(config)
    shards = config.non_worker_ranks() if not config.colocated else (size - 1 if size else None)
    workers = size - config.non_worker_ranks() if size else 1
    from ...optim import OptimizerError

    try:
        replica = train_replica(config, build_config_model(config, dataset), workers, shards or 1)
        if shards:
            build_shards(config, replica.layout, base_codec(config), shards)
    except (OptimizerError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    layout = replica.layout
    quantized = sum(segment.size for segment in layout.quantized)
    from ...optim import recipe_description

    lines = [f"model {config.model} on {config.data}: {layout.total:,} parameters, {len(layout.quantized)} "
             f"quantized layer(s) holding {quantized / max(layout.total, 1):.1%} ({config.codec}, {config.policy})",
             f"recipe: {recipe_description(config)}"]
    if size is None:
        lines.append("world: size unknown (give --ranks N, or run inside the Slurm job): ranks, servers and "
                     f"--link-bandwidth not checked; this run needs at least {config.non_worker_ranks() + 1}")
    else:
        servers = "colocated servers" if config.colocated else f"{config.non_worker_ranks()} server rank(s)"
        lines.append(f"world: {size} ranks ({source}): {servers}, {workers} worker(s)")
    lines += nodes
    lines.append(f"trace: {config.trace} ({'resumed' if config.resume else 'overwritten' if Path(config.trace).exists() else 'new'}), "
                 f"checkpoint {config.checkpoint_path}")
    lines.append("not checked here: the MPI launch (PMI, thread level)"
                 + (", each rank's GPU" if config.device != "cpu" else "") + "; mpigrad doctor checks the launch")
    return lines


def check_nodes(config: RunConfig, size: int | None, environ=os.environ) -> list[str]:
    """The report's ``nodes:`` line and its notes (``mpigrad: note: ...``) for a world of
    ``size`` ranks (None: unknown): the nodes as the launch resolves them
    (``plan.topology.resolve_topology`` without MPI's nodes: UsageError, one line, for a
    ``--ranks-per-node L`` that does not divide the workers or ``--exchange hierarchical`` on
    one node), and Slurm's tasks per node against them (``plan.nodes.slurm_nodes_notes``).
    ``--ranks-per-node auto`` is not refused: MPI's nodes settle it at launch, and where
    Slurm's variables lay the job out the notes say what the launch would find there."""
    L = config.ranks_per_node
    if L == AUTO:
        line = ("nodes: resolved at launch from MPI's shared-memory split (--ranks-per-node auto), and the "
                f"exchange with them (--exchange {config.exchange})")
        notes = slurm_nodes_notes(config, size, None, environ=environ) if size is not None else []
        return [line, *(f"mpigrad: {note}" for note in notes)]
    if size is None:
        return [] if L == 1 else [f"nodes: {L} worker(s) per node (--ranks-per-node {L}): not checked without the "
                                  f"world's size, which needs a multiple of {L} workers"]
    topology, exchange, notes = resolve_topology(config, size, None)
    notes += slurm_nodes_notes(config, size, topology, environ=environ)
    line = nodes_line(topology, exchange, config)
    return [*([line] if line else []), *(f"mpigrad: {note}" for note in notes)]
