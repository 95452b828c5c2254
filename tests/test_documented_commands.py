"""Every command the docs tell a user to run is run here, the way a user would.

Which commands: in README.rst, docs/*.rst, examples/**/README.md and jobscripts/README.md,
every line of a code block (an indented block, or a fenced one in Markdown) that starts with
a command word (``mpiexec``, ``mpigrad``, ``python``, ``PYTHONPATH=...``, ``mkdir``, ``for``,
``pip``, Slurm's and the module system's commands, ...) or with a ``$ `` prompt. A trailing
backslash continues a command, ``&&`` separates two, and a shell ``for`` loop is one
command up to its ``done``. Each is run, unless EXCLUDED names it with the reason.

How: per document, in a fresh directory holding the checkout's examples/ and jobscripts/
(as a fresh clone), with the traces the docs name as placeholders (``run.h5``,
``fix2.h5``, ``runs/*.h5``; PLACEHOLDERS), in the documented order, through ``bash`` with
this virtual environment's ``mpiexec``, ``mpigrad`` and ``python`` first on PATH and one
thread per rank (a plain ``mpiexec ... mpigrad train`` run goes to the worker's shared world
through conftest's ``world_relay``: the same options, folder and output, no start-up). Shortened by SHORTEN: a ``mpigrad train`` runs 3 iterations, a ``for``
loop runs its first value only (test_every_documented_command_is_run_or_excluded loads the
config of every other value instead).

Outputs: the lines a ``$ `` command shows after it must be what the command printed,
unless ILLUSTRATIVE names the command with the reason; sample lines shown without a
command (a progress line, error messages) must be listed in ILLUSTRATIVE_SAMPLES, and the
README's progress line is checked for its fields and its traffic (test_readme_progress_line).
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import REPO

DOCS = [REPO / "README.rst", *sorted((REPO / "docs").glob("*.rst")),
        *sorted((REPO / "examples").rglob("README.md")), REPO / "jobscripts" / "README.md"]

COMMAND_WORDS = {"mpiexec", "mpirun", "mpigrad", "python", "pip", "sbatch", "srun", "salloc", "squeue", "scontrol", "sacct",
                 "scancel", "module", "mkdir", "for", "export", "source", "tail", "exit", "cd"}

_SLURM = "needs a Slurm cluster (tests/test_slurm.py and tests/test_jobscripts.py run the jobscripts)"
_CIFAR = "needs CIFAR-10, a download (tests/test_data_fetch.py fetches from a local archive and server)"
_GRID = "needs the paper grid's CIFAR-10 traces (days of simulated training on 12 or 18 ranks)"
_COMPARISON = ("the comparison: 75 runs, about 45 minutes (tests/test_compare_example.py runs its tiny "
               "version end to end)")
_MAP = ("the map over bandwidths: 252 runs and 360 re-timings, hours (tests/test_map.py runs its tiny "
        "version end to end)")
_HARD = ("the teacher task: 24 runs, about 50 minutes (tests/test_hard_example.py runs its tiny "
         "version end to end)")

#: (regex searched in the command, reason): commands not run here.
EXCLUDED = [
    (r"^pip install", "installs packages: the tests run in the installed checkout"),
    (r"^python -m venv|^source ~/venvs|^module load|^export MPIGRAD_ENV_SCRIPT",
     "sets up a cluster account (site modules, a venv in $HOME)"),
    (r"^python -m pytest", "runs the test suite, of which this test is part"),
    (r"^mpigrad lab\b", "builds network namespaces as root (tests/test_lab.py runs small labs)"),
    (r"^mpiexec (--oversubscribe )?.*ip netns exec NAME", "the lab's launch line, with placeholders"),
    (r"^(MPIGRAD_LAB_|RANK=I|GLOO_SOCKET_IFNAME=lab0)", "the variables a lab node is given, not a command"),
    (r"^mpirun --oversubscribe", "Open MPI's flags, which MPICH's mpirun refuses (.ci/run's Open MPI pass starts "
                                 "its runs with them, through mpigrad/mpiexec.py)"),
    (r"^(sbatch|srun|salloc|squeue|scontrol|sacct|scancel|exit)\b", _SLURM),
    (r"^tail -f mpigrad-sweep", _SLURM),
    (r"^mpigrad data (fetch|verify) cifar10 data/cifar10$|^mpigrad data verify data/cifar10$", _CIFAR),
    (r"^mpigrad train --check --config examples/paper-12nodes/mqgrad\.toml$",
     _CIFAR + "; tests/test_train_check.py checks that config with --data digits"),
    (r"runs/paper-1[28]nodes", _GRID),
    (r"^python examples/compare/run\.py", _COMPARISON),
    (r"^python examples/compare/lowrank\.py", "the low-rank comparison: 40 runs, 30 to 60 minutes on a shared 2-core machine "
                                              "(tests/test_powersgd_quantized.py runs its --smoke version)"),
    (r"^mpigrad trace compare runs/compare/", "reads the comparison's traces (" + _COMPARISON + ")"),
    (r"^python examples/hard/run\.py", _HARD),
    (r"^mpiexec -n [23] python -m mpi4py examples/api/train\.py( --config examples/compare/fix2\.toml --trace "
     r"runs/api[/a-z0-9]*\.h5| --ddp)$",
     "tests/test_api_mpi.py runs examples/api/train.py with fix2.toml, mqgrad.toml and fp32.toml, and under DDP"),
    (r"^python examples/map/run\.py", _MAP),
    (r"^python examples/nodes/run\.py", "the nodes' comparison: 39 runs, about 23 minutes (tests/test_nodes_example.py "
                                       "runs its --smoke version end to end)"),
    (r"^mpigrad trace compare runs/hard/", "reads the teacher task's traces (" + _HARD + ")"),
    (r"^mpiexec .*--device cuda", "needs a GPU (CI has none: tests/test_device_path_mpi.py runs the device path "
                                  "in Numba's CUDA simulator, docs/gpu.rst's simulator command too)"),
    (r"^mpigrad bench (codecs|iteration|trace|peers|clock|device|api)",
     "a benchmark, minutes per run (tests/test_bench_iteration.py runs bench iteration small, "
     "tests/test_bench_peers.py bench peers, tests/test_bench_clock.py bench clock, "
     "tests/test_device_path_mpi.py bench device, tests/test_bench_api.py bench api)"),
    (r"^mpigrad trace compare bench-peers/", "reads bench peers' traces (tests/test_bench_peers.py compares them)"),
    (r"^mpigrad trace retime", "the placeholders are written through the TraceWriter API, with none of the "
                               "bytes a run records (tests/test_retime.py re-times real runs)"),
    (r"^mpigrad simulate \S+\.h5", "replays a recorded run's trace, which the docs' placeholders are not "
                                   "(tests/test_simulate.py replays real runs)"),
    (r"^mpiexec -n 17 .*--trace runs/nodes/4x4\.h5$", "17 ranks, half a minute of a 2-core machine's CPUs for its "
                                                     "start-up alone (tests/test_hierarchical.py runs 2 x 2 under "
                                                     "MPICH and Open MPI)"),
    (r"^python examples/scale/run\.py", "the map at scale: 270 SimGrid simulations, about 42 minutes "
                                        "(tests/test_simulate.py simulates each layout and the peers)"),
]

#: (regex, replacement) applied to a command before it runs: short but real runs.
SHORTEN = [
    (r"(mpigrad train\b[^\n;]*)", r"\1 --iterations 3"),
    (r"(-m mpigrad\.policies\.simenv\b.*?)--seeds \d+", r"\1--seeds 2"),
    (r"\bfor (\w+) in ([^;\n]+?); do", lambda m: f"for {m.group(1)} in {m.group(2).split()[0]}; do"),
    (r"(mpigrad bench calibrate -o \S+)", r"\1 --sizes 1024,16384 --repeat 1"),
]

#: (regex searched in a $-command, reason): outputs shown for it that are not compared.
ILLUSTRATIVE = [
    (r"^mpigrad trace info", "dates, version and config of the run that wrote the file"),
    (r"^mpigrad trace repair", "the repair of a killed 1800-iteration run; the placeholder is complete"),
]

#: (document, regex of a sample line shown without a command, reason).
ILLUSTRATIVE_SAMPLES = [
    ("README.rst", r"^iter \d+/\d+ ", "a 300-iteration run; test_readme_progress_line checks its fields and traffic"),
    ("docs/models.rst", r"^mpigrad train: error: ", "errors of broken plugins (tests/test_plugins.py checks them)"),
    ("jobscripts/README.md", r"^mpigrad doctor: error: ", "needs srun's PMI mismatch on a cluster"),
    ("docs/lab.rst", r"^mpigrad lab: error: ", "needs a machine without root (tests/test_lab.py checks the refusals)"),
    ("docs/lab.rst", r"^mpigrad train: error: --resume: trace lab\.h5 ran on lab ",
     "a lab run resumed outside it (tests/test_trace_network.py checks the refusal)"),
]
_SAMPLE_LINE = re.compile(r"^(iter \d+/\d+ |mpigrad [a-z]+: error: )")


@dataclass
class Command:
    doc: str
    line: int
    text: str
    output: list[str] = field(default_factory=list)   # lines shown after a $ prompt

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def _blocks(path: Path) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each code block: fenced (Markdown) or indented by 4."""
    lines = path.read_text().splitlines()
    blocks, current, start, fenced = [], [], 0, False
    for number, line in enumerate(lines, 1):
        if path.suffix == ".md" and line.lstrip().startswith("```"):
            if fenced:
                blocks.append((start, current))
                current = []
            fenced, start = not fenced, number + 1
            continue
        if fenced:
            current.append(line)
        elif line.startswith("    ") or (current and not line.strip()):
            if not current:
                start = number
            current.append(line[4:])
        elif current:
            blocks.append((start, current))
            current = []
    if current:
        blocks.append((start, current))
    return blocks


