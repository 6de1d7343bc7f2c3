"""The running torch release and what it can do: the one constant version branches
test, and the CPU's 16-bit instructions."""

from __future__ import annotations

import functools
import logging

import torch


def release_of(version: str) -> tuple[int, int]:
    """``"2.11.0+cu130"`` -> ``(2, 11)``; ``"2.16.0a0+git1234"`` -> ``(2, 16)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


TORCH_RELEASE: tuple[int, int] = release_of(torch.__version__)
"""``(major, minor)`` of the running torch (``"2.11.0+cu130"`` -> ``(2, 11)``)."""

GRAPH_AUTOCAST_SWITCHES: bool = TORCH_RELEASE >= (2, 12)
"""Whether dynamo records ``torch.set_autocast_enabled``/``set_autocast_dtype`` in a graph
(from torch 2.12; before, each call is a graph break and runs eagerly)."""

@functools.cache  # once per process (``warn_no_graph_switches.cache_clear()`` re-arms it)
def warn_no_graph_switches() -> None:
    """Called at trace time where :data:`GRAPH_AUTOCAST_SWITCHES` is False: a module rule or
    a cast model's scope inside compiled code then breaks the graph at each autocast
    switch (the switch runs eagerly between graphs; the dtypes are eager mode's). Warns
    once per process."""
    logging.getLogger("ampkit").warning(
        "ampkit: torch %s cannot switch autocast inside a compiled graph (torch.compile of torch 2.12 "
        "and newer can): each module rule and fp32-kept module of a cast model breaks the graph "
        "where it starts and ends. The layers compute in the dtypes of eager mode; the breaks cost "
        "speed. Use torch >= 2.12 for one graph.",
        torch.__version__,
    )


def cpu_has_native_16bit(dtype: torch.dtype) -> bool | None:
    """Whether the CPU computes ``dtype`` (bf16: AVX-512-bf16 or AMX tiles; fp16:
    AMX-FP16) natively (``torch.cpu._is_avx512_bf16_supported`` and friends), or None
    when this torch cannot tell."""
    cpu = torch.cpu
    try:
        if dtype == torch.bfloat16:
            return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())
        return bool(cpu._is_amx_fp16_supported())
    except AttributeError:
        return None
