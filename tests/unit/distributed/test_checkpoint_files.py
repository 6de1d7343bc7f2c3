"""``ampkit.distributed.save_checkpoint``/``load_checkpoint`` against hostile folders, in
one process (the same code runs per rank; the two-rank cases are in test_fsdp.py):
nothing in a folder is unpickled beyond DCP's metadata classes and weights-only
entries, another level's state is refused, impossible values and changed bytes are
refused, special files never block, and a refusal changes nothing."""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import shutil
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.state_dict import get_state_dict

import ampkit
from ampkit.distributed import load_checkpoint, save_checkpoint
from ampkit.distributed.checkpoint import AmpState
from ampkit.distributed.dcp_files import write_checksums

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MARKER = "ampkit_payload_ran"


class Payload:
    """Runs ``open(marker, 'w')`` when fully unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _build(level: str, dtype: torch.dtype = torch.bfloat16):
    ampkit.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ampkit.initialize(model, opt, opt_level=level, dtype=dtype)


def _train(model, opt, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        opt.zero_grad()
        with ampkit.scale_loss(model(x).float().pow(2).mean(), opt) as loss:
            loss.backward()
        opt.step()


def _snapshot(model, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for _, state in sorted(opt.state_dict()["state"].items()):
        out += [v.clone() for _, v in sorted(state.items()) if torch.is_tensor(v)]
    out += [torch.tensor(g["lr"]) for g in opt.param_groups]
    sd = ampkit.state_dict()
    out += [v.clone() for v in AmpState().state_dict().values()] if sd["trainers"] else []
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def _resum(folder: Path) -> None:
    """What an attacker who edits files also does: write the checksums anew."""
    for f in folder.glob("ampkit_checksums_*.json"):
        f.unlink()
    write_checksums(folder, 0, is_coordinator=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dcp")
    for level in ("O2", "O2K", "O1"):
        model, opt = _build(level)
        _train(model, opt, 3)
        save_checkpoint(out / level, model, opt)
    model, opt = _build("O2", torch.float16)
    _train(model, opt, 3)
    save_checkpoint(out / "O2-fp16", model, opt)
    ampkit.reset()
    return out


def _refused(tmp_path: Path, folder: Path, level: str = "O2K", dtype: torch.dtype = torch.bfloat16) -> str:
    """Load ``folder`` into a trained ``level`` session: it must raise StateError and
    change nothing; returns the message."""
    model, opt = _build(level, dtype)
    _train(model, opt, 2, seed=5)
    before = _snapshot(model, opt)
    with pytest.raises(ampkit.StateError) as err:
        load_checkpoint(folder, model, opt)
    assert _same(before, _snapshot(model, opt)), "a refused load changed the session"
    _train(model, opt, 1, seed=6)  # and the session still trains
    return str(err.value)


def test_unsharded_o2_roundtrip_is_bitwise(saved, tmp_path):
    """An O2 model that is not sharded (fp32 masters held by ampkit) saves and resumes:
    the resumed run's next steps equal the saving run's, bitwise."""
    model, opt = _build("O2")
    _train(model, opt, 3)
    _train(model, opt, 2, seed=9)
    expected = _snapshot(model, opt)
    model, opt = _build("O2")
    load_checkpoint(saved / "O2", model, opt)
    _train(model, opt, 2, seed=9)
    assert _same(expected, _snapshot(model, opt))


@pytest.mark.parametrize("setup", ["O2K", "O1"])
def test_roundtrip_and_fresh_optimizer(saved, setup):
    model, opt = _build(setup)
    _train(model, opt, 3)
    _train(model, opt, 2, seed=9)
    expected = _snapshot(model, opt)
    model, opt = _build(setup)
    load_checkpoint(saved / setup, model, opt)
    _train(model, opt, 2, seed=9)
    assert _same(expected, _snapshot(model, opt))


@pytest.mark.parametrize(
    "src, level, dtype",
    [("O2K", "O1", torch.float16), ("O2K", "O1", torch.bfloat16), ("O2K", "O3", torch.bfloat16),
     ("O2K", "O0", torch.bfloat16), ("O2", "O1", torch.float16), ("O2-fp16", "O2", torch.bfloat16),
     ("O1", "O2K", torch.bfloat16), ("O1", "O1", torch.float16)],
)  # fmt: skip
def test_another_levels_checkpoint_is_refused(saved, tmp_path, src, level, dtype):
    msg = _refused(tmp_path, saved / src, level, dtype)
    assert "Nothing was loaded" in msg


def test_a_payload_in_metadata_never_runs(saved, tmp_path):
    folder = tmp_path / "ck"
    shutil.copytree(saved / "O2K", folder)
    meta = folder / ".metadata"
    md = pickle.loads(meta.read_bytes())
    md.planner_data = {"x": Payload(tmp_path / MARKER)}
    meta.write_bytes(pickle.dumps(md))
    _resum(folder)
    msg = _refused(tmp_path, folder)
    assert "builtins.open" in msg or "io.open" in msg
    assert not (tmp_path / MARKER).exists()


def test_a_pickled_hyperparameter_never_runs(saved, tmp_path):
    model, opt = _build("O2K")
    _train(model, opt, 2)
    model_sd, optim_sd = get_state_dict(model, opt)
    optim_sd["param_groups"][0]["lr"] = Payload(tmp_path / MARKER)
    folder = tmp_path / "ck"
    dcp.save({"model": model_sd, "optim": optim_sd, "amp": AmpState()}, checkpoint_id=str(folder))
    write_checksums(folder, 0, is_coordinator=True)
    msg = _refused(tmp_path, folder)
    assert "weights only" in msg and "lr" in msg
    assert not (tmp_path / MARKER).exists()


@pytest.mark.parametrize(
    "where, value",
    [("state", -1.0), ("lr", float("nan")), ("lr", -0.1), ("lr", "0.1"), ("betas", (0.9, 1.5)), ("eps", float("inf"))],
)
def test_impossible_optimizer_values_are_refused(saved, tmp_path, where, value):
    model, opt = _build("O2K")
    _train(model, opt, 2)
    model_sd, optim_sd = get_state_dict(model, opt)
    if where == "state":
        first = next(iter(optim_sd["state"].values()))
        first["exp_avg_sq"] = first["exp_avg_sq"].clone().fill_(value)
    else:
        optim_sd["param_groups"][0][where] = value
    folder = tmp_path / "ck"
    dcp.save({"model": model_sd, "optim": optim_sd, "amp": AmpState()}, checkpoint_id=str(folder))
    write_checksums(folder, 0, is_coordinator=True)
    _refused(tmp_path, folder)


def test_a_flipped_bit_is_refused(saved, tmp_path):
    folder = tmp_path / "ck"
    shutil.copytree(saved / "O2K", folder)
    data = next(folder.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    assert "checksum" in _refused(tmp_path, folder)


def test_a_file_outside_the_folder_is_refused(saved, tmp_path):
    folder = tmp_path / "ck"
    shutil.copytree(saved / "O2K", folder)
    meta = folder / ".metadata"
    md = pickle.loads(meta.read_bytes())
    index = next(iter(md.storage_data))
    md.storage_data[index].relative_path = "../outside.distcp"
    meta.write_bytes(pickle.dumps(md))
    _resum(folder)
    assert "not a file name inside the folder" in _refused(tmp_path, folder)


def test_a_fifo_in_place_of_a_file_does_not_block(saved, tmp_path):
    folder = tmp_path / "ck"
    shutil.copytree(saved / "O2K", folder)
    data = next(folder.glob("*.distcp"))
    data.unlink()
    os.mkfifo(data)
    result: list[str] = []
    worker = threading.Thread(target=lambda: result.append(_refused(tmp_path, folder)), daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "loading blocked on a FIFO"
    assert result and "not a regular file" in result[0]


def test_truncated_or_garbage_metadata_is_refused(saved, tmp_path):
    for content in (b"", b"\x80\x04garbage", (saved / "O2K" / ".metadata").read_bytes()[:100]):
        folder = tmp_path / f"ck{len(content)}"
        shutil.copytree(saved / "O2K", folder)
        (folder / ".metadata").write_bytes(content)
        _resum(folder)
        _refused(tmp_path, folder)


def test_malformed_checksums_are_refused(saved, tmp_path):
    folder = tmp_path / "ck"
    shutil.copytree(saved / "O2K", folder)
    (folder / "ampkit_checksums_0.json").write_text(json.dumps({"format": 1, "sha256": [1]}))
    _refused(tmp_path, folder)


def test_a_folder_without_checksums_loads_with_a_warning(saved, tmp_path):
    folder = tmp_path / "ck"
    shutil.copytree(saved / "O2K", folder)
    for f in folder.glob("ampkit_checksums_*.json"):
        f.unlink()
    model, opt = _build("O2K")
    with pytest.warns(UserWarning, match="no checksums"):
        load_checkpoint(folder, model, opt)


def test_amp_state_strings_are_saved_and_checked(saved):
    """The compensation method and the state's format are in the checkpoint (as bytes),
    so a plain dcp.load into another session's AmpState sees them."""
    md = dcp.FileSystemReader(str(saved / "O2K")).read_metadata()
    keys = set(md.state_dict_metadata)
    assert "amp.format" in keys
    assert any(k.endswith("compensation/method") for k in keys)
    buf = io.BytesIO()
    torch.save(md, buf)  # metadata stays plain data


