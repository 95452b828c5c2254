"""A faster scheduler for Numba's CUDA simulator, where CI runs the device kernels.

Numba's simulator runs every simulated thread of a block as a Python thread and has a
manager thread poll them all (``is_alive`` in a loop) to release ``syncthreads`` barriers:
the polling takes the GIL from the threads doing the work, and starting a thread per
simulated thread costs more than most of them do. :func:`install` replaces the simulator's
block manager (``numba.cuda.simulator.kernel.BlockManager``) with one that

- runs a kernel without barriers (no ``syncthreads``, warp or grid sync, shared array
  anywhere in its code or the device functions it calls) thread by thread, in order, on the
  calling thread: one valid schedule of a kernel whose threads never wait for each other,
  so the results are those of any other;
- runs a kernel with barriers as Numba does, a Python thread per simulated thread, but
  releases each barrier when its last thread arrives (a condition variable), with no thread
  polling;

and both hand a kernel its arrays of plain numbers (no fields) as the NumPy arrays Numba
wraps: Numba wraps each in two objects whose ``__getitem__`` and ``__setitem__`` are Python
calls on every element read and written. An element, a slice, a write, ``.size``, ``len``,
``.view`` and the atomics are NumPy's either way. Where the wrappers differ, a kernel now
gets NumPy's behaviour: a negative index into ``.shape`` (which they refuse), whole-array
operators (``x + 1`` they refuse, ``x == 0`` they answer False) and ``bool(x)``; mpigrad's
kernels use none of these. Record arrays keep the wrappers, for their fields' attribute
access. And ``cuda.shared.array`` finds a block's array by its caller's frame, not by a walk
of the whole stack, for every kernel, those launched with ``debug=True`` too
(:func:`_shared_arrays_by_call_site`).

An exception in a simulated thread comes out as Numba's does, prefixed with the thread's
``tid=[x, y, z] ctaid=[x, y, z]``. A barrier reached by a kernel run without threads (code
this scan missed) raises rather than running on wrongly. Kernels launched with
``debug=True`` keep Numba's own manager, and so does every kernel under
``MPIGRAD_SIMULATOR_SCHEDULER=numba`` (to tell a scheduler's fault from a kernel's).
"""

from __future__ import annotations

import os
import threading
import types

import numpy as np

#: Names whose presence in a kernel's code (or a device function's it calls) means its
#: threads may wait for one another: barriers, warp and grid sync, shared memory.
_WAITING_NAMES = frozenset({"shared", "this_grid", "cg", "activemask"})

#: The kernel functions scanned, by id: whether each needs a thread per simulated thread.
_NEEDS_THREADS: dict[int, tuple[object, bool]] = {}


def needs_threads(fn) -> bool:
    """Whether simulated kernel ``fn`` (a Python function) may wait at a barrier or share
    memory between threads: any name with ``sync`` in it, or of :data:`_WAITING_NAMES`, in
    its code, its nested code or the code of the device functions and globals it reaches."""
    cached = _NEEDS_THREADS.get(id(fn))
    if cached is not None and cached[0] is fn:
        return cached[1]
    result = _scan(fn, set())
    _NEEDS_THREADS[id(fn)] = (fn, result)
    return result


def _scan(fn, seen: set[int]) -> bool:
    if id(fn) in seen or not isinstance(fn, types.FunctionType):
        return False
    seen.add(id(fn))
    referenced = [cell.cell_contents for cell in fn.__closure__ or () if _filled(cell)]
    codes = [fn.__code__]
    while codes:
        code = codes.pop()
        for name in code.co_names:
            if "sync" in name or name in _WAITING_NAMES:
                return True
            if name in fn.__globals__:
                referenced.append(fn.__globals__[name])
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    for obj in referenced:
        target = getattr(obj, "fn", obj)  # a simulated device function wraps its Python function
        if isinstance(target, types.FunctionType) and _scan(target, seen):
            return True
    return False


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _located(exc: BaseException, thread_idx, block_idx) -> BaseException:
    """``exc`` as Numba's simulator reports it: the thread and block prefixed."""
    tid, ctaid = f"tid={list(thread_idx)}", f"ctaid={list(block_idx)}"
    message = f"{tid} {ctaid}" if str(exc) == "" else f"{tid} {ctaid}: {exc}"
    try:
        return type(exc)(message)
    except Exception:  # an exception type that takes other arguments: as it was
        return exc


