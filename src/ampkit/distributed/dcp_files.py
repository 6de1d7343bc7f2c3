"""Reading a DCP checkpoint folder without running anything in it.

DCP's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle``, and its
default planner reads every non-tensor entry (an optimizer's ``lr``, ``betas``, ...)
with ``torch.load(weights_only=False)``: a planted payload in either runs on every rank
that loads. :func:`checkpoint_reader` and :func:`checkpoint_planner` give the reader and
planner :func:`ampkit.distributed.load_checkpoint` uses (and a loop of one's own can pass
to ``dcp.load``):

- ``.metadata`` is unpickled by an unpickler that admits DCP's metadata classes, torch's
  dtypes, ``torch.Size`` and paths, and nothing else; its structure is then checked (every
  entry's storage a plain file name inside the folder, offsets and lengths whole numbers).
- Non-tensor entries are read with ``torch.load(weights_only=True)``, at most
  ``MAX_BYTES_ENTRY`` (1 MiB) bytes each.
- Every data file (and ``.metadata``) is hashed (SHA-256) on save by the rank that wrote
  it (:func:`write_checksums`, ``ampkit_checksums_<rank>.json`` in the folder) and checked
  before it is read: a flipped bit is refused. A folder without checksums (written by
  plain ``dcp.save``) loads with one warning.
- Data files and ``.metadata`` must be regular files (no FIFO, device or folder).
"""

from __future__ import annotations

import collections
import enum
import gc
import hashlib
import io
import itertools
import math
import os
import pickle
import reprlib
import stat
import struct
import threading
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ampkit._internal.files import read_json, write_text
from ampkit.errors import StateError

__all__ = ["checkpoint_planner", "checkpoint_reader", "MAX_BYTES_ENTRY", "MAX_METADATA_BYTES", "write_checksums"]

MAX_BYTES_ENTRY = 1 << 20
"""The largest non-tensor entry (an optimizer hyperparameter, a string) read: 1 MiB."""

MAX_METADATA_BYTES = 1 << 30
"""The largest ``.metadata`` read: 1 GiB (a model of a million tensors stays far below)."""

_CHECKSUM_PREFIX = "ampkit_checksums_"
_METADATA = ".metadata"
_HASH_CHUNK = 1 << 22

_DCP_METADATA_CLASSES = (
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "_MEM_FORMAT_ENCODING",
)
_ALLOWED = {
    **{("torch.distributed.checkpoint.metadata", name): None for name in _DCP_METADATA_CLASSES},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): None,
    ("torch", "Size"): None,
    ("torch.serialization", "_get_layout"): None,
    ("pathlib", "PosixPath"): None,
    ("pathlib", "PurePosixPath"): None,
    ("pathlib", "WindowsPath"): None,
    ("pathlib", "PureWindowsPath"): None,
    ("collections", "OrderedDict"): None,
}


def _refused(path: Any, why: str) -> StateError:
    return StateError(
        f"the checkpoint {os.fspath(path)!r} cannot be loaded: {why}. Nothing was loaded: it is corrupt, "
        "truncated or was not written by torch.distributed.checkpoint; load an earlier one."
    )


