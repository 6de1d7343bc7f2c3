"""The fp8 layers of one ``initialize``: chosen (:func:`plan`), converted (:func:`activate`),
their scales saved and loaded, listed for reports (:func:`layers`), switched back on reset."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from ampkit._internal import registry as _reset
from ampkit._internal import torch_compat
from ampkit._internal.validate import (
    require_fields,
)
from ampkit._internal.where import user_stacklevel
from ampkit.errors import StateError

from .layer import _CONVERTED, _STATE_ATTR, Float8Linear
from .recipe import _WARNED_MARGINS, E4M3, ROLES, Fp8Recipe
from .scales import LayerState


class Fp8Training:
    """The fp8 layers of one ``initialize``: converts them, saves and loads their scales
    (``amp.state_dict()["extra"]["fp8"]``), lists them for reports."""

    def __init__(self, recipe: Fp8Recipe, chosen: Sequence[tuple[str, nn.Linear]]) -> None:
        self.recipe = recipe
        self.layers: dict[str, tuple[weakref.ref[nn.Linear], LayerState]] = {}
        for name, module in chosen:
            state = LayerState(name, recipe)
            dev = module.weight.device
            for s in state.roles.values():
                s.to(dev)
            self.layers[name] = (weakref.ref(module), state)

    def apply(self) -> None:
        for ref, state in self.layers.values():
            module = ref()
            if module is not None:
                module.__dict__[_STATE_ATTR] = state
                torch_compat.swap_module_class(module, Float8Linear)
                _CONVERTED.add(module)

    def state_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe.describe(),
            "layers": {n: st.state_dict() for n, (_, st) in self.layers.items()},
        }

    def check_state_dict(self, sd: Any) -> None:
        """Raise :class:`~ampkit.StateError` unless ``sd`` is a :meth:`state_dict` of
        the same recipe and layers whose every role passes
        :meth:`TensorScale.check_state_dict`."""
        require_fields(sd, ("recipe", "layers"), "the checkpoint's fp8 state", StateError)
        if not isinstance(sd["layers"], dict):
            raise StateError("the checkpoint's fp8 state is not a dict from amp.state_dict().")
        if type(sd["recipe"]) is not str or sd["recipe"] != self.recipe.describe():
            raise StateError(
                f"the checkpoint was saved with the fp8 recipe {sd.get('recipe')!r}, this run uses "
                f"{self.recipe.describe()!r}; initialize with the same Fp8Recipe."
            )
        if set(sd["layers"]) != set(self.layers):
            raise StateError(
                f"the checkpoint's fp8 layers {sorted(sd['layers'])} differ from this run's "
                f"{sorted(self.layers)}; initialize the same model with the same Fp8Recipe."
            )
        for name, (_, st) in self.layers.items():
            roles = require_fields(sd["layers"][name], ROLES, f"fp8 layer {name!r}", StateError)
            for role, scale in st.roles.items():
                fp8 = st.recipe.grad_dtype if role == "grad_output" else E4M3
                scale.check_state_dict(roles[role], f"fp8 layer {name!r} {role}", st.recipe, fp8)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for name, (_, st) in self.layers.items():
            for role, scale in st.roles.items():
                scale.load_state_dict(sd["layers"][name][role])

    def info(self) -> list[Fp8LayerInfo]:
        out = []
        for name, (ref, st) in self.layers.items():
            module = ref()
            shape = (module.out_features, module.in_features) if module is not None else (0, 0)
            r = st.roles
            out.append(
                Fp8LayerInfo(
                    name=name,
                    shape=shape,
                    recipe=st.recipe.describe(),
                    calls=r["input"].calls,
                    scales={k: float(v.scale) for k, v in r.items()},
                    amax={k: float(v.amax) for k, v in r.items()},
                    saturated={k: int(v.saturated) for k, v in r.items()},
                )
            )
        return out


@dataclasses.dataclass(frozen=True)
class Fp8LayerInfo:
    """One fp8 linear as reports show it: its qualified ``name``, ``(out, in)``
    ``shape``, ``recipe``, forward ``calls`` seen, and per role (input, weight,
    grad_output) the last scale (``scales``), the last abs-max (``amax``) and the casts
    that saturated (``saturated``). Rowwise recipes keep no
    per-tensor scale (their entries stay 1.0 / 0.0; ``explain`` shows their ranges)."""

    name: str
    shape: tuple[int, int]
    recipe: str
    calls: int
    scales: dict[str, float]
    amax: dict[str, float]
    saturated: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: The fp8 setup of the current ``initialize`` (read by ``amp.state_dict``, ``layers``,
#: ``explain`` and the doctor). Process-wide like the AMP session it belongs to
#: (``session.py``); ``_unconvert`` drops it on reset and the next ``initialize``.
class _Current:
    training: Fp8Training | None = None


_CURRENT = _Current()


def _switch_back(module: nn.Module) -> None:
    """One converted layer back to a plain ``nn.Linear`` without its fp8 state."""
    if type(module) is Float8Linear:
        torch_compat.swap_module_class(module, nn.Linear)
    module.__dict__.pop(_STATE_ATTR, None)


@_reset.on_reset
def _unconvert() -> None:
    """Back to plain ``nn.Linear`` on reset / the next ``initialize``."""
    for module in list(_CONVERTED):
        _switch_back(module)
    _CONVERTED.clear()
    _CURRENT.training = None
    _WARNED_MARGINS.clear()


def plan(
    recipe: Fp8Recipe, models: Sequence[nn.Module], skip: Sequence[nn.Module] = ()
) -> Fp8Training:
    """Choose the layers of ``models`` (validated, nothing changed yet), leaving out the
    modules in ``skip`` (those the level keeps fp32); names are prefixed ``"{i}."`` when
    there are several models."""
    chosen: list[tuple[str, nn.Linear]] = []
    skipped = {id(m) for m in skip}
    for i, model in enumerate(models):
        for name, m in recipe.choose(model):
            if id(m) not in skipped:
                chosen.append((f"{i}.{name}" if len(models) > 1 else name, m))
    if not chosen:
        warnings.warn(
            "ampkit fp8: the recipe chose no nn.Linear (by default it skips the first and last linear, "
            f"linears narrower than min_features={recipe.min_features} and sizes not divisible by "
            "16); lower Fp8Recipe.min_features or pass module_filter.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    return Fp8Training(recipe, chosen)


def activate(training: Fp8Training) -> None:
    """Convert the planned layers and make ``training`` the current one (after reset)."""
    training.apply()
    _CURRENT.training = training


@contextlib.contextmanager
def converted(recipe: Fp8Recipe, chosen: Sequence[tuple[str, nn.Linear]]) -> Iterator[Fp8Training]:
    """The ``chosen`` linears in fp8 inside the block, with fresh scales, outside any
    session (not :func:`current`; ``amp.state_dict`` does not see them); switched back
    to ``nn.Linear`` after. For measuring a layer in fp8 (``ampkit.tune``)."""
    training = Fp8Training(recipe, chosen)
    training.apply()
    try:
        yield training
    finally:
        for ref, _state in training.layers.values():
            module = ref()
            if module is not None:
                _switch_back(module)
                _CONVERTED.discard(module)


def current() -> Fp8Training | None:
    """The fp8 setup of the current ``initialize`` (None without ``fp8=``)."""
    return _CURRENT.training


def layers() -> list[Fp8LayerInfo]:
    """The current session's fp8 linears, with their last scales and abs-maxes."""
    t = _CURRENT.training
    return t.info() if t is not None else []
