# shellcheck shell=bash
# Shared by train.sbatch and sweep.sbatch; sourced, never run. It only defines mpigrad_*
# functions; nothing happens until a jobscript calls mpigrad_train. See README.md.
#
# Knobs (export them on the login node before sbatch; sbatch passes the environment on):
#   MPIGRAD_ENV_SCRIPT     a file sourced first in the job (module loads, venv activation)
#   MPIGRAD_LAUNCHER       srun (default), mpiexec or mpirun: who starts the ranks
#   MPIGRAD_SRUN_MPI       PMI for srun --mpi=... (pmix, pmi2; `srun --mpi=list`); default: site's
#   MPIGRAD_SRUN_OPTS      more srun options, split at spaces (e.g. --gpu-bind=single:1)
#   MPIGRAD_TRAIN_CMD      the training command (default: python -m mpi4py -m mpigrad train)
#   MPIGRAD_PYTHON         the Python that has mpigrad, for probes and `trace repair` (default python)
#   MPIGRAD_MAX_REQUEUES   give up requeueing after this many restarts (default 20)
#   MPIGRAD_END_MARGIN     seconds kept free before the time limit (default 60); the run gets
#                          --walltime <time left - margin> and stops two of its own measured
#                          iterations (plus the checkpoint write) before that
#   MPIGRAD_CHECKPOINT_EVERY  periodic checkpoints (default 30m; off: none)
#   MPIGRAD_NUMBA_CACHE    persistent Numba cache root, one subdirectory per CPU type (default
#                          ${XDG_CACHE_HOME:-$HOME/.cache}/mpigrad/numba); job: per job, node-local
#   NUMBA_CACHE_DIR        set: exactly that directory
#   HDF5_USE_FILE_LOCKING  default FALSE (one writer per trace; Lustre/NFS may lack flock)

# EXIT_REQUEUE of mpigrad/runtime/__init__.py: the run stopped at an iteration boundary after writing a
# checkpoint and flushing its trace; run it again with --resume to continue.
MPIGRAD_EXIT_REQUEUE=75

mpigrad_log() { printf 'mpigrad-job: %s\n' "$*"; }

mpigrad_die() {
    printf 'mpigrad-job: error: %s\n' "$*" >&2
    exit 2
}

# Thread counts, Numba cache, HDF5 locking, unbuffered logs: exported for every rank.
mpigrad_setup_env() {
    local threads=${SLURM_CPUS_PER_TASK:-1}
    [[ $threads =~ ^[1-9][0-9]*$ ]] || mpigrad_die "SLURM_CPUS_PER_TASK='$threads' is not a positive whole number"
    export OMP_NUM_THREADS=$threads MKL_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads
    export NUMBA_NUM_THREADS=$threads
    # srun >= 22.05 no longer inherits --cpus-per-task from the batch job: pass it on.
    export SRUN_CPUS_PER_TASK=$threads
    mpigrad_numba_cache
    export HDF5_USE_FILE_LOCKING=${HDF5_USE_FILE_LOCKING:-FALSE}
    export PYTHONUNBUFFERED=1
}

# A name for this node's CPU type: machine, model and instruction set flags (what Numba's
# cache key records about the CPU), hashed.
mpigrad_cpu_type() {
    {
        uname -m
        grep -m1 -E '^(model name|cpu model|Processor)' /proc/cpuinfo
        grep -m1 -E '^(flags|Features|isa)' /proc/cpuinfo
    } 2>/dev/null | cksum | cut -d' ' -f1
}

_mpigrad_job_cache=""   # a per-job Numba cache this job made; removed when the job ends