class _NoBarrier:
    """The calling thread's identity while it runs a block's threads in turn."""

    _ATTRIBUTES = ("threadIdx", "blockIdx", "thread_id", "syncthreads", "syncthreads_count", "syncthreads_and",
                   "syncthreads_or")

    def __init__(self, fn_name: str):
        self.fn_name = fn_name

    def barrier(self, *_):
        raise RuntimeError(f"simulated kernel {self.fn_name} reached a barrier while run without threads "
                           "(mpigrad.codecs.device.simulator found none in its code)")


#: ``MPIGRAD_SIMULATOR_SCHEDULER=numba`` keeps Numba's own block manager.
SCHEDULER_VARIABLE = "MPIGRAD_SIMULATOR_SCHEDULER"


def install_unless_refused() -> bool:
    """:func:`install`, unless ``MPIGRAD_SIMULATOR_SCHEDULER=numba`` keeps Numba's manager."""
    return os.environ.get(SCHEDULER_VARIABLE) != "numba" and install()


def install() -> bool:
    """Put the faster block manager in place of Numba's simulator's (once; idempotent).
    False, leaving Numba's, where the simulator is not the one this was written against
    (no ``BlockManager``/``BlockThread`` in ``numba.cuda.simulator.kernel``)."""
    from numba.cuda.simulator import kernel as sim

    if getattr(sim.BlockManager, "mpigrad_scheduler", False):
        return True
    if not (hasattr(sim, "BlockThread") and hasattr(sim, "Dim3")):
        return False
    numba_manager, numba_thread, dim3 = sim.BlockManager, sim.BlockThread, sim.Dim3
    within_kernel = getattr(sim, "FakeWithinKernelCUDAArray", None)

    def unwrapped(args: tuple) -> tuple:
        """``args`` with each array of plain numbers (no fields) as the ndarray Numba wraps."""
        if within_kernel is None:
            return args
        plain = []
        for arg in args:
            array = getattr(arg.__dict__.get("_item"), "_ary", None) if isinstance(arg, within_kernel) else None
            plain.append(array if isinstance(array, np.ndarray) and array.dtype.fields is None else arg)
        return tuple(plain)

    class WaitingThread(numba_thread):
        """A simulated thread whose barrier waits on its block's condition."""

        def syncthreads(self):
            block = self._manager
            with block.condition:
                if self.abort:
                    raise RuntimeError("abort flag set on syncthreads call")
                generation = block.generation
                block.arrived += 1
                if block.arrived == block.running:
                    block.release()
                else:
                    while generation == block.generation and not self.abort:
                        block.condition.wait()
                if self.abort:
                    raise RuntimeError("abort flag set on syncthreads clear")

        def run(self):
            block = self._manager
            try:
                super().run()
            finally:
                with block.condition:
                    block.running -= 1
                    if self.exception is not None and block.failed is None:
                        block.failed = self
                        for thread in block.threads:
                            thread.abort = True
                        block.condition.notify_all()
                    elif block.running and block.arrived == block.running:
                        block.release()  # the others wait at a barrier this thread left without

    class BlockManager(numba_manager):
        mpigrad_scheduler = True

        def release(self) -> None:
            self.arrived = 0
            self.generation += 1
            self.condition.notify_all()

        def run(self, grid_point, *args):
            if self._debug:
                return numba_manager.run(self, grid_point, *args)
            if needs_threads(self._f):
                return self._run_threads(grid_point, unwrapped(args))
            return self._run_in_turn(grid_point, unwrapped(args))

        def _run_in_turn(self, grid_point, args) -> None:
            caller = threading.current_thread()
            identity = _NoBarrier(getattr(self._f, "__name__", "?"))
            saved = {name: caller.__dict__[name] for name in _NoBarrier._ATTRIBUTES if name in caller.__dict__}
            block_dim = dim3(*self._block_dim)
            caller.blockIdx = dim3(*grid_point)
            for name in _NoBarrier._ATTRIBUTES[3:]:
                setattr(caller, name, identity.barrier)
            try:
                for point in np.ndindex(*self._block_dim):
                    caller.threadIdx = thread_idx = dim3(*point)
                    caller.thread_id = thread_idx.x + block_dim.x * (thread_idx.y + block_dim.y * thread_idx.z)
                    try:
                        self._f(*args)
                    except Exception as exc:
                        located = _located(exc, thread_idx, caller.blockIdx)
                        if located is exc:
                            raise
                        raise located.with_traceback(exc.__traceback__) from None
            finally:
                for name in _NoBarrier._ATTRIBUTES:
                    caller.__dict__.pop(name, None)
                caller.__dict__.update(saved)

        def _run_threads(self, grid_point, args) -> None:
            self.condition = threading.Condition()
            self.arrived = self.generation = 0
            self.failed = None
            points = list(np.ndindex(*self._block_dim))
            self.running = len(points)  # before any starts: a barrier counts them all

            def target():
                self._f(*args)

            self.threads = [WaitingThread(target, self, grid_point, point, self._debug) for point in points]
            for thread in self.threads:
                thread.start()
            for thread in self.threads:
                thread.join()
            if self.failed is not None:
                exception, traceback = self.failed.exception
                raise exception.with_traceback(traceback)

    sim.BlockManager = BlockManager
    _call_device_functions_in_place(sim)
    _shared_arrays_by_call_site()
    return True


