"""The checks every launched rank runs before any work (rank 0 decides, all agree): the
world and the PMI, MPI's thread level, the data, augmentation and model, the quantization
rule, the trace and checkpoint files (``--resume``'s among them) and their folders. The
checks that need no MPI (options, trace path, world size) are :mod:`..plan.checks`'; this
module adds what only a launched rank can see, and ``mpigrad train --check``
(:mod:`.jobcheck`) reuses its file and model checks."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

import h5py
from mpi4py import MPI

from ...data.augment import build_augmentation
from ...errors import UsageError
from ...models import check_model
from ...options import check_overwrite
from ...trace import TraceError, network, root_attrs
from ..exchange.build import base_codec, load_data
from ..exchange.replica import quantization_rule
from ..measure import checkpoint
from ..plan.checks import check_world
from ..plan.environment import check_world_size
from ..plan.gpu import workers_device
from ..plan.nodes import slurm_nodes_notes
from ..plan.topology import mpi_nodes, resolve_topology
from ..wire.mpi import bcast_asleep

if TYPE_CHECKING:
    import torch


def check_launch(config, comm: MPI.Comm, model=None) -> None:
    """Every check that can fail before work starts; rank 0 decides, all ranks agree.
    ``model``: a script's (:class:`mpigrad.Session`), checked in place of the config's
    model and data. Resolves the run's nodes (:func:`..plan.topology.resolve_topology`):
    on every rank ``config.ranks_per_node`` and ``config.exchange`` then hold the resolved
    values and ``config.topology`` the :class:`~..plan.topology.Topology`; rank 0 prints its
    notes, and those of a declared L against Slurm's tasks per node (``slurm_nodes_notes``)."""
    nodes = mpi_nodes(comm)
    message = resolved = None
    if comm.Get_rank() == 0:
        message, resolved = _launch_problem(config, comm.Get_size(), model, nodes)
    message, resolved = bcast_asleep(comm, (message, resolved), config.timeout,
                                     "rank 0 did not finish the launch checks")
    if message:
        raise UsageError(message)
    topology, exchange, notes = resolved
    config.ranks_per_node, config.exchange, config.topology = topology.ranks_per_node, exchange, topology
    if comm.Get_rank() == 0:
        for note in notes:
            print(f"mpigrad: {note}", flush=True)


#: MPI's thread levels by value, for messages.
THREAD_LEVELS = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
                 MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED", MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}


def check_thread_level(config, provided: int) -> None:
    """UsageError where a pipelined run on a GPU (``--device cuda`` or ``auto``) would call MPI
    from autograd's device thread, which the main thread did not start, and this MPI gave
    less than MPI_THREAD_SERIALIZED (``provided``, MPI_Query_thread): the calls would race or
    corrupt MPI's state. A CPU run's backward calls the hooks on the main thread."""
    if not config.pipeline or provided >= MPI.THREAD_SERIALIZED or workers_device(config) == "cpu":
        return
    raise UsageError(f"--pipeline --device {config.device}: the gradients' frames go from autograd's device "
                     f"thread, which needs MPI_THREAD_SERIALIZED or more, and this MPI gave "
                     f"{THREAD_LEVELS.get(provided, provided)} (mpi4py asks for mpi4py.rc.thread_level, 'multiple' "
                     f"by default; the MPI may be built without thread support): drop --pipeline, or use such an MPI")


def resume_attrs(trace) -> dict:
    """The root attributes of the trace ``--resume`` continues; UsageError (one line) where it
    cannot be read."""
    try:
        return root_attrs(trace)
    except TraceError as exc:
        raise UsageError(f"--resume: {exc}") from None


def check_resume_files(config, script: bool = False) -> None:
    """UsageError (one line) where ``--resume`` has nothing to continue: no trace, a complete
    one, or (``mpigrad train``'s; a script keeps its own state) no checkpoint. One rule for
    the launched ranks and ``mpigrad train --check``."""
    trace = Path(config.trace)
    if not trace.exists():
        raise UsageError(f"--resume: the trace {trace} to continue does not exist")
    if trace_status(trace) == "complete":
        raise UsageError(f"--resume: trace {trace} is complete, there is nothing to resume "
                         "(start a new run with another --trace, or --force without --resume)")
    if not script and not checkpoint.exists(config.checkpoint_path):
        raise UsageError(f"--resume: no checkpoint at {config.checkpoint_path}")