class _MetadataUnpickler(pickle._Unpickler):
    """An unpickler that builds DCP's metadata classes and nothing else: no function of
    the file's choosing is ever called, and state is set (``BUILD``) only on instances of
    the allowed classes, never on a class itself (which would change it for the whole
    process). Python's own unpickler, whose opcodes can be refused one by one (and whose
    memo is a dict: C's is an array as long as the largest index the file names, 64 GiB
    from a 12-byte file)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        found = vars(torch).get(name) if module == "torch" else None  # (no lazy import of a torch submodule)
        if isinstance(found, (torch.dtype, torch.layout)):
            return found
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP metadata never holds")

    def load_build(self) -> None:
        target = self.stack[-2]  # BUILD pops the state (the top), then sets it on this
        if isinstance(target, type) or f"{type(target).__module__}.{type(target).__qualname__}" not in _BUILDABLE:
            raise pickle.UnpicklingError(f"it sets the state of a {type(target).__name__}, which DCP metadata never does")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = load_build

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self._depths: dict[int, tuple[tuple, int]] = {}  # id -> (tuple, depth), tuples holding tuples

    def _nested(self, made: tuple) -> None:
        """``made`` holds tuples: refuse it if tuples nest more than ``_MAX_TUPLE_DEPTH``
        deep in it. Hashing one (a dict key, a ``MetadataIndex``) recurses in C with no
        limit, and a few hundred thousand levels crash the process."""
        depths = self._depths
        depth = 1 + max(depths[id(x)][1] if id(x) in depths else 1 for x in made if type(x) is tuple)
        if depth > _MAX_TUPLE_DEPTH:
            raise pickle.UnpicklingError(f"it nests tuples more than {_MAX_TUPLE_DEPTH} deep, which DCP metadata never does")
        depths[id(made)] = (made, depth)  # (the tuple kept: its id is not reused meanwhile)


def _tuple_checked(load: Any) -> Any:
    """The tuple opcode ``load`` of Python's unpickler, then the nesting check of the tuple
    it made where that holds a tuple (:meth:`_MetadataUnpickler._nested`)."""

    def run(self: _MetadataUnpickler) -> None:
        load(self)
        made = self.stack[-1]
        for item in made:
            if type(item) is tuple:
                self._nested(made)
                return

    return run


for _op in (pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3):
    _MetadataUnpickler.dispatch[_op[0]] = _tuple_checked(pickle._Unpickler.dispatch[_op[0]])
del _op

_ATOMS = frozenset({str, bytes, int, float, bool, type(None)})


def _plain_key(key: Any) -> bool:
    """Whether ``key`` may be hashed while unpickling: a str, number, None, dtype, layout
    or ``torch.Size``, a flat tuple of those, or a ``MetadataIndex`` of a str, a size and
    an int. A tuple shared within itself (``t = (u, u)``, ``u = (v, v)``, ...) or a
    ``MetadataIndex`` holding one is tiny in the file and takes exponential time to hash."""
    kind = type(key)
    if kind in _ATOMS or kind is torch.Size or kind is torch.dtype or kind is torch.layout:
        return True
    if kind is tuple:
        return len(key) <= 64 and all(type(x) in _ATOMS or type(x) is torch.Size for x in key)
    from torch.distributed.checkpoint.metadata import MetadataIndex

    if kind is MetadataIndex:
        offset, index = getattr(key, "offset", None), getattr(key, "index", None)
        return (type(getattr(key, "fqn", None)) is str and (offset is None or type(offset) is torch.Size)
                and (index is None or type(index) is int))  # fmt: skip
    return False


def _keys_checked(load: Any, keys: Any) -> Any:
    """The opcode ``load`` of Python's unpickler, after refusing any key or set element
    (``keys(self)``: those it is about to hash) that is not :func:`_plain_key`."""

    def run(self: _MetadataUnpickler) -> None:
        for key in keys(self):
            if not _plain_key(key):
                raise pickle.UnpicklingError(f"it hashes a {type(key).__name__} as a key, which DCP metadata never does")
        load(self)

    return run


def _reduce_args(self: _MetadataUnpickler) -> Any:
    """What ``REDUCE`` is about to hash: the enum's value and the layout's name (they are
    looked up in tables), and an ``OrderedDict``'s items (pickle gives it none: its items
    follow with ``SETITEMS``)."""
    func, args = self.stack[-2], self.stack[-1]
    if func is collections.OrderedDict:
        return () if args == () else [object()]  # (refused: an OrderedDict built from arguments)
    if not isinstance(func, type) or issubclass(func, enum.Enum):  # torch's layout lookup (a function), the enum
        return args if type(args) is tuple else [object()]
    return ()


_KEYED = {
    pickle.SETITEM: lambda self: [self.stack[-2]],
    pickle.SETITEMS: lambda self: self.stack[0::2],  # (the items since the mark)
    pickle.DICT: lambda self: self.stack[0::2],
    pickle.ADDITEMS: lambda self: list(self.stack),
    pickle.FROZENSET: lambda self: list(self.stack),
    pickle.REDUCE: _reduce_args,
}
for _op, _keys in _KEYED.items():
    _MetadataUnpickler.dispatch[_op[0]] = _keys_checked(pickle._Unpickler.dispatch[_op[0]], _keys)
del _op, _keys


_MAX_TUPLE_DEPTH = 64

#: The classes whose instances ``.metadata`` may set state on: DCP's dataclasses, each
#: instance made fresh by the same pickle (not the enum, whose members are shared).
_BUILDABLE = {
    f"{module}.{name}" for module, name in _ALLOWED if module.startswith("torch.distributed") and name != "_MEM_FORMAT_ENCODING"
}


_gc_lock = threading.Lock()
_gc_pauses = [0, False]  # loads under way in this process, whether the collector was on before the first


def _unpickle_metadata(file: Any) -> Any:
    """DCP's metadata from the open binary ``file`` (:class:`_MetadataUnpickler`), with
    Python's cycle collector paused meanwhile: the tens of thousands of objects made would
    otherwise set off collections that walk every object of the process (torch's
    included), a third of the reading's time or more. Loads in several threads share one pause; the
    collector is switched back on when the last ends, if it was on when the first began."""
    with _gc_lock:
        if _gc_pauses[0] == 0:
            _gc_pauses[1] = gc.isenabled()
            gc.disable()
        _gc_pauses[0] += 1
    try:
        return _MetadataUnpickler(file).load()
    finally:
        with _gc_lock:
            _gc_pauses[0] -= 1
            if _gc_pauses[0] == 0 and _gc_pauses[1]:
                gc.enable()


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 160, 160, 40


def _shown(value: Any) -> str:
    """``repr(value)`` cut short (two levels, 160 characters a string): a value the file
    chose, shown in a refusal (a list that holds itself twice at each level is a few
    hundred bytes in the file and gigabytes in full)."""
    return _REPR.repr(value)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_metadata(md: Any, path: Any) -> None:
    """Raise unless ``md`` is shaped as DCP writes it."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    if not isinstance(md, Metadata):
        raise _refused(path, f".metadata holds a {type(md).__name__}, not DCP's Metadata")
    entries = getattr(md, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        raise _refused(path, ".metadata has no table of entries")
    verdicts: dict[tuple[int, tuple[int, ...]], str] = {}
    for fqn, entry in entries.items():
        if not isinstance(fqn, str):
            raise _refused(path, f"an entry is named by a {type(fqn).__name__}")
        if isinstance(entry, BytesStorageMetadata):
            continue
        ok = (
            isinstance(entry, TensorStorageMetadata)
            and isinstance(entry.properties, TensorProperties)
            and isinstance(entry.properties.dtype, torch.dtype)
            and isinstance(entry.size, torch.Size)
            and all(_is_count(s) for s in entry.size)
            and isinstance(entry.chunks, list)
        )
        if not ok:
            raise _refused(path, f"the entry {_shown(fqn)} is malformed in .metadata")
        # entries may share one list of chunks (pickle's memo): each list is checked once per size
        key = (id(entry.chunks), tuple(entry.size))
        verdict = verdicts.get(key)
        if verdict is None:
            verdict = verdicts[key] = _chunks_verdict(entry.size, entry.chunks)
        if verdict == "malformed":
            raise _refused(path, f"the entry {_shown(fqn)} is malformed in .metadata")
        if verdict == "overlap":
            raise _refused(path, f"the chunks of {_shown(fqn)} do not cover it exactly once")
    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):
        raise _refused(path, ".metadata has no storage table")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or type(info).__qualname__ != "_StorageInfo":
            raise _refused(path, "the storage table of .metadata is malformed")
        name = info.relative_path
        if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            raise _refused(path, f"an entry is stored in {_shown(name)}, which is not a file name inside the folder")
        if not (_is_count(info.offset) and _is_count(info.length)):
            raise _refused(path, f"the entry {_shown(index.fqn)} has offset {_shown(info.offset)} and length {_shown(info.length)}")
        if getattr(info, "transform_descriptors", None):  # compression: save_checkpoint never writes it
            raise _refused(path, f"the entry {_shown(index.fqn)} is stored transformed (compressed), which ampkit does not read")
        if isinstance(entries.get(index.fqn), BytesStorageMetadata) and info.length > MAX_BYTES_ENTRY:
            raise _refused(path, f"the entry {_shown(index.fqn)} is {info.length} bytes, more than {MAX_BYTES_ENTRY}")
    planner_data = getattr(md, "planner_data", None)
    if planner_data is not None and not (
        isinstance(planner_data, dict)
        and all(
            isinstance(k, str) and isinstance(v, tuple) and all(isinstance(p, (str, int)) for p in v)
            for k, v in planner_data.items()
        )
    ):
        raise _refused(path, "the planner table of .metadata is malformed")
    from torch.distributed.checkpoint.metadata import StorageMeta

    if getattr(md, "storage_meta", None) is not None and not isinstance(md.storage_meta, StorageMeta):
        raise _refused(path, "the storage record of .metadata is malformed")


