"""``mpigrad data fetch|verify`` with hand-built archives, file:// URLs and a local HTTP server."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import re
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mpigrad.cli import main
from mpigrad.data import fetch as fetching

SPEC = fetching.DATASETS["cifar10"]
PREFIX = SPEC.prefix


def _noise(seed: bytes, blocks: int) -> bytes:
    return b"".join(hashlib.sha256(seed + bytes([i])).digest() for i in range(blocks))


def _contents() -> dict[str, bytes]:
    """Distinct, incompressible small stand-ins for every member of the CIFAR-10 archive."""
    names = [*SPEC.files, *SPEC.ignored]
    return {f"{PREFIX}/{name}": _noise(name.encode(), 40 + 7 * i) for i, name in enumerate(names)}


def _tarball(path: Path, members: dict[str, bytes] | None = None,
             extra: list[tarfile.TarInfo] = ()) -> Path:
    members = _contents() if members is None else members
    with tarfile.open(path, "w:gz") as tar:
        top = tarfile.TarInfo(PREFIX)
        top.type = tarfile.DIRTYPE
        tar.addfile(top)
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info, io.BytesIO(b"x" * info.size) if info.isfile() else None)
    return path


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _data_files(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.iterdir()) if dest.exists() else []


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["data", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if not line.startswith("  downloaded")]
    assert len(lines) == 1, err
    assert lines[0].startswith("mpigrad data: error: ")
    return lines[0]


@pytest.fixture
def archive(tmp_path) -> Path:
    return _tarball(tmp_path / "cifar-10-python.tar.gz")


@pytest.fixture
def official(monkeypatch, archive):
    """Make the built-in table describe the test archive, as a mirror's entry would."""
    spec = dataclasses.replace(SPEC, url=archive.as_uri(), md5=_md5(archive),
                               size=archive.stat().st_size)
    monkeypatch.setitem(fetching.DATASETS, "cifar10", spec)
    return spec


def test_builtin_entry_is_the_official_cifar10_python_archive():
    assert (SPEC.filename, SPEC.md5, SPEC.size) == (
        "cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a", 170498071)
    assert SPEC.files == ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4",
                          "data_batch_5", "test_batch", "batches.meta")
    with pytest.raises(fetching.FetchError, match="unknown dataset 'mnist'; can fetch: cifar10"):
        fetching.get_spec("mnist")


def test_fetch_downloads_verifies_and_unpacks(capsys, tmp_path, official):
    dest = tmp_path / "data" / "cifar10"
    code, out, err = _run(capsys, "fetch", "cifar10", str(dest))
    assert code == 0, err
    assert out.startswith(f"cifar10: fetched in {dest} (7 files, ")
    contents = _contents()
    assert _data_files(dest) == sorted([*SPEC.files, fetching.MANIFEST_NAME])
    for name in SPEC.files:
        assert (dest / name).read_bytes() == contents[f"{PREFIX}/{name}"]
    manifest = json.loads((dest / fetching.MANIFEST_NAME).read_text())
    assert manifest["archive_md5"] == official.md5 and manifest["source"] == official.url
    assert manifest["files"]["test_batch"] == {
        "bytes": len(contents[f"{PREFIX}/test_batch"]),
        "sha256": hashlib.sha256(contents[f"{PREFIX}/test_batch"]).hexdigest()}
    assert "downloaded" in err
    assert _run(capsys, "verify", str(dest))[:2] == (
        0, f"cifar10: 7 files in {dest} match {fetching.MANIFEST_NAME}\n")


def test_second_fetch_does_not_download_again(capsys, tmp_path, archive):
    dest = tmp_path / "c10"
    md5 = _md5(archive)
    assert _run(capsys, "fetch", "cifar10", str(dest), "--url", archive.as_uri(), "--md5", md5)[0] == 0
    gone = (tmp_path / "nowhere.tar.gz").as_uri()
    code, out, _ = _run(capsys, "fetch", "cifar10", str(dest), "--url", gone, "--md5", md5)
    assert code == 0 and out.startswith(f"cifar10: already present in {dest}")


def test_from_archive_with_mirror_md5_keeps_the_archive(capsys, tmp_path, archive):
    before = archive.read_bytes()
    dest = tmp_path / "c10"
    code, _, err = _run(capsys, "fetch", "cifar10", str(dest), "--from-archive", str(archive),
                        "--md5", _md5(archive).upper())
    assert code == 0, err
    assert archive.read_bytes() == before
    assert not (dest / fetching.PARTIAL_DIR).exists()
    assert json.loads((dest / fetching.MANIFEST_NAME).read_text())["source"] == str(archive.resolve())


def test_keep_archive_leaves_the_download(capsys, tmp_path, official):
    dest = tmp_path / "c10"
    assert _run(capsys, "fetch", "cifar10", str(dest), "--keep-archive")[0] == 0
    assert _md5(dest / fetching.PARTIAL_DIR / SPEC.filename) == official.md5


