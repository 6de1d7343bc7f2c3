"""Compensated updates for parameters stored in bfloat16 (opt level O2K).

A bf16 weight rounds away any update below half a unit in its last place, so with a
small learning rate pure-bf16 training stalls. :class:`CompensatedUpdates` keeps what
rounding takes: ``"kahan"`` (a bf16 compensation buffer per parameter, the value trained
being ``w + c``), ``"stochastic"`` (unbiased random rounding from a saved generator) or
``"nearest"`` (the reference). Two ways to step, per parameter group: a dedicated
in-place kernel for Kahan on bf16 Adam/AdamW/SGD (the optimizers with a rule in
:mod:`ampkit.trainer.optimizer_rules`, run by :mod:`ampkit.levels.update_kernels`; no
full-size temporary), and the real optimizer run on fp32 copies of a bounded chunk at
a time for any other optimizer whose update is per parameter. On an optimizer ampkit
manages it is a step extension (``before_update``/``after_update``: a skipped step never
reaches it; fp32 parameters of its groups step with torch's fused kernel where it fits);
on an unmanaged one, a step pre-hook and post-hook. Formulas, memory, which optimizers
take which path: ``docs/concepts/fp32.md`` ("Compensated updates"). Without replacing
``optimizer.step``: right before it, its class-level ``step`` runs once per chunk with
every grad outside the chunk set aside (torch skips parameters whose ``.grad`` is None),
then every grad is set aside so the step the user called finds nothing to do; right
after it the grads come back.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
from torch import nn

from ampkit._internal.dist import rank_and_world_size
from ampkit._internal.dtypes import LOW_PRECISION, cast_optimizer_state, local_tensor
from ampkit._internal.validate import (
    CORRUPT_CHECKPOINT,
    require_choice,
    require_fields,
    require_optimizer,
    require_tensor,
)
from ampkit.errors import AmpError, StateError
from ampkit.trainer.extensions import StepExtension
from ampkit.trainer.fused_step import fuse_wide_parts
from ampkit.trainer.managed import managed_state
from ampkit.trainer.optimizer_rules import (
    OptimizerRule,
    StepCounts,
    Update,
    counts_of,
    rule_for,
    zeros_tiled,
)
from ampkit.trainer.torch_scaler import refuse_scaled_handoff

from . import one_pass
from . import update_kernels as _kernels
from .update_kernels import Kernel, flat

__all__ = ["CompensatedUpdates", "Method", "stochastic_round", "kahan_round"]

Method = Literal["kahan", "stochastic", "nearest"]
_METHODS = ("kahan", "stochastic", "nearest")
KernelChoice = Literal["auto", "compiled", "eager", "generic"]
_KERNELS = ("auto", "compiled", "eager", "generic")
_STATE_FORMAT = 1


def stochastic_round(
    x: torch.Tensor, dtype: torch.dtype = torch.bfloat16, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Round fp32 ``x`` to bf16 stochastically: up with probability equal to the
    dropped fraction of a bf16 unit, so ``E[result] == x``. Non-finite values
    round to nearest."""
    if dtype != torch.bfloat16 or x.dtype != torch.float32:
        raise AmpError(f"stochastic rounding goes from float32 to bfloat16, got {x.dtype} -> {dtype}.")
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    # Adding noise below the 16 kept bits then truncating rounds the magnitude
    # up with the right probability (bf16 keeps the upper half of the fp32 bits).
    rounded = (bits + noise).bitwise_and_(-65536).view(torch.float32)
    out = torch.where(torch.isfinite(x), rounded, x)
    return out.to(torch.bfloat16)


def kahan_round(target: torch.Tensor, compensation: torch.Tensor) -> torch.Tensor:
    """Return ``round(target + compensation)`` in ``compensation``'s dtype and
    store the rounding error into ``compensation`` in place. ``target`` (fp32) is
    overwritten with scratch values."""
    total = target.add_(compensation)
    stored = total.to(compensation.dtype)
    compensation.copy_(total.sub_(stored))
    return stored


