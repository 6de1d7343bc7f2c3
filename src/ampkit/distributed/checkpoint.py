"""ampkit's state in ``torch.distributed.checkpoint`` (DCP) checkpoints.

:func:`save_checkpoint` / :func:`load_checkpoint` save and load a (FSDP2-sharded) model,
its optimizer and ampkit's state in one DCP checkpoint folder, with a SHA-256 per file.
Loading reads the folder as hostile (:mod:`ampkit.distributed.dcp_files`: nothing
unpickled beyond DCP's metadata classes and weights-only entries) and is whole or
nothing: DCP reads into copies, every value is checked (ampkit's state as
:func:`ampkit.load_state_dict` checks it, and exactly this session's entries; the model's
and the optimizer's tensors in this run's dtypes, finite, the optimizer's possible), and
only then is anything applied. The copies cost the model's and the optimizer's size on
each rank while loading.

:class:`AmpState` is ampkit's part alone, a DCP ``Stateful``, for a loop that builds its
own DCP state dict::

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import torch.distributed.checkpoint as dcp

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "amp": ampkit.distributed.AmpState()}, checkpoint_id=path)
    ...
    state = {"model": model_sd, "optim": optim_sd, "amp": ampkit.distributed.AmpState()}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

What it holds: the session's scalers, step counters and extra state (O2K's compensation
buffers, fp8 scales) as tensors only, one entry per value, strings as their UTF-8 bytes:
sharded values (the compensation of FSDP2's DTensor shards) as DTensors, which DCP
reshards when the world size changes; every other value as a tensor that is the same on
every rank. No entry is a pickled object. A plain ``dcp.load`` still unpickles
``.metadata`` and the optimizer's non-tensor entries: pass
``storage_reader=checkpoint_reader(path), planner=checkpoint_planner()`` (from
:mod:`ampkit.distributed.dcp_files`), and call :meth:`AmpState.expect` with the reader's
metadata first to refuse another level's state. Loading is whole or nothing: DCP reads
into copies, then :func:`ampkit.load_state_dict` validates every value before any is
applied, and a file DCP cannot read raises before that.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ampkit._internal.dist import rank_and_world_size
from ampkit._internal.dtypes import local_tensor
from ampkit._internal.tree import map_leaves
from ampkit._internal.validate import ABSURD_MAGNITUDE
from ampkit.errors import StateError

from .core import _comm_device

__all__ = ["AmpState", "load_checkpoint", "save_checkpoint"]

_SEP = "/"


def _flatten(
    obj: Any,
    prefix: str,
    out: dict[str, torch.Tensor],
    copy: bool = True,
    sizes: dict[str, int] | None = None,
    strings: set[str] | None = None,
) -> None:
    """Every leaf of ``obj`` (dicts, lists, tensors, numbers, bools, strings, None) as a
    tensor under its path; a string as the uint8 tensor of its UTF-8 bytes (the format,
    a compensation's method: what tells one level's state from another's), None is
    structure. ``copy``: tensors are cloned (default; DCP loads into them: never the live
    buffers), else put in as they are (for reading the entries' names only). ``sizes``:
    the byte counts the checkpoint's strings were saved with (a load's buffers);
    ``strings`` collects the paths of the strings."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            _flatten(value, f"{prefix}{_SEP}{key}" if prefix else str(key), out, copy, sizes, strings)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _flatten(value, f"{prefix}{_SEP}{i}", out, copy, sizes, strings)
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        if strings is not None:
            strings.add(prefix)
        if sizes is not None and prefix in sizes:
            out[prefix] = torch.zeros(sizes[prefix], dtype=torch.uint8)
        else:
            out[prefix] = torch.tensor(list(data), dtype=torch.uint8)
    elif isinstance(obj, torch.Tensor):
        out[prefix] = obj.detach().clone() if copy else obj
    elif prefix.endswith(f"{_SEP}shard_rank"):
        return  # which rank's shards a per-rank file holds: DCP maps shards itself
    elif isinstance(obj, bool):
        out[prefix] = torch.tensor(obj)
    elif isinstance(obj, int):
        out[prefix] = torch.tensor(obj, dtype=torch.int64)
    elif isinstance(obj, float):
        out[prefix] = torch.tensor(obj, dtype=torch.float64)
    elif obj is not None:
        raise StateError(f"ampkit's state holds a {type(obj).__name__} at {prefix!r}, which AmpState cannot save.")


def _rebuild(template: Any, prefix: str, values: dict[str, Any]) -> Any:
    """``template`` (the current session's state) with each leaf taken from ``values``,
    as the template's type."""
    if isinstance(template, dict):
        return {k: _rebuild(v, f"{prefix}{_SEP}{k}" if prefix else str(k), values) for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(_rebuild(v, f"{prefix}{_SEP}{i}", values) for i, v in enumerate(template))
    if template is None or prefix.endswith(f"{_SEP}shard_rank"):
        return template
    value = values[prefix]
    if not isinstance(value, torch.Tensor):
        raise StateError(f"ampkit's checkpoint entry {prefix!r} is a {type(value).__name__}, not a tensor.")
    if isinstance(template, str):
        local = local_tensor(value)
        if local.dtype != torch.uint8 or local.dim() != 1:
            raise StateError(f"ampkit's checkpoint entry {prefix!r} is not a saved string.")
        try:
            return bytes(local.tolist()).decode("utf-8")
        except UnicodeDecodeError:
            raise StateError(f"ampkit's checkpoint entry {prefix!r} is not a saved string (not UTF-8).") from None
    if isinstance(template, torch.Tensor):
        return value
    local = local_tensor(value)
    if local.numel() != 1:
        raise StateError(f"ampkit's checkpoint entry {prefix!r} has shape {tuple(local.shape)}; a number was saved there.")
    if isinstance(template, bool):
        if local.dtype != torch.bool:
            raise StateError(f"ampkit's checkpoint entry {prefix!r} is {local.dtype}, expected a bool.")
        return bool(local.item())
    if isinstance(template, int):
        if local.dtype != torch.int64:
            raise StateError(f"ampkit's checkpoint entry {prefix!r} is {local.dtype}, expected an integer.")
        return int(local.item())
    return float(local.item())


def _require_same_entries(expected: Any, saved: Any) -> None:
    """Raise StateError unless ``saved`` names exactly ``expected``'s entries."""
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    if missing or extra:
        raise StateError(
            "ampkit's part of the checkpoint does not match this session: it was saved by a run set up "
            f"another way (another opt level, dtype, loss scaler or optimizers; missing {missing[:4]}, "
            f"unexpected {extra[:4]}). Set up the same level, dtype, optimizers and param groups as the run "
            "that saved it. Nothing was loaded."
        )


def _require_same_scaler_kind(template: Any, saved: Any) -> None:
    """Raise StateError where a saved loss scaler is static and this session's dynamic or
    the reverse: a bf16 run's checkpoint (static scale 1) loaded into an fp16 run would
    switch its loss scaling off, and the entries of the two are the same."""
    for i, (mine, theirs) in enumerate(zip(template.get("trainers", []), saved.get("trainers", []))):
        for j, (a, b) in enumerate(zip(mine.get("scalers", []), theirs.get("scalers", []))):
            if isinstance(a, dict) and isinstance(b, dict) and a.get("dynamic") != b.get("dynamic"):
                kinds = {True: "a dynamic loss scale (fp16)", False: "a static loss scale (bf16 or fp32)"}
                raise StateError(
                    f"ampkit's checkpoint has {kinds.get(b.get('dynamic'), '?')} for trainer {i}'s loss {j}, this "
                    f"session {kinds.get(a.get('dynamic'), '?')}: it was saved by a run in another dtype. Set up the "
                    "same dtype as the run that saved it. Nothing was loaded."
                )


def _ensure_buffers() -> None:
    """Every compensated optimizer of the session with all its buffers (zeros where a
    parameter was not stepped yet): the state's entries are then the same before the
    first step, when a resumed run builds the dict DCP loads into, as after it."""
    from ampkit.levels.setup import compensations

    for comp in compensations():
        comp.ensure_buffers()


def _checksum(t: torch.Tensor) -> int:
    """An order-sensitive checksum of ``t``'s bytes (equal tensors give equal sums)."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    weights = torch.arange(1, data.numel() + 1, dtype=torch.int64)
    return int((data * weights).sum()) % (1 << 52) if data.numel() else 0  # exact in float64


def _require_replicated(entries: dict[str, torch.Tensor]) -> None:
    """Raise unless every entry that is no DTensor holds the same value on every rank:
    DCP saves such an entry once and loads it on every rank, so a per-rank value would
    come back as another rank's (two all-reduces of one checksum per entry)."""
    import torch.distributed as dist

    if not _multi_rank():
        return
    names = sorted(k for k, v in entries.items() if local_tensor(v) is v)
    if not names:
        return
    sums = torch.tensor([_checksum(entries[k]) for k in names], dtype=torch.float64, device=_device())
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    differ = [k for k, a, b in zip(names, low.tolist(), high.tolist()) if a != b]
    if differ:
        raise StateError(
            f"ampkit's state differs between ranks at {differ[:4]}; a DCP checkpoint keeps one copy of "
            "such values, so each rank would resume with another rank's. ampkit keeps them equal (every "
            "step's decision is agreed), so a rank was given another state: load the same checkpoint "
            "on every rank, or save ampkit.state_dict() per rank."
        )


class AmpState:
    """ampkit's session state as a DCP ``Stateful`` (see the module docstring). Build
    it after ``initialize``/``init_trainer``, on every rank; the session must be set up
    as the one that saved when loading (the same levels, optimizers and param groups;
    the world size may differ).

    Args:
        defer: False (default): ``load_state_dict`` applies what it validated. True: it
            only validates and keeps the apply step for :meth:`apply` (what
            :func:`load_checkpoint` does, to apply after the model's values are checked).
    """

    def __init__(self, defer: bool = False) -> None:
        self.defer = defer
        self._pending: Any = None
        self._sizes: dict[str, int] | None = None

    def expect(self, metadata: Any, key: str = "amp") -> None:
        """Check a checkpoint's DCP ``metadata`` (as :func:`ampkit.distributed.dcp_files.checkpoint_reader` reads it)
        before loading: the entries saved under ``key`` must be exactly this session's
        (another level's, dtype's or scaler's state has other entries, which a plain
        ``dcp.load`` would silently leave unread), each a tensor of the expected rank.
        Raises :class:`ampkit.StateError`; nothing is changed."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from ampkit.trainer.session import state_dict as session_state

        _ensure_buffers()
        expected: dict[str, torch.Tensor] = {}
        strings: set[str] = set()
        _flatten(session_state(), "", expected, copy=False, strings=strings)
        saved = {
            fqn[len(key) + 1 :]: entry
            for fqn, entry in metadata.state_dict_metadata.items()
            if fqn.startswith(f"{key}.")
        }
        if not saved:
            raise StateError(
                f"the checkpoint holds no ampkit state under {key!r}: it was not saved with "
                "ampkit.distributed.save_checkpoint (or AmpState) in this ampkit version. Nothing was loaded."
            )
        _require_same_entries(expected, saved)
        sizes: dict[str, int] = {}
        for name, template in expected.items():
            entry = saved[name]
            if not isinstance(entry, TensorStorageMetadata) or len(entry.size) != local_tensor(template).dim():
                raise StateError(f"ampkit's checkpoint entry {name!r} is not shaped as this session's. Nothing was loaded.")
            if name in strings:
                if entry.properties.dtype != torch.uint8 or entry.size[0] > 4096:
                    raise StateError(f"ampkit's checkpoint entry {name!r} is not a saved string. Nothing was loaded.")
                sizes[name] = int(entry.size[0])
        self._sizes = sizes

    def apply(self) -> None:
        """Apply what a deferred :meth:`load_state_dict` validated (once)."""
        if self._pending is None:
            raise StateError("AmpState.apply: nothing was loaded (or it was applied already).")
        pending, self._pending = self._pending, None
        pending()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{path: tensor}`` of every value of :func:`ampkit.state_dict` (copies)."""
        from ampkit.trainer.session import state_dict as session_state

        _ensure_buffers()
        out: dict[str, torch.Tensor] = {}
        _flatten(session_state(), "", out, sizes=self._sizes)
        _require_replicated(out)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``dcp.load`` read into :meth:`state_dict`'s entries: rebuilt on the
        current session's structure, validated whole, then applied (raises
        :class:`ampkit.StateError` and changes nothing on a missing, mistyped or
        invalid entry)."""
        from ampkit.trainer.session import prepare_load_state_dict
        from ampkit.trainer.session import state_dict as session_state

        if not isinstance(state_dict, dict):
            raise StateError(f"AmpState.load_state_dict takes a dict, got {type(state_dict).__name__}.")
        _ensure_buffers()
        template = session_state()
        expected: dict[str, torch.Tensor] = {}
        _flatten(template, "", expected, copy=False)
        _require_same_entries(expected, state_dict)
        rebuilt = _rebuild(template, "", state_dict)
        _require_same_scaler_kind(template, rebuilt)
        apply = prepare_load_state_dict(rebuilt)
        if self.defer:
            self._pending = apply
        else:
            apply()


def _copy_leaf(leaf: Any) -> Any:
    return leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf


def _require_sane(tree: Any, where: str, bounded: bool = True) -> None:
    """Raise StateError for a floating tensor in ``tree`` holding inf/NaN, or (where
    ``bounded``: not a param group's value, not a sum of squares, which may reach fp32's
    range) a magnitude past :data:`ABSURD_MAGNITUDE`. One reduction per tensor."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            _require_sane(v, f"{where}.{k}", bounded and k != "param_groups" and k not in _NONNEGATIVE_STATE)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            _require_sane(v, f"{where}.{i}", bounded)
    elif isinstance(tree, torch.Tensor) and tree.is_floating_point():
        local = local_tensor(tree)
        largest = float(local.abs().amax()) if local.numel() else 0.0  # NaN when any value is
        if not math.isfinite(largest):
            raise StateError(
                f"the checkpoint's {where} holds inf/NaN values. Nothing was loaded: the checkpoint is "
                "corrupt or was saved after training diverged; load an earlier one."
            )
        if bounded and largest > ABSURD_MAGNITUDE:
            raise StateError(
                f"the checkpoint's {where} holds values of magnitude {largest:.3g}, beyond "
                f"{ABSURD_MAGNITUDE:.3g} (past it a square overflows fp32; no run that trains saves one). Nothing "
                "was loaded: the checkpoint is corrupt; load an earlier one."
            )


def save_checkpoint(path: str | Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Save ``model`` (sharded or not), ``optimizer`` and ampkit's state into the DCP
    checkpoint folder ``path``, on every rank (``dcp.save`` with the state dicts of
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` and :class:`AmpState`),
    then each rank's SHA-256 of the files it wrote (``ampkit_checksums_<rank>.json``),
    which :func:`load_checkpoint` checks."""
    import torch.distributed.checkpoint as dcp

    from .dcp_files import write_checksums

    model_sd, optim_sd = _state_dicts(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "amp": AmpState()}, checkpoint_id=str(path))
    rank, _ = rank_and_world_size()
    write_checksums(path, rank, is_coordinator=rank == 0)
    _barrier()


def load_checkpoint(path: str | Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the :func:`save_checkpoint` folder ``path`` into ``model``, ``optimizer`` and
    ampkit's session, on every rank; the world size may differ from the saving run's.

    Nothing in the folder is unpickled beyond DCP's metadata classes and weights-only
    entries (:func:`ampkit.distributed.dcp_files.checkpoint_reader`); every file is checked
    against the checksums :func:`save_checkpoint` wrote (a folder without them loads with a
    warning). Whole or nothing, on every rank: a file that is unreadable, changed or not a
    regular file; ampkit state of another level, dtype or scaler; a missing or mistyped
    entry; an invalid ampkit value; a non-finite model or optimizer value, or an impossible
    one (a negative second moment or step, an optimizer hyperparameter of another type or
    out of range) raises :class:`ampkit.StateError` on every rank before anything is
    changed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from ampkit.errors import AmpError

    from .dcp_files import checkpoint_planner, checkpoint_reader

    had_state = bool(optimizer.state)
    model_sd, optim_sd = _state_dicts(model, optimizer)
    amp = AmpState(defer=True)
    state = {
        "model": map_leaves(model_sd, _copy_leaf, keep_types=True),
        "optim": map_leaves(optim_sd, _copy_leaf, keep_types=True),
        "amp": amp,
    }
    refused: AmpError | None = None
    reader = None
    try:
        reader = checkpoint_reader(str(path))
        metadata = reader.read_metadata()
        amp.expect(metadata)
    except AmpError as err:  # refused on every rank below, before any collective of dcp.load
        refused = err
    if not _any_rank(refused is not None):
        try:
            dcp.load(state, storage_reader=reader, planner=checkpoint_planner())
            _require_sane(state["model"], "model")
            _require_sane(state["optim"], "optimizer state")
            _require_possible_optim(state["optim"], optim_sd)
        except AmpError as err:  # this rank's shards or ampkit's state: refused on every rank below
            refused = err
        except CheckpointException as exc:
            refused = StateError(_first_failure(exc, path))
    if _any_rank(refused is not None):
        if not had_state:
            optimizer.state.clear()  # get_state_dict stepped a fresh optimizer to build its state
        message = _other_rank_refusal(refused)  # a collective: every rank takes part
        raise refused or StateError(message)
    _set_state_dicts(model, optimizer, state["model"], state["optim"])
    amp.apply()


def _other_rank_refusal(refused: Exception | None) -> str:
    """The message of the first rank that refused (every rank gathers them: strings)."""
    import torch.distributed as dist

    messages: list[Any] = [None] * rank_and_world_size()[1]
    if _multi_rank():
        dist.all_gather_object(messages, None if refused is None else str(refused))
    for rank, message in enumerate(messages):
        if isinstance(message, str):
            return f"rank {rank} refused its part of the checkpoint: {message}"
    return "another rank refused its part of the checkpoint (see that rank's error). Nothing was loaded."


def _first_failure(exc: Any, path: Any) -> str:
    """What a ``CheckpointException`` says, one line: ampkit's own refusal as it is, any
    other error with the checkpoint named."""
    from ampkit.errors import AmpError

    for failure in getattr(exc, "failures", {}).values():
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, AmpError):
            return str(error)
        text = str(error).strip().splitlines()
        return (f"the checkpoint {str(path)!r} cannot be loaded: {type(error).__name__}: "
                f"{text[0] if text else ''}. Nothing was loaded.")  # fmt: skip
    return f"the checkpoint {str(path)!r} cannot be loaded: {exc}. Nothing was loaded."


#: Optimizer state entries that are sums of squares (never negative), by torch's names.
_NONNEGATIVE_STATE = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta", "exp_inf", "step", "eta", "mu")
#: Hyperparameters that are never negative (where a param group has them).
_NONNEGATIVE_GROUP = ("lr", "eps", "momentum", "dampening", "alpha", "lr_decay", "initial_accumulator_value",
                      "rho", "lambd", "t0")  # fmt: skip


def _require_possible_optim(loaded: Any, template: Any) -> None:
    """Raise StateError for optimizer values training never produces: a negative second
    moment or step, and param-group values of another type than this optimizer's or out of
    range (a NaN or negative ``lr``, ``betas`` outside [0, 1))."""
    for key, entries in (loaded.get("state") or {}).items():
        for name, value in (entries or {}).items():
            if name in _NONNEGATIVE_STATE and isinstance(value, torch.Tensor) and value.numel():
                local = local_tensor(value)
                if local.numel() and bool((local < 0).any()):
                    raise StateError(
                        f"the checkpoint's optimizer state {key}.{name} holds negative values, which training "
                        "never produces. Nothing was loaded: the checkpoint is corrupt; load an earlier one."
                    )
    for i, (group, mine) in enumerate(zip(loaded.get("param_groups") or [], template.get("param_groups") or [])):
        for name, value in group.items():
            if name == "params" or name not in mine:
                continue
            ref = mine[name]
            where = f"the checkpoint's optimizer param group {i} {name!r}"
            if type(value) is not type(ref) and not (isinstance(ref, (int, float)) and type(value) in (int, float)
                                                      and not isinstance(ref, bool)):  # fmt: skip
                raise StateError(
                    f"{where} is a {type(value).__name__}; this optimizer's is a {type(ref).__name__}. Nothing was "
                    "loaded: the checkpoint was written for another optimizer or was tampered with."
                )
            numbers = [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else (
                list(value) if isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value) else [])
            if not all(math.isfinite(v) for v in numbers):
                raise StateError(f"{where} is {value!r}, not finite. Nothing was loaded.")
            if name in _NONNEGATIVE_GROUP and any(v < 0 for v in numbers):
                raise StateError(f"{where} is {value!r}, negative. Nothing was loaded.")
            if name == "betas" and not all(0 <= v < 1 for v in numbers):
                raise StateError(f"{where} is {value!r}; betas lie in [0, 1). Nothing was loaded.")


def _multi_rank() -> bool:
    """Whether a default process group of more than one rank is up."""
    return rank_and_world_size()[1] > 1


def _device() -> torch.device:
    """Where the default group's collectives take these small tensors."""
    return _comm_device(None, torch.device("cpu"))


def _any_rank(flag: bool) -> bool:
    """``flag`` OR-ed over every rank of the default group (``flag`` alone without one)."""
    import torch.distributed as dist

    if not _multi_rank():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _barrier() -> None:
    import torch.distributed as dist

    if _multi_rank():
        dist.barrier()


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
    """The model's and the optimizer's DCP state dicts (``get_state_dict``); at O2 on an
    unsharded model the optimizer steps fp32 masters the model does not hold, so its state
    is named through :func:`_master_view`."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
    )

    view = _master_view(model, optimizer)
    if view is None:
        return get_state_dict(model, optimizer)
    return get_model_state_dict(model), get_optimizer_state_dict(view, optimizer)


def _set_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_sd: Any, optim_sd: Any) -> None:
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )

    view = _master_view(model, optimizer)
    if view is None:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        return
    set_model_state_dict(model, model_sd)
    set_optimizer_state_dict(view, optimizer, optim_state_dict=optim_sd)


#: Wrappers whose parameter names DCP's state dicts leave out (DDP's, torch.compile's).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def _master_view(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.nn.Module | None:
    """A module holding, under each of ``model``'s parameter names (as DCP names them),
    the tensor ``optimizer`` steps for it: its fp32 master where it has one. None when
    the optimizer steps the model's own parameters."""
    from ampkit.levels.plan import masters_of

    masters = masters_of(optimizer)
    if masters is None:
        return None
    view = torch.nn.Module()
    for name, param in model.named_parameters():
        while name.startswith(_WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        master = masters.master_of(param)
        owner = view
        *path, leaf = name.split(".")
        for part in path:
            if part not in dict(owner.named_children()):
                owner.add_module(part, torch.nn.Module())
            owner = owner.get_submodule(part)
        owner.register_parameter(leaf, master if master is not None else param)
    return view
