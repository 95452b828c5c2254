"""Checks of ``mpigrad train``'s options alone, run before MPI, torch or any data start.

``check_options`` needs only the codec and policy registries (the codecs import Numba), so
a bad option is refused in about a second instead of after torch and MPI have started;
``check_trace`` refuses a trace path that is taken (a directory, or a file without
``--force``) as fast. Checks that need the world size, the data or the model are in
``run.preflight.check_launch``. ``run.jobcheck.check_job`` (``mpigrad train --check``) runs
all of them in one process without MPI: the world's against an assumed size.
"""

from __future__ import annotations

import os
from pathlib import Path

from ...codecs import Codec, CodecError, get_codec
from ...config import AUTO_CHUNK, RunConfig
from ...costmodel import CostModel, CostModelError, resolve
from ...errors import UsageError
from ...policies import PolicyError, bits_option, get_policy, policy_class, policy_options

__all__ = ["check_options", "check_trace", "check_world", "check_given_options", "check_two_rounds", "check_device", "base_codec", "broadcast_codec", "cost_model"]


def base_codec(config: RunConfig) -> Codec:
    """The run's codec at the initial bits (a codec fixed by its levels keeps them)."""
    codec = get_codec(config.codec_config())
    return codec.with_bits(config.bits) if codec.takes_policy_bits else codec


def broadcast_codec(config: RunConfig) -> tuple[Codec, int | None]:
    """The codec of the servers' broadcast (``--broadcast-codec``) and its fixed bits, or None
    when its bits follow the policy's. UsageError for a codec or bits it cannot take."""
    codec_config, bits = config.broadcast_codec_config()
    try:
        codec = get_codec(codec_config)
        if bits is not None:
            codec = codec.with_bits(bits)
        elif codec.takes_policy_bits:
            codec = codec.with_bits(config.bits)
    except ValueError as exc:
        raise UsageError(f"--broadcast-codec {config.broadcast_codec}: {exc}") from None
    return codec, bits


def cost_model(config: RunConfig) -> CostModel | None:
    """The cost model the run charges local work with: None unless ``compute_time`` is fixed
    on a modelled network and ``cost_model`` is not ``none``. UsageError (one line) for a
    model that cannot be read, lacks the run's codecs, or is given without ``compute_time``."""
    explicit = config.cost_model not in ("default", "none")
    if config.compute_time is None or config.net_mode == "off":
        if explicit:
            raise UsageError(f"--cost-model {config.cost_model}: a cost model is charged only with "
                             "--compute-time on a modelled network (without it local work is measured)")
        return None
    if base_codec(config).two_rounds:
        if explicit:
            raise UsageError(f"--cost-model {config.cost_model}: a cost model has no costs for {config.codec}'s "
                             "matrix products; run it with --cost-model none (the default charges none for it)")
        return None
    try:
        model = resolve(config.cost_model)
        if model is not None:
            for codec in (config.codec, broadcast_codec(config)[0].codec_id):
                model.check_codec(codec)
    except CostModelError as exc:
        raise UsageError(str(exc)) from None
    return model


def check_device(name: str) -> None:
    """UsageError for ``cuda`` where torch sees no CUDA device (imports torch only then)."""
    if name != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for, but torch sees no CUDA device here "
                         "(use --device cpu, or auto to take a GPU where there is one)")


def check_two_rounds(config: RunConfig, codec: Codec) -> None:
    """UsageError (one line) for what a two-round (low-rank) codec does not run with."""
    name = f"--codec {codec.codec_id}"
    chooses = policy_class(config.policy).chooses_settings
    if getattr(codec, "mixed", False) and not chooses:
        raise UsageError(f"{name} with ranks/widths needs a policy that chooses each layer's setting: "
                         f"--policy lgreco, not {config.policy} (or drop ranks/widths for every layer at rank)")
    if config.policy != "fixed" and not getattr(codec, "mixed", False):
        hint = (" or give it menus to choose from, e.g. --codec-opt ranks=1,2,4 --codec-opt widths=2,4,8"
                if chooses else "")
        raise UsageError(f"{name} has no bits to choose: use --policy fixed (its rank is --codec-opt rank=R){hint}")
    if config.error_feedback != "none":
        raise UsageError(f"{name} keeps its own error feedback on the workers (PowerSGD's); "
                         "drop --error-feedback")
    if config.momentum_correction:
        raise UsageError(f"{name} keeps its own error memory of the matrices, before which momentum correction "
                         "is not built: drop --momentum-correction (give the optimizer momentum instead)")
    if config.broadcast_codec not in ("paper", "same"):
        raise UsageError(f"{name}: the server broadcasts the averaged factors as they are; "
                         "drop --broadcast-codec")
    if config.pipeline:
        raise UsageError(f"{name} runs two rounds in the sequential order: drop --pipeline")
    if config.min_quantize_size is not None:
        raise UsageError(f"{name} chooses its layers itself (every matrix it compresses at its rank and "
                         "min_compression_rate): drop --min-quantize-size")


