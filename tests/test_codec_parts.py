"""The table of the built-in codecs' parts (mpigrad/codecs/parts.py, issue 61, item 6) is
complete and is what every lookup reads: each registered built-in codec has its row (and each
row a registered codec), each host module's Numba kernels, each NumPy twin, each device twin
and each device kind code is named by it, and the registry, ``reference.has_twin`` /
``twin_of``, ``device.DEVICE_CODECS`` / ``device_codec``, the device twins' ``kind``, the
frame table's float kinds and the device kernels' literal constants all agree with it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import mpigrad.codecs
from mpigrad.codecs import available, codec_class, get_codec
from mpigrad.codecs.base import BUILTIN_WIRE_IDS, CODECS
from mpigrad.codecs.parts import BUILTIN_CODECS, KIND_CODES, CodecParts, host_modules, parts_of, resolve

CODECS_DIR = Path(mpigrad.codecs.__file__).parent
ROWS = {parts.codec_id: parts for parts in BUILTIN_CODECS}


def _module_path(module: str) -> Path:
    return CODECS_DIR.joinpath(*module.split(".")[2:]).with_suffix(".py")


def _decorated_classes(path: Path, decorator: str) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.ClassDef)
            and any(getattr(d, "id", None) == decorator for d in node.decorator_list)}


def _kernel_imports(path: Path) -> set[str]:
    """The ``mpigrad.codecs.kernels.*`` modules a host module imports (``from .kernels import x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module == "kernels":
            found |= {f"mpigrad.codecs.kernels.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 1 and (node.module or "").startswith("kernels."):
            found.add(f"mpigrad.codecs.{node.module}")
    return found


def test_every_registered_built_in_codec_has_its_row_and_every_row_a_codec():
    assert sorted(ROWS) == available() and len(ROWS) == len(BUILTIN_CODECS)
    for codec_id, parts in ROWS.items():
        cls = resolve(parts.host)
        assert cls is codec_class(codec_id) and cls.codec_id == codec_id
        assert cls.wire_id in BUILTIN_WIRE_IDS and CODECS.by("wire_id", cls.wire_id) is cls
        assert parts_of(codec_id) is parts
    assert parts_of("topk") is None and parts_of("examples.plugins.topk:TopK") is None and parts_of(None) is None
    assert len({resolve(parts.host).wire_id for parts in BUILTIN_CODECS}) == len(BUILTIN_CODECS)


def test_the_table_names_every_class_that_registers_itself():
    """Every ``@register_codec`` class in mpigrad/codecs/ is a row's host, and the codecs
    package imports exactly the rows' host modules."""
    registered = {f"mpigrad.codecs.{path.stem}:{name}" for path in CODECS_DIR.glob("*.py")
                  for name in _decorated_classes(path, "register_codec")}
    assert registered == {parts.host for parts in BUILTIN_CODECS}
    assert sorted(host_modules()) == sorted({parts.host_module for parts in BUILTIN_CODECS})


def test_each_host_module_imports_the_kernels_its_rows_name_and_every_kernel_module_is_named():
    for module in host_modules():
        named = {kernel for parts in BUILTIN_CODECS if parts.host_module == module for kernel in parts.kernels}
        assert _kernel_imports(_module_path(module)) - {"mpigrad.codecs.kernels.common"} == named, module
    kernel_modules = {f"mpigrad.codecs.kernels.{path.stem}" for path in (CODECS_DIR / "kernels").glob("*.py")
                      if path.stem not in ("__init__", "common")}
    assert kernel_modules == {kernel for parts in BUILTIN_CODECS for kernel in parts.kernels}


def test_every_twin_is_found_from_the_table():
    from mpigrad.codecs import reference

    for codec_id, parts in ROWS.items():
        assert reference.has_twin(codec_id) == (parts.twin is not None)
        codec = get_codec({"id": codec_id})
        if parts.twin is None:
            with pytest.raises(KeyError):
                reference.twin_of(codec)
            continue
        twin = reference.twin_of(codec)
        assert type(reference._twin(codec_id)) is resolve(parts.twin)
        assert twin.codec_id == codec_id and twin is not codec
    assert not reference.has_twin("topk")
    # every twin class in reference/ is some row's
    twins = {f"mpigrad.codecs.reference.{path.stem}:{node.name}" for path in (CODECS_DIR / "reference").glob("*.py")
             for node in ast.parse(path.read_text()).body
             if isinstance(node, ast.ClassDef) and node.name.endswith("Twin") and not node.name.startswith("_")}
    assert twins == {parts.twin for parts in BUILTIN_CODECS if parts.twin}


def test_every_device_twin_and_its_agreement_is_found_from_the_table():
    from mpigrad.codecs.device import DEVICE_CODECS, device_codec, host_only

    with_device = {codec_id: parts for codec_id, parts in ROWS.items() if parts.device}
    assert DEVICE_CODECS == {codec_id: parts.device_agreement for codec_id, parts in with_device.items()}
    for codec_id, parts in ROWS.items():
        codec = get_codec({"id": codec_id})
        assert (host_only(codec) is None) == (parts.device is not None)
    from mpigrad.codecs.device import codecs as device_codecs

    concrete = {f"mpigrad.codecs.device.codecs:{name}" for name, cls in vars(device_codecs).items()
                if inspect.isclass(cls) and issubclass(cls, device_codecs.DeviceCodec) and not name.startswith("_")
                and cls.__module__ == device_codecs.__name__ and not inspect.isabstract(cls)}
    assert concrete == {parts.device for parts in with_device.values()}
    for codec_id, parts in with_device.items():
        assert type(device_codec(get_codec({"id": codec_id}))) is resolve(parts.device)


def test_the_kind_codes_are_the_tables_in_the_kernels_the_twins_and_the_frame_table():
    from mpigrad.codecs.device import kernels as k
    from mpigrad.codecs.device import table

    with_device = [parts for parts in BUILTIN_CODECS if parts.device]
    assert KIND_CODES == {parts.codec_id: parts.kind_code for parts in with_device}
    for parts in with_device:
        assert getattr(k, parts.kind_name) == parts.kind_code == resolve(parts.device).kind, parts.codec_id
    # the kernels' kind constants, all of them, are the table's
    constants = {"UNIFORM", "SIGN", "TERNGRAD", "QSGD", "FLOAT32", "FLOAT16"}
    assert {parts.kind_name for parts in with_device} == constants
    assert sorted(KIND_CODES.values()) == list(range(len(constants)))
    assert table.FLOAT_KINDS == (KIND_CODES["fp32"], KIND_CODES["fp16"])


def test_the_table_is_a_leaf_and_checks_its_rows():
    tree = ast.parse((CODECS_DIR / "parts.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name.startswith("mpigrad") or not name or name.startswith(".")}
    with pytest.raises(ValueError, match="device twin needs"):
        CodecParts("x", "m:C", device="m:D")
    with pytest.raises(AttributeError):
        BUILTIN_CODECS[0].codec_id = "other"  # frozen
