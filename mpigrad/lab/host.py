"""What the lab asks of the host: root, ``ip netns``, ``tc``'s tbf (netem for latency), and
the one way it runs their commands.

Every check answers with one line a user can act on; :func:`unavailable_reason` is what
``mpigrad lab`` refuses with and what the lab tests skip with. The probes work inside a
throwaway namespace of their own, so the host's interfaces are never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache

from ..errors import UsageError

#: Where a user without root goes instead (docs/lab.rst has the commands).
WITHOUT_ROOT = ("run it as root, in a container with --cap-add NET_ADMIN --cap-add SYS_ADMIN, in a VM, or in a "
                "user namespace (unshare --user --map-root-user --net --mount; see docs/lab.rst)")


class LabError(RuntimeError):
    """A lab command failed (one line: the command and what it printed)."""


class LabUnavailable(UsageError):
    """This host cannot build a lab (not root, no ``ip netns``, no tbf): exit 2, one line."""


def run(args: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run one ``ip``/``tc`` command; LabError with its first line of stderr when it fails."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise LabError(f"{args[0]} not found: install iproute2") from None
    except subprocess.TimeoutExpired:
        raise LabError(f"{' '.join(args)} did not finish within {timeout:g} s") from None
    if check and done.returncode:
        first = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}").splitlines()[0]
        raise LabError(f"{' '.join(args)}: {first}")
    return done


def in_namespace(namespace: str, args: list[str]) -> list[str]:
    """``args`` run inside network namespace ``namespace``."""
    return ["ip", "netns", "exec", namespace, *args]


@dataclass(frozen=True)
class HostSupport:
    """What the probe found. ``reason`` is the one line why no lab can be built (None: it can)."""

    reason: str | None
    netem: bool

    @property
    def latency_reason(self) -> str | None:
        """Why ``--latency`` is refused here (None when the kernel has netem)."""
        if self.netem:
            return None
        return ("--latency needs tc's netem qdisc, which this kernel does not have (sch_netem): "
                "the lab shapes rates only here")


_PROBE_NAMESPACE = "mgl-probe-{pid}"


@lru_cache(maxsize=1)
def probe() -> HostSupport:
    """Check root, ``ip``, ``tc``, ``ip netns``, tbf and netem (once per process)."""
    if os.geteuid() != 0:
        return HostSupport(f"mpigrad lab needs root to make network namespaces: {WITHOUT_ROOT}", False)
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return HostSupport(f"mpigrad lab needs the {tool!r} command (iproute2), which is not on PATH", False)
    namespace = _PROBE_NAMESPACE.format(pid=os.getpid())
    made = run(["ip", "netns", "add", namespace], check=False)
    if made.returncode:
        first = (made.stderr.strip() or "failed").splitlines()[0]
        return HostSupport(f"ip netns does not work here ({first}): {WITHOUT_ROOT}", False)
    try:
        tc = in_namespace(namespace, ["tc", "qdisc", "add", "dev", "lo", "root"])
        tbf = run([*tc, "tbf", "rate", "8mbit", "burst", "64kb", "latency", "400ms"], check=False)
        if tbf.returncode:
            first = (tbf.stderr.strip() or "failed").splitlines()[0]
            return HostSupport(f"tc's tbf qdisc does not work here ({first}): the kernel needs sch_tbf", False)
        run(in_namespace(namespace, ["tc", "qdisc", "del", "dev", "lo", "root"]), check=False)
        netem = run([*tc, "netem", "delay", "1ms"], check=False).returncode == 0
        return HostSupport(None, netem)
    finally:
        run(["ip", "netns", "delete", namespace], check=False)


def unavailable_reason() -> str | None:
    """One line saying why this host cannot build a lab, or None."""
    return probe().reason


def require_lab() -> HostSupport:
    """The probe's findings; LabUnavailable (one line) when no lab can be built here."""
    support = probe()
    if support.reason:
        raise LabUnavailable(support.reason)
    return support
