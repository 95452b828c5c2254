"""The block scheduler that mpigrad puts in Numba's CUDA simulator
(mpigrad/codecs/device/simulator.py): barrier-free kernels run thread by thread on the calling
thread, kernels with barriers on threads released by a condition; both give CUDA's results,
name a failing thread as Numba does, and never hang on a failure or a thread that leaves."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from numba import config

pytestmark = pytest.mark.skipif(not config.ENABLE_CUDASIM, reason="the simulator's scheduler (a GPU run has none)")

if config.ENABLE_CUDASIM:
    from numba import cuda

    from mpigrad.codecs.device import kernels  # installs the scheduler
    from mpigrad.codecs.device.simulator import needs_threads

    THREADS = 8

    @cuda.jit
    def doubled(x, out, threads):
        i = cuda.grid(1)
        if i < x.size:
            out[i] = 2 * x[i]
            threads[i] = threading.get_ident()

    @cuda.jit(device=True)
    def wait_for_block():
        cuda.syncthreads()

    @cuda.jit
    def block_sums(x, out, threads):
        """Each block's sum by a tree in shared memory, its barriers in a device function."""
        t = cuda.threadIdx.x
        i = cuda.grid(1)
        s = cuda.shared.array(THREADS, np.float64)
        s[t] = x[i] if i < x.size else 0.0
        threads[i] = threading.get_ident()
        wait_for_block()
        step = THREADS // 2
        while step > 0:
            if t < step:
                s[t] += s[t + step]
            wait_for_block()
            step //= 2
        if t == 0:
            out[cuda.blockIdx.x] = s[0]

    @cuda.jit
    def waits_in_a_device_function(out):
        wait_for_block()
        out[cuda.threadIdx.x] = 1

    @cuda.jit
    def leaves_early(x, out):
        """Thread 0 returns before the barrier the others wait at."""
        t = cuda.threadIdx.x
        if t == 0:
            return
        cuda.syncthreads()
        out[t] = x[t]

    @cuda.jit
    def fails_in_one_thread(x, out, wait):
        i = cuda.grid(1)
        if wait:
            cuda.syncthreads()
        out[i] = x[i + 1000 * (i == 13)]  # thread 5 of block 1 reads past the end

    @cuda.jit(device=True)
    def thread_number():
        return cuda.threadIdx.x

    # A device function of another module: its ``cuda`` global is not the kernel's to swap.
    _elsewhere = {"cuda": cuda}
    exec("def block_number():\n    return cuda.blockIdx.x\n", _elsewhere)
    block_number = cuda.jit(device=True)(_elsewhere["block_number"])

    @cuda.jit
    def numbered(out):
        out[cuda.grid(1)] = 100 * block_number() + thread_number()

    #: What the kernels below saw, appended by their simulated threads.
    SEEN: list = []

    @cuda.jit
    def records_its_arrays(x, records):
        i = cuda.grid(1)
        SEEN.append((type(x), type(records)))
        records[i].total = x[i] + 1  # a record's field by attribute: Numba's wrapper gives it

    @cuda.jit
    def two_shared_arrays(out):
        """Two shared arrays, one per line: each thread writes its number to the first and
        its negative to the second; after the barrier thread 0 sums each."""
        t = cuda.threadIdx.x
        first = cuda.shared.array(THREADS, np.int64)
        second = cuda.shared.array(THREADS, np.int64)
        SEEN.append((cuda.blockIdx.x, id(first), id(second)))
        first[t], second[t] = t, -t
        cuda.syncthreads()
        if t == 0:
            out[cuda.blockIdx.x, 0] = first.sum()
            out[cuda.blockIdx.x, 1] = second.sum()

    @cuda.jit
    def hidden_barrier(out):
        getattr(cuda, "".join(["sync", "threads"]))()  # a barrier no scan of names sees
        out[0] = 1


def run_with_timeout(launch, seconds: float = 60):
    """Call ``launch`` on a thread; fail the test if it has not returned in ``seconds``."""
    box = {}

    def target():
        try:
            launch()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the simulated kernel hung"
    if "error" in box:
        raise box["error"]


def test_the_scan_tells_the_device_kernels_with_barriers_from_those_without():
    assert needs_threads(kernels.range_keys.py_func) and needs_threads(kernels.sum_partials.py_func)
    assert not needs_threads(kernels.finish_ranges.py_func)
    assert needs_threads(block_sums.py_func)
    assert needs_threads(waits_in_a_device_function.py_func)  # its barrier is in a device function
    assert not needs_threads(doubled.py_func)


def test_a_kernel_without_barriers_runs_every_thread_on_the_calling_thread():
    x = np.arange(37, dtype=np.float32)
    out, threads = np.zeros(40, np.float32), np.zeros(40, np.int64)
    doubled[5, THREADS](x, out, threads)                      # 40 threads, the last 3 past x
    assert np.array_equal(out[:37], 2 * x) and not out[37:].any()
    assert set(threads[:37]) == {threading.get_ident()}


