"""Advice: what to change, as code to paste and as structured data, each tied to the
evidence that triggered it."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ampkit.errors import PolicyError, ScalerError
from ampkit.scaling.loss_scaler import LossScaler

from ._findings import Finding

if TYPE_CHECKING:
    from ampkit.casting.policy import Policy

    from ._core import Doctor

FP16_MAX = float(torch.finfo(torch.float16).max)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
MAX_SCALE = 2.0**24  # LossScaler's default cap


@dataclasses.dataclass(frozen=True)
class Advice:
    """One change to make.

    Attributes:
        kind: ``"module_fp32"``, ``"op_fp32"``, ``"use_bf16"``, ``"init_scale"``,
            ``"clip"``, ``"learning_rate"``, ``"unscale_before_clip"``, ``"scale_loss"``,
            ``"one_backward_per_scale_loss"``, ``"sync_masters"``, ``"clip_after_backward"``,
            ``"restore_weights"`` or ``"diagnose"``.
        title: the change, in a few words.
        evidence: the measurement that triggered it.
        code: code to paste.
        change: the change as data, for programs:
            ``module_fp32``: ``{"module_rules": {name: torch.float32}}``;
            ``op_fp32``: ``{"fp32_ops": (op,)}``; ``use_bf16``: ``{"dtype": torch.bfloat16}``
            (these three are :class:`~ampkit.Policy` fields: :meth:`apply_to` merges them);
            ``init_scale``: ``{"init_scale": float, "dynamic": bool}`` (:meth:`scaler`);
            ``clip``: ``{"max_norm": float}``; ``learning_rate``: ``{"lr_factor": float}``;
            the misuse kinds: ``{}`` or the names involved.
    """

    kind: str
    title: str
    evidence: str
    code: str
    change: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    _POLICY_KINDS = ("module_fp32", "op_fp32", "use_bf16")

    def apply_to(self, policy: Policy) -> Policy:
        """``policy`` with this advice applied (policy kinds only): module rules and op
        lists merge, ``use_bf16`` switches the compute dtype."""
        if self.kind not in self._POLICY_KINDS:
            raise PolicyError(f"advice {self.kind!r} is not a policy change; read advice.change instead.")
        return policy.override(**dict(self.change))

    def scaler(self, **config: Any) -> LossScaler:
        """A :class:`~ampkit.LossScaler` with this advice's ``init_scale`` (``init_scale``
        kind only); ``config`` adds other LossScaler arguments."""
        if self.kind != "init_scale":
            raise ScalerError(f"advice {self.kind!r} does not set a loss scale.")
        args = {"init_scale": self.change["init_scale"], "dynamic": self.change.get("dynamic", True)}
        if args["dynamic"]:
            args["max_scale"] = max(MAX_SCALE, args["init_scale"])
        return LossScaler(**(args | config))

    def to_dict(self) -> dict[str, Any]:
        def plain(v: Any) -> Any:
            if isinstance(v, torch.dtype):
                return str(v)
            if isinstance(v, Mapping):
                return {str(k if not isinstance(k, type) else k.__name__): plain(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [plain(x) for x in v]
            return v

        return {"kind": self.kind, "title": self.title, "evidence": self.evidence, "code": self.code,
                "change": plain(dict(self.change))}


def _pow2(x: float) -> str:
    k = round(math.log2(x))
    return f"2.0**{k}" if math.isclose(2.0**k, x) else f"{x:g}"


def scale_for(current: float, largest: float, margin_bits: int = 3) -> float:
    """The power-of-two scale that puts ``largest`` (measured at ``current``) at least
    ``margin_bits`` binary orders below fp16's max."""
    k = math.floor(math.log2(FP16_MAX / largest)) - margin_bits
    return current * 2.0**k


def build(doc: Doctor) -> list[Advice]:
    """Every advice the doctor's evidence supports, most specific first."""
    out: list[Advice] = []
    seen: set[tuple[str, str]] = set()

    def add(a: Advice) -> None:
        key = (a.kind, repr(sorted((str(k), str(v)) for k, v in a.change.items())))
        if key not in seen:
            seen.add(key)
            out.append(a)

    for m in doc.misuse:
        a = _misuse_advice(m)
        if a is not None:
            add(a)
    for f in doc.findings:
        for a in _finding_advice(doc, f):
            add(a)
    if not any(f.level == "op" and f.kind != "underflow" for f in doc.findings):
        for a in _skip_rate_advice(doc):
            add(a)
    for a in _module_level_advice(doc):
        add(a)
    for a in _trend_advice(doc):
        add(a)
    return out