def test_an_absurd_master_is_refused_by_amp_load_state_dict():
    """A bf16 model's fp32 master of 1e38 is representable in bf16, but its square
    overflows fp32 (no run that trains saves one): ``amp.load_state_dict`` refuses it and
    changes nothing."""
    model, opt = _build("O2")
    _train(model, opt, 2)
    sd = ampkit.state_dict()
    entry = sd["trainers"][0]["optimizers"][0]["extra"]["master_weights"]["masters"][0]
    entry[2] = entry[2].clone().fill_(1e38)
    before = _snapshot(model, opt)
    with pytest.raises(ampkit.StateError, match="master"):
        ampkit.load_state_dict(sd)
    assert _same(before, _snapshot(model, opt))


def _edited(saved: Path, tmp_path: Path, edit) -> Path:
    """A copy of the O2K checkpoint whose ``.metadata`` ``edit(md)`` changed, rehashed."""
    folder = tmp_path / "ck"
    shutil.copytree(saved / "O2K", folder)
    meta = folder / ".metadata"
    md = pickle.loads(meta.read_bytes())
    edit(md)
    meta.write_bytes(pickle.dumps(md))
    _resum(folder)
    return folder


def _first(md, suffix: str) -> str:
    return next(k for k in md.state_dict_metadata if k.endswith(suffix))


