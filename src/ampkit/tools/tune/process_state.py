"""What the tuner leaves of the process: nothing a user can observe. Its measurements and
probes draw random numbers and open ampkit scopes, which install ampkit's global module
hooks and its optimizer step hook; :func:`as_found` puts the random streams (torch's,
CUDA's, Python's, numpy's) and those global hooks back as they were."""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator

import torch

from ampkit.casting.engine import active_scopes, module_hooks, remove_step_hook, step_hook_installed

__all__ = ["as_found"]


@contextlib.contextmanager
def as_found() -> Iterator[None]:
    """Run the block, then restore the random streams and remove the global hooks it
    installed, however it ends. Hooks that were installed before it stay: another
    scope of the process relies on them. ampkit's own removal waits for the process's
    only thread (:func:`ampkit.reset`); here none is needed, as hooks absent when the
    tuner started mean no thread was in an ampkit scope, and the tuner's have closed."""
    hooks_before, step_hook_before = module_hooks.installed(), step_hook_installed()
    python_state = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    try:
        with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if cuda else []):
            yield
    finally:
        random.setstate(python_state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)
        if not hooks_before and not active_scopes():
            module_hooks.remove()
        if not step_hook_before:
            remove_step_hook()