def _strip_comment(line: str) -> str:
    """``line`` without a trailing shell comment (a ``#`` after a space, outside quotes)."""
    quote = None
    for k, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and k and line[k - 1].isspace():
            return line[:k].rstrip()
    return line.rstrip()


def _is_command(text: str) -> bool:
    words = text.split()
    if not words or _SAMPLE_LINE.match(text):
        return False
    first = words[0]
    if first == "for":  # a shell loop, not Python's "for x in y:"
        return bool(re.match(r"for \w+ in .*; do\b", text))
    return first in COMMAND_WORDS or bool(re.fullmatch(r"[A-Z_]+=\S*", first))


def documented_commands(path: Path) -> tuple[list[Command], list[tuple[int, str]]]:
    """The commands of ``path`` in order, and the sample lines it shows without a command."""
    doc = str(path.relative_to(REPO))
    commands, samples = [], []
    for start, lines in _blocks(path):
        k = 0
        prompted = None
        while k < len(lines):
            number, line = start + k, lines[k]
            stripped = line.strip()
            k += 1
            if not stripped:
                prompted = None if prompted is None or not prompted.output else prompted
                continue
            is_prompt = stripped.startswith("$ ")
            text = stripped[2:] if is_prompt else stripped
            if prompted is not None and not is_prompt:
                prompted.output.append(line.rstrip())
                continue
            if not _is_command(text):
                if _SAMPLE_LINE.match(text):
                    samples.append((number, text))
                continue
            while text.endswith("\\") and k < len(lines):
                text = text[:-1].rstrip() + " " + lines[k].strip()
                k += 1
            if re.match(r"for \w+ in .*; do", text):
                depth = len(re.findall(r"\bdo\b", text)) - len(re.findall(r"\bdone\b", text))
                body = [_strip_comment(text)]
                while depth > 0 and k < len(lines):
                    part = lines[k].strip()
                    k += 1
                    while part.endswith("\\") and k < len(lines):
                        part = part[:-1].rstrip() + " " + lines[k].strip()
                        k += 1
                    depth += len(re.findall(r"\bdo\b", part)) - len(re.findall(r"\bdone\b", part))
                    body.append(_strip_comment(part))
                commands.append(Command(doc, number, "\n".join(body)))
                continue
            for part in _strip_comment(text).split(" && "):
                commands.append(Command(doc, number, part.strip()))
            prompted = commands[-1] if is_prompt else None
    return commands, samples


