"""One GPU per rank (runtime/plan/gpu.py): the rank -> device rule, the CUDA-aware MPI query and
what ``mpigrad doctor`` prints of both. The rule is pure; the query asks the real MPI."""

from __future__ import annotations

import pytest

from mpigrad.errors import UsageError
from mpigrad.runtime.plan.gpu import cuda_aware_mpi, gpu_rank, plan_devices, plan_world

ONE_GPU = (("GPU-a",), 1)
FOUR_GPUS = (("GPU-a", "GPU-b", "GPU-c", "GPU-d"), 4)


def test_workers_take_the_devices_of_their_position_on_the_node():
    assert plan_devices([(3, *FOUR_GPUS), (1, *FOUR_GPUS), (2, *FOUR_GPUS)], False, "n1") == {1: 0, 2: 1, 3: 2}


def test_more_gpu_ranks_than_devices_is_refused_in_one_line_unless_shared():
    with pytest.raises(UsageError) as exc:
        plan_devices([(1, *ONE_GPU), (2, *ONE_GPU)], False, "gpu07")
    message = str(exc.value)
    assert message.startswith("2 ranks train on a GPU on gpu07 (1, 2) but see 1 device:") and "--share-gpu" in message
    assert "\n" not in message
    assert plan_devices([(1, *ONE_GPU), (2, *ONE_GPU), (3, *ONE_GPU)], True, "gpu07") == {1: 0, 2: 0, 3: 0}


def test_ranks_given_a_device_each_by_slurm_take_their_own_first_device():
    # --gpus-per-task=1: each task sees one device, a different one (same CUDA_VISIBLE_DEVICES=0 under cgroups)
    assert plan_devices([(1, ("GPU-a",), 1), (2, ("GPU-b",), 1)], False, "n1") == {1: 0, 2: 0}


def test_a_rank_that_sees_no_device_is_refused():
    with pytest.raises(UsageError, match="rank 2 on n1 sees no CUDA device"):
        plan_devices([(1, *ONE_GPU), (2, (), 0)], False, "n1")


def test_rank_0_takes_a_gpu_only_when_it_serves_a_shard():
    assert not gpu_rank(0, colocated=True) and gpu_rank(0, colocated=False) and gpu_rank(1, colocated=True)
    two_nodes = [(0, 0, "a", *FOUR_GPUS), (1, 0, "a", *FOUR_GPUS), (2, 0, "a", *FOUR_GPUS),
                 (3, 3, "b", *FOUR_GPUS), (4, 3, "b", *FOUR_GPUS)]
    assert plan_world(two_nodes, colocated=True, share=False) == {0: None, 1: 0, 2: 1, 3: 0, 4: 1}
    assert plan_world(two_nodes, colocated=False, share=False) == {0: 0, 1: 1, 2: 2, 3: 0, 4: 1}
    # Two workers and a colocated rank 0 fit a two-GPU node; with one server they do not.
    two_gpus = [(r, 0, "a", ("GPU-a", "GPU-b"), 2) for r in range(3)]
    assert plan_world(two_gpus, colocated=True, share=False) == {0: None, 1: 0, 2: 1}
    with pytest.raises(UsageError, match="3 ranks train on a GPU on a"):
        plan_world(two_gpus, colocated=False, share=False)


def test_the_pip_mpi_says_it_is_not_cuda_aware():
    supported, why = cuda_aware_mpi()
    assert supported is False
    assert why in ("MPIX_Query_cuda_support() returned 0", "MPIX_GPU_query_support(CUDA) set 0 (return code 0)")


@pytest.fixture(scope="module")
def gpu_table_config_run(tmp_path_factory, mpi_env):
    """examples/gpu/resnet18.toml (which sets neither ``tf32`` nor ``device``) trained one
    small step on the CPU, colocated: its result and trace."""
    from conftest import REPO, run_mpi

    trace = tmp_path_factory.mktemp("gpu-table") / "t.h5"
    result = run_mpi(3, ["train", "--config", str(REPO / "examples" / "gpu" / "resnet18.toml"), "--iterations", "1",
                         "--batch-size", "2", "--servers", "colocated", "--trace", str(trace)], mpi_env)
    return result, trace


@pytest.mark.mpi
def test_a_run_records_its_device_and_what_tf32_torch_used(tmp_path, mpi_env, gpu_table_config_run):
    from conftest import SMALL_RUN, run_mpi
    from mpigrad.trace import load

    result, trace = gpu_table_config_run  # the default setting
    assert result.returncode == 0, result.stderr
    off_trace = tmp_path / "off.h5"
    result = run_mpi(3, ["train", "--trace", str(off_trace), *SMALL_RUN, "--iterations", "1", "--tf32", "off"],
                     mpi_env)
    assert result.returncode == 0, result.stderr
    default, off = load(trace).attrs, load(off_trace).attrs
    assert default["device"] == "cpu" and default["workers_device"] == "cpu"
    # torch's own defaults: TF32 off for matmuls, on for cuDNN convolutions
    assert default["tf32"] == {"setting": "default", "matmul": False, "cudnn_conv": True}
    assert off["tf32"] == {"setting": "off", "matmul": False, "cudnn_conv": False}


def test_a_bad_tf32_setting_is_refused():
    from mpigrad.config import RunConfig

    with pytest.raises(UsageError, match="tf32 must be one of default, on, off"):
        RunConfig(tf32="maybe", lr=0.1).validate()


@pytest.mark.mpi
def test_the_gpu_table_script_runs_configs_train_takes(gpu_table_config_run):
    """examples/gpu/table.sh (issue 34's table on a GPU node): bash parses it, every layout it
    runs passes train's checks on its config, and the config trains (one small step on the
    CPU here: the script itself needs a GPU)."""
    import re
    import shlex
    import subprocess

    from conftest import REPO
    from mpigrad.config import RunConfig
    from mpigrad.runtime.plan.checks import check_options

    script = REPO / "examples" / "gpu" / "table.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    layouts = re.findall(r'^\s+"(--servers[^"]*)"$', script.read_text(), re.M)
    assert len(layouts) == 5
    config = str(REPO / "examples" / "gpu" / "resnet18.toml")
    for layout in layouts:
        words = shlex.split(layout)
        overrides = {"servers": words[1], "pipeline": True if "--pipeline" in words else None,
                     "codec": words[words.index("--codec") + 1],
                     "bits": int(words[words.index("--bits") + 1]) if "--bits" in words else None}
        check_options(RunConfig.from_sources(config, overrides))
    result, _ = gpu_table_config_run
    assert result.returncode == 0, result.stderr