def _chunks_verdict(size: torch.Size, chunks: list[Any]) -> str:
    """``"malformed"`` unless every chunk is DCP's, its offsets and sizes whole numbers of
    the tensor's rank that stay inside it; else ``"overlap"`` unless they cover it exactly
    once (:func:`_tiles`); else ``"ok"``."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    for c in chunks:
        if not (
            isinstance(c, ChunkStorageMetadata)
            and isinstance(c.offsets, torch.Size)
            and isinstance(c.sizes, torch.Size)
            and len(c.offsets) == len(c.sizes) == len(size)
            and all(_is_count(o) and _is_count(s) and o + s <= n for o, s, n in zip(c.offsets, c.sizes, size))
        ):
            return "malformed"
    return "ok" if _tiles(size, [(tuple(c.offsets), tuple(c.sizes)) for c in chunks]) else "overlap"


def _tiles(size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether ``chunks`` (offsets, sizes, each inside the tensor) cover a tensor of
    ``size`` exactly once.

    Linear in the chunks where every chunk spans the tensor whole but along one dimension
    (FSDP2's shards, any 1-d tensor): sorted along it, each must start where the one
    before ends. Otherwise the chunks' edges cut each dimension into intervals, and the
    chunks into whole cells of that grid: each cell must be covered once, counted for all
    chunks at once (a +-1 at each chunk's corners, summed along every dimension). More
    than ``_MAX_CELLS`` cells, or more than ``_MAX_CUT_DIMS`` dimensions cut, are refused:
    no world's shards cut one tensor that finely."""
    if sum(math.prod(sizes) for _, sizes in chunks) != math.prod(size):
        return False
    live = [c for c in chunks if math.prod(c[1])]
    if len(live) > _MAX_CHUNKS:  # more shards than any world writes one tensor in
        return False
    if len(live) <= 1 or not size:
        return True  # (the volumes agree: one chunk covers it all)
    whole = [k for k in range(len(size)) if all(off[k] == 0 and sz[k] == size[k] for off, sz in live)]
    cut = [k for k in range(len(size)) if k not in whole]
    if len(cut) <= 1:
        dim = cut[0] if cut else 0
        end = 0
        for off, sz in sorted(live, key=lambda c: c[0][dim]):
            if off[dim] != end:
                return False
            end += sz[dim]
        return end == size[dim]
    if len(cut) > _MAX_CUT_DIMS:
        return False
    offs = torch.tensor([[off[k] for off, _ in live] for k in cut], dtype=torch.int64)  # a row per cut dim
    ends = offs + torch.tensor([[sz[k] for _, sz in live] for k in cut], dtype=torch.int64)
    lows, highs, cells = [], [], []
    for j, k in enumerate(cut):
        edges = torch.unique(torch.cat([offs[j], ends[j], torch.tensor([0, size[k]])]))  # sorted
        cells.append(edges.numel() - 1)
        if math.prod(cells) > _MAX_CELLS:
            return False
        lows.append(torch.searchsorted(edges, offs[j]))
        highs.append(torch.searchsorted(edges, ends[j]))
    marks = torch.zeros([n + 1 for n in cells], dtype=torch.int64)
    for corner in itertools.product((0, 1), repeat=len(cut)):
        at = tuple(highs[j] if up else lows[j] for j, up in enumerate(corner))
        sign = -1 if sum(corner) % 2 else 1
        marks.index_put_(at, torch.full((len(live),), sign, dtype=torch.int64), accumulate=True)
    for j in range(len(cut)):
        marks = marks.cumsum(j)
    return bool((marks[tuple(slice(0, n) for n in cells)] == 1).all())


