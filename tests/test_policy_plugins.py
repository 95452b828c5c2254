"""A bit policy of the user's own, named ``package.module:Class``: checked like the model and
data plugins, and trained under a real mpiexec (examples/plugins/plateau.py)."""

from __future__ import annotations

import os
import sys
import textwrap

import numpy as np
import pytest
from conftest import REPO, SMALL_RUN, run_mpi

from mpigrad.policies import Observation, PolicyError, check_decision, get_policy, policy_options
from mpigrad.trace import load

EXAMPLES = REPO / "examples" / "plugins"

BROKEN = textwrap.dedent('''
    from mpigrad.policies import Policy

    class Decides(Policy):
        policy_id = "decides"

        def __init__(self, *, width: int = 0, n_layers=1, seed=0):
            super().__init__(n_layers=n_layers, seed=seed)
            self.width = width

        def _config(self):
            return {"width": self.width}

        def bits_range(self):
            return 2, 8

        def decide(self, obs):
            return (4,) * (self.n_layers + self.width)

    class Abstract(Policy):
        policy_id = "abstract"

    class TakesFixed(Decides):
        policy_id = "fixed"

    class NoId(Decides):
        policy_id = None

    class Raises(Decides):
        policy_id = "raises"

        def __init__(self, *, n_layers=1, seed=0):
            raise RuntimeError("no GPU here")

    not_a_class = 3
''')


@pytest.fixture()
def plugins(tmp_path, monkeypatch):
    (tmp_path / "broken_policies.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return tmp_path


def test_a_plugin_policy_is_built_checked_and_round_trips(plugins):
    policy = get_policy({"id": "plateau:PlateauBits", "window": 2, "patience": 2}, n_layers=2, seed=1)
    assert policy_options("plateau:PlateauBits") == {"initial_bits": 2, "max_bits": 8, "window": 10, "patience": 30}
    assert get_policy(policy.get_config(), n_layers=2, seed=1) == policy
    bits = [policy.decide(Observation(i, loss, 0.0)) for i, loss in enumerate([3, 2, 2.5, 2.6, 2.7, 2.8, 2.9])]
    assert bits == [(2, 2)] * 4 + [(3, 3)] * 2 + [(4, 4)]
    assert [r["iteration"] for r in policy.drain_records()] == [4, 6]
    resumed = get_policy(policy.get_config(), n_layers=2, seed=1)
    resumed.load_state_dict(policy.state_dict())
    assert resumed.decide(Observation(7, 3.0, 0.0)) == policy.decide(Observation(7, 3.0, 0.0))


@pytest.mark.parametrize("spec, message", [
    ("broken_policies:Abstract", "policy broken_policies:Abstract does not implement _config, bits_range, decide"),
    ("broken_policies:TakesFixed", "policy_id 'fixed' is taken by mpigrad.policies.fixed.FixedPolicy"),
    ("broken_policies:NoId", 'must set policy_id = "a-name-of-its-own"'),
    ("broken_policies:not_a_class", "broken_policies:not_a_class is a int, not a callable"),
    ("collections:OrderedDict", "is the class OrderedDict, not a subclass of mpigrad.policies.Policy"),
    ("broken_policies:Raises", "broken_policies:Raises failed: RuntimeError: no GPU here"),
    ("broken_policies:Nope", "module 'broken_policies' has no attribute 'Nope'"),
    ("no_such_module:Policy", "cannot import 'no_such_module'"),
])
def test_broken_plugins_are_refused_in_one_line(plugins, spec, message):
    with pytest.raises(PolicyError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        get_policy({"id": spec})
    assert "\n" not in str(error.value)


def test_unknown_options_of_a_plugin_list_the_valid_ones(plugins):
    with pytest.raises(PolicyError, match=r"unknown option\(s\) patiense; valid: initial_bits, max_bits, window, "
                                          r"patience"):
        get_policy({"id": "plateau:PlateauBits", "patiense": 3})


def test_every_decision_is_checked_against_the_layers_and_the_bits_range(plugins):
    policy = get_policy({"id": "broken_policies:Decides", "width": 1}, n_layers=2)
    with pytest.raises(PolicyError, match=r"decided bits \(4, 4, 4\) for iteration 5: expected 2 whole "
                                          r"number\(s\) in \[2, 8\]"):
        check_decision(policy, policy.decide(Observation(5, 1.0, 0.0)), 5)
    for bad in [(4, 9), (4, 1.5), None, (4,)]:
        with pytest.raises(PolicyError):
            check_decision(policy, bad, 0)
    assert check_decision(policy, np.array([3, 8]), 0) == [3, 8]


@pytest.mark.mpi
def test_the_example_plugin_trains_under_mpiexec_and_a_bad_decision_fails_the_run(tmp_path, mpi_env, plugins):
    env = dict(mpi_env, PYTHONPATH=os.pathsep.join([str(EXAMPLES), str(plugins), mpi_env.get("PYTHONPATH", "")]))
    trace = tmp_path / "plateau.h5"
    result = run_mpi(3, ["train", "--trace", str(trace), *SMALL_RUN, "--iterations", "30", "--policy",
                         "plateau:PlateauBits", "--policy-opt", "window=2", "--policy-opt", "patience=3"],
                     env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    tr = load(trace)
    assert tr.complete and tr.label == "PlateauBits"
    bits = tr.steps["bits"].to_numpy()
    assert bits[0] == 2 and bits[-1] > 2 and (np.diff(bits) >= 0).all()
    assert list(tr.policy["iteration"]) == [i for i in range(1, 30) if bits[i] > bits[i - 1]]

    failed = tmp_path / "decides.h5"
    result = run_mpi(3, ["train", "--trace", str(failed), *SMALL_RUN, "--iterations", "5", "--policy",
                         "broken_policies:Decides", "--policy-opt", "width=1"], env, cwd=tmp_path)
    assert result.returncode != 0
    layers = len(tr.steps.filter(like="bits_layers").columns)
    assert (f"policy 'decides' decided bits ({', '.join(['4'] * (layers + 1))}) for iteration 0: expected "
            f"{layers} whole number(s) in [2, 8]") in result.stderr
    assert load(failed).status == "failed"


def test_cli_refuses_a_broken_plugin_before_mpi_starts(plugins):
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXAMPLES), str(plugins)]))
    result = subprocess.run([sys.executable, "-m", "mpigrad", "train", "--policy", "broken_policies:Abstract",
                             "--trace", str(plugins / "x.h5")], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == ("mpigrad train: error: policy broken_policies:Abstract does not implement "
                                     "_config, bits_range, decide")
    assert not (plugins / "x.h5").exists()