def test_a_kernel_with_barriers_runs_a_thread_per_simulated_thread_and_reduces_right():
    x = np.random.default_rng(0).standard_normal(30)
    out, threads = np.zeros(4), np.zeros(32, np.int64)
    run_with_timeout(lambda: block_sums[4, THREADS](x, out, threads))
    np.testing.assert_allclose(out, [x[b * THREADS:(b + 1) * THREADS].sum() for b in range(4)], rtol=1e-12)
    assert threading.get_ident() not in set(threads) and len(set(threads[:THREADS])) == THREADS


def test_a_thread_that_leaves_before_a_barrier_releases_the_others():
    x = np.arange(THREADS, dtype=np.float32) + 1
    out = np.zeros(THREADS, np.float32)
    run_with_timeout(lambda: leaves_early[1, THREADS](x, out))
    assert out[0] == 0 and np.array_equal(out[1:], x[1:])


@pytest.mark.parametrize("wait", [0, 1], ids=["in-turn", "threads"])
def test_a_failing_thread_is_named_as_numba_names_it(wait):
    x, out = np.zeros(16, np.float32), np.zeros(16, np.float32)
    with pytest.raises(IndexError, match=r"^tid=\[5, 0, 0\] ctaid=\[1, 0, 0\]: "):
        run_with_timeout(lambda: fails_in_one_thread[2, THREADS](x, out, wait))
    doubled[2, THREADS](x + 1, out, np.zeros(16, np.int64))   # the launch ended: the next one runs
    assert np.array_equal(out, 2 * (x + 1))


def test_a_barrier_the_scan_missed_fails_rather_than_running_on():
    with pytest.raises(RuntimeError, match="hidden_barrier reached a barrier while run without threads"):
        hidden_barrier[1, THREADS](np.zeros(1, np.int32))


def test_device_functions_swap_cuda_only_where_their_module_is_not_swapped_already(monkeypatch):
    from numba.cuda.simulator import kernel as sim

    swapped = []
    numba_swap = sim.swapped_cuda_module

    def counted(fn, module):
        swapped.append(fn.__name__)
        return numba_swap(fn, module)

    monkeypatch.setattr(sim, "swapped_cuda_module", counted)
    out = np.zeros(2 * THREADS, np.int64)
    numbered[2, THREADS](out)
    assert np.array_equal(out, [100 * b + t for b in range(2) for t in range(THREADS)])
    # The kernel's launch swaps its module, which is thread_number's too: only the other
    # module's device function swaps its own, once per call.
    assert swapped.count("numbered") == 1 and swapped.count("block_number") == 2 * THREADS
    assert "thread_number" not in swapped


@pytest.mark.parametrize("wait", [0, 1], ids=["in-turn", "threads"])
def test_plain_arrays_reach_the_kernel_as_numpys_and_record_arrays_keep_numbas_wrapper(wait):
    """The scheduler hands a kernel its arrays of plain numbers unwrapped (NumPy's element
    reads and writes, without Numba's two Python-level wrappers on each); a record array
    keeps the wrapper, whose attribute access to a field a kernel may use."""
    x = np.arange(2 * THREADS, dtype=np.float32)
    records = np.zeros(2 * THREADS, dtype=[("total", np.float32)])
    SEEN.clear()
    launch = records_its_arrays[2, THREADS]
    if wait:  # the same kernel body, run on threads: give it a barrier's name to scan
        launch = cuda.jit(_with_barrier(records_its_arrays.py_func))[2, THREADS]
    run_with_timeout(lambda: launch(x, records))
    assert np.array_equal(records["total"], x + 1)
    assert len(SEEN) == 2 * THREADS and {kinds[0] for kinds in SEEN} == {np.ndarray}
    assert {kinds[1] for kinds in SEEN} != {np.ndarray}  # Numba's wrapper


def _with_barrier(fn):
    """``fn`` with a ``cuda.syncthreads()`` before its body, so that the scan runs it on threads."""
    def waits(x, records):
        cuda.syncthreads()
        fn(x, records)
    return waits


def test_each_shared_array_is_its_lines_for_every_thread_of_a_launch(monkeypatch):
    """``cuda.shared.array`` found by its caller's line, as Numba's simulator files it, but
    from the caller's frame, with no walk of the stack: the two arrays of two lines are two,
    and every thread of a launch gets the same pair."""
    import traceback

    walks = []
    monkeypatch.setattr(traceback, "extract_stack", lambda *a, **k: walks.append(a) or [])
    out = np.zeros((3, 2), np.int64)
    SEEN.clear()
    run_with_timeout(lambda: two_shared_arrays[3, THREADS](out))
    assert walks == []
    assert out.tolist() == [[sum(range(THREADS)), -sum(range(THREADS))]] * 3
    assert len(SEEN) == 3 * THREADS and len({(a, b) for _, a, b in SEEN}) == 1
    assert SEEN[0][1] != SEEN[0][2]


def test_the_environment_keeps_numbas_own_scheduler():
    code = ("import os; os.environ['NUMBA_ENABLE_CUDASIM'] = '1'\n"
            "from numba.cuda.simulator import kernel\n"
            "import mpigrad.codecs.device.kernels\n"
            "print(getattr(kernel.BlockManager, 'mpigrad_scheduler', False))")
    for value, installed in (("numba", "False"), ("", "True")):
        env = dict(os.environ, MPIGRAD_SIMULATOR_SCHEDULER=value)
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == installed