def test_an_entry_of_another_kind_or_shape_is_refused(saved, tmp_path):
    """A tensor entry turned into a non-tensor one (which DCP would read as whatever the
    bytes hold, of any shape: the update then writes past the buffer), a tensor of
    another shape or dtype, and an entry this run lacks are refused before any read."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    def as_bytes(md):
        md.state_dict_metadata[_first(md, "exp_avg_sq")] = BytesStorageMetadata()

    def reshaped(md):
        entry = md.state_dict_metadata[_first(md, "exp_avg")]
        entry.size = torch.Size([1])
        entry.chunks[0].sizes = torch.Size([1])
        entry.chunks[0].offsets = torch.Size([0])

    def retyped(md):
        md.state_dict_metadata[_first(md, "exp_avg")].properties.dtype = torch.float64

    def extra(md):
        md.state_dict_metadata["model.extra.weight"] = md.state_dict_metadata[_first(md, "0.weight")]

    for edit, words in ((as_bytes, "not a tensor"), (reshaped, "shape"), (retyped, "float64"), (extra, "does not have")):
        msg = _refused(tmp_path, _edited(saved, tmp_path / edit.__name__, edit))
        assert words in msg, (edit.__name__, msg)


def test_metadata_cannot_change_a_class_for_the_process(saved, tmp_path):
    """A ``.metadata`` pickle that sets state (BUILD) on an allowed *class* rather than an
    instance is refused, and the class is as it was (Path still works, MetadataIndex
    still hashes, a later save and load work)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    def glob(module: str, name: str) -> bytes:
        return b"c" + module.encode() + b"\n" + name.encode() + b"\n"

    payload = (b"\x80\x02" + glob("pathlib", "PosixPath") + b"N}X" + (6).to_bytes(4, "little") + b"is_dir"
               + glob("torch", "Size") + b"s\x86b0"
               + glob("torch.distributed.checkpoint.metadata", "MetadataIndex") + b"N}X"
               + (8).to_bytes(4, "little") + b"__hash__Ns\x86b0N.")  # fmt: skip
    folder = tmp_path / "ck"
    shutil.copytree(saved / "O2K", folder)
    (folder / ".metadata").write_bytes(payload)
    _resum(folder)
    assert "sets the state of a type" in _refused(tmp_path, folder)
    assert Path(tmp_path).is_dir() is True
    hash(MetadataIndex("x"))
    model, opt = _build("O2K")
    load_checkpoint(saved / "O2K", model, opt)