def _reason(patterns, text: str) -> str | None:
    """The reason of the first pattern found in ``text`` or in it without leading VAR=value."""
    bare = re.sub(r"^(?:[A-Z_]+=\S*\s+)+", "", text)
    return next((reason for pattern, reason in patterns
                 if re.search(pattern, text, re.M) or re.search(pattern, bare, re.M)), None)


def shortened(text: str) -> str:
    for pattern, replacement in SHORTEN:
        text = re.sub(pattern, replacement, text)
    return text


def _loop_configs(text: str) -> list[str]:
    """Every ``--config`` path a for loop visits, its variables substituted."""
    loops = re.findall(r"\bfor (\w+) in ([^;\n]+?); do", text)
    configs = re.findall(r"--config (\S+)", text)
    paths = []
    for values in itertools.product(*(v.split() for _, v in loops)):
        for config in configs:
            for (name, _), value in zip(loops, values):
                config = config.replace(f"${{{name}}}", value).replace(f"${name}", value)
            paths.append(config)
    return paths


ALL = {doc: documented_commands(doc) for doc in DOCS}


def test_every_documented_command_is_run_or_excluded():
    """The rules above find the documented commands; every exclusion still matches one; every
    config a loop visits (only its first value runs) loads; every sample line is listed."""
    from mpigrad.config import RunConfig

    commands = [c for doc in DOCS for c in ALL[doc][0]]
    run = [c for c in commands if not _reason(EXCLUDED, c.text)]
    assert len(run) >= 25 and sum("mpigrad train" in c.text for c in run) >= 6, [str(c) for c in run]
    for pattern, reason in EXCLUDED + ILLUSTRATIVE:
        assert any(_reason([(pattern, reason)], c.text) for c in commands), f"stale: {pattern} ({reason})"
    for command in run:
        for config in _loop_configs(command.text):
            RunConfig.from_sources(str(REPO / config), {})
    for doc in DOCS:
        name = str(doc.relative_to(REPO))
        for number, text in ALL[doc][1]:
            assert any(d == name and re.search(p, text) for d, p, _ in ILLUSTRATIVE_SAMPLES), \
                f"{name}:{number}: sample output neither produced by a test nor listed as illustrative: {text}"