def test_wrong_checksum_is_reported_and_nothing_is_extracted(capsys, tmp_path, archive):
    dest = tmp_path / "c10"
    wrong = "0" * 32
    code, _, err = _run(capsys, "fetch", "cifar10", str(dest), "--url", archive.as_uri(), "--md5", wrong)
    assert code == 2
    assert re.search(rf"has MD5 {_md5(archive)}, expected {wrong} \(corrupt or not the right "
                     rf"archive\); the bad download was deleted$", _one_error_line(err))
    assert not dest.exists()
    code, _, err = _run(capsys, "fetch", "cifar10", str(dest), "--from-archive", str(archive),
                        "--md5", wrong)
    assert code == 2 and "the bad download was deleted" not in _one_error_line(err)
    assert archive.exists() and not dest.exists()


def test_truncated_archive_fails_the_size_check(capsys, tmp_path, official, archive):
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(archive.read_bytes()[:-100])
    code, _, err = _run(capsys, "fetch", "cifar10", str(tmp_path / "c10"), "--from-archive", str(cut))
    assert code == 2
    assert _one_error_line(err).endswith(
        f"is {cut.stat().st_size} bytes, expected {official.size} (truncated or not the right archive)")
    assert not (tmp_path / "c10").exists()


def test_truncated_archive_with_matching_checksum_is_still_caught(capsys, tmp_path, archive):
    """A mirror whose published MD5 describes a broken file: extraction fails, nothing lands."""
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    dest = tmp_path / "c10"
    code, _, err = _run(capsys, "fetch", "cifar10", str(dest), "--from-archive", str(cut),
                        "--md5", _md5(cut))
    assert code == 2
    assert "is truncated or corrupt" in _one_error_line(err)
    assert not dest.exists()


def _member(name: str, kind: bytes = tarfile.REGTYPE, size: int = 3, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname = kind, size if kind == tarfile.REGTYPE else 0, link
    return info


@pytest.mark.parametrize("members, extra, message", [
    (None, [_member("../evil")], "holds an unexpected member '../evil'"),
    (None, [_member("/tmp/evil-abs")], "holds an unexpected member '/tmp/evil-abs'"),
    (None, [_member(f"{PREFIX}/../evil")], f"holds an unexpected member '{PREFIX}/../evil'"),
    (None, [_member(f"{PREFIX}/extra")], f"holds an unexpected member '{PREFIX}/extra'"),
    ({k: v for k, v in _contents().items() if not k.endswith("data_batch_1")},
     [_member(f"{PREFIX}/data_batch_1", tarfile.SYMTYPE, link="/etc/passwd")],
     f"member '{PREFIX}/data_batch_1' is duplicated or not a regular file"),
    (None, [_member(f"{PREFIX}/test_batch")],
     f"member '{PREFIX}/test_batch' is duplicated or not a regular file"),
    ({k: v for k, v in _contents().items() if not k.endswith(("test_batch", "data_batch_5"))}, [],
     "lacks data_batch_5, test_batch"),
])
def test_foreign_members_are_refused_before_anything_lands(capsys, tmp_path, members, extra, message):
    bad = _tarball(tmp_path / "bad.tar.gz", members, extra)
    dest = tmp_path / "work" / "c10"
    code, _, err = _run(capsys, "fetch", "cifar10", str(dest), "--from-archive", str(bad),
                        "--md5", _md5(bad))
    assert code == 2
    assert message in _one_error_line(err) and "nothing was extracted" in err
    assert not dest.exists()
    assert not (tmp_path / "work" / "evil").exists() and not (tmp_path / "evil").exists()


def test_existing_files_are_never_replaced_without_force(capsys, tmp_path, archive):
    dest = tmp_path / "c10"
    dest.mkdir()
    (dest / "data_batch_1").write_bytes(b"my own copy")
    args = ["fetch", "cifar10", str(dest), "--from-archive", str(archive), "--md5", _md5(archive)]
    code, _, err = _run(capsys, *args)
    assert code == 2 and _one_error_line(err).endswith(
        "already holds data_batch_1, not written by mpigrad data fetch; pass --force to replace it")
    assert (dest / "data_batch_1").read_bytes() == b"my own copy"
    assert _data_files(dest) == ["data_batch_1"]
    assert _run(capsys, *args, "--force")[0] == 0
    assert (dest / "data_batch_1").read_bytes() == _contents()[f"{PREFIX}/data_batch_1"]


def test_verify_and_refetch_notice_a_damaged_copy(capsys, tmp_path, archive):
    dest = tmp_path / "c10"
    args = ["fetch", "cifar10", str(dest), "--from-archive", str(archive), "--md5", _md5(archive)]
    assert _run(capsys, *args)[0] == 0
    damaged = dest / "data_batch_3"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"?")
    code, _, err = _run(capsys, "verify", str(dest))
    assert code == 2 and _one_error_line(err).endswith(
        f"{damaged} differs from the copy that was fetched (size or SHA-256)")
    code, _, err = _run(capsys, *args)
    assert code == 2 and _one_error_line(err).endswith("; pass --force to fetch again")
    assert _run(capsys, *args, "--force")[0] == 0
    assert _run(capsys, "verify", str(dest))[0] == 0
    (dest / "test_batch").unlink()
    assert "test_batch is missing" in _one_error_line(_run(capsys, "verify", str(dest))[2])
    assert "has no mpigrad-fetch.json" in _one_error_line(_run(capsys, "verify", str(tmp_path))[2])


