"""The warm-up compiles every kernel a run can use; KernelWatch names any it missed.

Every real run of the suite (conftest ``run_mpi``) fails on the line a rank prints for a
kernel first called inside the run, so the runs that switch codecs (PowerSGD's factor codec
after its float32 start, a fp16 broadcast, widths chosen by a policy) check the warm-up too.
"""

from __future__ import annotations

import sys
import types

import numpy as np
from numba import njit

from mpigrad.codecs import get_codec
from mpigrad.config import RunConfig
from mpigrad.runtime.exchange.warmup import KernelWatch, kernel_signatures, run_codecs, warm_up


def ids(codecs) -> list[tuple[str, int]]:
    return [(c.codec_id, c.get_config().get("bits", 0)) for c in codecs]


def test_a_moving_policy_warms_every_width_it_may_choose():
    codecs = ids(run_codecs(RunConfig(policy="adaptive")))
    assert ("fp32", 0) in codecs
    widths = sorted(bits for codec, bits in codecs if codec == "uniform")
    assert widths == list(range(widths[0], widths[-1] + 1)) and len(widths) > 1


def test_a_fixed_width_warms_that_width_only():
    assert ids(run_codecs(RunConfig(policy="fixed", bits=4))) == [("uniform", 4), ("fp32", 0)]


def test_powersgd_warms_its_factor_rest_and_menu_codecs():
    config = RunConfig(codec="powersgd", policy="fixed", min_quantize_size=None,
                       codec_opts={"rank": 2, "factor_bits": 8, "rest_bits": 16, "start": 2})
    codecs = ids(run_codecs(config))
    assert codecs[0] == ("powersgd", 0) and ("uniform", 8) in codecs and ("fp16", 0) in codecs


def test_a_broadcast_codec_of_its_own_is_warmed():
    codecs = ids(run_codecs(RunConfig(policy="fixed", broadcast_codec="fp16")))
    assert ("fp16", 0) in codecs and ("uniform", 2) in codecs


def test_warm_up_runs_encode_decode_and_accumulate_of_each_codec():
    codec = get_codec({"id": "terngrad"})
    seconds = warm_up(RunConfig(), [codec])
    assert seconds >= 0 and codec.calls == 2  # one encode per warm-up size


def test_the_watch_names_a_kernel_first_called_after_it(monkeypatch):
    module = types.ModuleType("mpigrad._watch_probe")

    def double(x):
        return 2 * x

    double.__module__, double.__qualname__ = module.__name__, "double"
    module.double = njit(double)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    watch = KernelWatch()
    assert watch.compiled() == []
    module.double(np.float32(1.5))
    assert watch.compiled() == ["mpigrad._watch_probe.double"]
    assert "mpigrad._watch_probe.double" in kernel_signatures()
