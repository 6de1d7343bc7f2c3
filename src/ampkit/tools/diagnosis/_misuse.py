"""The doctor's training-loop checks: mistakes it sees around a step (clipping before
unscaling, a backward outside ``scale_loss``, a loss scaled twice, O2 weights changed
behind their masters, gradient hooks that see scaled grads), each recorded once as a
:class:`~ampkit.tools.diagnosis.Misuse` with a warning."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ampkit._internal.dtypes import local_tensor
from ampkit.levels.setup import master_weights_of
from ampkit.trainer import api as _optim

from ._findings import Misuse
from ._record import Recorder, StepLog


class MisuseChecks:
    """The misuse checks of one doctor: ``found`` is its list of :class:`Misuse`
    (the doctor's ``misuse``), ``recorder`` names parameters and finds their hooks,
    ``warn_once(key, message)`` warns once per key."""

    def __init__(self, found: list[Misuse], recorder: Recorder, warn_once: Callable[[str, str], None]) -> None:
        self.found = found
        self.recorder = recorder
        self._warn_once = warn_once
        self._user_hooks_checked: set[int] = set()

    def check_step(self, state: _optim.ManagedOptimizer, log: StepLog, compute_dtype: torch.dtype | None) -> None:
        """Every check that runs before a step's grads are unscaled."""
        self.scaled_edits(state, log)
        self.backward_passes(state, log, compute_dtype)
        self.masters(state)
        self.user_hooks(state)

    def record(self, kind: str, state: Any, message: str, **details: Any) -> None:
        """Note the first misuse of ``kind`` (at ``state``'s coming step) and warn once."""
        step = getattr(state, "steps", 0) + 1
        if any(m.kind == kind for m in self.found):
            return
        self.found.append(Misuse(kind, step, message, details))
        self._warn_once(kind, f"ampkit.doctor: {message}")

    def scaled_edits(self, state: _optim.ManagedOptimizer, log: StepLog) -> None:
        """Grads changed in place between backward and ampkit's unscale while they
        still held ``S*g`` -- typically ``clip_grad_norm_`` before ``amp.unscale``. With
        ampkit's gradient path grads are real when backward ends, so this concerns the
        grads it leaves scaled until the step (FSDP2's sharded parameters)."""
        scale = state.scalers[0].scale
        if scale == 1.0 or not log.scaled_grads:
            return
        pairs = []
        for pref, gref, sumsq in log.scaled_grads.values():
            p, g = pref(), gref()
            if p is None or g is None or p.grad is not g:
                continue
            # squared norms, not version counters: in-place ops on DTensor grads (FSDP2)
            # leave those unchanged
            pairs.append(torch.stack([sumsq, local_tensor(g).detach().float().pow(2).sum()]))
        if not pairs:
            return
        changed = [v for v in torch.stack(pairs).tolist() if not math.isclose(v[0], v[1], rel_tol=1e-6)]
        ratios = [math.sqrt(after / before) for before, after in changed if before > 0 and math.isfinite(after)]
        if not ratios:
            return
        lo, hi = min(ratios), max(ratios)
        uniform = hi <= lo * 1.01 + 1e-12 and hi < 0.999
        if uniform:
            before = math.sqrt(sum(v[0] for v in changed))
            after = math.sqrt(sum(v[1] for v in changed))
            self.record(
                "clip_before_unscale", state,
                f"the grads of {len(changed)} parameter(s) were scaled down by {lo:.3g} between backward "
                f"and the step while they still held the loss scale ({scale:g}): the total norm went from "
                f"{before:.4g} (= {before / scale:.4g} unscaled) to {after:.4g}, so clip_grad_norm_ clipped "
                "the scaled grads and the update is about 1/scale too small. Call ampkit.unscale(optimizer) "
                "before clipping (or clip ampkit.master_params(optimizer) after it).",
                factor=lo, norm_before=before / scale, norm_after=after / scale, scale=scale,
            )
        elif not torch.distributed.is_initialized():
            self.record(
                "grads_modified_while_scaled", state,
                f"the grads of {len(changed)} parameter(s) were changed in place between backward and "
                f"the step while they still held the loss scale ({scale:g}); code that reads or edits "
                "grads (clipping, noise, masks, logging norms) must run after ampkit.unscale(optimizer).",
            )

    def backward_passes(self, state: _optim.ManagedOptimizer, log: StepLog, compute_dtype: torch.dtype | None) -> None:
        """Backward passes outside ``scale_loss``, or more of them than scaled losses."""
        if not log.params:
            return
        tasks: dict[int, tuple[int, int]] = {}
        for seq, *_rest, task in log.params:
            lo, hi = tasks.get(task, (seq, seq))
            tasks[task] = (min(lo, seq), max(hi, seq))
        scaled = set(log.scaled_tasks)
        if log.scaled_losses == 0:
            if state.scalers[0].scale != 1.0 or compute_dtype is torch.float16:
                self.record(
                    "step_without_scale_loss", state,
                    "optimizer.step() ran on grads from a backward outside ampkit.scale_loss: the loss was "
                    "not scaled (fp16 grads can underflow) and the loss scaler learns nothing from the "
                    "step. Write `with ampkit.scale_loss(loss, optimizer) as scaled: scaled.backward()`.",
                )
            return
        spans = [tasks[t] for t in scaled if t in tasks]
        unscaled = [
            t for t, (lo, hi) in tasks.items()
            if t not in scaled and not any(a <= lo and hi <= b for a, b in spans)
        ]
        repeated = len(log.scaled_tasks) > log.scaled_losses
        if unscaled or repeated:
            what = (
                f"{len(unscaled)} backward pass(es) outside scale_loss added unscaled grads to grads "
                "scaled by the loss scale" if unscaled else
                f"backward ran {len(log.scaled_tasks)} times on {log.scaled_losses} scaled loss(es) "
                "(retain_graph=True and a second backward?), adding the same grads twice"
            )
            self.record(
                "two_backward_one_scale_loss", state,
                f"the grads of this step come from more backward passes than scale_loss calls: {what}. "
                "Give every backward its own `with ampkit.scale_loss(loss, optimizer) as scaled:` "
                "(losses summed before one scale_loss count as one).",
                backward_passes=len(tasks), scaled_losses=log.scaled_losses,
            )

    def masters(self, state: _optim.ManagedOptimizer) -> None:
        """O2 model weights that are no longer their masters rounded."""
        mw = master_weights_of(state.optimizer)
        if mw is None:
            return
        pairs = mw.pairs()
        if not pairs:
            return
        with torch.no_grad():
            diff = torch.stack([(m.to(p.dtype) != p).any() for p, m in pairs]).tolist()
        stale = [self.recorder.param_name(p) or f"param {i}" for i, ((p, _), d) in enumerate(zip(pairs, diff)) if d]
        if stale:
            self.record(
                "masters_out_of_sync", state,
                f"{len(stale)} O2 model weight(s) ({', '.join(stale[:3])}{'...' if len(stale) > 3 else ''}) "
                "differ from their fp32 masters rounded: they were changed outside the optimizer "
                "(p.data.copy_, a manual update). The step takes each changed tensor into its "
                "master whole, so those masters lose their low bits (the edit's result is kept in "
                "16 bits only). To keep fp32 precision, change the masters instead: "
                "ampkit.master_params(optimizer).",
                params=stale,
            )

    def user_hooks(self, state: _optim.ManagedOptimizer) -> None:
        """Gradient hooks of the user's, which see the scaled grads."""
        scale = state.scalers[0].scale
        if scale == 1.0:
            return
        for name, p in self.recorder.hooked_params():
            if id(p) in self._user_hooks_checked:
                continue
            self._user_hooks_checked.add(id(p))
            if self.recorder.user_grad_hooks(p):
                self.record(
                    "grad_hook_sees_scaled_grads", state,
                    f"parameter {name} has a gradient hook (Tensor.register_hook): hooks run inside "
                    f"backward and see the scaled grad S*g (S = {scale:g}), so a clamp or clip there acts on "
                    "S*g. Clip after backward with torch.nn.utils.clip_grad_norm_/clip_grad_value_ instead.",
                    param=name,
                )
                return
