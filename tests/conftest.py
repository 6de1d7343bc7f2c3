"""Shared test setup: one thread per process (the CI box has 2 cores), a clean
ampkit global state around every test, and the `cuda` marker skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_ampkit_state():
    """Undo any process-wide ampkit state a test left behind (amp.init, sessions)."""
    yield
    import ampkit

    reset = getattr(ampkit, "reset", None)
    if reset is not None:
        reset()