# ---- running them ---------------------------------------------------------------------------

def _placeholders(folder: Path, commands: list[str]) -> None:
    """The trace files ``commands`` read without making them, and only those (a directory
    the commands should create stays absent): docs/trace.rst's fix2.h5 and mqgrad.h5 (the
    runs whose outputs it shows), fix4.h5, fix8.h5, adaptive.h5 and run.h5 as copies, and
    runs/*.h5 as a folder of both."""
    from test_analysis import write_sample_runs

    (folder / ".samples").mkdir()
    samples = write_sample_runs(folder / ".samples")
    text = "\n".join(commands)
    for name, source in [("fix2", "fix2"), ("mqgrad", "mqgrad"), ("fix4", "fix2"), ("fix8", "fix2"),
                         ("adaptive", "mqgrad"), ("run", "fix2")]:
        if re.search(rf"(?<![\w/.$]){name}\.h5", text):
            shutil.copy(samples[source], folder / f"{name}.h5")
    if "runs/*.h5" in text:
        (folder / "runs").mkdir()
        for name, path in samples.items():
            shutil.copy(path, folder / "runs" / f"{name}.h5")
    shutil.rmtree(folder / ".samples")


def _fresh_clone(folder: Path) -> None:
    tracked = subprocess.run(["git", "ls-files", "examples", "jobscripts"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    for name in tracked:
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)


def _run(command: str, folder: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["bash", "-c", "set -e\n" + command], cwd=folder, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(exc.cmd, 124, exc.stdout or "", f"timed out after {timeout} s")


@pytest.fixture
def user_env(mpi_env, world_relay) -> dict[str, str]:
    """The environment a user's shell has: this venv first on PATH, one thread per rank;
    where the suite's worlds are on, each plain ``mpigrad train`` run goes to this worker's
    world (conftest's ``world_relay``: no start-up per documented run), every other command
    to the venv's ``mpiexec``."""
    bin_dir = str(Path(sys.executable).parent)
    env = dict(mpi_env, PATH=os.pathsep.join([bin_dir, mpi_env.get("PATH", "")]))
    env.pop("PYTHONPATH", None)
    return world_relay(env)


#: Outputs of the commands run, by document and command text, for the checks below.
_RESULTS: dict[tuple[str, str], subprocess.CompletedProcess] = {}


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("doc", [d for d in DOCS if any(not _reason(EXCLUDED, c.text) for c in ALL[d][0])],
                         ids=lambda d: str(d.relative_to(REPO)))
def test_documented_commands_run(doc, tmp_path, user_env):
    commands = [c for c in ALL[doc][0] if not _reason(EXCLUDED, c.text)]
    _fresh_clone(tmp_path)
    _placeholders(tmp_path, [c.text for c in commands])
    failures = []
    for command in commands:
        result = _run(shortened(command.text), tmp_path, user_env, timeout=240)
        _RESULTS[(command.doc, command.text)] = result
        if result.returncode != 0:
            failures.append(f"{command}\n  exit {result.returncode}: {result.stderr.strip()[-600:]}")
            continue
        if command.output and not _reason(ILLUSTRATIVE, command.text):
            shown = "\n".join(line.rstrip() for line in command.output).strip()
            printed = "\n".join(line.rstrip() for line in result.stdout.splitlines()).strip()
            if shown != printed:
                failures.append(f"{command}\n  the doc shows:\n{shown}\n  it printed:\n{printed}")
    assert not failures, "\n".join(failures)
    if doc.name == "README.rst":
        _check_readme_progress_line(doc)


def _check_readme_progress_line(doc: Path) -> None:
    """The README's sample line has the fields the quick start prints, and traffic the run
    could have sent: at least its iterations x the bytes of a 2-bit iteration (bits never fall
    below the initial 2)."""
    quick = next(r for (d, text), r in _RESULTS.items()
                 if d == "README.rst" and text == "mpiexec -n 3 python -m mpi4py -m mpigrad train")
    printed = [line for line in quick.stdout.splitlines() if line.startswith("iter ")][-1]
    sample = next(line.strip() for line in doc.read_text().splitlines() if line.strip().startswith("iter 300/300"))

    def fields(line):
        return re.findall(r"(?:^|\s)([A-Za-z+]+)(?=\s)", line)

    assert fields(sample)[:len(fields(printed))] == fields(printed), (sample, printed)
    done, = map(int, re.match(r"iter\s+(\d+)/", printed).groups())
    per_iteration = float(re.search(r"sent ([\d.]+) MB", printed).group(1)) / done
    assert " bits 2 " in printed
    iterations = int(re.match(r"iter (\d+)/", sample).group(1))
    sent = float(re.search(r"sent ([\d.]+) MB", sample).group(1))
    assert sent >= 0.999 * iterations * per_iteration, \
        f"README: {iterations} iterations cannot send {sent} MB when one 2-bit iteration sends {per_iteration:.2f} MB"


def test_shortening_rules():
    loop = "for m in fix2 fix4; do\n    mpiexec -n 4 python -m mpi4py -m mpigrad train --config examples/quick/$m.toml\ndone"
    assert shortened(loop) == ("for m in fix2; do\n    mpiexec -n 4 python -m mpi4py -m mpigrad train "
                               "--config examples/quick/$m.toml --iterations 3\ndone")
    assert _loop_configs(loop) == ["examples/quick/fix2.toml", "examples/quick/fix4.toml"]
    assert shlex.split(shortened("python -m mpigrad.policies.simenv --seeds 40 --policy x"))[4] == "2"
    assert shortened("mpigrad bench calibrate -o costs.json     # a note") == \
        "mpigrad bench calibrate -o costs.json --sizes 1024,16384 --repeat 1     # a note"