# Exports NUMBA_CACHE_DIR. Compiled kernels persist across requeues and jobs in
# $MPIGRAD_NUMBA_CACHE/cpu-<CPU type>: Numba replaces its cache files atomically and keys
# entries by source file, signature and CPU, and jobs on one CPU type write interchangeable
# files, so jobs sharing the directory at once cost at worst a second compile, never a wrong
# kernel. Where it cannot be written (read-only home on compute nodes), or with
# MPIGRAD_NUMBA_CACHE=job: a per-job directory on node-local disk, removed at the end.
mpigrad_numba_cache() {
    if [[ -n ${NUMBA_CACHE_DIR:-} ]]; then
        export NUMBA_CACHE_DIR
        return 0
    fi
    local root=${MPIGRAD_NUMBA_CACHE:-${XDG_CACHE_HOME:-${HOME:-/nonexistent}/.cache}/mpigrad/numba}
    if [[ $root != job ]]; then
        local dir
        dir=$root/cpu-$(mpigrad_cpu_type)
        if mkdir -p -- "$dir" 2>/dev/null && [[ -w $dir ]]; then
            export NUMBA_CACHE_DIR=$dir
            return 0
        fi
        mpigrad_log "Numba cache $dir cannot be written: compiling into a per-job cache on this node"
    fi
    _mpigrad_job_cache=${TMPDIR:-/tmp}/mpigrad-numba-$(mpigrad_job_ref)
    export NUMBA_CACHE_DIR=$_mpigrad_job_cache
}