def _glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _str(text: str) -> bytes:
    return b"X" + len(text).to_bytes(4, "little") + text.encode()


def _unpickled(payload: bytes):
    """``payload`` read as a folder's ``.metadata`` by ampkit's checkpoint reader."""
    import tempfile

    from ampkit.distributed.dcp_files import checkpoint_reader

    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the folder has no checksums: one warning)
        (Path(folder) / ".metadata").write_bytes(payload)
        return checkpoint_reader(folder).read_metadata()


#: What the reader admits by name (the module docstring of ampkit.distributed.dcp_files).
_ADMITTED = [("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")] + [
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
    ("torch", "float32"), ("torch", "strided")]  # fmt: skip


@pytest.mark.parametrize("module,name", _ADMITTED)
@pytest.mark.parametrize("how", ["attribute", "dict"])
def test_no_allowed_object_can_be_changed_by_the_file(module, name, how):
    """``BUILD`` aimed at each object the reader admits (the class or function itself, not
    an instance), setting an attribute one way (slot state: ``setattr``) or the other (an
    instance dict): refused, and the real object has no such attribute afterwards."""
    import importlib

    real = getattr(importlib.import_module(module), name)
    before = dict(vars(real)) if hasattr(real, "__dict__") else {}
    state = b"N}" + _str("planted") + b"K\x01s\x86" if how == "attribute" else b"}" + _str("planted") + b"K\x01s"
    payload = b"\x80\x02" + _glob(module, name) + state + b"b."
    with pytest.raises(ampkit.StateError, match="cannot be read"):
        _unpickled(payload)
    assert not hasattr(real, "planted") and (dict(vars(real)) if hasattr(real, "__dict__") else {}) == before


