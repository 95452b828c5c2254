"""Download, verify and unpack datasets on a login node; compute nodes have no internet.

``fetch("cifar10", dest)`` downloads the archive into ``dest/.partial/`` (an interrupted
HTTP download resumes where it stopped), checks its size and MD5 before opening it, and
unpacks only the members the dataset expects, by name, into a staging directory. Only when
every member is out intact are the files moved into ``dest``; the manifest
``dest/mpigrad-fetch.json`` (size and SHA-256 of each file) is written last, so a directory
with a manifest is complete. A wrong checksum, a truncated or foreign archive raise
:class:`FetchError` and leave ``dest`` without new data files.

Mirrors and hand-copied archives: ``url=`` fetches from another place (``file://`` works);
``md5=`` replaces the expected checksum for a mirror that repackaged the archive (the size
check is then skipped, the MD5 still guards the download). Tests replace entries of
``DATASETS`` the same way.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import re
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

__all__ = ["FetchError", "ArchiveSpec", "FetchResult", "DATASETS", "MANIFEST_NAME",
           "PARTIAL_DIR", "available", "get_spec", "fetch", "verify", "download", "file_md5"]

MANIFEST_NAME = "mpigrad-fetch.json"
PARTIAL_DIR = ".partial"
_MANIFEST_FORMAT = 1
_CHUNK = 1 << 20

Progress = Callable[[int, "int | None"], None]   # (bytes so far, total bytes or None)


class FetchError(ValueError):
    """A download, archive or data directory that cannot be used; the message says why."""


class UnreachableError(FetchError):
    """The download could not start: no route, no DNS, refused (a node without internet)."""


@dataclass(frozen=True)
class ArchiveSpec:
    """Where a dataset's archive lives, how to check it, and which members to keep."""

    dataset: str
    filename: str
    url: str
    md5: str
    size: int | None               # bytes of the official archive, None if unknown
    prefix: str                    # the directory every member lives in
    files: tuple[str, ...]         # members written into the destination, by base name
    ignored: tuple[str, ...] = ()  # members allowed in the archive but not written


DATASETS: dict[str, ArchiveSpec] = {}


def _register(spec: ArchiveSpec) -> ArchiveSpec:
    DATASETS[spec.dataset] = spec
    return spec


_register(ArchiveSpec(
    dataset="cifar10", filename="cifar-10-python.tar.gz",
    url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    md5="c58f30108f718f92721af3b95e74349a", size=170498071, prefix="cifar-10-batches-py",
    files=("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5",
           "test_batch", "batches.meta"),
    ignored=("readme.html",)))


def available() -> list[str]:
    """Sorted names of the datasets that can be fetched."""
    return sorted(DATASETS)


def get_spec(dataset: str) -> ArchiveSpec:
    try:
        return DATASETS[dataset]
    except KeyError:
        raise FetchError(f"unknown dataset {dataset!r}; can fetch: {', '.join(available())}") from None


@dataclass(frozen=True)
class FetchResult:
    dest: Path
    manifest: dict
    action: str                    # "fetched" or "already present"