# Seconds until this job's time limit (squeue's %L), nothing when unlimited or unknown.
mpigrad_time_left() {
    local left
    left=$(squeue -h -j "$(mpigrad_job_ref)" -o %L 2>/dev/null | head -n 1) || return 0
    if [[ $left =~ ^(([0-9]+)-)?(([0-9]+):)?([0-9]+):([0-9]+)$ ]]; then
        local days=${BASH_REMATCH[2]:-0} h=${BASH_REMATCH[4]:-0} m=${BASH_REMATCH[5]} s=${BASH_REMATCH[6]}
        printf '%d\n' $(( ((10#$days * 24 + 10#$h) * 60 + 10#$m) * 60 + 10#$s ))
    fi
}

# True when the installed mpigrad's run configuration has the key $1 (checkpoint_every).
mpigrad_train_knows() {
    "${MPIGRAD_PYTHON:-python}" -c 'import dataclasses, sys
from mpigrad.config import RunConfig
sys.exit(sys.argv[1] not in {f.name for f in dataclasses.fields(RunConfig)})' "$1" 2>/dev/null
}

# Fills the array MPIGRAD_OPTIONS with what the job adds before the user's train options:
# --walltime from the job's time left minus MPIGRAD_END_MARGIN, so that the run stops two of
# its own measured iterations (plus the checkpoint write) before the limit, however long an
# iteration takes (--signal's warning comes at a fixed margin that a slow iteration can
# outlast); and --checkpoint-every.
mpigrad_job_options() {
    MPIGRAD_OPTIONS=()
    local left margin=${MPIGRAD_END_MARGIN:-60} every=${MPIGRAD_CHECKPOINT_EVERY:-30m}
    [[ $margin =~ ^[0-9]+$ ]] || mpigrad_die "MPIGRAD_END_MARGIN='$margin' is not a whole number of seconds"
    left=$(mpigrad_time_left)
    if [[ -n $left ]]; then
        (( left > margin )) ||
            mpigrad_die "the job has ${left} s left, no more than MPIGRAD_END_MARGIN=$margin: ask for a longer --time or a smaller margin"
        MPIGRAD_OPTIONS+=(--walltime "$(( left - margin ))s")
    fi
    if [[ $every != off ]]; then
        if mpigrad_train_knows checkpoint_every; then
            MPIGRAD_OPTIONS+=(--checkpoint-every "$every")
        else
            mpigrad_log "this mpigrad has no --checkpoint-every: no periodic checkpoints"
        fi
    fi
}

# After a failed step: `mpigrad trace repair` marks the trace failed and makes it readable
# when a rank died before rank 0 could close it.
mpigrad_repair_trace() {
    local trace=$1 output status=0
    [[ -f $trace ]] || return 0
    output=$("${MPIGRAD_PYTHON:-python}" -m mpigrad trace repair "$trace" 2>&1) || status=$?
    if (( status == 0 )); then
        mpigrad_log "mpigrad trace repair $trace: ${output:-done}"
    elif [[ $output == *"invalid choice: 'repair'"* ]]; then
        mpigrad_log "this mpigrad has no \`mpigrad trace repair\`: $trace left as the run left it"
    else
        mpigrad_log "mpigrad trace repair $trace failed ($status): ${output##*$'\n'}"
    fi
}

# Fills the array MPIGRAD_LAUNCH with the launcher command for SLURM_NTASKS ranks.
mpigrad_launcher() {
    case ${MPIGRAD_LAUNCHER:-srun} in
        srun)
            # Not --kill-on-bad-exit=1 (nor a site's KillOnBadExit=1): after a stop every rank
            # exits 75, and srun would kill rank 0 while it still writes the checkpoint when a
            # worker's 75 came first. A rank that dies is named by rank 0 (--timeout) and an
            # exception on any rank aborts them all (python -m mpi4py).
            MPIGRAD_LAUNCH=(srun --kill-on-bad-exit=0)
            if [[ -n ${MPIGRAD_SRUN_MPI:-} ]]; then
                MPIGRAD_LAUNCH+=("--mpi=$MPIGRAD_SRUN_MPI")
            fi
            local extra=()
            read -r -a extra <<< "${MPIGRAD_SRUN_OPTS:-}"
            MPIGRAD_LAUNCH+=("${extra[@]}")
            ;;
        mpiexec|mpirun)
            # Open MPI as root (a container) needs --allow-run-as-root; MPICH needs nothing.
            local extra=()
            read -r -a extra <<< "${MPIGRAD_MPIEXEC_OPTS:-}"
            MPIGRAD_LAUNCH=("$MPIGRAD_LAUNCHER" "${extra[@]}" -n "$SLURM_NTASKS")
            ;;
        *)
            mpigrad_die "MPIGRAD_LAUNCHER must be srun, mpiexec or mpirun, not '${MPIGRAD_LAUNCHER}'"
            ;;
    esac
}

# A config may declare the world size it was written for with a line "# ranks: N".
mpigrad_check_ranks() {
    local declared
    declared=$(sed -n 's/^# ranks: *\([0-9][0-9]*\).*/\1/p' "$1" | head -n 1)
    if [[ -n $declared && $declared != "$SLURM_NTASKS" ]]; then
        mpigrad_die "$1 is written for $declared ranks but this job has SLURM_NTASKS=$SLURM_NTASKS; submit with sbatch --ntasks=$declared"
    fi
}

# The job as scontrol names it: JOBID, or ARRAYJOBID_TASKID for an array task.
mpigrad_job_ref() {
    if [[ -n ${SLURM_ARRAY_JOB_ID:-} && -n ${SLURM_ARRAY_TASK_ID:-} ]]; then
        printf '%s_%s\n' "$SLURM_ARRAY_JOB_ID" "$SLURM_ARRAY_TASK_ID"
    else
        printf '%s\n' "$SLURM_JOB_ID"
    fi
}

_mpigrad_step_pid=""
_mpigrad_pending=""       # a signal that arrived before the step had a pid
_mpigrad_signal=""        # the last stop signal the batch shell received: USR1 or TERM
_mpigrad_interrupted=0

# The step is always asked to stop with USR1 (mpigrad treats USR1 and TERM alike). A TERM
# from scancel, preemption or the time limit has reached every process of the job already,
# srun and the ranks included: the shell adds a stop request, never a second TERM to srun.
_mpigrad_on_signal() {
    _mpigrad_signal=$1
    _mpigrad_interrupted=1
    if [[ -n $_mpigrad_step_pid ]]; then
        mpigrad_log "batch shell got SIG$1: asking the job step (pid $_mpigrad_step_pid) to stop with SIGUSR1"
        kill -s USR1 "$_mpigrad_step_pid" 2>/dev/null || true
    else
        _mpigrad_pending=USR1
    fi
}

# Catch USR1 and TERM from the start of the job, so that one arriving during set-up does
# not kill the batch shell before the step exists.
mpigrad_trap_stop_signals() {
    trap '_mpigrad_on_signal USR1' USR1
    trap '_mpigrad_on_signal TERM' TERM
}

# Runs "$@" in the background as the job step and waits for it, forwarding USR1 and TERM
# to it (srun and mpiexec pass them on to every rank). Returns the step's exit status, or
# 75 without starting the step when a stop signal came first.
mpigrad_run_step() {
    local status
    mpigrad_trap_stop_signals
    if [[ -n $_mpigrad_signal ]]; then
        mpigrad_log "SIG$_mpigrad_signal arrived before the step started: not starting it"
        _mpigrad_pending=""
        return "$MPIGRAD_EXIT_REQUEUE"
    fi
    "$@" &
    _mpigrad_step_pid=$!
    if [[ -n $_mpigrad_pending ]]; then
        # Caught between fork and $!. Give the child time to exec: until then it runs the
        # shell's trap and would drop the signal.
        sleep 0.2
        mpigrad_log "passing on SIG$_mpigrad_pending that arrived while the step started"
        kill -s "$_mpigrad_pending" "$_mpigrad_step_pid" 2>/dev/null || true
        _mpigrad_pending=""
    fi
    while :; do
        _mpigrad_interrupted=0
        status=0
        wait "$_mpigrad_step_pid" || status=$?
        # A trapped signal makes wait return early (status > 128) while the step runs on.
        if (( _mpigrad_interrupted && status > 128 )); then
            continue
        fi
        break
    done
    trap - USR1 TERM
    _mpigrad_step_pid=""
    return "$status"
}

_mpigrad_resume_hint() {
    printf 'to resume, submit the same script and arguments again with MPIGRAD_RUN_ID=%s\n' "${MPIGRAD_RUN_ID:-$SLURM_JOB_ID}"
}

# What the job does after the step exited with status $1; returns the job's exit status.
mpigrad_finish() {
    local status=$1 restarts=${SLURM_RESTART_COUNT:-0} job
    job=$(mpigrad_job_ref)
    if (( status == 0 )); then
        mpigrad_log "run finished"
        return 0
    fi
    if (( status != MPIGRAD_EXIT_REQUEUE )); then
        mpigrad_log "run failed with exit status $status"
        return "$status"
    fi
    if [[ $_mpigrad_signal == TERM ]]; then
        mpigrad_log "stopped at a checkpoint after SIGTERM (scancel or preemption): not requeueing; $(_mpigrad_resume_hint)"
        return "$status"
    fi
    if (( restarts >= ${MPIGRAD_MAX_REQUEUES:-20} )); then
        mpigrad_log "stopped at a checkpoint; restarted $restarts times already (MPIGRAD_MAX_REQUEUES): not requeueing; $(_mpigrad_resume_hint)"
        return "$status"
    fi
    # Logged first: requeueing a running job ends this shell soon after.
    mpigrad_log "stopped at a checkpoint; requeueing job $job, the next start resumes"
    if scontrol requeue "$job"; then
        return 0
    fi
    mpigrad_log "stopped at a checkpoint but scontrol requeue $job failed; $(_mpigrad_resume_hint)"
    return "$status"
}

# What every job does first: catch the stop signals, check it runs under sbatch, and source
# MPIGRAD_ENV_SCRIPT (modules, a venv) when set.
_mpigrad_prepare() {
    mpigrad_trap_stop_signals
    [[ -n ${SLURM_JOB_ID:-} && -n ${SLURM_NTASKS:-} ]] ||
        mpigrad_die "SLURM_JOB_ID/SLURM_NTASKS unset: submit this script with sbatch"
    if [[ -n ${MPIGRAD_ENV_SCRIPT:-} ]]; then
        [[ -f $MPIGRAD_ENV_SCRIPT ]] || mpigrad_die "MPIGRAD_ENV_SCRIPT=$MPIGRAD_ENV_SCRIPT not found"
        local shell_flags=$-
        set +eu   # module and venv scripts read unset variables and run failing commands
        # shellcheck source=/dev/null
        source "$MPIGRAD_ENV_SCRIPT"
        if [[ $shell_flags == *e* ]]; then set -e; fi
        if [[ $shell_flags == *u* ]]; then set -u; fi
    fi
}

# mpigrad_script SCRIPT.py [its arguments]: a training script of one's own (mpigrad.Session,
# docs/api.rst) as the whole job, with train's set-up, signal forwarding and requeue: the
# walltime signal reaches every rank, rank 0 stops the run at an iteration's end, the first
# worker saves the checkpoint, every rank exits 75 (Session.exit) and the job requeues itself.
# The script resumes on the next start from what it saved (examples/api/train.py: when its
# --checkpoint FILE exists).
mpigrad_script() {
    local script=$1
    shift
    _mpigrad_prepare
    [[ -f $script ]] || mpigrad_die "script $script not found (relative paths start in $PWD)"
    mpigrad_setup_env
    mpigrad_launcher
    mpigrad_log "job $(mpigrad_job_ref) restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-$(hostname)}: $SLURM_NTASKS ranks x $OMP_NUM_THREADS threads"
    local cmd=("${MPIGRAD_LAUNCH[@]}" "${MPIGRAD_PYTHON:-python}" -m mpi4py "$script" "$@")
    mpigrad_log "step: ${cmd[*]}"
    local status=0
    mpigrad_run_step "${cmd[@]}" || status=$?
    if [[ -n $_mpigrad_job_cache ]]; then
        rm -rf -- "$_mpigrad_job_cache"
    fi
    mpigrad_finish "$status"
}

# mpigrad_sweep RUNS: a file of runs (one line of mpigrad train options each, with its own
# --trace) as one job step, the runs one after another in the same ranks (mpigrad sweep), so
# the ranks start once. A complete trace is skipped and a stopped one resumed, so a requeued
# job goes on where it stopped: the walltime signal stops the running run at a checkpoint,
# the step exits 75 and the job requeues itself. A run the launch checks refuse is reported
# and the next starts (the step then exits 2). A rank's failure aborts the step: the job
# ends with its status and the later runs are not started; a line with --force starts its
# incomplete trace again when the job is submitted anew.
mpigrad_sweep() {
    local runs=$1
    shift
    _mpigrad_prepare
    [[ -f $runs ]] || mpigrad_die "runs file $runs not found (relative paths start in $PWD)"
    mpigrad_setup_env
    mpigrad_launcher
    mpigrad_log "job $(mpigrad_job_ref) restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-$(hostname)}: $SLURM_NTASKS ranks x $OMP_NUM_THREADS threads"
    local cmd=("${MPIGRAD_LAUNCH[@]}" "${MPIGRAD_PYTHON:-python}" -m mpi4py -m mpigrad sweep "$runs")
    mpigrad_log "step: ${cmd[*]}"
    local status=0
    mpigrad_run_step "${cmd[@]}" || status=$?
    if [[ -n $_mpigrad_job_cache ]]; then
        rm -rf -- "$_mpigrad_job_cache"
    fi
    mpigrad_finish "$status"
}

# mpigrad_train CONFIG TRACE [more train options]: the whole job. An existing TRACE means an
# earlier start of this job (or of MPIGRAD_RUN_ID's) wrote it, so the run continues with
# --resume from the checkpoint next to it; a trace is never overwritten.
mpigrad_train() {
    local config=$1 trace=$2
    shift 2
    _mpigrad_prepare
    [[ -f $config ]] || mpigrad_die "config $config not found (relative paths start in $PWD)"
    mpigrad_check_ranks "$config"
    mpigrad_setup_env
    mpigrad_launcher
    local train_cmd resume=()
    read -r -a train_cmd <<< "${MPIGRAD_TRAIN_CMD:-python -m mpi4py -m mpigrad train}"
    mkdir -p -- "$(dirname -- "$trace")"
    if [[ -e $trace ]]; then
        resume=(--resume)
    fi
    mpigrad_log "job $(mpigrad_job_ref) restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-$(hostname)}: $SLURM_NTASKS ranks x $OMP_NUM_THREADS threads"
    mpigrad_log "rank 0 (the server) runs on ${SLURMD_NODENAME:-$(hostname)}, the first of ${SLURM_JOB_NUM_NODES:-1} node(s)"
    mpigrad_log "NUMBA_CACHE_DIR=$NUMBA_CACHE_DIR HDF5_USE_FILE_LOCKING=$HDF5_USE_FILE_LOCKING"
    mpigrad_job_options
    local cmd=("${MPIGRAD_LAUNCH[@]}" "${train_cmd[@]}" --config "$config" --trace "$trace" "${resume[@]}"
               "${MPIGRAD_OPTIONS[@]}" "$@")
    mpigrad_log "step: ${cmd[*]}"
    local status=0
    mpigrad_run_step "${cmd[@]}" || status=$?
    if (( status != 0 && status != MPIGRAD_EXIT_REQUEUE )); then
        mpigrad_repair_trace "$trace"
    fi
    if [[ -n $_mpigrad_job_cache ]]; then
        rm -rf -- "$_mpigrad_job_cache"
    fi
    mpigrad_finish "$status"
}
