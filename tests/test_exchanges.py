"""The ways of aggregating behind one interface (runtime/exchange/way.py, ways.py): the
registry names them, the config picks one at one place, the config's own checks refuse
the combinations the protocol does not run, and every way runs through the roles (each
rank a thread on the loopback channel) with the sides expected for it."""

from __future__ import annotations

import threading

import pytest

from mpigrad.config import RunConfig
from mpigrad.errors import UsageError
from mpigrad.runtime.exchange import ways
from mpigrad.runtime.exchange.colocated import Colocated, ColocatedRank0, ColocatedWorker
from mpigrad.runtime.exchange.hierarchical import Hierarchical, HierarchicalRank0, HierarchicalWorker
from mpigrad.runtime.exchange.hierarchical_pipeline import (HierarchicalPipelined, HierarchicalPipelinedRank0,
                                                            HierarchicalPipelinedWorker)
from mpigrad.runtime.exchange.pipeline import Pipelined, PipelinedRank0, PipelinedWorker
from mpigrad.runtime.exchange.servers import SeparateServers, ServersRank0, ServersShardServer, ServersWorker
from mpigrad.runtime.exchange.tworounds import LowRankRank0, LowRankRounds, LowRankShardServer, LowRankWorker
from mpigrad.runtime.plan.checks import base_codec, check_two_rounds
from mpigrad.runtime.roles import server, shard, worker
from mpigrad.runtime.roles.stopping import StopFlag
from mpigrad.runtime.run.session import run_other_rank, run_parameter_server
from mpigrad.runtime.wire.loopback import LoopbackNetwork
from mpigrad.trace import load

POWERSGD = dict(codec="powersgd", policy="fixed", codec_opts={"start": 2})  # one round, then two
#: (options, the way's names, its class, the inner way's class or None)
COMBINATIONS = [
    (dict(servers=1), ["servers"], SeparateServers, None),
    (dict(servers=2), ["servers"], SeparateServers, None),
    (dict(servers="colocated"), ["colocated"], Colocated, None),
    (dict(servers="colocated", pipeline=True), ["pipelined"], Pipelined, None),
    (dict(servers=1, **POWERSGD), ["servers", "lowrank"], LowRankRounds, SeparateServers),
    (dict(servers=2, **POWERSGD), ["servers", "lowrank"], LowRankRounds, SeparateServers),
    (dict(servers="colocated", **POWERSGD), ["colocated", "lowrank"], LowRankRounds, Colocated),
    (dict(servers="colocated", ranks_per_node=2, exchange="hierarchical"), ["hierarchical"], Hierarchical, None),
    (dict(servers="colocated", ranks_per_node=2, exchange="hierarchical", **POWERSGD), ["hierarchical", "lowrank"],
     LowRankRounds, Hierarchical),
    (dict(servers="colocated", ranks_per_node=2, exchange="hierarchical", pipeline=True), ["hierarchical-pipelined"],
     HierarchicalPipelined, None),
]


def test_the_registry_names_the_ways():
    assert ways.EXCHANGES.names() == ["colocated", "hierarchical", "hierarchical-pipelined", "lowrank", "pipelined",
                                      "servers"]
    assert ways.EXCHANGES.lookup("servers") is SeparateServers
    with pytest.raises(UsageError, match="unknown exchange 'ring'; available: colocated, hierarchical, "
                                         "hierarchical-pipelined, lowrank"):
        ways.EXCHANGES.lookup("ring")


@pytest.mark.parametrize("options, names, way, inner", COMBINATIONS)
def test_the_config_picks_the_way(options, names, way, inner):
    config = RunConfig(lr=0.1, **options)
    config.validate()
    assert ways.exchange_names(config) == names
    chosen = ways.choose_exchange(config)
    assert type(chosen) is way
    assert (type(chosen.inner) if inner is not None else None) is inner


def test_the_combinations_the_protocol_does_not_run_are_refused_by_the_configs_checks():
    with pytest.raises(UsageError, match="pipeline needs servers = colocated"):
        RunConfig(lr=0.1, servers=2, pipeline=True).validate()
    config = RunConfig(servers="colocated", pipeline=True, **POWERSGD)
    with pytest.raises(UsageError, match="runs two rounds in the sequential order: drop --pipeline"):
        check_two_rounds(config, base_codec(config))


