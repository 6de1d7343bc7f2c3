"""ampkit's state in ``torch.distributed.checkpoint`` (DCP) checkpoints.

:func:`save_checkpoint` / :func:`load_checkpoint` save and load a (FSDP2-sharded) model,
its optimizer and ampkit's state in one DCP checkpoint folder. Loading is whole or
nothing: DCP reads into copies, every value is checked (ampkit's state as
:func:`ampkit.load_state_dict` checks it; the model's and the optimizer's floating
tensors finite), and only then is anything applied. The copies cost the model's and
the optimizer's size on each rank while loading.

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
buffers, fp8 scales) as tensors only, one entry per value: sharded values (the
compensation of FSDP2's DTensor shards) as DTensors, which DCP reshards when the world
size changes; every other value as a tensor that is the same on every rank. No entry is a
pickled object, so loading ampkit's part of a checkpoint never unpickles (DCP's default
planner reads non-tensor entries with ``torch.load(weights_only=False)``). Loading is
whole or nothing: DCP reads into copies, then :func:`ampkit.load_state_dict` validates
every value before any is applied, and a file DCP cannot read raises before that.
"""

from __future__ import annotations

from typing import Any

import torch

from ampkit._internal.dist import rank_and_world_size
from ampkit._internal.dtypes import local_tensor
from ampkit._internal.tree import map_leaves
from ampkit.errors import StateError

from .core import _comm_device

__all__ = ["AmpState", "load_checkpoint", "save_checkpoint"]

_SEP = "/"


def _flatten(obj: Any, prefix: str, out: dict[str, torch.Tensor], copy: bool = True) -> None:
    """Every leaf of ``obj`` (dicts, lists, tensors, numbers, bools, strings, None) as a
    tensor under its path; strings and None are structure (checked on load, not saved).
    ``copy``: tensors are cloned (default; DCP loads into them: never the live buffers),
    else put in as they are (for reading the entries' names only)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            _flatten(value, f"{prefix}{_SEP}{key}" if prefix else str(key), out, copy)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _flatten(value, f"{prefix}{_SEP}{i}", out, copy)
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
    elif obj is not None and not isinstance(obj, str):
        raise StateError(f"ampkit's state holds a {type(obj).__name__} at {prefix!r}, which AmpState cannot save.")


def _rebuild(template: Any, prefix: str, values: dict[str, Any]) -> Any:
    """``template`` (the current session's state) with each leaf taken from ``values``,
    as the template's type."""
    if isinstance(template, dict):
        return {k: _rebuild(v, f"{prefix}{_SEP}{k}" if prefix else str(k), values) for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(_rebuild(v, f"{prefix}{_SEP}{i}", values) for i, v in enumerate(template))
    if template is None or isinstance(template, str) or prefix.endswith(f"{_SEP}shard_rank"):
        return template
    value = values[prefix]
    if not isinstance(value, torch.Tensor):
        raise StateError(f"ampkit's checkpoint entry {prefix!r} is a {type(value).__name__}, not a tensor.")
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
        _flatten(session_state(), "", out)
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
        missing = sorted(set(expected) - set(state_dict))
        extra = sorted(set(state_dict) - set(expected))
        if missing or extra:
            raise StateError(
                "ampkit's part of the checkpoint does not match this session "
                f"(missing {missing[:4]}, unexpected {extra[:4]}): set up the same levels, optimizers "
                "and param groups as the run that saved it."
            )
        apply = prepare_load_state_dict(_rebuild(template, "", state_dict))
        if self.defer:
            self._pending = apply
        else:
            apply()


def _copy_leaf(leaf: Any) -> Any:
    return leaf.detach().clone() if isinstance(leaf, torch.Tensor) else leaf


def _require_finite(tree: Any, where: str) -> None:
    if isinstance(tree, dict):
        for k, v in tree.items():
            _require_finite(v, f"{where}.{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            _require_finite(v, f"{where}.{i}")
    elif isinstance(tree, torch.Tensor) and tree.is_floating_point():
        local = local_tensor(tree)
        if not bool(torch.isfinite(local).all()):
            raise StateError(
                f"the checkpoint's {where} holds inf/NaN values. Nothing was loaded: the checkpoint is "
                "corrupt or was saved after training diverged; load an earlier one."
            )


def save_checkpoint(path: str | Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Save ``model`` (sharded or not), ``optimizer`` and ampkit's state into the DCP
    checkpoint folder ``path``, on every rank (``dcp.save`` with the state dicts of
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` and :class:`AmpState`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "amp": AmpState()}, checkpoint_id=str(path))


def load_checkpoint(path: str | Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the :func:`save_checkpoint` folder ``path`` into ``model``, ``optimizer`` and
    ampkit's session, on every rank; the world size may differ from the saving run's. Whole or
    nothing: a file DCP cannot read (``CheckpointException``), a missing or mistyped
    entry, an invalid ampkit value or a non-finite model or optimizer value raises
    before anything is changed (:class:`ampkit.StateError` for the last three)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ampkit.errors import AmpError

    model_sd, optim_sd = get_state_dict(model, optimizer)
    amp = AmpState(defer=True)
    state = {
        "model": map_leaves(model_sd, _copy_leaf, keep_types=True),
        "optim": map_leaves(optim_sd, _copy_leaf, keep_types=True),
        "amp": amp,
    }
    refused: AmpError | None = None
    try:
        dcp.load(state, checkpoint_id=str(path))
        _require_finite(state["model"], "model")
        _require_finite(state["optim"], "optimizer state")
    except AmpError as err:  # this rank's shards or ampkit's state: refused on every rank below
        refused = err
    if _any_rank(refused is not None):
        raise refused or StateError(
            "another rank refused its part of the checkpoint (see that rank's error). Nothing was loaded."
        )
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    amp.apply()


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
