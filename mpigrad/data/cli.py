"""``mpigrad data``: fetch and verify datasets on a login node.

    mpigrad data fetch cifar10 DIR                       # download, verify MD5, unpack
    mpigrad data fetch cifar10 DIR --from-archive FILE   # a tarball copied by hand
    mpigrad data verify [cifar10] DIR                    # re-check files against the manifest

Training jobs then read ``DIR`` (``data_dir = "DIR"``) and never download.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import UsageError
from . import fetch as fetching


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    fetch = actions.add_parser(
        "fetch", help="download (or take a local archive), verify and unpack a dataset",
        description="Download a dataset archive, verify its checksum and unpack it into DIR. "
                    "Run it on a login node: compute nodes usually have no internet.")
    fetch.add_argument("dataset", choices=fetching.available(), help="dataset to fetch")
    fetch.add_argument("dir", metavar="DIR", help="directory that will hold the dataset files")
    fetch.add_argument("--from-archive", metavar="FILE",
                       help="verify and unpack this local archive instead of downloading")
    fetch.add_argument("--url", help="download from this mirror instead (file:// works too)")
    fetch.add_argument("--md5", help="expected MD5 of a mirror's repackaged archive "
                                     "(default: the official archive's; disables the size check)")
    fetch.add_argument("--force", action="store_true", help="replace files already in DIR")
    fetch.add_argument("--keep-archive", action="store_true",
                       help=f"keep the downloaded archive in DIR/{fetching.PARTIAL_DIR}")
    fetch.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                       help="network timeout (default 60)")
    fetch.set_defaults(handler=_run_fetch)
    verify = actions.add_parser(
        "verify", help="check a fetched directory against its manifest",
        description="Check the files in DIR against the manifest 'mpigrad data fetch' wrote (size and "
                    "SHA-256). A directory without one (filled by hand or by torchvision, e.g. holding "
                    "cifar-10-batches-py) is checked by reading its files as the dataset.")
    verify.add_argument("dataset", nargs="?", choices=fetching.available(),
                        help="the dataset DIR should hold (optional, as in fetch)")
    verify.add_argument("dir", metavar="DIR", help="directory written by 'mpigrad data fetch' (or holding the files)")
    verify.set_defaults(handler=_run_verify)


def run(args: argparse.Namespace) -> int:
    try:
        return args.handler(args)
    except fetching.FetchError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"{exc.filename or 'I/O'}: {exc.strerror or exc}") from None


def _run_fetch(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    result = fetching.fetch(args.dataset, args.dir, archive=args.from_archive, url=args.url,
                            md5=args.md5, force=args.force, keep_archive=args.keep_archive,
                            timeout=args.timeout, progress=_ProgressPrinter())
    files = result.manifest["files"]
    size = sum(info["bytes"] for info in files.values())
    print(f"{args.dataset}: {result.action} in {result.dest} "
          f"({len(files)} files, {size / 2**20:.1f} MiB; MD5 {result.manifest['archive_md5']})")
    return 0


def _run_verify(args: argparse.Namespace) -> int:
    manifest = fetching.verify(args.dir, args.dataset)
    if manifest.get("checked") == "content":
        print(f"{manifest['dataset']}: {len(manifest['files'])} files in {manifest['folder']} read as "
              f"{manifest['dataset']} (no {fetching.MANIFEST_NAME}: checked by content, not by checksum)")
    else:
        print(f"{manifest.get('dataset')}: {len(manifest['files'])} files in {args.dir} "
              f"match {fetching.MANIFEST_NAME}")
    return 0


class _ProgressPrinter:
    """Download progress on stderr, one line per tenth (or per 64 MiB when the size is unknown)."""

    def __init__(self):
        self._next_mark = 0

    def __call__(self, received: int, total: int | None) -> None:
        mark = received * 10 // total if total else received >> 26
        if mark < self._next_mark:
            return
        self._next_mark = mark + 1
        of = f" of {total / 2**20:.1f} MiB ({100 * received // total}%)" if total else " MiB"
        print(f"  downloaded {received / 2**20:.1f}{of}", file=sys.stderr, flush=True)
