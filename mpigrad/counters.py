"""What the device path asks of the host, counted: kernel launches, host synchronisations and
bytes copied each way between host and device.

A leaf of the package (it imports nothing of mpigrad), below the runtime and the codecs
alike: the runtime owns the interface (what is counted, :class:`DeviceCounts`, the sites'
names), and the device codecs (:mod:`mpigrad.codecs.device`), the error memory
(:mod:`mpigrad.feedback`) and the runtime's device path all count into it, without the
codecs importing the runtime or the runtime importing the codecs' internals.

One tally per process (a rank), kept by the call sites themselves, not by the driver: so the
same counts come out under Numba's CUDA simulator as on a GPU, and CI can pin them (a change
that adds a launch or a synchronisation changes a count and fails a test). A launch is one
Numba kernel launch or one torch operation on device tensors made by the path (the error
memory's adds); a synchronisation is anything that makes the host wait for the device: a
stream or device synchronise, a blocking copy, a read of a device value (``.item()``,
``bool()``); a copy also counts its bytes, host to device (``to_device``) or device to host
(``to_host``).

    before = snapshot()
    ... encode, decode ...
    spent = snapshot() - before          # DeviceCounts: launches, synchronizations, bytes
    spent.sites                          # {"sync: status read": 2, "launch: numba": 14, ...}
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["DeviceCounts", "launched", "synchronized", "copied", "snapshot", "kernels_launched"]


@dataclass(frozen=True)
class DeviceCounts:
    """A tally (or the difference of two): ``sites`` counts each launch and synchronisation
    by where it happened; the totals are sums over them."""

    sites: Counter = field(default_factory=Counter)
    bytes_to_device: int = 0
    bytes_to_host: int = 0

    @property
    def launches(self) -> int:
        return sum(n for site, n in self.sites.items() if site.startswith("launch:"))

    @property
    def synchronizations(self) -> int:
        return sum(n for site, n in self.sites.items() if site.startswith("sync:"))

    def __sub__(self, other: "DeviceCounts") -> "DeviceCounts":
        sites = Counter(self.sites)
        sites.subtract(other.sites)
        return DeviceCounts(+sites, self.bytes_to_device - other.bytes_to_device,
                            self.bytes_to_host - other.bytes_to_host)

    def describe(self) -> str:
        """'14 launches, 3 synchronisations, 1.2 kB to the device, 5.0 kB to the host'."""
        return (f"{self.launches} launches, {self.synchronizations} synchronisations, "
                f"{_bytes(self.bytes_to_device)} to the device, {_bytes(self.bytes_to_host)} to the host")


def _bytes(n: int) -> str:
    return f"{n} B" if n < 1000 else f"{n / 1e3:.1f} kB" if n < 1e6 else f"{n / 1e6:.2f} MB"


_sites: Counter = Counter()
_to_device = 0
_to_host = 0
_kernels: set[str] = set()


def launched(where: str = "numba", count: int = 1, kernel: str | None = None) -> None:
    """``count`` kernel launches (``where``: "numba", or "torch" for a torch operation);
    ``kernel``: the Numba kernel's name, kept in :func:`kernels_launched`."""
    _sites[f"launch: {where}"] += count
    if kernel is not None:
        _kernels.add(kernel)


def kernels_launched() -> frozenset[str]:
    """The Numba kernels this process has launched so far, by name: a kernel first launched
    after the warm-up is compiled (or loaded from the cache) inside an iteration."""
    return frozenset(_kernels)


def synchronized(where: str) -> None:
    """The host waited for the device at ``where`` (e.g. "status read", "frame to host")."""
    _sites[f"sync: {where}"] += 1


def copied(direction: str, nbytes: int) -> None:
    """``nbytes`` copied ``direction`` ("to_device" or "to_host")."""
    global _to_device, _to_host
    if direction == "to_device":
        _to_device += int(nbytes)
    elif direction == "to_host":
        _to_host += int(nbytes)
    else:
        raise ValueError(f"direction must be to_device or to_host, got {direction!r}")


def snapshot() -> DeviceCounts:
    """This process's tally so far."""
    return DeviceCounts(Counter(_sites), _to_device, _to_host)