def _module_fp32(f: Finding, evidence: str) -> Advice:
    name = f.module
    code = (
        f"amp.init(dtype=torch.float16, module_rules={{{name!r}: torch.float32}})\n"
        f"# or, scoped: with amp.autocast(amp.Policy(dtype=torch.float16, module_rules={{{name!r}: torch.float32}})):"
    )
    return Advice(
        "module_fp32", f"run module {name!r} in fp32", evidence, code,
        {"module_rules": {name: torch.float32}},
    )


def _finding_advice(doc: Doctor, f: Finding) -> list[Advice]:
    out: list[Advice] = []
    if f.kind == "underflow":
        rng = f.magnitude_range
        flushed = sum(v[0] for v in f.flushed.values())
        nz = sum(v[2] for v in f.flushed.values())
        worst = max(f.flushed.items(), key=lambda kv: kv[1][0] / kv[1][2] if kv[1][2] else 0)
        ev = (
            f"step {f.step}, loss scale {f.scale:g}: {flushed} of {nz} non-zero fp16 backward values "
            f"({flushed / nz:.0%}) flush to zero (fp32 recompute of each op); worst in {worst[0]!r} "
            f"({worst[1][0] / worst[1][2]:.0%})"
        )
        if rng is not None:
            ev += f"; their fp32 magnitudes span {rng[0]:.2g}..{rng[1]:.2g}"
            new = min(scale_for(f.scale, rng[1]), MAX_SCALE)
            if new > f.scale:
                out.append(_init_scale_advice(doc, new, f"raise the loss scale to {_pow2(new)}", ev + (
                    f"; a scale of {_pow2(new)} lifts them by {new / f.scale:g}x and keeps the largest "
                    f"({rng[1] * new / f.scale:.3g}) below fp16's max"
                )))
        out.append(_bf16_advice(ev + "; bf16 has fp32's exponent range (no underflow at these magnitudes)"))
        return out
    if f.kind == "nonfinite_input":
        src = ", ".join(f.params) if f.params else "the input batch or a buffer"
        out.append(Advice(
            "restore_weights", "find where the inf/NaN came from before this step",
            f"step {f.step}: inf/NaN reached op {f.op} in {f.module!r} from outside the step ({src})",
            "assert all(torch.isfinite(p).all() for p in model.parameters())\n"
            "assert torch.isfinite(batch).all()   # reload the last good checkpoint if a weight is inf/NaN",
            {"params": list(f.params)},
        ))
        return out
    if f.direction == "forward":
        o = f.outputs[0] if f.outputs else None
        fp32 = f.fp32_abs_max
        ev = f"step {f.step}: op {f.op} in {f.module!r} ({f.module_type}) produced inf/NaN in {f.dtype or 'fp16'}"
        if f.inputs:
            ev += f" from finite inputs (abs-max {max(s.abs_max for s in f.inputs):.3g})"
        if fp32 is not None:
            ev += f"; in fp32 its output abs-max is {fp32:.3g}, above fp16's {FP16_MAX:g}"
        if f.consumer:
            ev += f"; the next op to read it was {f.consumer}" + (
                f" in {f.consumer_module!r}" if f.consumer_module else "")
        if f.module is not None:
            out.append(_module_fp32(f, ev))
        if f.policy_op:
            code = (
                f"amp.init(dtype=torch.float16, fp32_ops=[{f.policy_op!r}])\n"
                f"# or, scoped: with amp.autocast(amp.Policy(dtype=torch.float16, fp32_ops=[{f.policy_op!r}])):"
            )
            out.append(Advice(
                "op_fp32", f"run {f.torch_function or f.policy_op} in fp32", ev, code,
                {"fp32_ops": (f.policy_op,)},
            ))
        if (fp32 is None or fp32 < BF16_MAX) and (o is None or o.dtype == "fp16"):
            out.append(_bf16_advice(ev + "; bf16 reaches 3.4e38"))
        lr = _lr_evidence(doc, f)
        if lr is not None:
            out.append(lr)
        return out
    # backward
    fp32 = f.fp32_abs_max
    ev = (
        f"step {f.step}: backward op {f.op} [{f.node}] in {f.module!r} produced inf/NaN at loss scale {f.scale:g}"
    )
    if f.params:
        ev += f"; first non-finite parameter grad(s): {', '.join(f.params)}"
    if fp32 is not None and math.isfinite(fp32) and fp32 > 0:
        ev += f"; in fp32 the op's output abs-max is {fp32:.3g}"
        new = scale_for(f.scale, fp32)
        if new >= 1.0:
            out.append(_init_scale_advice(doc, new, f"lower the loss scale to {_pow2(new)}", ev + (
                f"; at {_pow2(new)} it would be {fp32 * new / f.scale:.3g}, below fp16's {FP16_MAX:g}"
            )))
        elif f.module is not None:
            out.append(_module_fp32(f, ev + "; it overflows fp16 even at loss scale 1"))
    elif f.module is not None:
        out.append(_module_fp32(f, ev))
    out.append(_bf16_advice(ev + "; bf16 reaches 3.4e38"))
    return out