@pytest.mark.parametrize("argv, message", [
    (["--md5", "abc"], "MD5 'abc' is not 32 hexadecimal digits"),
    (["--url", "file:///x", "--from-archive", "y"], "give either a URL to download or a local archive"),
    (["--timeout", "0"], "--timeout must be positive"),
    (["--from-archive", "/nonexistent/a.tgz"], "archive /nonexistent/a.tgz does not exist"),
])
def test_bad_options(capsys, tmp_path, argv, message):
    code, _, err = _run(capsys, "fetch", "cifar10", str(tmp_path / "d"), *argv)
    assert code == 2 and message in _one_error_line(err)


class _Server(ThreadingHTTPServer):
    payload = b""
    drop_after: int | None = None      # serve only this many bytes of the next response
    requests: list


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        server = self.server
        ranged = self.headers.get("Range")
        server.requests.append((self.path, ranged))
        if self.path != "/cifar-10-python.tar.gz":
            self.send_error(404)
            return
        start = int(re.fullmatch(r"bytes=(\d+)-", ranged)[1]) if ranged else 0
        body = server.payload[start:]
        self.send_response(206 if ranged else 200)
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{len(server.payload) - 1}/{len(server.payload)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if server.drop_after is not None:
            body, server.drop_after = body[: server.drop_after], None
            self.close_connection = True
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def http_server(archive):
    server = _Server(("127.0.0.1", 0), _Handler)
    server.payload, server.requests = archive.read_bytes(), []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_interrupted_http_download_resumes(capsys, tmp_path, http_server, archive):
    url = f"http://127.0.0.1:{http_server.server_port}/cifar-10-python.tar.gz"
    dest = tmp_path / "c10"
    args = ["fetch", "cifar10", str(dest), "--url", url, "--md5", _md5(archive), "--timeout", "20"]
    size = archive.stat().st_size
    http_server.drop_after = half = size // 2
    code, _, err = _run(capsys, *args)
    assert code == 2
    assert _one_error_line(err).endswith(
        f"stopped after {half} of {size} bytes; run the same command again to resume")
    assert (dest / fetching.PARTIAL_DIR / SPEC.filename).stat().st_size == half
    assert _data_files(dest) == [fetching.PARTIAL_DIR]
    code, _, err = _run(capsys, *args)
    assert code == 0, err
    assert http_server.requests == [("/cifar-10-python.tar.gz", None),
                                    ("/cifar-10-python.tar.gz", f"bytes={half}-")]
    assert _data_files(dest) == sorted([*SPEC.files, fetching.MANIFEST_NAME])


def test_http_errors_are_one_line(capsys, tmp_path, http_server):
    url = f"http://127.0.0.1:{http_server.server_port}/missing.tar.gz"
    code, _, err = _run(capsys, "fetch", "cifar10", str(tmp_path / "c10"), "--url", url)
    assert code == 2 and _one_error_line(err).endswith(f"download of {url} failed: HTTP 404 Not Found")
    assert not (tmp_path / "c10").exists()


# ---- without internet, and directories filled by other tools -----------------------------

def test_a_download_without_network_names_from_archive(capsys, tmp_path):
    url = "http://127.0.0.1:9/cifar-10-python.tar.gz"  # discard port: nothing listens
    code, _, err = _run(capsys, "fetch", "cifar10", str(tmp_path / "c10"), "--url", url, "--timeout", "5")
    line = _one_error_line(err)
    assert code == 2 and f"download of {url} failed: " in line
    assert line.endswith(f"; without internet here, copy cifar-10-python.tar.gz from {SPEC.url} by hand and run: "
                         f"mpigrad data fetch cifar10 {tmp_path / 'c10'} --from-archive cifar-10-python.tar.gz")


def test_verify_takes_the_dataset_like_fetch(capsys, tmp_path, archive):
    dest = tmp_path / "c10"
    assert _run(capsys, "fetch", "cifar10", str(dest), "--from-archive", str(archive), "--md5", _md5(archive))[0] == 0
    code, out, err = _run(capsys, "verify", "cifar10", str(dest))
    assert (code, err) == (0, "") and out == f"cifar10: 7 files in {dest} match mpigrad-fetch.json\n"
    assert _run(capsys, "verify", str(dest))[0] == 0


def test_verify_reads_a_torchvision_style_folder_without_manifest(capsys, tmp_path):
    from test_data import fake_cifar

    folder = tmp_path / "torchvision" / PREFIX
    fake_cifar(folder)
    code, out, err = _run(capsys, "verify", "cifar10", str(tmp_path / "torchvision"))
    assert (code, err) == (0, "")
    assert out == (f"cifar10: 6 files in {folder} read as cifar10 (no mpigrad-fetch.json: checked by content, "
                   "not by checksum)\n")
    (folder / "data_batch_2").write_bytes(b"not a pickle")
    code, _, err = _run(capsys, "verify", str(tmp_path / "torchvision"))
    assert code == 2 and "data_batch_2" in _one_error_line(err)
