"""The hierarchical exchange's failures name the right worker (issue 62): a worker's
non-finite gradient reaches its node's owner of the slice, whose frames carry the node's
mean; the owner names the worker whose slice was not finite, not itself. A finite gradient
beyond fp16's range inside a node (``--intra-codec fp16``) ends the run with a line naming
the worker and the way out, not as a non-finite gradient of another rank."""

from __future__ import annotations

import pytest

from mpigrad.config import RunConfig
from mpigrad.runtime.exchange.build import base_codec, build_replica, build_shards, load_data
from mpigrad.runtime.roles import faults
import test_runtime_loopback


NODES = dict(policy="fixed", bits=4, ranks_per_node=2, exchange="hierarchical")


def owner_of_element_0(**options) -> int:
    """The rank of node 0's worker that owns the slice holding the flat gradient's element 0."""
    config = RunConfig(**{**test_runtime_loopback.BASE, **NODES, "servers": "colocated", **options})
    replica = build_replica(config, load_data(config))
    shards = build_shards(config, replica.layout, base_codec(config), 4)
    shard = next(s for s, one in enumerate(shards) if any(p.offset == 0 for p in one.pieces))
    return 1 + shard % 2


def _errors(tmp_path, **options) -> str:
    code, errors, _ = test_runtime_loopback.run(tmp_path, servers="colocated", workers=4, timeout=8.0,
                                                **{**NODES, **options})
    assert errors, code
    return " | ".join(f"{rank}: {error}" for rank, error in sorted(errors.items()))


@pytest.mark.parametrize("owner, intra", [(True, "fp32"), (False, "fp32"), (False, "int8")],
                         ids=["the slice's owner", "another worker of the node", "another worker, int8 slices"])
def test_a_non_finite_gradient_names_its_worker(tmp_path, monkeypatch, owner, intra):
    owns = owner_of_element_0()
    culprit = owns if owner else 3 - owns  # ranks 1 and 2 are node 0
    monkeypatch.setenv("MPIGRAD_INJECT_FAULT", f"nan-grad:{culprit}:2")
    text = _errors(tmp_path, intra_codec=intra)
    assert f"worker rank {culprit} computed a non-finite gradient at iteration 2" in text
    other = 3 - culprit
    assert f"worker rank {other} computed" not in text


def test_powersgds_factors_name_the_worker_too(tmp_path, monkeypatch):
    """PowerSGD on the hierarchical exchange: the factors of a node mean that is not finite
    are refused by the slice's owner naming the worker (8-bit factors: the codec refuses them)."""
    culprit = 3 - owner_of_element_0(codec="powersgd", codec_opts={"start": 0, "factor_bits": 8},
                                     min_quantize_size=None)
    monkeypatch.setenv("MPIGRAD_INJECT_FAULT", f"nan-grad:{culprit}:2")
    text = _errors(tmp_path, codec="powersgd", codec_opts={"start": 0, "factor_bits": 8}, min_quantize_size=None)
    assert f"worker rank {culprit} computed a non-finite gradient at iteration 2" in text
    assert f"worker rank {3 - culprit} computed" not in text


def test_a_gradient_beyond_half_precision_is_named_with_the_way_out(tmp_path, monkeypatch):
    culprit = 3 - owner_of_element_0()  # it sends element 0 to the owner at fp16
    original = faults.Fault.before_send

    def huge(self, iteration, loss, grad):
        if self.kind == "nan-grad" and iteration == self.iteration:
            grad[0] = 1e6  # finite in float32, infinite in fp16
            return loss
        return original(self, iteration, loss, grad)

    monkeypatch.setattr(faults.Fault, "before_send", huge)
    monkeypatch.setenv("MPIGRAD_INJECT_FAULT", f"nan-grad:{culprit}:1")
    text = _errors(tmp_path, intra_codec="fp16")
    assert (f"worker rank {culprit}: its gradient reaches 1e+06 at iteration 1, beyond fp16's range (65504) inside "
            "its node: use --intra-codec bf16 or fp32") in text
