# shellcheck shell=bash
# Shared by train.sbatch and sweep.sbatch; sourced, never run. It only defines mpigrad_*
# functions; nothing happens until a jobscript calls mpigrad_train. See README.md.
#
# Knobs (export them on the login node before sbatch; sbatch passes the environment on):
#   MPIGRAD_ENV_SCRIPT     a file sourced first in the job (module loads, venv activation)
#   MPIGRAD_LAUNCHER       srun (default) or mpiexec: who starts the ranks
#   MPIGRAD_SRUN_MPI       PMI for srun --mpi=... (pmix, pmi2; `srun --mpi=list`); default: site's
#   MPIGRAD_TRAIN_CMD      the training command (default: python -m mpi4py -m mpigrad train)
#   MPIGRAD_MAX_REQUEUES   give up requeueing after this many restarts (default 20)
#   NUMBA_CACHE_DIR        default ${TMPDIR:-/tmp}/mpigrad-numba-$SLURM_JOB_ID (per job, per node)
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
    # Node-local, per job: no two jobs (or nodes) write the same cache files.
    export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-${TMPDIR:-/tmp}/mpigrad-numba-${SLURM_JOB_ID}}
    export HDF5_USE_FILE_LOCKING=${HDF5_USE_FILE_LOCKING:-FALSE}
    export PYTHONUNBUFFERED=1
}

# Fills the array MPIGRAD_LAUNCH with the launcher command for SLURM_NTASKS ranks.
mpigrad_launcher() {
    case ${MPIGRAD_LAUNCHER:-srun} in
        srun)
            MPIGRAD_LAUNCH=(srun --kill-on-bad-exit=1)
            if [[ -n ${MPIGRAD_SRUN_MPI:-} ]]; then
                MPIGRAD_LAUNCH+=("--mpi=$MPIGRAD_SRUN_MPI")
            fi
            ;;
        mpiexec)
            MPIGRAD_LAUNCH=(mpiexec -n "$SLURM_NTASKS")
            ;;
        *)
            mpigrad_die "MPIGRAD_LAUNCHER must be srun or mpiexec, not '${MPIGRAD_LAUNCHER}'"
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

_mpigrad_on_signal() {
    _mpigrad_signal=$1
    _mpigrad_interrupted=1
    if [[ -n $_mpigrad_step_pid ]]; then
        mpigrad_log "batch shell got SIG$1: forwarding it to the job step (pid $_mpigrad_step_pid)"
        kill -s "$1" "$_mpigrad_step_pid" 2>/dev/null || true
    else
        _mpigrad_pending=$1
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
    if scontrol requeue "$job"; then
        mpigrad_log "stopped at a checkpoint; requeued job $job, the next start resumes"
        return 0
    fi
    mpigrad_log "stopped at a checkpoint but scontrol requeue $job failed; $(_mpigrad_resume_hint)"
    return "$status"
}

# mpigrad_train CONFIG TRACE [more train options]: the whole job. An existing TRACE means an
# earlier start of this job (or of MPIGRAD_RUN_ID's) wrote it, so the run continues with
# --resume from the checkpoint next to it; a trace is never overwritten.
mpigrad_train() {
    local config=$1 trace=$2
    shift 2
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
    local cmd=("${MPIGRAD_LAUNCH[@]}" "${train_cmd[@]}" --config "$config" --trace "$trace" "${resume[@]}" "$@")
    mpigrad_log "job $(mpigrad_job_ref) restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST:-$(hostname)}: $SLURM_NTASKS ranks x $OMP_NUM_THREADS threads"
    mpigrad_log "NUMBA_CACHE_DIR=$NUMBA_CACHE_DIR HDF5_USE_FILE_LOCKING=$HDF5_USE_FILE_LOCKING"
    mpigrad_log "step: ${cmd[*]}"
    local status=0
    mpigrad_run_step "${cmd[@]}" || status=$?
    mpigrad_finish "$status"
}