def file_md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def download(url: str, target: Path, *, timeout: float = 60.0, progress: Progress | None = None) -> None:
    """Fetch ``url`` into ``target``; resume from ``target``'s length when the server allows.

    Raises FetchError when the transfer fails or ends short of its announced length; the
    bytes received so far stay in ``target`` for the next attempt.
    """
    target = Path(target)
    have = target.stat().st_size if target.exists() else 0
    request = urllib.request.Request(url, headers={"User-Agent": "mpigrad-data-fetch"})
    if have:
        request.add_header("Range", f"bytes={have}-")
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:   # nothing left past our length: the checksum decides
            return
        raise FetchError(f"download of {url} failed: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise UnreachableError(f"download of {url} failed: {getattr(exc, 'reason', exc)}") from None
    with response:
        resumed = have > 0 and getattr(response, "status", None) == 206 and \
            re.match(rf"bytes {have}-", response.headers.get("Content-Range", "")) is not None
        received = have if resumed else 0
        length = response.headers.get("Content-Length")
        total = received + int(length) if length and length.isdigit() else None
        try:
            with open(target, "ab" if resumed else "wb") as out:
                while block := response.read(_CHUNK):
                    out.write(block)
                    received += len(block)
                    if progress is not None:
                        progress(received, total)
        except (http.client.HTTPException, TimeoutError, ConnectionError) as exc:
            raise FetchError(f"download of {url} stopped after {received} bytes "
                             f"({type(exc).__name__}); run the same command again to resume") from None
    if total is not None and received < total:
        raise FetchError(f"download of {url} stopped after {received} of {total} bytes; "
                         f"run the same command again to resume")


def _check_archive(path: Path, size: int | None, md5: str, *, own_download: bool) -> None:
    actual = path.stat().st_size
    problem = None
    if size is not None and actual != size:
        problem = f"is {actual} bytes, expected {size} (truncated or not the right archive)"
    elif (digest := file_md5(path)) != md5:
        problem = f"has MD5 {digest}, expected {md5} (corrupt or not the right archive)"
    if problem is None:
        return
    if own_download:   # our own bad bytes: drop them so that the next attempt starts clean
        path.unlink()
        problem += "; the bad download was deleted"
    raise FetchError(f"archive {path} {problem}")


def _extract(archive: Path, spec: ArchiveSpec, staging: Path) -> dict[str, dict]:
    """Copy the expected members of ``archive`` into ``staging``; reject anything else."""
    wanted = {f"{spec.prefix}/{name}": name for name in spec.files}
    allowed = set(wanted) | {f"{spec.prefix}/{name}" for name in spec.ignored}
    files: dict[str, dict] = {}
    seen: set[str] = set()
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                name = member.name.removeprefix("./").rstrip("/")
                if name == spec.prefix and member.isdir():
                    continue
                if name not in allowed:
                    raise FetchError(f"archive {archive} holds an unexpected member {member.name!r}; "
                                     f"not the {spec.dataset} archive, nothing was extracted")
                if name in seen or not member.isfile():
                    raise FetchError(f"archive {archive}: member {member.name!r} is duplicated "
                                     f"or not a regular file; nothing was extracted")
                seen.add(name)
                if name in wanted:
                    files[wanted[name]] = _copy_member(tar, member, staging / wanted[name])
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise FetchError(f"archive {archive} is truncated or corrupt ({exc}); "
                         f"nothing was extracted") from None
    missing = [name for name in spec.files if name not in files]
    if missing:
        raise FetchError(f"archive {archive} lacks {', '.join(missing)}; nothing was extracted")
    return files


def _copy_member(tar: tarfile.TarFile, member: tarfile.TarInfo, target: Path) -> dict:
    digest, size = hashlib.sha256(), 0
    source = tar.extractfile(member)
    with source, open(target, "wb") as out:
        while block := source.read(_CHUNK):
            out.write(block)
            digest.update(block)
            size += len(block)
    return {"bytes": size, "sha256": digest.hexdigest()}


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def verify(dest: str | os.PathLike, dataset: str | None = None) -> dict:
    """Check every file listed in ``dest``'s manifest (size and SHA-256); return the manifest.

    A directory without a manifest that holds ``dataset``'s files (cifar10's, also in the
    archive's ``cifar-10-batches-py`` folder, as torchvision leaves them) is checked by
    reading them as that dataset instead; the manifest returned then says ``"checked":
    "content"``. ``dataset`` None: cifar10 for such a directory.
    """
    dest = Path(dest)
    path = dest / MANIFEST_NAME
    if dataset is not None:
        get_spec(dataset)
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        return _verify_content(dest, get_spec(dataset or "cifar10"))
    except ValueError:
        manifest = None
    listed = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(listed, dict) or not listed or not all(
            Path(name).name == name and isinstance(info, dict) and {"bytes", "sha256"} <= set(info)
            for name, info in listed.items()):
        raise FetchError(f"{path} is not a valid mpigrad fetch manifest")
    for name, info in listed.items():
        file = dest / name
        if not file.is_file():
            raise FetchError(f"{file} is missing (listed in {MANIFEST_NAME})")
        if file.stat().st_size != info["bytes"] or _file_sha256(file) != info["sha256"]:
            raise FetchError(f"{file} differs from the copy that was fetched (size or SHA-256)")
    if dataset is not None and manifest.get("dataset") != dataset:
        raise FetchError(f"{dest} holds the {manifest.get('dataset')!r} dataset, not {dataset!r}")
    return manifest


def _verify_content(dest: Path, spec: ArchiveSpec) -> dict:
    """A directory without a manifest: read ``spec``'s files as its dataset (FetchError if
    they are absent, incomplete or malformed)."""
    folder = dest if (dest / spec.files[0]).exists() or not (dest / spec.prefix).is_dir() else dest / spec.prefix
    present = [name for name in spec.files if (folder / name).is_file()]
    if not present:
        raise FetchError(f"{dest} has no {MANIFEST_NAME} (not fetched by mpigrad data fetch) and holds no "
                         f"{spec.dataset} files ({', '.join(spec.files)}, or a {spec.prefix} folder of them)")
    from . import load_dataset  # the package's loaders: the same reading as training
    from .datasets import DataError

    try:
        load_dataset(spec.dataset, data_dir=str(folder))
    except DataError as exc:
        raise FetchError(str(exc)) from None
    return {"dataset": spec.dataset, "checked": "content", "folder": str(folder),
            "files": {name: {"bytes": (folder / name).stat().st_size} for name in present}}


def _already_present(dest: Path, spec: ArchiveSpec) -> dict | None:
    """The manifest of a complete earlier fetch, None for a fresh directory; raise for anything
    that fetching would overwrite."""
    if (dest / MANIFEST_NAME).exists():
        try:
            manifest = verify(dest)
        except FetchError as exc:
            raise FetchError(f"{exc}; pass --force to fetch again") from None
        if manifest.get("dataset") != spec.dataset:
            raise FetchError(f"{dest} holds the {manifest.get('dataset')!r} dataset; "
                             f"choose another directory or pass --force")
        return manifest
    clashing = [name for name in spec.files if (dest / name).exists()]
    if clashing:
        raise FetchError(f"{dest} already holds {clashing[0]}, not written by mpigrad data fetch; "
                         f"pass --force to replace it")
    return None


def fetch(dataset: str, dest: str | os.PathLike, *, archive: str | os.PathLike | None = None,
          url: str | None = None, md5: str | None = None, force: bool = False,
          keep_archive: bool = False, timeout: float = 60.0,
          progress: Progress | None = None) -> FetchResult:
    """Make ``dest`` hold a verified copy of ``dataset`` (see the module docstring).

    ``archive``: a local copy of the archive to verify and unpack instead of downloading
    (never modified or deleted). ``url``/``md5``: mirror overrides. ``force``: replace files
    already in ``dest``. ``keep_archive``: leave the downloaded archive in ``dest/.partial``.
    """
    spec = get_spec(dataset)
    if archive is not None and url is not None:
        raise FetchError("give either a URL to download or a local archive, not both")
    if md5 is not None and not re.fullmatch(r"[0-9a-fA-F]{32}", md5):
        raise FetchError(f"MD5 {md5!r} is not 32 hexadecimal digits")
    expected_md5 = (md5 or spec.md5).lower()
    expected_size = spec.size if expected_md5 == spec.md5 else None
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise FetchError(f"{dest} exists and is not a directory")
    if not force and (manifest := _already_present(dest, spec)) is not None:
        return FetchResult(dest, manifest, "already present")

    created = not dest.exists()
    partial = dest / PARTIAL_DIR
    partial.mkdir(parents=True, exist_ok=True)
    try:
        archive_path, source = _obtain_archive(spec, partial, archive, url, timeout, progress)
        _check_archive(archive_path, expected_size, expected_md5, own_download=archive is None)
        files = _unpack(archive_path, spec, dest, partial)
    finally:
        if not any(partial.iterdir()):
            partial.rmdir()
            if created and not any(dest.iterdir()):
                dest.rmdir()
    manifest = {
        "format": _MANIFEST_FORMAT, "dataset": spec.dataset, "archive": archive_path.name,
        "archive_md5": expected_md5, "archive_bytes": archive_path.stat().st_size,
        "source": source, "fetched": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "files": files,
    }
    temporary = dest / (MANIFEST_NAME + ".tmp")
    temporary.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(temporary, dest / MANIFEST_NAME)
    if archive is None and not keep_archive:
        archive_path.unlink()
        if not any(partial.iterdir()):
            partial.rmdir()
    return FetchResult(dest, manifest, "fetched")


def _obtain_archive(spec: ArchiveSpec, partial: Path, archive, url, timeout, progress) -> tuple[Path, str]:
    """The archive to unpack and where it came from: downloaded into ``partial``, or ``archive``."""
    if archive is not None:
        path = Path(archive)
        if not path.is_file():
            raise FetchError(f"archive {path} does not exist or is not a file")
        return path, str(path.resolve())
    source = url or spec.url
    path = partial / spec.filename
    try:
        download(source, path, timeout=timeout, progress=progress)
    except UnreachableError as exc:
        raise UnreachableError(f"{exc}; without internet here, copy {spec.filename} from {spec.url} by hand "
                               f"and run: mpigrad data fetch {spec.dataset} {partial.parent} --from-archive "
                               f"{spec.filename}") from None
    return path, source


def _unpack(archive: Path, spec: ArchiveSpec, dest: Path, partial: Path) -> dict[str, dict]:
    """Extract through a staging directory, then move the files into ``dest`` together."""
    staging = Path(tempfile.mkdtemp(prefix="extract-", dir=partial))
    try:
        files = _extract(archive, spec, staging)
        (dest / MANIFEST_NAME).unlink(missing_ok=True)   # a half-replaced directory is not complete
        for name in files:
            os.replace(staging / name, dest / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return files