def _bf16_advice(evidence: str) -> Advice:
    return Advice(
        "use_bf16", "compute in bf16 instead of fp16", evidence,
        "amp.init(dtype=torch.bfloat16)     # or amp.initialize(model, opt, opt_level=..., dtype=torch.bfloat16)",
        {"dtype": torch.bfloat16},
    )


def _init_scale_advice(doc: Doctor, new: float, title: str, evidence: str) -> Advice:
    dynamic = any(s.scalers[0].dynamic for s in doc._states) if doc._states else True
    code = f"amp.init_trainer(optimizer, scaler=amp.LossScaler(init_scale={_pow2(new)}"
    code += ("))" if dynamic else ", dynamic=False))")
    return Advice("init_scale", title, evidence, code, {"init_scale": new, "dynamic": dynamic})


def _skip_rate_advice(doc: Doctor) -> list[Advice]:
    """Many skipped steps that the op-level check did not see again: the dynamic
    scale settles lower than it started."""
    points = [p for p in doc.history if p.optimizer == 0]
    skipped = [p for p in points if p.skipped]
    if len(skipped) < 3 or len(points) < 4:
        return []
    first = points[0].scale
    settled = min(p.scale for p in points[-max(3, len(points) // 4):])
    if settled >= first:
        return []
    ev = (
        f"{len(skipped)} of {len(points)} steps skipped while the loss scale fell from {first:g} to "
        f"{settled:g}"
    )
    return [_init_scale_advice(doc, settled, f"start the loss scale at {_pow2(settled)}", ev)]


def unexplained_events(doc: Doctor) -> list[Finding]:
    """Module-level events (skipped steps, non-finite losses) that no op-level finding
    explains and that were not shown to vanish (an op-level check after them saw no
    inf/NaN: the dynamic scale backed off)."""
    if any(f.level == "op" and f.kind != "underflow" for f in doc.findings):
        return []
    return [ev for ev in doc.events if ev.recurred is not False]


def _module_level_advice(doc: Doctor) -> list[Advice]:
    """Module-level findings of steps the op-level check never reached: keep the
    module named in fp32 (not the whole model), compute in bf16 instead of fp16, and
    run the op-level check on the failing batch."""
    if any(f.level == "op" and f.kind != "underflow" for f in doc.findings):
        return []
    out = []
    for ev in doc.events[:1]:
        if ev.direction == "forward" and ev.module is not None:
            out.append(_module_fp32(ev, f"step {ev.step}: module {ev.module!r} ({ev.module_type}) output "
                                        f"went inf/NaN in the forward (module-level record)"))
    events = unexplained_events(doc)
    if not events:
        return out
    ev = events[0]
    what = (
        f"step {ev.step}: first inf/NaN at {ev.where()} (module-level record); no op-level check "
        f"ran on a later step ({doc.checks_run} of max_checks={doc.max_checks} run, every={doc.every})"
    )
    if ev.module and not out:  # a named submodule; "" is the whole model
        out.append(_module_fp32(ev, what))
    if doc.compute_dtype is torch.float16:
        out.append(_bf16_advice(what + "; bf16 reaches 3.4e38"))
    out.append(Advice(
        "diagnose", "run the op-level check on the batch that failed", what,
        "finding = doc.diagnose(lambda: loss_fn(model(x), y).backward())   # inside `with amp.doctor(opt) as doc:`\n"
        "print(finding.summary())   # the op, its module and the values; zero the grads after",
    ))
    return out


def _lr_evidence(doc: Doctor, f: Finding) -> Advice | None:
    margin = doc.margins.get(f.module or "")
    if margin is None:
        return None
    hist = [v for s, v in margin.act_history if s < f.step]
    if len(hist) < 6:
        return None
    start, end = hist[max(0, len(hist) - 20)], hist[-1]
    if start <= 0 or end / start < 16:
        return None
    lr = doc.lrs[0] if doc.lrs else None
    ev = (
        f"the output abs-max of {f.module!r} grew {end / start:.0f}x over the {min(20, len(hist))} steps "
        f"before it overflowed ({start:.3g} -> {end:.3g}): the weights are diverging"
    )
    code = "for group in optimizer.param_groups:\n    group['lr'] *= 0.1"
    if lr is not None:
        code += f"   # lr {lr:g} -> {lr * 0.1:g}"
    return Advice("learning_rate", "check the learning rate (try 10x lower)", ev, code, {"lr_factor": 0.1})


def _trend_advice(doc: Doctor) -> list[Advice]:
    out: list[Advice] = []
    points = [p for p in doc.history if p.optimizer == 0 and not p.skipped]
    norms = [p.grad_norm for p in points if p.grad_norm is not None and math.isfinite(p.grad_norm)]
    if len(norms) >= 10:
        base = statistics.median(norms[: len(norms) // 2])
        spikes = [(p.step, p.grad_norm) for p in points
                  if p.grad_norm is not None and base > 0 and p.grad_norm > 10 * base]
        if spikes and len(spikes) <= max(1, len(norms) // 10):  # sporadic, not a new level
            max_norm = float(f"{2 * base:.1g}")
            step, value = max(spikes, key=lambda s: s[1])
            out.append(Advice(
                "clip", f"clip the gradient norm at {max_norm:g}",
                f"the unscaled gradient norm spiked to {value:.3g} at step {step} ({len(spikes)} step(s) above "
                f"10x the median {base:.3g})",
                f"amp.unscale(optimizer)\ntorch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={max_norm:g})",
                {"max_norm": max_norm},
            ))
    losses = [p.loss for p in points if p.loss is not None and math.isfinite(p.loss)]
    if len(losses) >= 12:
        head = statistics.mean(losses[:4])
        tail = statistics.mean(losses[-4:])
        last = losses[-6:]
        rising = all(b > a for a, b in zip(last, last[1:]))  # diverging, not a jump in the data
        if head > 0 and tail > 3 * head and rising and last[-1] > 2 * last[0]:
            lr = doc.lrs[0] if doc.lrs else None
            code = "for group in optimizer.param_groups:\n    group['lr'] *= 0.1"
            if lr is not None:
                code += f"   # lr {lr:g} -> {lr * 0.1:g}"
            out.append(Advice(
                "learning_rate", "check the learning rate (try 10x lower)",
                f"the loss rose from {head:.4g} to {tail:.4g} (mean of the first and last 4 steps seen), "
                f"rising at each of the last {len(last)} steps",
                code, {"lr_factor": 0.1},
            ))
    return out


def _misuse_advice(m: Any) -> Advice | None:
    table = {
        "clip_before_unscale": (
            "unscale_before_clip", "call amp.unscale(optimizer) before clipping",
            "amp.unscale(optimizer)\ntorch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\noptimizer.step()",
        ),
        "grads_modified_while_scaled": (
            "unscale_before_clip", "read and edit grads only after amp.unscale(optimizer)",
            "amp.unscale(optimizer)\n# ... code that reads or edits p.grad ...\noptimizer.step()",
        ),
        "step_without_scale_loss": (
            "scale_loss", "run backward inside amp.scale_loss",
            "with amp.scale_loss(loss, optimizer) as scaled:\n    scaled.backward()\noptimizer.step()",
        ),
        "two_backward_one_scale_loss": (
            "one_backward_per_scale_loss", "one scale_loss per backward pass",
            "for loss in losses:\n    with amp.scale_loss(loss, optimizer) as scaled:\n        scaled.backward()",
        ),
        "loss_scaled_twice": (
            "scale_loss", "pass the unscaled loss to amp.scale_loss, once",
            "with amp.scale_loss(loss, optimizer) as scaled:   # loss: not yet scaled\n    scaled.backward()",
        ),
        "masters_out_of_sync": (
            "sync_masters", "change O2 weights through their fp32 masters",
            "with torch.no_grad():\n    for m in ampkit.master_params(optimizer):\n"
            "        m.clamp_(-0.01, 0.01)   # the model gets them rounded at its next forward",
        ),
        "grad_hook_sees_scaled_grads": (
            "clip_after_backward", "clip after backward, not in a gradient hook",
            "amp.unscale(optimizer)\ntorch.nn.utils.clip_grad_value_(model.parameters(), clip_value)",
        ),
    }
    entry = table.get(m.kind)
    if entry is None:
        return None
    kind, title, code = entry
    return Advice(kind, title, f"step {m.step}: {m.message}", code, dict(m.details))