def test_a_shared_enum_member_cannot_be_changed_by_the_file():
    """DCP's memory-format enum is unpickled by value; its members are shared by the whole
    process. State set on the member the file names is refused."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    member = _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    before = dict(vars(member))
    enum = _glob("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")
    for state in (b"}" + _str("_value_") + b"K\x07s", b"N}" + _str("_value_") + b"K\x07s\x86"):
        with pytest.raises(ampkit.StateError, match="cannot be read"):
            _unpickled(b"\x80\x02" + enum + b"K\x00\x85R" + state + b"b.")
        assert dict(vars(member)) == before and _MEM_FORMAT_ENCODING(0) is member


def test_metadata_unpickles_as_the_real_classes_and_pickles_again(saved):
    """A checkpoint's ``.metadata`` read by the reader equals plain ``pickle``'s reading,
    every object an instance of DCP's own classes (a storage entry is found by a key DCP
    makes itself, and the whole pickles again, as DCP does to send it to other ranks), and
    the cycle collector is as it was, after a good file and a refused one, also with loads
    in two threads at once."""
    import gc
    import pickle as pk

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    raw = (saved / "O2K" / ".metadata").read_bytes()
    md = _unpickled(raw)
    plain = pk.loads(raw)
    plain.storage_meta.load_id = md.storage_meta.load_id  # (the reader's own, as DCP's sets it)
    assert md == plain and type(md) is Metadata
    tensors = [e for e in md.state_dict_metadata.values() if isinstance(e, TensorStorageMetadata)]
    assert tensors and all(type(e) is TensorStorageMetadata and type(e.properties) is TensorProperties
                           and all(type(c) is ChunkStorageMetadata for c in e.chunks) for e in tensors)  # fmt: skip
    assert all(e.properties.memory_format is torch.contiguous_format for e in tensors)
    key = next(iter(md.storage_data))
    assert type(key) is MetadataIndex and type(md.storage_data[key]) is _StorageInfo
    assert md.storage_data[MetadataIndex(key.fqn, key.offset, key.index)] is md.storage_data[key]
    assert pk.loads(pk.dumps(md)) == md
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            _unpickled(raw)
            with pytest.raises(ampkit.StateError, match="os.system"):
                _unpickled(b"\x80\x02" + _glob("os", "system") + b".")
            assert gc.isenabled() is enabled
        finally:
            gc.enable()
    for _ in range(20):  # two threads' loads overlap: the collector is on when both are done
        threads = [threading.Thread(target=_unpickled, args=(raw,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert gc.isenabled()


@pytest.mark.parametrize("where", ["dict key", "index offset"])
def test_tuples_nested_past_any_metadata_are_refused_before_they_are_hashed(where):
    """Tuples nested 100 deep (hashing a few hundred thousand levels crashes the process:
    C recurses with no limit) as a dict key or inside a ``MetadataIndex`` key: refused by
    the reader before the hash; 60 levels (past anything DCP writes) still read."""
    md = "torch.distributed.checkpoint.metadata"

    def payload(depth: int) -> bytes:
        nest = b")" + b"\x85" * depth
        key = nest if where == "dict key" else _glob(md, "MetadataIndex") + b"(" + _str("w") + nest + b"tR"
        return b"\x80\x02" + _glob(md, "Metadata") + b"(}N}(" + key + b"Nu" + b"tR."

    with pytest.raises(ampkit.StateError, match="nests tuples"):
        _unpickled(payload(100))
    got = None
    try:
        got = _unpickled(payload(60))
    except ampkit.StateError as e:
        assert "nests tuples" not in str(e)
    assert got is None or got.storage_data is not None


@pytest.mark.parametrize("where", ["dict key", "index fqn", "set", "enum value"])
def test_a_tuple_shared_within_itself_is_refused_before_it_is_hashed(where):
    """``t = (u, u)``, ``u = (v, v)``, ... 40 levels: 400 bytes in the file, 2**40 steps to
    hash. As a dict key, inside a ``MetadataIndex`` key, in a frozenset or as the memory
    format's value it is refused before anything hashes it."""
    md = "torch.distributed.checkpoint.metadata"
    dag = b"K\x01" + b"".join(b"r" + i.to_bytes(4, "little") + b"j" + i.to_bytes(4, "little") + b"\x86"
                               for i in range(40))  # fmt: skip
    body = {
        "dict key": b"}" + dag + b"K\x00s",
        "index fqn": b"}" + _glob(md, "MetadataIndex") + b"(" + dag + b"tRK\x00s",
        "set": b"(" + dag + b"\x91",
        "enum value": _glob(md, "_MEM_FORMAT_ENCODING") + b"(" + dag + b"tR",
    }[where]
    with pytest.raises(ampkit.StateError, match="as a key|cannot be read"):
        _unpickled(b"\x80\x02" + body + b".")


def test_a_refusal_shows_a_value_of_the_file_cut_short():
    """A list holding one list twice at each of 30 levels (a few hundred bytes pickled; its
    full repr would be gigabytes) where a file name belongs: the refusal's message stays
    short."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    nest: list = ["x"]
    for _ in range(30):
        nest = [nest, nest]
    md = Metadata(state_dict_metadata={}, storage_data={MetadataIndex("w"): _StorageInfo(nest, 0, 1)})
    payload = pickle.dumps(md, protocol=2)
    assert len(payload) < 2000
    with pytest.raises(ampkit.StateError, match="not a file name") as err:
        _unpickled(payload)
    assert len(str(err.value)) < 2000


def _storage_info_without_fields() -> bytes:
    md, fs = "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"
    key = _glob(md, "MetadataIndex") + b"(" + _str("a") + b"tR"
    return b"\x80\x02" + _glob(md, "Metadata") + b"(}N}(" + key + _glob(fs, "_StorageInfo") + b")\x81utR."


@pytest.mark.parametrize("case", ["frame-2**64", "bytes8-2**64", "memo-2**24", "fields-missing", "cut-int",
                                  "cut-frame"])
def test_small_hostile_metadata_is_refused_without_a_large_allocation(saved, tmp_path, case):
    """Lengths and a memo index past anything the file could hold, an entry made without
    its fields, and opcodes cut short: each refused as a StateError on load, with the session unchanged
    and no large allocation made while reading (C's unpickler keeps its memo as an array
    twice the largest index named: 256 MiB for the third, 12 bytes long; 64 GiB at the
    largest index)."""
    import tracemalloc

    huge = (2**64 - 1).to_bytes(8, "little")
    payload = {
        "frame-2**64": b"\x80\x04\x95" + huge,
        "bytes8-2**64": b"\x80\x04\x8e" + huge,
        "memo-2**24": b"\x80\x02Nr" + (2**24).to_bytes(4, "little") + b".",
        "fields-missing": _storage_info_without_fields(),
        "cut-int": b"\x80\x02J\x01\x02",  # a BININT cut short
        "cut-frame": b"\x80\x04\x95\x01",
    }[case]
    folder = tmp_path / "ck"
    shutil.copytree(saved / "O2K", folder)
    (folder / ".metadata").write_bytes(payload)
    _resum(folder)
    tracemalloc.start()
    try:
        assert "cannot be loaded" in _refused(tmp_path, folder)
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("how", ["none", "half", "twice"])
def test_chunks_that_do_not_cover_a_tensor_once_are_refused(saved, tmp_path, how):
    """A tensor's chunks must cover it exactly once: none (the run's own values would stay),
    half (a mix of two runs) or one chunk twice is refused."""

    def edit(md):
        entry = md.state_dict_metadata[_first(md, "0.weight")]
        chunk = entry.chunks[0]
        if how == "none":
            entry.chunks = []
        elif how == "half":
            chunk.sizes = torch.Size([chunk.sizes[0] // 2, *chunk.sizes[1:]])
        else:
            entry.chunks = [chunk, chunk]

    assert "cover it exactly once" in _refused(tmp_path, _edited(saved, tmp_path, edit))


def _cover_once(shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether ``chunks`` cover a tensor of ``shape`` exactly once, element by element."""
    count = torch.zeros(shape, dtype=torch.int32)
    for off, size in chunks:
        count[tuple(slice(o, o + n) for o, n in zip(off, size))] += 1
    return bool((count == 1).all())