_MAX_CHUNKS = 1 << 16
_MAX_CELLS = 1 << 22
_MAX_CUT_DIMS = 6


def _regular(path: Path, folder: Any) -> int:
    """The size of the regular file ``path``; refused when it is anything else."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise _refused(folder, f"{path.name} is missing") from None
    except OSError as exc:
        raise _refused(folder, f"{path.name}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _refused(folder, f"{path.name} is not a regular file")
    return st.st_size


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_checksums(path: str | os.PathLike[str], rank: int, is_coordinator: bool) -> None:
    """Hash the files ``rank`` wrote into the DCP folder ``path`` (``__<rank>_*.distcp``,
    and ``.metadata`` where ``is_coordinator``: the rank DCP wrote it from, rank 0) into
    ``ampkit_checksums_<rank>.json`` (written by ampkit's safe writer)."""
    folder = Path(path)
    names = sorted(p.name for p in folder.glob(f"__{rank}_*.distcp"))
    if is_coordinator:
        names.append(_METADATA)
    sums = {name: _sha256(folder / name) for name in names}
    import json

    write_text(folder / f"{_CHECKSUM_PREFIX}{rank}.json", json.dumps({"format": 1, "sha256": sums}, indent=0),
               "the checkpoint's checksums", StateError)  # fmt: skip


def _read_checksums(folder: Path) -> dict[str, str] | None:
    """Every saving rank's checksums merged (None when the folder has none)."""
    files = sorted(folder.glob(f"{_CHECKSUM_PREFIX}*.json"))
    if not files:
        return None
    sums: dict[str, str] = {}
    for file in files:
        doc = read_json(file, "the checkpoint's checksums", StateError, limit=64 << 20)
        table = doc.get("sha256") if isinstance(doc, dict) and doc.get("format") == 1 else None
        if not isinstance(table, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in table.items()):
            raise _refused(folder, f"{file.name} is malformed")
        for name, value in table.items():
            if sums.setdefault(name, value) != value:
                raise _refused(folder, f"two checksum files disagree about {name}")
    return sums


_warned_unsummed: set[str] = set()  # folders warned about (once each)
_classes: dict[str, type] = {}


def _reader_class() -> type:
    if "reader" not in _classes:
        from torch.distributed.checkpoint import FileSystemReader

        class AmpkitCheckpointReader(FileSystemReader):
            """DCP's ``FileSystemReader`` with :func:`_read_metadata` and checked files."""

            def __init__(self, path: str | os.PathLike[str]) -> None:
                super().__init__(path)
                self._ampkit_folder(Path(self.path))

            def _ampkit_folder(self, folder: Path) -> None:
                self.ampkit_sums = _read_checksums(folder)
                self.ampkit_verified: set[str] = set()
                # what read_metadata read, per rank argument: read and checked once per
                # reader (ampkit's load_checkpoint and dcp.load both ask), one view for both
                self.ampkit_metadata: dict[int | None, Any] = {}
                self.ampkit_read_from = folder

            def reset(self, checkpoint_id: Any = None) -> None:
                super().reset(checkpoint_id)
                if Path(self.path) != self.ampkit_read_from:  # another folder: its own checksums
                    self._ampkit_folder(Path(self.path))

            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                rank = kwargs.get("rank")
                md = self.ampkit_metadata.get(rank)
                if md is None:
                    md = self.ampkit_metadata[rank] = _read_metadata(self, rank)
                md.storage_meta.load_id = self.load_id
                return md

            def read_data(self, plan: Any, planner: Any) -> Any:
                _verify_files(self, (self.storage_data[item.storage_index].relative_path for item in plan.items))
                return super().read_data(plan, planner)

        _classes["reader"] = AmpkitCheckpointReader
    return _classes["reader"]


def checkpoint_reader(path: str | os.PathLike[str]) -> Any:
    """A DCP ``StorageReader`` for the checkpoint folder ``path`` that never unpickles
    beyond DCP's metadata classes and checks every file before reading it (see the module
    docstring); for ``dcp.load(state, storage_reader=checkpoint_reader(path),
    planner=checkpoint_planner())``. Raises :class:`~ampkit.StateError` for a malformed
    checksum file."""
    return _reader_class()(path)


def _read_metadata(reader: Any, rank: int | None) -> Any:
    folder = Path(reader.path)
    name = _METADATA if rank is None else f"__{rank}{_METADATA}"
    path = folder / name
    if _regular(path, folder) > MAX_METADATA_BYTES:
        raise _refused(folder, f"{name} is larger than {MAX_METADATA_BYTES} bytes")
    _verify_files(reader, [name])
    try:
        with open(path, "rb") as f:
            md = _unpickle_metadata(f)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, RuntimeError,
            IndexError, KeyError, RecursionError, MemoryError, UnicodeDecodeError, OverflowError,
            struct.error) as exc:  # fmt: skip
        raise _refused(folder, f"{name} cannot be read ({type(exc).__name__}: {exc})") from None
    try:
        _check_metadata(md, folder)
    except (AttributeError, TypeError, ValueError, RecursionError) as exc:  # an object made without its fields
        raise _refused(folder, f"{name} is malformed ({type(exc).__name__}: {exc})") from None
    from torch.distributed.checkpoint.metadata import StorageMeta

    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = StorageMeta()
    return md


