"""The code dynamo compiled: its cache entries and their guard code (read for the
autocast state they were compiled under), and resetting it."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import torch


def autocast_device_index(device_type: str) -> int:
    """The position of ``device_type`` in the ``enabled`` list of the autocast state
    that dynamo's global-state guard prints (``torch._C._autocast_supported_devices()``
    order)."""
    return torch._C._autocast_supported_devices().index(device_type)


def compiled_frames_ok() -> bool:
    """Whether dynamo has compiled any frame in this process
    (``torch._dynamo.utils.counters["frames"]["ok"]``); False if dynamo is not loaded."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils is not None and bool(utils.counters["frames"].get("ok"))


def dynamo_compile_lock() -> Any:
    """``torch._dynamo.convert_frame.compile_lock``: held while dynamo compiles a frame;
    hold it to read or reset its code cache."""
    from torch._dynamo.convert_frame import compile_lock

    return compile_lock


def reset_compiled_code(code: Any) -> None:
    """Drop the compiled code dynamo keeps for ``code`` (compiled anew on its next call;
    ``torch._C._dynamo.eval_frame.reset_code``)."""
    from torch._C._dynamo.eval_frame import reset_code as _reset_code

    _reset_code(code)


def compiled_code_entries() -> Iterator[tuple[Any, list[list[str]]]]:
    """Each code object dynamo compiled, with the guard code of each of its cache
    entries (``input_codes.seen``, ``_debug_get_cache_entry_list``,
    ``entry.guard_manager.code_parts``). Raises if dynamo's cache layout changed."""
    from torch._dynamo.convert_frame import input_codes
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    for ref in list(input_codes.seen):
        code = ref()
        if code is not None:
            yield code, [_entry_guard_parts(entry) for entry in _debug_get_cache_entry_list(code)]


def _entry_guard_parts(entry: Any) -> list[str]:
    """One cache entry's guard code. Before torch 2.11 dynamo prints its global-state guard
    as a bare ``___check_global_state()``, without the state it compares against; that
    part is then completed with the autocast ``enabled`` list asked of the guard itself
    (:func:`_probe_autocast_enabled`), so that :func:`global_autocast_enabled_in_guard`
    reads every release alike."""
    parts = list(entry.guard_manager.code_parts)
    if any(_GLOBAL_STATE in p for p in parts) or _BARE_GLOBAL_STATE not in parts:
        return parts
    for leaf in entry.guard_manager.root.get_leaf_guards():
        if type(leaf).__name__ == "GLOBAL_STATE":
            enabled = [_probe_autocast_enabled(leaf, d) for d in torch._C._autocast_supported_devices()]
            parts.append(_GLOBAL_STATE + json.dumps({"autocast_state": {"enabled": enabled}}))
            break
    return parts


def _probe_autocast_enabled(leaf: Any, device_type: str) -> bool:
    """Whether a global-state guard (``torch._C._dynamo.guards.GLOBAL_STATE``) may have
    been taken with autocast on ``device_type`` enabled: the guard is checked with that
    device's autocast switched off and everything else as it is now; it passes, or fails
    naming no autocast change, only if the guarded code was traced with it off. Any
    other answer counts as enabled (the caller then recompiles that code: safe)."""
    was = torch.is_autocast_enabled(device_type)
    torch.set_autocast_enabled(device_type, False)
    try:
        result = leaf.check_verbose(None)
    finally:
        torch.set_autocast_enabled(device_type, was)
    return not result.result and any("autocast" in p for p in result.verbose_code_parts)


_GLOBAL_STATE = "___check_global_state() against "
_BARE_GLOBAL_STATE = "___check_global_state()"


def global_autocast_enabled_in_guard(parts: list[str], device_type: str) -> bool | None:
    """From one cache entry's guard code: whether it was compiled with autocast on
    ``device_type`` enabled (dynamo's global-state guard prints the state as JSON after
    ``___check_global_state() against``), or None if the entry has no such guard."""
    states = [json.loads(p[p.index(_GLOBAL_STATE) + len(_GLOBAL_STATE):]) for p in parts if _GLOBAL_STATE in p]
    if not states:
        return None
    return bool(states[0]["autocast_state"]["enabled"][autocast_device_index(device_type)])


def guards_name(parts: list[str], text: str) -> bool:
    """Whether one cache entry's guard code mentions ``text`` (``"_state.compile_key"``:
    the entry is guarded on ampkit's scopes)."""
    return any(text in part for part in parts)
