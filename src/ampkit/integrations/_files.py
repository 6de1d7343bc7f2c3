"""Reading ampkit's checkpoint files for the integrations: ``torch.load`` with
``weights_only=True`` only (tensors, containers and primitives: a file can never run
code), every way a file can be unreadable turned into the integration's own error."""

from __future__ import annotations

import os
import pickle
import zipfile
from typing import Any

import torch

from ampkit.errors import AmpError

__all__ = ["read_checkpoint_file"]


def read_checkpoint_file(path: str | os.PathLike[str], error: type[AmpError], map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)``; a missing, truncated, empty or not
    weights-only file raises ``error`` naming the path and the cause (nothing else of
    the checkpoint has been touched by then)."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise error(f"{os.fspath(path)} does not exist.") from None
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise error(
            f"{os.fspath(path)} cannot be read as weights only (torch.load(weights_only=True)): {first}. "
            "ampkit never unpickles its files fully: a file that needs it was not written by ampkit, "
            "or was tampered with."
        ) from None
    except (OSError, EOFError, RuntimeError, ValueError, zipfile.BadZipFile, KeyError) as exc:
        raise error(
            f"{os.fspath(path)} is not a readable checkpoint file ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else 'truncated or empty'}); "
            "it may be truncated (an interrupted save) or another file. Resume from an earlier checkpoint."
        ) from None