def test_a_config_that_no_one_round_way_takes_is_a_bug(monkeypatch):
    monkeypatch.setattr(Colocated, "chosen", staticmethod(lambda config: True))
    with pytest.raises(ValueError, match=r"\['colocated', 'servers'\] hold for one run"):
        ways.exchange_names(RunConfig(servers=1))


# ---- every way through the roles, on the loopback channel ----------------------------------
BASE = dict(model_opts={"fc_sizes": [64, 64]}, min_quantize_size=2000, iterations=4, batch_size=8,
            net_mode="virtual", compute_time=0.01, eval_every=0, progress_every=0, checksum_every=1,
            seed=5, lr=0.01)
#: The sides each role builds, by combination (worker, shard server, rank 0).
SIDES = [
    ((ServersWorker,), (), (ServersRank0,)),
    ((ServersWorker,), (ServersShardServer,), (ServersRank0,)),
    ((ColocatedWorker,), (), (ColocatedRank0,)),
    ((PipelinedWorker,), (), (PipelinedRank0,)),
    ((LowRankWorker, ServersWorker), (), (LowRankRank0, ServersRank0)),
    ((LowRankWorker, ServersWorker), (LowRankShardServer, ServersShardServer), (LowRankRank0, ServersRank0)),
    ((LowRankWorker, ColocatedWorker), (), (LowRankRank0, ColocatedRank0)),
    ((HierarchicalWorker,), (), (HierarchicalRank0,)),
    ((LowRankWorker, HierarchicalWorker), (), (LowRankRank0, HierarchicalRank0)),
    ((HierarchicalPipelinedWorker,), (), (HierarchicalPipelinedRank0,)),
]


def run(tmp_path, options, workers=2):
    config = RunConfig(**{**BASE, **options, "trace": str(tmp_path / "run.h5")})
    net = LoopbackNetwork(config.non_worker_ranks() + workers, config.shard_count(config.non_worker_ranks() + workers),
                          timeout=20.0, colocated=config.colocated)
    errors, codes = {}, {}

    def rank_main(rank):
        try:
            channel = net.channel(rank)
            codes[rank] = (run_parameter_server(config, channel, StopFlag(), ["test"], lambda message: None)
                           if rank == 0 else run_other_rank(config, channel))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(net.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(80)
    return codes, errors, config


@pytest.mark.parametrize("options, sides", [(c[0], s) for c, s in zip(COMBINATIONS, SIDES)],
                         ids=["star", "sharded", "colocated", "pipelined", "powersgd-star", "powersgd-sharded",
                              "powersgd-colocated", "hierarchical", "powersgd-hierarchical",
                              "pipelined-hierarchical"])
def test_each_way_runs_through_the_roles_with_its_sides(tmp_path, monkeypatch, options, sides):
    seen = {"worker": set(), "shard": set(), "rank0": set()}

    def recording(module, role):
        real = module.choose_exchange

        def choose(config):
            way = real(config)
            build = {"worker": way.worker, "shard": way.shard_server, "rank0": way.rank0}[role]

            def side(parts):
                made = build(parts)
                seen[role].add((type(made),) + ((type(made.inner),) if hasattr(made, "__dict__")
                                                and "inner" in made.__dict__ else ()))
                return made
            setattr(way, {"worker": "worker", "shard": "shard_server", "rank0": "rank0"}[role], side)
            return way
        monkeypatch.setattr(module, "choose_exchange", choose)

    recording(worker, "worker")
    recording(shard, "shard")
    recording(server, "rank0")
    codes, errors, config = run(tmp_path, options)
    assert not errors, errors
    assert codes[0] == 0
    trace = load(config.trace)
    assert trace.complete and list(trace.steps["iteration"]) == [0, 1, 2, 3]
    worker_sides, shard_sides, rank0_sides = sides
    assert seen["worker"] == {worker_sides}
    assert seen["shard"] == ({shard_sides} if shard_sides else set())
    assert seen["rank0"] == {rank0_sides}