def _verify_files(reader: Any, names: Iterable[str]) -> None:
    """Check each file against the saved checksums (once per reader)."""
    folder = Path(reader.path)
    sums: dict[str, str] | None = reader.ampkit_sums
    ends: dict[str, int] = {}
    for info in (getattr(reader, "storage_data", None) or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name in sorted(set(names) - reader.ampkit_verified):
        size = _regular(folder / name, folder)
        if name in ends and size != ends[name]:
            raise _refused(folder, f"{name} holds {size} bytes; its entries end at byte {ends[name]}")
        if sums is None:
            if str(folder) not in _warned_unsummed:
                _warned_unsummed.add(str(folder))
                warnings.warn(
                    f"ampkit: the checkpoint {str(folder)!r} has no checksums (it was written by plain dcp.save or "
                    "an older ampkit): a corrupted file cannot be told from a good one. "
                    "ampkit.distributed.save_checkpoint writes them.",
                    stacklevel=4,
                )
            continue
        if name not in sums:
            raise _refused(folder, f"{name} has no checksum (a file added after the save)")
        if _sha256(folder / name) != sums[name]:
            raise _refused(folder, f"{name} does not match its checksum (a changed or corrupted file)")
        reader.ampkit_verified.add(name)


def _planner_class() -> type:
    if "planner" not in _classes:
        from torch.distributed.checkpoint import DefaultLoadPlanner

        class AmpkitCheckpointPlanner(DefaultLoadPlanner):
            """DCP's default load planner with every entry checked against what it loads
            into and non-tensor entries read weights-only."""

            def __init__(self, strict: bool = True) -> None:
                super().__init__()
                self.ampkit_strict = strict

            def create_local_plan(self) -> Any:
                _check_entries(self.state_dict, self.metadata, self.ampkit_strict)
                return super().create_local_plan()

            def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
                obj = _load_entry(read_item.dest_index.fqn, value)
                clean = io.BytesIO()
                torch.save(obj, clean)  # what DCP's own load_bytes reads back: ampkit's bytes, not the file's
                clean.seek(0)
                super().load_bytes(read_item, clean)

        _classes["planner"] = AmpkitCheckpointPlanner
    return _classes["planner"]


def checkpoint_planner(strict: bool = True) -> Any:
    """DCP's default load planner, except that every entry must be what it loads into (a
    tensor of the same shape and dtype where the state dict holds a tensor, a non-tensor
    entry elsewhere) and a non-tensor entry is read with ``torch.load(weights_only=True)``,
    at most ``MAX_BYTES_ENTRY`` (1 MiB) bytes; anything else raises
    :class:`~ampkit.StateError`. ``strict`` (default True): the checkpoint may hold no
    entry the state dict lacks (False: a partial load, e.g. the model alone)."""
    return _planner_class()(strict)


def _check_entries(state: dict[str, Any], metadata: Any, strict: bool) -> None:
    """Raise StateError where a checkpoint entry is not what the (flattened) state dict
    it loads into holds: a tensor's kind, shape and dtype, or a non-tensor's kind."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    saved = metadata.state_dict_metadata
    for fqn, value in state.items():
        entry = saved.get(fqn)
        if entry is None:
            continue  # missing: DCP's own check names it
        if isinstance(value, torch.Tensor):
            if not isinstance(entry, TensorStorageMetadata):
                raise StateError(f"the checkpoint's entry {fqn!r} is not a tensor, where this run holds one. "
                                 "Nothing was loaded: the checkpoint is corrupt or from another model.")  # fmt: skip
            if tuple(entry.size) != tuple(value.size()) or entry.properties.dtype != value.dtype:
                raise StateError(
                    f"the checkpoint's entry {fqn!r} is a {entry.properties.dtype} tensor of shape {tuple(entry.size)}; "
                    f"this run's is {value.dtype} {tuple(value.size())}: it was saved by another model, level or "
                    "dtype. Set up the run as the one that saved it. Nothing was loaded."
                )
        elif not isinstance(entry, BytesStorageMetadata):
            raise StateError(f"the checkpoint's entry {fqn!r} is a tensor, where this run holds a "
                             f"{type(value).__name__}. Nothing was loaded: the checkpoint is corrupt.")  # fmt: skip
    if strict:
        extra = sorted(set(saved) - set(state))
        if extra:
            raise StateError(
                f"the checkpoint holds entries this run does not have ({extra[:4]}): it was saved by another model, "
                "optimizer or level. Set up the run as the one that saved it. Nothing was loaded."
            )


def _load_entry(fqn: str, value: io.BytesIO) -> Any:
    data = value.read(MAX_BYTES_ENTRY + 1)
    if len(data) > MAX_BYTES_ENTRY:
        raise StateError(f"the checkpoint's entry {fqn!r} is larger than {MAX_BYTES_ENTRY} bytes.")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # a weights-only refusal, truncation or garbage: all the same refusal
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StateError(
            f"the checkpoint's entry {fqn!r} cannot be read as weights only ({first:.200}). "
            "ampkit never unpickles checkpoint entries fully; the file was tampered with or is corrupt."
        ) from None