def _read_chunks(shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]):
    """A ``.metadata`` with one tensor entry of ``shape`` stored in ``chunks``, read by the
    public reader: the metadata, or the StateError raised."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    entry = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape),
                                  [ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n in chunks])  # fmt: skip
    try:
        return _unpickled(pickle.dumps(Metadata(state_dict_metadata={"t": entry}, storage_data={})))
    except ampkit.StateError as e:
        return e


@st.composite
def _chunk_layouts(draw):
    """A small 1-d, 2-d or 3-d shape and chunks inside it: a grid cut of it (each cut kept
    or not), then maybe a chunk dropped, repeated, grown or shrunk (the volume changes),
    shifted by one, or in place of another of its volume (the volume stays)."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    cuts = [sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1)) if n > 1 else []) for n in shape]
    import itertools

    bounds = [[0, *c, n] for c, n in zip(cuts, shape)]
    chunks = [tuple(zip(*((b[i], b[i + 1] - b[i]) for b, i in zip(bounds, cell))))
              for cell in itertools.product(*(range(len(b) - 1) for b in bounds))]  # fmt: skip
    chunks = [(tuple(o), tuple(n)) for o, n in chunks]
    change = draw(st.sampled_from(["none", "drop", "repeat", "grow", "shrink", "shift", "swap"]))
    i = draw(st.integers(0, len(chunks) - 1))
    off, size = chunks[i]
    k = draw(st.integers(0, len(shape) - 1))
    if change == "drop":
        del chunks[i]
    elif change == "repeat":
        chunks.append(chunks[i])
    elif change == "grow" and off[k] + size[k] < shape[k]:
        chunks[i] = (off, size[:k] + (size[k] + 1,) + size[k + 1 :])
    elif change == "shrink" and size[k] > 1:
        chunks[i] = (off, size[:k] + (size[k] - 1,) + size[k + 1 :])
    elif change == "shift":  # the same volume: an overlap and a gap
        to = off[k] + draw(st.sampled_from([-1, 1]))
        if 0 <= to <= shape[k] - size[k]:
            chunks[i] = (off[:k] + (to,) + off[k + 1 :], size)
    elif change == "swap" and len(chunks) > 1:  # one chunk twice, another of its volume gone
        j = draw(st.integers(0, len(chunks) - 1))
        if j != i and math.prod(chunks[j][1]) == math.prod(size):
            chunks[j] = chunks[i]
    return shape, draw(st.permutations(chunks))