# --- dedicated updates: the kernels of ampkit.trainer.optimizer_rules, Kahan-rounded -----

_BF = torch.bfloat16
_DEDICATED: dict[Update, Kernel] = {}


def _kernel(update: Update) -> Kernel:
    """The compensated kernel of ``update`` (made once): roles weight, compensation, grad
    and state, all bf16; all but the grad written."""
    k = _DEDICATED.get(update)
    if k is None:
        n = len(update.state_keys)
        k = _DEDICATED[update] = Kernel(update.name, update.compensated, mutated=(0, 1, *range(3, 3 + n)),
                                        example_dtypes=(_BF,) * (3 + n))  # fmt: skip
    return k


class CompensatedUpdates:
    """Make ``optimizer`` update its bf16 parameters with compensation.

    Args:
        optimizer: any ``torch.optim`` optimizer except LBFGS; its low-precision
            parameters may be added later with ``add_param_group``.
        method: ``"kahan"`` (default), ``"stochastic"`` or ``"nearest"``.
        chunk_numel: at most this many elements of low-precision parameters are
            expanded to fp32 at once (a single larger parameter is stepped alone).
            Default 2**20.
        seed: seed of the generator used by ``"stochastic"``. Default 0.
        kernel: how the dedicated updates (Kahan; Adam, AdamW, SGD) run: ``"auto"``
            (default: ``"compiled"`` where a C++ compiler is found, else ``"eager"``),
            ``"compiled"`` (``torch.compile``; falls back to ``"eager"`` with a warning
            if compiling fails), ``"eager"`` (op by op, in chunks of ``chunk_numel``),
            or ``"generic"`` (no dedicated update: every optimizer takes the generic
            path).

    fp32 parameters in the same optimizer (normalization layers) are stepped as
    usual. Call :meth:`remove` to detach.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        method: Method = "kahan",
        chunk_numel: int = 1 << 20,
        seed: int = 0,
        kernel: KernelChoice = "auto",
    ) -> None:
        require_optimizer(optimizer, "CompensatedUpdates")
        require_choice(method, _METHODS, "compensation method")
        require_choice(kernel, _KERNELS, "kernel")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise AmpError(
                "LBFGS mixes all parameters in one update and calls a closure many "
                "times per step; compensated updates need a per-parameter optimizer."
            )
        if not isinstance(chunk_numel, int) or isinstance(chunk_numel, bool) or chunk_numel < 1:
            raise AmpError(f"chunk_numel must be a positive int, got {chunk_numel!r}.")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise AmpError(f"seed must be an int, got {seed!r}.")
        self.optimizer = optimizer
        self.method: Method = method
        self.chunk_numel = chunk_numel
        self.kernel: KernelChoice = kernel
        self._buffers: dict[int, torch.Tensor] = {}  # id(param) -> compensation
        self._params: dict[int, nn.Parameter] = {}  # keeps ids valid
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed)
        self._device_generators: dict[torch.device, torch.Generator] = {}
        self._inside = False
        self._set_aside: list[tuple[nn.Parameter, torch.Tensor]] | None = None
        self._handles: list[Any] = []
        self._extension: _CompensatedStep | None = None
        try:
            managed = managed_state(optimizer)
        except StateError:  # not managed by ampkit: torch's step hooks
            managed = None
        if managed is not None and managed.optimizer is optimizer:
            self._extension = _CompensatedStep(self)
            managed.add_extension(self._extension)
            # the fp32 rest: fused where it fits (groups added later too, at their first step)
            self._handles = fuse_wide_parts(optimizer, managed.kernels, managed.kernel_listeners)
        else:
            self._handles = [
                optimizer.register_step_pre_hook(self._pre_step_hook),
                optimizer.register_step_post_hook(self._post_step),
            ]

    def remove(self) -> None:
        """Detach from the optimizer (compensation buffers are dropped)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._extension is not None:
            self._extension.remove()
            self._extension = None

    def kernels_ahead(self) -> list[_kernels.AheadJob]:
        """The update kernels this optimizer's dedicated updates run (none with the
        generic path or the eager kernels), for :func:`~ampkit.levels.update_kernels.compile_ahead`."""
        if self.method != "kahan" or self.kernel in ("generic", "eager"):
            return []
        return one_pass.kernels_ahead(self.optimizer, _BF, kernels=lambda update, low: _kernel(update))

    # -- which parameters ---------------------------------------------------------

    def _low_params(self) -> Iterator[tuple[int, int, nn.Parameter]]:
        for gi, group in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.dtype in LOW_PRECISION:
                    yield gi, pi, p

    def ensure_buffers(self) -> None:
        """Give every 16-bit parameter its compensation buffer now (zeros: no
        compensation yet), so that a checkpoint's layout does not depend on which
        parameters have been stepped (:class:`ampkit.distributed.AmpState` loads into
        the entries it finds)."""
        self._buffers_for([p for _, _, p in self._low_params()])

    def buffer(self, param: nn.Parameter) -> torch.Tensor | None:
        """The Kahan compensation buffer of ``param`` (None before its first step
        or with another method)."""
        return self._buffers.get(id(param))

    def _buffer_for(self, p: nn.Parameter, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(id(p))
        if not _buffer_fits(buf, like):
            buf = torch.zeros_like(like, memory_format=torch.preserve_format)
            self._buffers[id(p)] = buf
            self._params[id(p)] = p
        return buf

    def _buffers_for(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """:meth:`_buffer_for` of each of ``params``; the missing ones made together:
        pieces of one buffer per dtype and device where they can be
        (:func:`~ampkit.trainer.optimizer_rules.zeros_tiled`)."""
        bufs = [self._buffers.get(id(p)) for p in params]
        missing = [p for p, buf in zip(params, bufs) if not _buffer_fits(buf, p)]
        if not missing:  # every step after the first
            return bufs  # type: ignore[return-value]
        groups: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p in missing:
            groups.setdefault((p.dtype, p.device), []).append(p)
        for group in groups.values():
            if all(type(p) is nn.Parameter for p in group):
                for p, buf in zip(group, zeros_tiled([p.detach() for p in group])):
                    self._buffers[id(p)] = buf
                    self._params[id(p)] = p
        return [self._buffer_for(p, p.detach()) for p in params]

    def _generator_for(self, device: torch.device) -> torch.Generator:
        if device.type == "cpu":
            return self._generator
        gen = self._device_generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(int(torch.randint(0, 2**62, (1,), generator=self._generator)))
            self._device_generators[device] = gen
        return gen

    # -- the step -----------------------------------------------------------------

    def _chunks(self, params: list[nn.Parameter]) -> Iterator[list[nn.Parameter]]:
        chunk: list[nn.Parameter] = []
        size = 0
        for p in params:
            if chunk and size + p.numel() > self.chunk_numel:
                yield chunk
                chunk, size = [], 0
            chunk.append(p)
            size += p.numel()
        if chunk:
            yield chunk

    def _pre_step_hook(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        skip = None
        if not self._inside:
            refuse_scaled_handoff(optimizer)
            # torch.amp.GradScaler after its unscale_: the grads are real and its inf flag
            # goes to the fused kernel (it calls step() on a skipped step too): ours take it
            skip = optimizer.__dict__.get("found_inf")
        self._pre_step(optimizer, args, kwargs, skip=skip)  # (a step pre-hook returns None: arguments unchanged)

    def _pre_step(
        self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict, skip: torch.Tensor | None = None,
        plan: list[tuple[dict, OptimizerRule, list[nn.Parameter]]] | None = None,
    ) -> list[StepCounts]:
        """The compensated part of a step, before the optimizer's own ``step``. ``skip``:
        the found-inf flag of a step decided on the device (the dedicated kernels take
        it; ``plan``: :meth:`_plan`'s, made for it right before). Returns the step
        counters to settle once its outcome is known (none without ``skip``)."""
        if self._inside:
            return []
        # args[0] is the optimizer itself; anything after it is a closure.
        if len(args) > 1 or kwargs.get("closure") is not None:
            raise AmpError(
                "compensated updates do not support optimizer.step(closure): compute "
                "the loss and backward before calling step()."
            )
        low = [p for _, _, p in self._low_params() if p.grad is not None]
        low_ids = {id(p) for p in low}
        dedicated = self._plan(optimizer) if plan is None else plan
        done = {id(p) for _, _, params in dedicated for p in params}
        low = [p for p in low if id(p) not in done]
        if not low and self._extension is not None:  # every 16-bit grad has a dedicated kernel (the usual case)
            return self._dedicated_only(optimizer, dedicated, skip)
        every = [p for g in optimizer.param_groups for p in g["params"]]
        # Grads of everything not stepped yet; fp32 parameters go with the first chunk.
        pending = {id(p): p.grad for p in every if p.grad is not None}
        fp32_first = [p for p in every if id(p) not in low_ids and p.grad is not None]
        chunks = list(self._chunks(low)) or [[]]
        chunks[0] = fp32_first + chunks[0]
        self._inside = True
        try:
            counts = self._step_all_dedicated(optimizer, dedicated, skip)
            for chunk in chunks:
                if chunk:
                    self._step_chunk(optimizer, chunk, pending, every)
        except BaseException:
            for p in every:
                p.grad = pending.get(id(p))
            raise
        finally:
            self._inside = False
        # The step the user called runs after this hook: it must find no grads.
        self._set_aside = [(p, pending[id(p)]) for p in every if id(p) in pending]
        for p in every:
            p.grad = None
        return counts

    def _dedicated_only(
        self, optimizer: torch.optim.Optimizer, dedicated: list[tuple[dict, OptimizerRule, list[nn.Parameter]]],
        skip: torch.Tensor | None,
    ) -> list[StepCounts]:
        """:meth:`_pre_step` of a managed optimizer where every 16-bit grad goes through a
        dedicated kernel: those run, their grads are set aside until the update ends (the
        managed step puts them back also where the optimizer's step raises), and the fp32
        rest keeps its grads for the step the user called, which updates it as it would
        have alone (with the same found-inf flag, on a step skipped on the device). Not on
        torch's step hooks: no post-hook runs after a step that raised."""
        self._inside = True
        try:
            counts = self._step_all_dedicated(optimizer, dedicated, skip)
        finally:
            self._inside = False
        aside = [(p, p.grad) for _, _, params in dedicated for p in params]
        for p, _ in aside:
            p.grad = None
        self._set_aside = aside
        return counts

    # -- dedicated updates ----------------------------------------------------------

    def _step_all_dedicated(
        self, optimizer: torch.optim.Optimizer, dedicated: list[tuple[dict, OptimizerRule, list[nn.Parameter]]],
        skip: torch.Tensor | None,
    ) -> list[StepCounts]:
        """:meth:`_step_dedicated` of each ``(group, rule, params)`` of ``dedicated``
        (:meth:`_plan`'s); the step counters to settle."""
        counts = []
        for group, rule, params in dedicated:
            c = self._step_dedicated(optimizer, group, rule, params, skip)
            if c is not None:
                counts.append(c)
        return counts

    def _plan(self, optimizer: torch.optim.Optimizer) -> list[tuple[dict, OptimizerRule, list[nn.Parameter]]]:
        """(group, rule, params) for the parameters a dedicated update steps; the rest
        take the generic path. Reads only: nothing is changed here."""
        if self.method != "kahan" or self.kernel == "generic":
            return []
        plan = []
        for group in optimizer.param_groups:
            rule = rule_for(optimizer, group)
            if rule is None:
                continue
            params = [p for p in group["params"] if self._fits(optimizer, p, rule)]
            if params:
                plan.append((group, rule, params))
        return plan

    def _fits(self, optimizer: torch.optim.Optimizer, p: nn.Parameter, rule: OptimizerRule) -> bool:
        g = p.grad
        if g is None or p.dtype != _BF or g.dtype != _BF or g.is_sparse:
            return False
        plain = type(p) is nn.Parameter and type(g) is torch.Tensor  # (per parameter: kept lean)
        if plain:
            local = p
        else:  # type(g) is not type(w): a sharded parameter with a full grad, or the reverse
            w = p.detach()
            if type(g) is not type(w):
                return False
            local, g = local_tensor(w), local_tensor(g)
        shape, stride, device = local.shape, local.stride(), local.device  # same_layout, inline
        if g.shape != shape or g.stride() != stride or g.device != device:
            return False
        if not local.is_contiguous() and flat(local) is None:
            return False
        buf = self._buffers.get(id(p))
        if buf is not None:
            buf = buf if plain else local_tensor(buf)
            if buf.shape != shape or buf.stride() != stride or buf.device != device:
                return False
        state = optimizer.state.get(p)
        if state:
            if rule.counted and "step" not in state:
                return False
            for key in rule.state_keys:
                v = state.get(key)
                if v is None and not rule.counted:
                    continue
                if not torch.is_tensor(v) or v.dtype != _BF:
                    return False
                v = v if plain else local_tensor(v)
                if v.shape != shape or v.stride() != stride or v.device != device:
                    return False
        return True

    def _step_dedicated(
        self, optimizer: torch.optim.Optimizer, group: dict, rule: OptimizerRule, params: list[nn.Parameter],
        skip: torch.Tensor | None = None,
    ) -> StepCounts | None:
        assert self.kernel != "generic" and rule.plan is not None
        mode = _kernels.resolve_mode(self.kernel)
        run = {"mode": mode, "chunk_numel": self.chunk_numel, "batch_numel": self.chunk_numel, "skip": skip}
        # FSDP2's DTensor shards: the update is elementwise, so each rank steps its local shard
        plain = all(type(p) is nn.Parameter for p in params)
        if plain:  # plain tensors: as they are (the kernel detaches)
            ws = params
            cs = self._buffers_for(params)
            gs = [p.grad for p in params]
        else:
            ws = [local_tensor(p.detach()) for p in params]
            cs = [local_tensor(self._buffer_for(p, p.detach())) for p in params]
            gs = [local_tensor(p.grad) for p in params]  # type: ignore[arg-type]
        with torch.no_grad():
            states, plan = rule.plan(optimizer, group, params)
            for update, idx, scalars in plan:
                static = update.static_args(group) if update.static_keys else {}
                keys = update.state_keys
                if idx is None:  # every parameter (the usual case): no reindexing
                    tensors = [ws, cs, gs, *[[s[key] if plain else local_tensor(s[key]) for s in states]
                                             for key in keys]]  # fmt: skip
                else:
                    tensors = [[ws[i] for i in idx], [cs[i] for i in idx], [gs[i] for i in idx],
                               *[[states[i][key] if plain else local_tensor(states[i][key]) for i in idx]
                                 for key in keys]]  # fmt: skip
                _kernel(update)(tensors, scalars, **static, **run)
        if skip is None:
            return None
        return counts_of(states, skip)

    def _post_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._inside or self._set_aside is None:
            return
        for p, g in self._set_aside:
            p.grad = g
        self._set_aside = None

    def _step_chunk(
        self,
        optimizer: torch.optim.Optimizer,
        chunk: list[nn.Parameter],
        grads: dict[int, torch.Tensor],
        every: list[nn.Parameter],
    ) -> None:
        in_chunk = {id(p) for p in chunk}
        for p in every:
            p.grad = grads[id(p)] if id(p) in in_chunk else None
        positions = {
            id(p): (gi, pi)
            for gi, group in enumerate(optimizer.param_groups)
            for pi, p in enumerate(group["params"])
            if id(p) in in_chunk
        }
        widened = [
            self._widen(optimizer, p, grads[id(p)], positions[id(p)]) for p in chunk if p.dtype in LOW_PRECISION
        ]
        try:
            type(optimizer).step(optimizer)
        finally:
            for p, wide in widened:
                self._narrow(optimizer, p, wide, grads[id(p)], positions[id(p)])
            for p in chunk:
                p.grad = None

    def _widen(
        self,
        optimizer: torch.optim.Optimizer,
        p: nn.Parameter,
        grad: torch.Tensor,
        where: tuple[int, int],
    ) -> tuple[nn.Parameter, nn.Parameter]:
        """Give the optimizer an fp32 stand-in for ``p``: a parameter with ``p``'s value,
        grad and state in fp32, in ``p``'s place in ``param_groups``. ``p`` keeps its
        dtype: changing it through ``p.data`` would reset ``p``'s gradient accumulator in
        autograd, and with it the hooks DistributedDataParallel registered there."""
        wide = nn.Parameter(p.detach().to(torch.float32), requires_grad=p.requires_grad)
        wide.grad = grad.to(torch.float32)
        p.grad = None
        state = optimizer.state.pop(p, None)
        if state:
            optimizer.state[wide] = cast_optimizer_state(state, torch.float32)
        optimizer.param_groups[where[0]]["params"][where[1]] = wide
        return p, wide

    def _narrow(
        self,
        optimizer: torch.optim.Optimizer,
        p: nn.Parameter,
        wide: nn.Parameter,
        grad: torch.Tensor,
        where: tuple[int, int],
    ) -> None:
        """Round the optimizer's fp32 result back into ``p`` (in place) and store its
        state in ``p``'s dtype, under ``p`` again."""
        low = p.dtype
        optimizer.param_groups[where[0]]["params"][where[1]] = p
        result = wide.detach()
        with torch.no_grad():
            if self.method == "kahan":
                new = kahan_round(result, self._buffer_for(p, p.detach()))
            elif self.method == "stochastic":
                new = stochastic_round(result, low, self._generator_for(result.device))
            else:
                new = result.to(low)
            p.copy_(new)
        state = optimizer.state.pop(wide, None)
        if state:
            optimizer.state[p] = cast_optimizer_state(state, low)
        p.grad = grad

    # -- checkpoints --------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"format", "method", "buffers": [[group, index, tensor], ...],
        "generator": ByteTensor}``: what a resumed run needs to continue bitwise."""
        entries = [
            [gi, pi, self._buffers[id(p)]]
            for gi, pi, p in self._low_params()
            if id(p) in self._buffers
        ]
        out = {
            "format": _STATE_FORMAT,
            "method": self.method,
            "buffers": entries,
            "num_buffers": len(entries),  # a deleted entry is then a refused state, not a partial one
            "generator": self._generator.get_state(),
            "device_generators": {
                str(d): g.get_state() for d, g in self._device_generators.items()
            },
        }
        if any(local_tensor(t) is not t for _, _, t in entries):
            # FSDP2 shards: this rank's pieces only (a DCP checkpoint maps them to any rank)
            out["shard_rank"] = rank_and_world_size()[0]
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore buffers and generator saved by :meth:`state_dict`; the
        optimizer must have the same param groups as when saved. Validated
        completely first (:meth:`check_state_dict`): a rejected state raises
        :class:`~ampkit.StateError` and changes nothing."""
        buffers, generator, device_generators = self._checked(state)
        for p, _ in buffers:
            self._params[id(p)] = p
        self._buffers = {id(p): t for p, t in buffers}
        self._generator.set_state(generator)
        self._device_generators = device_generators

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Raise :class:`~ampkit.StateError` unless :meth:`load_state_dict` would
        accept ``state``."""
        self._checked(state)

    def _checked(
        self, state: Any
    ) -> tuple[list[tuple[nn.Parameter, torch.Tensor]], torch.Tensor, dict[torch.device, torch.Generator]]:
        if not isinstance(state, Mapping) or type(state.get("format")) is not int or state["format"] != _STATE_FORMAT:
            found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise StateError(
                f"compensation state has format {found!r}, expected "
                f"{_STATE_FORMAT}: it was not written by CompensatedUpdates.state_dict()."
            )
        require_fields(state, ("format", "method", "buffers", "generator"), "compensation state", StateError,
                       optional=("device_generators", "num_buffers", "shard_rank"),
                       source="CompensatedUpdates.state_dict()")  # fmt: skip
        rank = rank_and_world_size()[0]
        if "shard_rank" in state and state["shard_rank"] != rank:
            raise StateError(
                f"this compensation state holds the FSDP2 shards of rank {state['shard_rank']!r}; this is "
                f"rank {rank}. Load each rank's own ampkit.state_dict() file, or save and load with "
                "ampkit.distributed.save_checkpoint / load_checkpoint (DCP), which reshards."
            )
        if state["method"] != self.method:
            raise StateError(
                f"the checkpoint used compensation {state['method']!r}, this run "
                f"{self.method!r}: initialize with the same compensation to resume."
            )
        entries = state["buffers"]
        if not isinstance(entries, (list, tuple)):
            raise StateError(f"compensation state: 'buffers' must be a list, got {entries!r:.80}.")
        count = state.get("num_buffers", len(entries))  # absent in 0.3's checkpoints
        if type(count) is not int or count != len(entries):
            raise StateError(
                f"compensation state: 'num_buffers' is {count!r} but {len(entries)} buffer entries are "
                f"present: the state is incomplete or edited. {CORRUPT_CHECKPOINT}"
            )
        groups = self.optimizer.param_groups
        buffers: list[tuple[nn.Parameter, torch.Tensor]] = []
        seen: set[tuple[int, int]] = set()
        for entry in entries:
            if not (
                isinstance(entry, (list, tuple))
                and len(entry) == 3
                and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in entry[:2])
                and isinstance(entry[2], torch.Tensor)
            ):
                raise StateError(
                    f"compensation state: each buffer entry must be [group, index, tensor], got {entry!r:.80}."
                )
            gi, pi, t = entry
            try:
                p = groups[gi]["params"][pi]
            except (IndexError, KeyError):
                raise StateError(
                    f"the checkpoint has a compensation buffer for group {gi}, index "
                    f"{pi}, which this optimizer lacks: build the same param groups "
                    "before loading."
                ) from None
            if (gi, pi) in seen or p.shape != t.shape or p.dtype not in LOW_PRECISION or t.dtype != p.dtype:
                raise StateError(
                    f"compensation buffer at group {gi}, index {pi} is a {t.dtype} tensor of "
                    f"shape {tuple(t.shape)}; the parameter there is {p.dtype} "
                    f"{tuple(p.shape)}: the model does not match the checkpoint."
                )
            # a compensation is the low part a rounding lost: at most half an ulp of its
            # weight, and no weight of this dtype has an ulp above eps * max
            info = torch.finfo(p.dtype)
            if local_tensor(t) is not t and (local_tensor(p) is p or (t.device_mesh, t.placements) != (
                    p.device_mesh, p.placements)):  # fmt: skip
                raise StateError(
                    f"compensation buffer at group {gi}, index {pi} is sharded as {t.placements}; the "
                    "parameter is not sharded that way: load it into the model it was saved from."
                )
            require_tensor(local_tensor(t), f"compensation buffer at group {gi}, index {pi}", StateError,
                           p.dtype, finite=True, hint=CORRUPT_CHECKPOINT, max_abs=info.eps * info.max)
            seen.add((gi, pi))
            buffers.append((p, t.detach().to(device=p.device, copy=True)))
        generator = _checked_generator_state(state["generator"], "cpu")
        saved_devices = state.get("device_generators", {})
        if not isinstance(saved_devices, Mapping):
            raise StateError(f"compensation state: 'device_generators' must be a dict, got {saved_devices!r:.80}.")
        device_generators: dict[torch.device, torch.Generator] = {}
        for d, s in saved_devices.items():
            try:
                device = torch.device(d)
                gen = torch.Generator(device=device)
            except (RuntimeError, TypeError):
                raise StateError(f"compensation state: no generator on device {d!r} here.") from None
            gen.set_state(_checked_generator_state(s, str(device)))
            device_generators[device] = gen
        return buffers, generator, device_generators

    def param_and_state_bytes(self) -> int:
        """Bytes held by the optimizer's parameters, its state tensors and the
        compensation buffers."""
        return _tensor_bytes(
            [p for g in self.optimizer.param_groups for p in g["params"]],
            self.optimizer,
        ) + sum(local_tensor(b).numel() * b.element_size() for b in self._buffers.values())


def _checked_generator_state(state: Any, device: str) -> torch.Tensor:
    """``state`` if a generator on ``device`` accepts it (tried on a scratch one)."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
        raise StateError(
            f"compensation state: a generator state must be a 1-d uint8 tensor, got {state!r:.80}."
        )
    try:
        torch.Generator(device=device).set_state(state)
    except (RuntimeError, TypeError, ValueError) as err:
        raise StateError(f"compensation state: invalid {device} generator state ({err}).") from None
    return state


def _buffer_fits(buf: torch.Tensor | None, like: torch.Tensor) -> bool:
    """Whether ``buf`` is a compensation buffer for a parameter shaped as ``like``: made,
    of its shape and dtype (else one is made anew: zeros)."""
    return buf is not None and buf.shape == like.shape and buf.dtype == like.dtype


def _tensor_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    """Bytes of ``params`` and ``optimizer``'s state tensors on this rank (a DTensor
    counts its local shard)."""
    total = sum(local_tensor(p.detach()).numel() * p.element_size() for p in params)
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                total += local_tensor(v).numel() * v.element_size()
    return total


class _CompensatedStep(StepExtension):
    """The compensated update of a managed optimizer's taken steps: the pre-step work
    right before the optimizer's own ``step``, the grads put back right after.

    Right on a step skipped on the device (:mod:`ampkit.trainer.device_skip`) where
    every 16-bit grad goes through a dedicated kernel (:attr:`device_skip`): those take
    the step's found-inf flag (weights, compensation and state kept where it is set),
    the fp32 rest steps with torch's fused kernel and the same flag, and the step
    counters the kernels advanced are settled once the outcome is known. The generic
    path (fp32 copies rounded back) keeps the step decided on the host."""

    steps_grads_itself = True  # the dedicated kernels read the 16-bit grads

    def __init__(self, comp: CompensatedUpdates) -> None:
        self.comp = comp
        self._managed: Any = lambda: None
        self._plan: list[tuple[dict, OptimizerRule, list[nn.Parameter]]] | None = None
        self._counts: list[StepCounts] = []
        self._own: set[int] = set()

    def on_add(self, optimizer: Any) -> None:
        self._managed = weakref.ref(optimizer)

    @property  # type: ignore[override]
    def device_skip(self) -> bool:  # asked once per step, right before the update
        comp = self.comp
        opt = comp.optimizer
        low = [p for _, _, p in comp._low_params() if p.grad is not None]
        self._plan = plan = comp._plan(opt)  # the update right after uses it
        done = {id(p) for _, _, params in plan for p in params}
        self._own = {id(group) for group, _, _ in plan if all(p.grad is None or id(p) in done for p in group["params"])}
        # a parameter without its compensation buffer yet (its first step, or state loaded
        # without ampkit's): the step makes it, so a skipped one must be known first
        fresh = any(not _buffer_fits(comp.buffer(p), p)
                    for _, _, params in plan for p in params)  # fmt: skip
        return not fresh and all(id(p) in done for p in low)

    def own_groups(self) -> set[int]:
        return self._own

    def before_update(self, args: tuple, kwargs: dict) -> None:
        opt = self.comp.optimizer
        managed = self._managed()
        skip = managed.skip_flag if managed is not None else None
        plan, self._plan = self._plan, None
        self._counts += self.comp._pre_step(opt, (opt, *args), kwargs, skip=skip, plan=plan if skip is not None else None)

    def after_update(self) -> None:
        opt = self.comp.optimizer
        self.comp._post_step(opt, (opt,), {})

    def after_step(self, skipped: bool) -> None:
        self._plan = None
        counts, self._counts = self._counts, []
        for c in counts:
            c.settle(skipped)