def unused_bits(config: RunConfig, codec: Codec) -> str | None:
    """Why this run has no use for ``--bits`` (None when it uses it): the policy must take
    it (``bits_option``: its width or start width) and a codec must follow the policy's
    widths (the workers' codec, or a broadcast codec that follows them)."""
    if codec.two_rounds:
        return (f"--codec {codec.codec_id}: its widths are --codec-opt factor_bits=B and rest_bits=B "
                "(its rank --codec-opt rank=R)")
    if bits_option(config.policy) is None:
        widths = [name for name in policy_options(config.policy) if "bits" in name or name == "schedule"]
        return (f"--policy {config.policy}: it chooses its widths itself"
                + (f", from its own options (--policy-opt {', '.join(widths)})" if widths else ""))
    down, down_bits = broadcast_codec(config)
    if codec.takes_policy_bits or (down_bits is None and down.takes_policy_bits):
        return None
    if codec.accepts_bits:
        return f"--codec {codec.codec_id}: its levels fix the quantization (drop levels to set bits)"
    width = f" (it sends {codec.fixed_bits}-bit values)" if codec.fixed_bits else ""
    return f"--codec {codec.codec_id}: it has no bits option{width}"


#: The run options that only some policies or codecs use, and the function that says why
#: this run does not (None when it does): an option the user set (``RunConfig.given``) that
#: the run would not use is refused, never silently ignored.
UNUSED = {"bits": unused_bits}


def replaced_bits_note(config: RunConfig, codec: Codec) -> str | None:
    """rank 0's line where the command line's policy or codec replaced a config file's method
    and that method's ``bits`` is not what this run uses (``RunConfig.replaced_bits``), else None."""
    if config.replaced_bits is None:
        return None
    path, bits = config.replaced_bits
    why = unused_bits(config, codec)
    if why is None:
        return None
    return (f"mpigrad: note: {path}'s bits = {bits} went with its method, which the command line replaced; "
            f"they do not apply to {why}")


def check_given_options(config: RunConfig, codec: Codec) -> None:
    """UsageError (one line) for an option the user set (config file or command line) that
    this run's policy and codecs do not use: ``--bits does not apply to --policy aimd: ...``."""
    for option in sorted(config.given & UNUSED.keys()):
        why = UNUSED[option](config, codec)
        if why is not None:
            raise UsageError(f"--{option.replace('_', '-')} does not apply to {why}")


def check_recipe(config: RunConfig) -> None:
    """UsageError (one line) for an optimizer or schedule that cannot be built, or a plugin
    optimizer where ``--shard-chunk`` cuts layers (it may need whole layers). The paper's
    plain SGD (warm-up and scaling are the config's checks) is checked without importing torch
    (a refusal stays fast); so is the augmentation (its data set's fit: the launch check)."""
    from ...data import DataError
    from ...data.augment import check_augmentation

    try:
        check_augmentation(config.augment, config.augment_opts)
    except DataError as exc:
        raise UsageError(str(exc)) from None
    if config.lr_schedule_opts and not config.lr_schedule:
        raise UsageError("--lr-schedule-opt without --lr-schedule: name the schedule")
    if config.optimizer == "sgd" and not config.update_options and not config.lr_schedule:
        return
    from ...optim import OptimizerError, check_recipe as check
    from ...plugins import is_plugin

    try:
        check(config.optimizer, config.update_options, config.lr_schedule, config.lr_schedule_opts,
              config.lr_warmup, config.lr_scaling)
    except OptimizerError as exc:
        raise UsageError(str(exc)) from None
    if is_plugin(config.optimizer) and config.shard_chunk not in (0, AUTO_CHUNK):
        raise UsageError(f"--optimizer {config.optimizer}: a plugin optimizer gets each piece of the layout, and "
                         "--shard-chunk cuts layers into pieces, which an optimizer that needs whole layers "
                         "cannot take: drop --shard-chunk")


def check_options(config: RunConfig) -> None:
    """UsageError (one line) for options that cannot work together, whatever the launch."""
    _check_method(config)
    check_recipe(config)