def _shared_arrays_by_call_site() -> None:
    """Let ``cuda.shared.array`` find its block's array by the caller's file and line, as
    Numba's simulator keys it, but from the caller's frame: Numba's ``traceback.extract_stack``
    walks the whole stack and reads each frame's source line, on every simulated thread's
    every call. The array is filed with ``dict.setdefault``, so that threads that ask at
    once all get the one filed first (Numba's look-up then store, with the stack walk
    between, can hand two threads two arrays when the interpreter switches between them)."""
    import sys

    from numba.cuda.simulator import kernelapi

    shared = getattr(kernelapi, "FakeCUDAShared", None)
    types, numpy_support = getattr(kernelapi, "types", None), getattr(kernelapi, "numpy_support", None)
    if shared is None or types is None or numpy_support is None or getattr(shared.array, "mpigrad_by_frame", False):
        return
    try:  # the simulator this was written against files its arrays in a dict
        filed_in_a_dict = isinstance(shared(0).__dict__.get("_allocations"), dict)
    except Exception:  # noqa: BLE001 - another simulator: keep its own
        filed_in_a_dict = False
    if not filed_in_a_dict:
        return
    numba_array = shared.array

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:  # Numba's refusal, and dynamic memory (no key)
            return numba_array(self, shape, dtype, alignment)
        allocations = self._allocations
        caller = sys._getframe(1)
        site = (caller.f_code.co_filename, caller.f_lineno)
        found = allocations.get(site)
        if found is None:
            if isinstance(dtype, types.Type):
                dtype = numpy_support.as_dtype(dtype)
            found = allocations.setdefault(site, np.empty(shape, dtype))
        return found

    array.mpigrad_by_frame = True
    shared.array = array


def _call_device_functions_in_place(sim) -> None:
    """Let a simulated device function called inside a kernel skip Numba's swap of its
    module's ``cuda`` globals where that module is swapped already (by the kernel running, or
    an enclosing device function): Numba's swap then only counts the entrance, after a scan
    of the module's globals under two locks on every call."""
    from numba.cuda.simulator import kernelapi

    swapped = getattr(kernelapi, "_swap_refcount", None)
    if swapped is None:  # not the simulator this was written against: keep its calls
        return
    numba_call = sim.FakeCUDAKernel.__call__

    def __call__(self, *args):
        if self._device and swapped.get(id(self.fn.__globals__)):
            return self.fn(*args)
        return numba_call(self, *args)

    sim.FakeCUDAKernel.__call__ = __call__