@settings(max_examples=300, deadline=None)
@given(_chunk_layouts())
def test_chunks_are_accepted_exactly_when_they_cover_the_tensor_once(layout):
    """Every layout of chunks (grids of a small tensor, a chunk dropped, repeated, grown or
    shrunk, in any order) is accepted exactly when it covers every element once, as
    counted element by element."""
    shape, chunks = layout
    got = _read_chunks(shape, chunks)
    if _cover_once(shape, chunks):
        assert not isinstance(got, Exception), (shape, chunks, got)
    else:
        assert isinstance(got, ampkit.StateError) and "cover it exactly once" in str(got), (shape, chunks, got)


def test_many_shards_of_one_tensor_are_accepted_and_a_repeated_one_refused():
    """4,096 one-row shards of one tensor (FSDP2's layout on that many ranks) and a 64 x 64
    grid of 2-d shards are accepted, each with one shard twice instead of another refused
    (the check sorts the rows and counts the grid's cells: comparing every pair of the
    4,096 rows took 4.9 s, now 1 ms)."""
    rows = [((i, 0), (1, 4)) for i in range(4096)]
    assert not isinstance(_read_chunks((4096, 4), rows), Exception)
    assert isinstance(_read_chunks((4096, 4), rows[:-1] + rows[:1]), ampkit.StateError)
    grid = [((i, j), (1, 1)) for i in range(64) for j in range(64)]
    assert not isinstance(_read_chunks((64, 64), grid), Exception)
    assert isinstance(_read_chunks((64, 64), grid[1:] + grid[-1:]), ampkit.StateError)


def test_an_oversized_non_tensor_entry_is_refused_before_it_is_read(saved, tmp_path):
    def edit(md):
        index = next(i for i in md.storage_data if i.fqn.endswith(".lr"))
        md.storage_data[index].length = 512 << 20

    assert "more than" in _refused(tmp_path, _edited(saved, tmp_path, edit))


def test_a_data_file_longer_than_its_entries_is_refused(saved, tmp_path):
    folder = tmp_path / "ck"
    shutil.copytree(saved / "O2K", folder)
    with open(next(folder.glob("*.distcp")), "ab") as f:
        f.write(b"\0" * 4096)
    _resum(folder)
    assert "entries end at byte" in _refused(tmp_path, folder)


@pytest.mark.parametrize("value", [3, "x", b"\0"])
def test_a_malformed_storage_record_is_refused(saved, tmp_path, value):
    def edit(md):
        md.storage_meta = value

    assert "storage record" in _refused(tmp_path, _edited(saved, tmp_path, edit))


def test_a_compressed_entry_is_refused(saved, tmp_path):
    def edit(md):
        next(iter(md.storage_data.values())).transform_descriptors = ["stream.zstd/1"]

    assert "compressed" in _refused(tmp_path, _edited(saved, tmp_path, edit))


def test_a_load_reads_the_metadata_once_and_a_file_swapped_after_the_check_is_not_read(saved, tmp_path):
    """``load_checkpoint`` reads ``.metadata`` and DCP asks the reader for it again: the
    second ask gets the view already read and checked (one unpickle per load); a file
    replaced in between is not read. A reader reset to another folder reads that folder,
    against that folder's checksums."""
    from ampkit.distributed.dcp_files import checkpoint_planner, checkpoint_reader

    folder = tmp_path / "ck"
    shutil.copytree(saved / "O2K", folder)
    reader = checkpoint_reader(folder)
    first = reader.read_metadata()
    (folder / ".metadata").write_bytes(b"\x80\x04garbage")
    again = reader.read_metadata()
    assert again is first and again.storage_meta.load_id == reader.load_id
    model, opt = _build("O2K")
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "amp": AmpState()}
    dcp.load(state, storage_reader=reader, planner=checkpoint_planner())  # DCP's reset, then its own ask
    assert reader.read_metadata() is first
    expected = (saved / "O2K" / "ampkit_checksums_0.json").read_text()
    assert json.loads(expected)["sha256"] == reader.ampkit_sums
    reader.reset(str(saved / "O2"))
    other = reader.read_metadata()
    assert other is not first and set(other.state_dict_metadata) != set(first.state_dict_metadata)
    assert reader.ampkit_sums == json.loads((saved / "O2" / "ampkit_checksums_0.json").read_text())["sha256"]
    # the first folder's metadata, garbage now, is refused by a new reader
    with pytest.raises(ampkit.StateError, match="checksum|cannot be read"):
        checkpoint_reader(folder).read_metadata()