def _check_method(config: RunConfig) -> None:
    """The codec, policy, bits and device options (check_options)."""
    try:
        if "bits" in config.codec_opts:
            raise UsageError("set the bits with --bits (bits = N at the top of a config file), "
                             "not as a codec option: the policy starts from it")
        if config.policy == "schedule" and "schedule" not in config.policy_opts:
            raise UsageError("--policy schedule needs its schedule, e.g. --policy-opt schedule=0:2,500:4,2000:8 "
                             "(bits 2 from iteration 0, 4 from 500, 8 from 2000); --bits does not apply")
        codec = base_codec(config)
        policy = get_policy(config.policy_config(), n_layers=1, seed=config.seed)
        check_given_options(config, codec)
        from ...codecs.device import threads_per_block
        threads_per_block(False)  # MPIGRAD_DEVICE_THREADS, refused here rather than on every worker
        if codec.two_rounds:  # no bits: a rank, or settings a policy chooses
            check_two_rounds(config, codec)
            cost_model(config)
            check_device(config.device)
            return
        lowest, highest = policy.bits_range()
        moving = lowest != highest
        if moving and not codec.accepts_bits:
            raise UsageError(f"policy {config.policy!r} chooses bits, but codec {config.codec!r} has no "
                             "bits option: use --policy fixed, or a codec such as uniform or qsgd")
        if moving and not codec.takes_policy_bits:
            raise UsageError(f"codec option levels fixes the quantization, but policy {config.policy!r} "
                             "chooses bits: use --policy fixed, or drop levels")
        if codec.takes_policy_bits:
            policy.check_codec(codec)
        down, down_bits = broadcast_codec(config)
        if moving and down_bits is None and down.accepts_bits:
            policy.check_codec(down)
    except (CodecError, PolicyError) as exc:
        raise UsageError(str(exc)) from None
    cost_model(config)
    check_device(config.device)


def check_trace(config: RunConfig) -> None:
    """UsageError (one line) for a trace path ``mpigrad train`` cannot take, before any rank
    starts: a directory (``--force`` or not: a directory is not overwritten), an existing file
    without ``--force`` or ``--resume`` (``options.check_overwrite``, the rule of every result
    file), a trace or checkpoint whose nearest existing folder is not a directory or cannot
    be written. ``run.preflight.check_launch`` checks the rest of ``--resume`` (the trace and its
    checkpoint must exist) and creates the folders."""
    from ...options import check_overwrite

    trace = Path(config.trace)
    check_overwrite([trace], config.force or config.resume, error=UsageError,
                    alternative=" or --trace to choose another")
    for path, what in ((trace, "trace"), (config.checkpoint_path, "checkpoint")):
        folder = path.parent
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not folder.is_dir():
            raise UsageError(f"{folder}, where the {what} should go, is not a directory")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise UsageError(f"cannot write the {what} {path}: folder {folder} is not writable")


def check_world(config: RunConfig, size: int, script: bool = False) -> None:
    """UsageError (one line) for a world of ``size`` ranks this run cannot have: fewer than 2,
    another than the config file's ``# ranks: N`` line, too few for its servers, or fewer
    than a ``--link-bandwidth`` rank. One rule for ``mpigrad train --check`` and for the
    launched ranks (``run.preflight.check_launch``, which adds the PMI's and the thread level's
    checks); ``script``: a script's ``Session``, whose launch line names the script."""
    if size < 2:
        command = "SCRIPT.py" if script else "-m mpigrad train"
        raise UsageError(f"mpigrad {'' if script else 'train '}needs at least 2 MPI ranks (rank 0 is the "
                         "scheduler, and the server unless servers = colocated; the others train): launch with "
                         f"mpiexec -n P+1 python -m mpi4py {command}")
    if config.declared_ranks and config.declared_ranks[1] != size:
        path, ranks = config.declared_ranks
        raise UsageError(f"{path} is written for {ranks} ranks (its '# ranks: {ranks}' line) but this run "
                         f"has {size}: launch with mpiexec -n {ranks}, or edit that line in a copy")
    if size < config.non_worker_ranks() + 1:
        raise UsageError(f"--servers {config.servers} needs at least {config.non_worker_ranks() + 1} MPI ranks "
                         f"(S servers and at least one worker), this run has {size}")
    beyond = sorted(int(rank) for rank in config.link_bandwidth if int(rank) >= size)
    if beyond:
        raise UsageError(f"--link-bandwidth names rank(s) {', '.join(map(str, beyond))}, but this run has ranks "
                         f"0..{size - 1}")