def check_checkpoint_identity(config, size: int, resolved) -> None:
    """UsageError (one line) where the checkpoint ``--resume`` would load is from another
    configuration or world size, or none of its files is usable: the identity the run checks
    as it loads it (:func:`..measure.checkpoint.load`), taken as the run takes it, after the
    launch resolved its nodes (``resolved``: :func:`..plan.topology.resolve_topology`'s).
    Checked among the launch checks so that every rank ends together with exit 2, where the
    run's own load would have to MPI_Abort the job (a sweep's next run then starts). Reads
    the checkpoint once more than the run does."""
    topology, exchange, _ = resolved
    as_run = copy.copy(config)
    as_run.ranks_per_node, as_run.exchange, as_run.topology = topology.ranks_per_node, exchange, topology
    checkpoint.load(config.checkpoint_path, checkpoint.identity(as_run.to_dict(), size))


def _launch_problem(config, size: int, model=None, nodes=None) -> tuple[str | None, tuple | None]:
    """(the first problem's line, else None; the resolved nodes, exchange and notes)."""
    script = model is not None  # a Session's model, before the config's takes its place below
    try:
        check_world_size(size)  # first: a PMI mismatch under srun also shows as size 1
        check_world(config, size, script=script)
        topology, exchange, notes = resolve_topology(config, size, nodes)
        resolved = (topology, exchange, notes + slurm_nodes_notes(config, size, topology))
        check_thread_level(config, MPI.Query_thread())
        if model is None:
            dataset = load_data(config)
            build_augmentation(config.augment, config.augment_opts, dataset)  # does this data set take it?
            model = check_model(config.model, input_shape=dataset.input_shape, num_classes=dataset.num_classes,
                                seed=config.seed, **config.model_opts)
        check_quantizes_something(config, model)
        trace = Path(config.trace)
        if config.resume:
            check_resume_files(config, script=script)
            if not script:
                check_checkpoint_identity(config, size, resolved)
            network.resume_change(trace, resume_attrs(trace), network.current(), config.force)  # refused unless --force
        else:
            check_overwrite([trace], config.force, error=UsageError, alternative=" or --trace to choose another")
        make_parent_directory(trace, "trace")
        make_parent_directory(config.checkpoint_path, "checkpoint")
    except (UsageError, ValueError) as exc:
        return str(exc), None
    return None, resolved


def make_parent_directory(path: Path, what: str) -> None:
    """Create the directory that will hold ``path``, as output options usually do
    (``--trace runs/a.h5`` in a fresh clone); UsageError naming it if that fails."""
    if path.parent.exists() and not path.parent.is_dir():
        raise UsageError(f"{path.parent}, where the {what} should go, is not a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create directory {path.parent} for the {what}: {exc.strerror or exc}") from None


def check_quantizes_something(config, model: torch.nn.Module) -> None:
    """UsageError when a quantizing codec would apply to no layer (every layer smaller than
    --min-quantize-size, or a model that names none): the run would train in float32 while
    its log and trace say bits."""
    if config.codec == "fp32":
        return
    params = [p for p in model.parameters() if p.requires_grad]
    codec = base_codec(config)
    quantize = quantization_rule(model, config.min_quantize_size, codec)
    if any(quantize(p) for p in params):
        return
    if codec.two_rounds:
        raise UsageError(f"codec {config.codec!r} would compress no layer: no matrix of this model has "
                         f"(n + m) r * min_compression_rate < n m at rank {codec.rank}; lower the rank or "
                         "min_compression_rate, or use --codec fp32")
    rule = ("the model names no layer to quantize" if config.min_quantize_size is None else
            f"the largest layer of this model has {max((p.numel() for p in params), default=0):,} "
            f"elements, --min-quantize-size is {config.min_quantize_size:,}")
    raise UsageError(f"codec {config.codec!r} would quantize nothing: {rule}; set --min-quantize-size, "
                     "or use --codec fp32 for an unquantized run")


def trace_status(path: Path) -> str | None:
    """The status a trace file records ("complete", "stopped", ...), None if unreadable."""
    try:
        with h5py.File(path, "r", swmr=True) as f:
            status = f.attrs.get("status")
    except OSError:
        return None
    return status.decode() if isinstance(status, bytes) else status
