"""A per-layer precision plan as data: which modules run in 16 bits and which stay fp32,
with the measurements behind each choice; saved and loaded as JSON (validated before
anything is built from it) and turned into the :class:`ampkit.Policy` that applies it.

The plan is the tuner's output (:func:`ampkit.tools.tune.tune`); see the tuning guide
(``docs/guides/tuning.md``) for how it is measured."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ampkit._internal.dtypes import DTYPES_BY_NAME as DTYPES
from ampkit._internal.files import check_target, read_json, write_file, write_text
from ampkit.casting.lists import DEFAULT_LISTS
from ampkit.casting.policy import Policy, exact_name
from ampkit.errors import AmpError

__all__ = ["FP8", "ModuleChoice", "PlanError", "TunePlan"]

#: A module's dtype in a plan: a name of ``DTYPES`` (fp32, bf16, fp16), or ``"fp8"`` for a linear whose
#: matmuls run in fp8 (its output in the plan's 16-bit dtype).
FP8 = "fp8"
FORMAT = "ampkit-tune-plan"
VERSION = 1
#: The largest plan file :meth:`TunePlan.load` reads: 16 MiB (a plan of a few hundred
#: modules is tens of kilobytes).
PLAN_READ_LIMIT = 16 << 20


class PlanError(AmpError, ValueError):
    """A tuning plan that cannot be used: a file that is not a plan, a field of the wrong
    type, a dtype name ampkit does not know, a module name the model does not have."""


@dataclasses.dataclass(frozen=True)
class ModuleChoice:
    """One tuned module.

    Attributes:
        name: its qualified name in the tuned model (``"blocks.0.attn.qkv"``).
        kind: its class name (``"Linear"``).
        dtype: ``"fp32"`` (kept wide), the plan's 16-bit dtype (``"bf16"``/``"fp16"``), or
            ``"fp8"`` (an ``nn.Linear`` whose matmuls run in fp8, output in the plan's dtype).
        fp32_ms: forward + backward time of the module alone in fp32, milliseconds.
        low_ms: the same in the lowered dtype: ``dtype``'s when the module is lowered, the
            plan's 16-bit dtype's when it is kept fp32 (NaN where not measured).
        loss_deviation: relative change of the loss, against fp32, when only this module
            runs lowered (in ``dtype``, or the plan's 16-bit dtype when kept; mean over the
            calibration batches; inf where non-finite).
        grad_deviation: relative change of the whole gradient (L2 norm) in the same run.
        reason: why this dtype, in words.
    """

    name: str
    kind: str
    dtype: str
    fp32_ms: float
    low_ms: float
    loss_deviation: float
    grad_deviation: float
    reason: str

    @property
    def saved_ms(self) -> float:
        """Time saved per step by running this module lowered (negative: slower)."""
        return self.fp32_ms - self.low_ms if math.isfinite(self.low_ms) else 0.0


@dataclasses.dataclass(frozen=True)
class TunePlan:
    """The tuner's plan: every measured module with its dtype and why, the probe that
    confirmed it, and what the tuning cost.

    Attributes:
        dtype: the 16-bit dtype of the lowered modules (``"bf16"``/``"fp16"``; ``"fp32"``
            when no 16-bit dtype was tried).
        level: the opt level to run the plan at, the fastest the probe found within the
            budget: ``"O1"``, ``"O2"`` or ``"O2K"`` (kept modules pinned by a module rule,
            and at O2/O2K by ``keep_fp32``), or ``"O0"`` when nothing is lowered (fp32
            throughout, without the casting machinery's per-op cost); checked against
            the levels where the plan is used (``initialize``, the integrations,
            ``ampkit run``).
        device_type: where it was measured (``"cpu"``, ``"cuda"``).
        budget: the allowed relative deviation of the final training loss from fp32's.
        modules: one :class:`ModuleChoice` per candidate module, in model order.
        skipped: candidate dtypes not tried, each with why (``{"fp8": "..."}``).
        predicted_deviation: the sum of the lowered modules' loss deviations.
        probe: the confirming training runs: ``steps``; ``fp32_loss``/``fp32_ms``;
            ``plan_loss``/``plan_ms``/``deviation`` at :attr:`level`; ``O1_ms``,
            ``O2_ms``, ``O2K_ms`` (and ``_loss``) for the module plan at each level tried,
            ``all_O1_ms``... for everything lowered (chosen where it was faster within the
            budget); and ``uniform_loss``/``uniform_deviation`` (everything lowered at O1). Losses are
            means over the last quarter of steps, step times medians; a deviation is how
            much *worse* than fp32's the loss is, relative (a lower loss spends nothing).
        backed_off: modules lowered at first and put back to fp32 because the probe
            exceeded the budget, in that order.
        seconds: the tuner's own wall time.
        machine: torch version, device name and the CPU flags that decide 16-bit speed.
    """

    dtype: str
    level: str
    device_type: str
    budget: float
    modules: tuple[ModuleChoice, ...]
    skipped: dict[str, str]
    predicted_deviation: float
    probe: dict[str, float]
    backed_off: tuple[str, ...]
    seconds: float
    machine: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def lowered(self) -> list[str]:
        """Names of the modules the plan runs in 16 bits."""
        return [m.name for m in self.modules if m.dtype != "fp32"]

    @property
    def fp8(self) -> list[str]:
        """Names of the linears the plan runs in fp8 (a subset of :attr:`lowered`)."""
        return [m.name for m in self.modules if m.dtype == FP8]

    @property
    def kept_fp32(self) -> list[str]:
        """Names of the modules the plan keeps in fp32."""
        return [m.name for m in self.modules if m.dtype == "fp32"]

    @property
    def keep_fp32(self) -> list[str]:
        """``initialize``'s ``keep_fp32`` for the plan, which it applies at the levels that
        cast the model (their weights stay fp32 too): the kept modules, each name matched
        exactly, never as a glob (:func:`ampkit.casting.policy.exact_name`: ``"a[0]"`` is
        ``"a[[]0]"``)."""
        return [exact_name(n) for n in self.kept_fp32]

    def policy(self, base: Policy | None = None) -> Policy:
        """The :class:`ampkit.Policy` that applies the plan's module choices: ``base``
        (default: the device's default lists in the plan's dtype) with a module rule
        pinning each kept module to fp32 by its exact name (never a glob: a module named
        ``"x*"`` pins that module alone). ``initialize(..., plan=)`` and
        ``ampkit.init(plan=)`` use it; with ``ampkit.autocast(plan.policy())`` the level's
        other settings are yours. Names are relative to the outermost module called, as
        when the plan was tuned. The fp8 linears (:attr:`fp8`) run in the plan's 16-bit
        dtype under this policy alone: converting them is ``initialize``'s."""
        rules = {exact_name(name): torch.float32 for name in self.kept_fp32}
        if base is None:
            return Policy(dtype=DTYPES[self.dtype] if self.dtype != "fp32" else torch.bfloat16, module_rules=rules)
        return base.override(module_rules=rules)

    def check_model(self, model: torch.nn.Module | Sequence[torch.nn.Module]) -> None:
        """Raise :class:`PlanError` if a module the plan names is not in ``model`` (or in
        any model of a list)."""
        one = isinstance(model, torch.nn.Module)
        models = [model] if one else list(model)
        names = {n for m in models for n, _ in m.named_modules()}
        missing = [m.name for m in self.modules if m.name not in names]
        if missing:
            which = "this model does not" if one else "these models do not"
            raise PlanError(f"the plan names modules {which} have: {missing[:5]}"
                            f"{' ...' if len(missing) > 5 else ''}; tune this model again.")  # fmt: skip

    def compute_dtype(self, dtype: torch.dtype | None, owner: str = "") -> torch.dtype | None:
        """The dtype to compute in with this plan given the caller's ``dtype`` (None: not
        given): the plan's 16-bit dtype where it lowers modules (:class:`PlanError` if
        ``dtype`` is another), else ``dtype`` as given. ``owner`` prefixes the message."""
        if not self.lowered:
            return dtype
        low = DTYPES[self.dtype]
        if dtype is not None and dtype != low:
            raise PlanError(f"{owner}{': ' if owner else ''}the plan lowers modules to {self.dtype}, and "
                            f"dtype={dtype} was passed; drop dtype, or tune again for that dtype.")  # fmt: skip
        return low

    @classmethod
    def coerce(cls, plan: Any, owner: str = "plan") -> TunePlan:
        """``plan`` itself, or the plan saved at a path (str or ``os.PathLike``);
        :class:`PlanError` for anything else (``owner`` names the argument)."""
        if isinstance(plan, TunePlan):
            return plan
        if not isinstance(plan, (str, os.PathLike)):
            raise PlanError(f"{owner} takes an ampkit.TunePlan or the path of a saved one, got {type(plan).__name__}.")
        return cls.load(plan)

    def report(self) -> str:
        """A plain-text table: each module's dtype, time share, deviations and why."""
        total = sum(m.fp32_ms for m in self.modules if math.isfinite(m.fp32_ms)) or 1.0
        rows = [f"{'module':32} {'kind':14} {'dtype':5} {'fp32 ms':>8} {'low ms':>8} {'time %':>6} "
                f"{'loss dev':>9} {'grad dev':>9}  why"]  # fmt: skip
        for m in self.modules:
            rows.append(f"{m.name[:32]:32} {m.kind[:14]:14} {m.dtype:5} {m.fp32_ms:8.3f} {m.low_ms:8.3f} "
                        f"{100 * m.fp32_ms / total:6.1f} {m.loss_deviation:9.2e} {m.grad_deviation:9.2e}  {m.reason}")  # fmt: skip
        p = self.probe
        fp8 = f" ({len(self.fp8)} linear(s) in fp8)" if self.fp8 else ""
        rows.append(f"plan: {len(self.lowered)} of {len(self.modules)} modules in {self.dtype}{fp8} at {self.level}; "
                    f"{p.get('plan_ms', math.nan):.2f} ms a step against fp32's {p.get('fp32_ms', math.nan):.2f} ms; "
                    f"predicted deviation "
                    f"{self.predicted_deviation:.2e}, probe {p.get('deviation', math.nan):.2e} "
                    f"(everything lowered: {p.get('uniform_deviation', math.nan):.2e}), budget {self.budget:.2e}; "
                    f"tuned in {self.seconds:.1f} s")  # fmt: skip
        for dtype, why in self.skipped.items():
            rows.append(f"not tried: {dtype}: {why}")
        if self.backed_off:
            rows.append(f"put back to fp32 after the probe: {', '.join(self.backed_off)}")
        return "\n".join(rows)

    def save_png(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`figure` as a PNG. Needs matplotlib (``pip install -e '.[cli]'``).
        Raises :class:`ampkit.OutputPathError` before drawing when ``path`` cannot be
        written (a folder, a symlink, a FIFO or device, a missing or read-only folder)."""
        what = "the tuning plan's plot"
        target = check_target(path, what)
        import matplotlib.pyplot as plt

        fig = self.figure()
        try:
            write_file(target, lambda f: fig.savefig(f, dpi=100, format="png"), what)
        finally:
            plt.close(fig)
        return target

    def figure(self) -> Any:
        """The plan as a matplotlib figure (what :meth:`save_png` writes; close it with
        ``matplotlib.pyplot.close``). Left, per module, its forward + backward time in
        fp32 and in 16 bits, each 16-bit bar labelled by what the plan did: lowered (to
        the plan's dtype, or to fp8) or kept fp32 (the 16-bit time was measured, not
        used). Right, its loss deviation with only it lowered, on a log axis from a floor
        the axis label states: a deviation of exactly 0 is written "0" at the floor (no
        bar), an infinite one "inf" across the axis, one not measured (NaN, a plan by
        hand) "not measured"; the budget is a red line. The
        legend sits below both axes, over no bar. Uses matplotlib's Agg backend when
        none was chosen."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        mods = list(self.modules)[::-1]
        y = list(range(len(mods)))
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, max(3.0, 0.35 * len(mods) + 2.0)), sharey=True)
        ax1.barh([i + 0.2 for i in y], [m.fp32_ms for m in mods], height=0.4, color="lightgray", label="fp32 time")
        low = self.dtype if self.dtype != "fp32" else "16-bit"
        kinds = (("lowered", f"{low} time: lowered to {low}", "tab:blue", ""),
                 (FP8, "fp8 time: lowered to fp8", "tab:orange", ""),
                 ("fp32", f"{low} time (measured): kept fp32", "white", "//"))  # fmt: skip
        for kind, label, colour, hatch in kinds:
            rows = [i for i, m in zip(y, mods) if _plot_kind(m.dtype) == kind]
            if rows:
                ax1.barh([i - 0.2 for i in rows], [_finite(mods[i].low_ms) for i in rows], height=0.4, color=colour,
                         edgecolor="tab:gray", hatch=hatch, label=label)  # fmt: skip
        ax1.set_yticks(y, [f"{m.name} ({m.kind})" for m in mods])
        ax1.set_xlabel("forward + backward alone, ms")
        _deviation_axis(ax2, mods, self.budget, [_plot_kind(m.dtype) for m in mods])
        fp8 = f" ({len(self.fp8)} in fp8)" if self.fp8 else ""
        fig.suptitle(f"ampkit.tune: {len(self.lowered)} of {len(self.modules)} modules in {self.dtype}{fp8} at {self.level}")
        handles = [h for ax in (ax1, ax2) for h in ax.get_legend_handles_labels()[0]]
        legend = fig.legend(handles, [h.get_label() for h in handles], loc="lower center", ncol=3, fontsize=9,
                            bbox_to_anchor=(0.5, 0.0), frameon=False)  # fmt: skip
        fig.canvas.draw()  # the legend's height decides the room the axes leave below them
        height = legend.get_window_extent().height / fig.bbox.height
        fig.tight_layout(rect=(0.0, height + 0.01, 1.0, 1.0))
        return fig

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON types (non-finite numbers as strings)."""
        out = dataclasses.asdict(self)
        out["modules"] = [{k: _num(v) for k, v in m.items()} for m in out["modules"]]
        out["probe"] = {k: _num(v) for k, v in out["probe"].items()}
        out["predicted_deviation"] = _num(out["predicted_deviation"])
        out["backed_off"] = list(self.backed_off)
        return {"format": FORMAT, "version": VERSION, **out}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON to ``path`` (replaced whole: a partial file is never left);
        :class:`ampkit.OutputPathError` when ``path`` is not a regular file's name (a folder,
        a symlink, a FIFO or device) or its folder is missing or read-only."""
        write_text(path, json.dumps(self.to_dict(), indent=1), "the tuning plan")

    @classmethod
    def by_hand(cls, lowered: list[str], kept_fp32: list[str], *, dtype: str = "bf16", level: str = "O1",
                device_type: str = "cpu", fp8: Sequence[str] = ()) -> TunePlan:  # fmt: skip
        """A plan written by hand: the modules named in ``lowered`` run in ``dtype``
        (``"bf16"`` default, or ``"fp16"``), the linears named in ``fp8`` in fp8 (default:
        none), those in ``kept_fp32`` stay fp32, at ``level`` (``"O1"`` default, ``"O2"``,
        ``"O2K"``; ``"O0"`` when nothing is lowered), for ``device_type`` (``"cpu"``
        default). Nothing is measured: times and deviations are NaN, the budget 0.
        Checked like a loaded plan (:class:`PlanError`)."""
        def entry(name: str, dt: str) -> dict[str, Any]:
            return {"name": name, "kind": "", "dtype": dt, "fp32_ms": "nan", "low_ms": "nan",
                    "loss_deviation": "nan", "grad_deviation": "nan", "reason": "set by hand"}  # fmt: skip

        if isinstance(fp8, str) or not all(isinstance(n, str) for n in [*lowered, *kept_fp32, *fp8]):
            raise PlanError("by_hand takes lists of module names (strings).")
        return cls.from_dict({
            "format": FORMAT, "version": VERSION, "dtype": dtype, "level": level, "device_type": device_type,
            "budget": 0.0, "modules": [entry(n, dtype) for n in lowered] + [entry(n, FP8) for n in fp8]
            + [entry(n, "fp32") for n in kept_fp32],
            "skipped": {}, "predicted_deviation": 0.0, "probe": {}, "backed_off": [], "seconds": 0.0,
        })  # fmt: skip

    @classmethod
    def from_dict(cls, doc: Any) -> TunePlan:
        """The plan ``doc`` describes (as :meth:`to_dict` writes it); :class:`PlanError`
        naming the first field that is wrong (every field's type is checked)."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise PlanError(f"not an ampkit tuning plan (no \"format\": \"{FORMAT}\"); write one with ampkit.tune.")
        if type(doc.get("version")) is not int or doc["version"] != VERSION:  # 1.0 or true is not the integer 1
            raise PlanError(f"tuning plan version {_shown(doc.get('version'))}: this ampkit reads version {VERSION}.")
        try:
            modules = tuple(_choice(m) for m in _field(doc, "modules", list))
            plan = cls(
                dtype=_one_of(_field(doc, "dtype", str), "dtype", DTYPES),
                level=_field(doc, "level", str),  # what it means is the levels' to check (ampkit.levels)
                device_type=_one_of(_field(doc, "device_type", str), "device_type", DEFAULT_LISTS),
                budget=_at_least_zero(_field(doc, "budget", (int, float)), "budget", "a relative loss deviation"),
                modules=modules,
                skipped=_names_to(_field(doc, "skipped", dict), "skipped", _text),
                predicted_deviation=_number(doc.get("predicted_deviation"), "predicted_deviation"),
                probe=_names_to(_field(doc, "probe", dict), "probe", _number),
                backed_off=tuple(_text(x, "an entry of backed_off") for x in _field(doc, "backed_off", list)),
                seconds=_at_least_zero(_field(doc, "seconds", (int, float)), "seconds", "the tuner's wall time"),
                machine=_machine(doc.get("machine")),
            )
        except RecursionError:
            raise PlanError("tuning plan: a field is nested too deeply to be a plan ampkit wrote.") from None
        except (TypeError, KeyError) as exc:
            raise PlanError(f"tuning plan: {_shown(str(exc))[1:-1]}") from None
        if len({m.name for m in modules}) != len(modules):
            raise PlanError("tuning plan: a module is named twice.")
        bad = [m.name for m in modules if m.dtype not in ("fp32", plan.dtype, FP8)]
        if bad:
            raise PlanError(f"tuning plan: modules {bad[:3]} are in neither fp32, fp8 nor the plan's {plan.dtype}.")
        if plan.fp8 and plan.dtype == "fp32":
            raise PlanError("tuning plan: fp8 linears need a 16-bit dtype for their outputs and the rest of the "
                            "model; the plan's dtype is fp32.")  # fmt: skip
        return plan

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TunePlan:
        """Read the plan :meth:`save` wrote to ``path``; :class:`PlanError` for a missing,
        unreadable, truncated or malformed file, and for anything that is not a regular
        file of at most ``PLAN_READ_LIMIT`` bytes (16 MiB; a FIFO or ``/dev/zero`` is
        refused without being read)."""
        return cls.from_dict(read_json(path, "the tuning plan", PlanError, PLAN_READ_LIMIT))


def _num(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else repr(value)


def _shown(value: Any) -> str:
    """``repr(value)``, cut to 60 characters (a field's value in a one-line message)."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"a deeply nested {type(value).__name__}"
    return text if len(text) <= 60 else f"{text[:57]}..."


def _number(value: Any, name: str) -> float:
    if isinstance(value, str) and value in ("inf", "nan", "-inf"):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanError(f"tuning plan: {name} is {_shown(value)}, not a number.")
    try:
        return float(value)
    except OverflowError:  # an integer past float's range
        raise PlanError(f"tuning plan: {name} is {_shown(value)}, past a float's range.") from None


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise PlanError(f"tuning plan: {name} is {_shown(value)}, not a string.")
    return value


def _names_to(doc: dict, name: str, check: Callable[[Any, str], Any]) -> dict[str, Any]:
    """``doc`` (a plan's object field ``name``) with each value ``check(value, where)``ed;
    its keys must be strings."""
    out = {}
    for key, value in doc.items():
        out[_text(key, f"a key of {name}")] = check(value, f"{name}[{_shown(key)}]")
    return out


def _machine_value(value: Any, name: str) -> Any:
    """One entry of a plan's ``machine`` record: a string, number, bool or null, or a
    list of those (``cpu_flags``)."""
    scalar = (str, int, float, bool, type(None))
    if isinstance(value, scalar) or (isinstance(value, list) and all(isinstance(v, scalar) for v in value)):
        return list(value) if isinstance(value, list) else value
    raise PlanError(f"tuning plan: {name} is {_shown(value)}; a machine entry is a string, a number or a list of them.")


def _machine(value: Any) -> dict[str, Any]:
    """A plan's ``machine`` record (absent or null: empty)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PlanError(f"tuning plan: machine is {_shown(value)}, not an object (torch version, device, CPU flags).")
    return _names_to(value, "machine", _machine_value)


def _field(doc: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in doc:
        raise PlanError(f"tuning plan: the field {name!r} is missing.")
    value = doc[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        wanted = "a number" if kind == (int, float) else getattr(kind, "__name__", kind)
        raise PlanError(f"tuning plan: {name} is {type(value).__name__}, not {wanted}.")
    return value


def _at_least_zero(value: int | float, name: str, what: str) -> float:
    """A plan's ``budget`` or ``seconds``: a finite number, zero or more."""
    number = _number(value, name)
    if not (math.isfinite(number) and number >= 0):
        raise PlanError(f"tuning plan: {name} is {_shown(value)}; {what} is a finite number, zero or more.")
    return number


def _one_of(name: str, field: str, choices: Any) -> str:
    """A plan's ``field`` if it is one of ``choices`` (``device_type``: one ampkit has op
    lists for, what :func:`ampkit.tune` records), else :class:`PlanError`."""
    if name not in choices:
        raise PlanError(f"tuning plan: {field} {_shown(name)}; one of {', '.join(choices)}.")
    return name


def _choice(m: Any) -> ModuleChoice:
    if not isinstance(m, dict):
        raise PlanError(f"tuning plan: a module entry is {type(m).__name__}, not an object.")
    dtype = _field(m, "dtype", str)
    name = _field(m, "name", str)
    if not name:
        raise PlanError("tuning plan: a module's name is empty (the whole model); a plan names the modules below it.")
    return ModuleChoice(
        name=name, kind=_field(m, "kind", str), dtype=dtype if dtype == FP8 else _one_of(dtype, "dtype", DTYPES),
        fp32_ms=_number(m.get("fp32_ms"), "fp32_ms"), low_ms=_number(m.get("low_ms"), "low_ms"),
        loss_deviation=_number(m.get("loss_deviation"), "loss_deviation"),
        grad_deviation=_number(m.get("grad_deviation"), "grad_deviation"), reason=_field(m, "reason", str),
    )  # fmt: skip


def _plot_kind(dtype: str) -> str:
    """A module's bar in the plan's plot: ``"fp32"`` (kept), ``"fp8"``, or ``"lowered"``."""
    return dtype if dtype in ("fp32", FP8) else "lowered"


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def _deviation_axis(ax: Any, mods: list[ModuleChoice], budget: float, kinds: list[str]) -> None:
    """The plot's right axis: each module's loss deviation alone, log scale from a floor
    a decade below the smallest positive deviation (or the budget); 0 and inf written."""
    devs = [m.loss_deviation for m in mods]
    positive = [d for d in devs if math.isfinite(d) and d > 0]
    marks = [*positive, *([budget] if math.isfinite(budget) and budget > 0 else [])] or [1e-3]
    floor = 10.0 ** math.floor(math.log10(min(marks))) / 10
    top = max(marks) * 3
    colours = {"fp32": "tab:gray", FP8: "tab:orange", "lowered": "tab:blue"}
    for i, (d, kind) in enumerate(zip(devs, kinds)):
        if math.isfinite(d) and d > 0:
            ax.barh(i, d - floor, left=floor, color=colours[kind])
        else:
            word = "0" if d == 0 else "not measured" if math.isnan(d) else "inf" if math.isinf(d) else f"{d:.1e}"
            ax.text(floor * 1.15, i, word, va="center", fontsize=9)
            if math.isinf(d):  # across the axis
                ax.barh(i, top - floor, left=floor, color=colours[kind], alpha=0.3)
    if floor < budget < math.inf:
        ax.axvline(budget, color="red", linestyle="--", label=f"loss budget {budget:.1e}")
    ax.set_xscale("log")
    ax.set_xlim(floor, top)
    ax.set_xlabel(f'loss deviation with only this module lowered\n(log axis from {floor:.0e}; "0": none)')
