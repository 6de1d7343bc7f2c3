"""Multi-process training: skip decisions every rank agrees on, DDP/FSDP2 helpers.

If one rank skips a step and another takes it, the replicas stop being replicas,
silently; code between backward and the step can change one rank's gradients only
(per-rank noise or masks, writes through ``.data``, ``no_sync`` accumulation, several
loss ids), so with agreement on, the step's found-inf segments are encoded on the device
into one small vector (per loss id: overflowed, masked, clean or absent; plus the skip
flag) and go through **one** ``all_reduce(MAX)``, whose host read is the step's one host
sync: every rank skips together and feeds every loss scaler the same event. Ranks that
scaled different loss ids in one step get a :class:`~ampkit.DistributedError` on every
rank. :func:`set_sync` chooses per optimizer (``"auto"``, ``"always"``, ``"never"``),
:func:`sync_plan` says what the next step will do and why; the modes, their costs and the
DDP/FSDP2 recipes per opt level are ``docs/guides/distributed.md``.

How it plugs in: :data:`AGREEMENT` implements :class:`ampkit.trainer.decision.StepAgreement`;
importing this module installs it as the trainer's default agreement
(:func:`ampkit.trainer.extensions.set_default_agreement`), which ``ampkit.init_trainer``
hands to every managed optimizer, whose step calls it before reading the flags; the skip
rule is :func:`ampkit.trainer.decision.decide`, the same for one process and many.
Nothing happens in a single process, or before ``torch.distributed`` is initialized.
:func:`register_ddp` broadcasts O2's masters from rank 0 (built from each rank's fp32
model before DDP broadcast its weights); without it, masters that differ make the first
step raise a :class:`~ampkit.DistributedError`.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from ampkit._internal.dtypes import torch_class
from ampkit._internal.validate import require_choice
from ampkit.errors import DistributedError
from ampkit.levels.sharding import (
    FSDPGuard as FSDPGuard,  # 0.3's pickled path ampkit.distributed.core.FSDPGuard
)
from ampkit.trainer import extensions as _extensions
from ampkit.trainer import loss_slots as _trainer
from ampkit.trainer import managed as _step
from ampkit.trainer import session as _session

# SyncBatchNorm and the ranks' state check live in modules of their own; importable from here
from .ranks import check_ranks_agree, fingerprint
from .syncbn import convert_bn, convert_sync_batchnorm

__all__ = [
    "fingerprint",
    "convert_bn",
    "SyncMode",
    "SyncPlan",
    "set_sync",
    "sync_plan",
    "register_ddp",
    "convert_sync_batchnorm",
    "check_ranks_agree",
]

SyncMode = Literal["auto", "always", "never"]
_MODES = ("auto", "always", "never")

dist = torch.distributed


# --- per-optimizer settings ------------------------------------------------------------


@dataclasses.dataclass
class _Settings:
    sync: SyncMode = "auto"
    group: Any = None  # process group; None: the default (world) group
    masters_checked: bool = False


# Module state: per-optimizer sync settings (weak keys), set by set_sync.
_SETTINGS: weakref.WeakKeyDictionary[_step.ManagedOptimizer, _Settings] = (
    weakref.WeakKeyDictionary()
)


def agrees_over_world(state: _step.ManagedOptimizer) -> bool:
    """Whether this optimizer's skip decisions are agreed over the whole world (any
    sync mode but ``"never"``, on the default group): every rank skips the same steps."""
    settings = _SETTINGS.get(state)
    return settings is None or (settings.sync != "never" and settings.group is None)


def _settings(state: _step.ManagedOptimizer) -> _Settings:
    s = _SETTINGS.get(state)
    if s is None:
        s = _SETTINGS[state] = _Settings()
    return s


def set_sync(
    optimizer_or_list: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    sync: SyncMode = "auto",
    *,
    group: Any = None,
) -> None:
    """Choose when the skip decision of a managed optimizer is agreed across ranks.

    Args:
        optimizer_or_list: optimizer(s) managed by :func:`ampkit.init_trainer` or
            :func:`ampkit.initialize` (set it after those: a new ``initialize`` starts
            from the defaults).
        sync: ``"auto"`` (default: agree on every multi-rank step unless the grads are
            FSDP2's DTensors, which torch agrees on), ``"always"`` or ``"never"``; see
            the module docs.
        group: the process group to agree over (default: the world).
    """
    require_choice(sync, _MODES, "set_sync: sync", DistributedError)
    opts = list(optimizer_or_list) if isinstance(optimizer_or_list, (list, tuple)) else [optimizer_or_list]
    for opt in opts:
        s = _settings(_step.managed_state(opt))
        s.sync = sync
        s.group = group


# --- DDP models announced by the user ----------------------------------------------------


def register_ddp(ddp_model: nn.Module) -> nn.Module:
    """Broadcast the fp32 master weights (O2) of ``ddp_model``'s parameters from its
    group's first rank, as DDP's constructor does with the model's own weights, and
    return the model. Call it on every rank, right after wrapping::

        model, opt = ampkit.initialize(model, opt, opt_level="O2")
        model = ampkit.distributed.register_ddp(DDP(model))

    Masters built from differently seeded models then agree; without it (and without
    the same seed on every rank) the first step raises :class:`~ampkit.DistributedError`.
    The skip decision is agreed over the ranks either way (:func:`set_sync`)."""
    ddp_cls = nn.parallel.DistributedDataParallel
    if not isinstance(ddp_model, ddp_cls):
        raise DistributedError(
            f"register_ddp expects a torch.nn.parallel.DistributedDataParallel, got "
            f"{type(ddp_model).__name__}; wrap the model first: register_ddp(DDP(model))."
        )
    ignored = set(getattr(ddp_model, "parameters_to_ignore", ()))
    param_ids = frozenset(
        id(p) for name, p in ddp_model.module.named_parameters() if p.requires_grad and name not in ignored
    )
    _broadcast_masters(param_ids, ddp_model.process_group)
    return ddp_model


def _managed_states() -> list[_step.ManagedOptimizer]:
    return [
        state
        for member in _session.current_session().members
        if isinstance(member, _trainer.Trainer)
        for state in member.optimizers
    ]


def _master_pairs(state: _step.ManagedOptimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(fp32 master, 16-bit model parameter) for each mastered parameter (O2)."""
    backward = state.backward_params
    if backward is None:
        return []
    return [(m, p) for m, p in zip(state.grad_params(), backward) if m is not p]


def _broadcast_masters(param_ids: frozenset[int], group: Any) -> None:
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for state in _managed_states():
            for master, model_p in _master_pairs(state):
                if id(model_p) in param_ids:
                    dist.broadcast(master.data, src=src, group=group)


# --- the decision: agree or not ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SyncPlan:
    """What the next step of an optimizer does about cross-rank agreement.

    Attributes:
        agree: whether its found-inf flags go through one ``all_reduce(MAX)``.
        reason: why, in words.
    """

    agree: bool
    reason: str


def sync_plan(optimizer: torch.optim.Optimizer) -> SyncPlan:
    """Whether the next ``step()`` of ``optimizer`` would all-reduce its found-inf flag,
    judged from its gradients and the registered DDP models now (as for a step that
    checks its grads once, i.e. one loss id)."""
    state = _step.managed_state(optimizer)
    return _plan(state, num_segments=1)


def _plan(state: _step.ManagedOptimizer, num_segments: int) -> SyncPlan:
    if not (dist.is_available() and dist.is_initialized()):
        return SyncPlan(False, "torch.distributed is not initialized")
    s = _SETTINGS.get(state) or _Settings()
    if dist.get_world_size(s.group) < 2:
        return SyncPlan(False, "a single process in the group")
    if s.sync == "never":
        return SyncPlan(False, "sync='never'")
    if s.sync == "always":
        return SyncPlan(True, "sync='always'")
    # Only what every rank sees alike decides (a rank that all-reduces while another
    # does not would hang): the sync mode and the kind of grads, never this rank's
    # values. The grads are on the params in param_groups or, before an O2 step moved
    # them into the masters, on the model's params.
    backward = state.backward_params
    grads = [
        p.grad
        for p in itertools.chain(state.grad_params(), backward if backward is not None else ())
        if p.grad is not None
    ]
    dtensor = torch_class("torch.distributed.tensor", "DTensor")
    if grads and dtensor is not None and all(isinstance(g, dtensor) for g in grads):
        return SyncPlan(
            False, "the grads are DTensors: torch's unscale kernel already all-reduces the flag"
        )
    if num_segments > 1:
        return SyncPlan(True, "several loss ids were checked between backward passes this step")
    return SyncPlan(
        True,
        "the ranks' grads can differ at the step (changed on one rank after DDP's all-reduce, "
        "also through .data, which only the values show; no_sync; per-rank losses)",
    )


class _Agreement:
    """The one collective of a step: ``all_reduce(MAX)`` over ``group`` of a vector
    living on ``device``. At an optimizer's first distributed step it carries one more
    element, this rank's verdict on its master weights, so that a mismatch on any rank
    raises on every rank instead of leaving the others waiting in a collective."""

    def __init__(self, group: Any, like: torch.device, first_step_error: str | None | bool) -> None:
        self.group = group
        self.device = _comm_device(group, like)
        # False: no check this step; None: checked, fine; str: what is wrong here.
        self._first_step_error = first_step_error

    def reduce(self, tensor: torch.Tensor) -> None:
        error = self._first_step_error
        if error is False:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
            return
        flag = torch.full((1,), 0.0 if error is None else 1.0, device=tensor.device)
        packed = torch.cat([tensor, flag])
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=self.group)
        if packed[-1].item() > 0:
            raise DistributedError(error or _MASTERS_ELSEWHERE)
        tensor.copy_(packed[:-1])


def _comm_device(group: Any, like: torch.device) -> torch.device:
    backend = str(dist.get_backend(group))
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend in ("gloo", "mpi"):
        return torch.device("cpu")
    return like  # e.g. "cpu:gloo,cuda:nccl": the flags' own device is supported


def _agreement_for(
    state: _step.ManagedOptimizer, segments: Sequence[tuple[int | None, torch.Tensor | None]]
) -> _Agreement | None:
    """The trainer's hook, called once per step before the found-inf flags are read."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    s = _settings(state)
    if dist.get_world_size(s.group) < 2:
        return None
    if not _plan(state, len(segments)).agree:
        return None
    # The masters check rides on the collective, so that a mismatch on one rank raises
    # on every rank.
    first_step_error: str | None | bool = False
    if not s.masters_checked:
        s.masters_checked = True
        if _master_pairs(state):
            first_step_error = _masters_mismatch(state)
    like = next((f.device for _, f in segments if f is not None), torch.device("cpu"))
    return _Agreement(s.group, like, first_step_error)


_MASTERS_FIX = (
    "Call ampkit.distributed.register_ddp(ddp_model) on every rank right after wrapping "
    "(it broadcasts the masters too), or seed every rank the same before building the "
    "model (loading model weights with load_state_dict, before or after initialize, "
    "keeps the masters in step too)."
)
_MASTERS_ELSEWHERE = (
    "fp32 master weights do not match the model's 16-bit weights on another rank at the "
    "first step, so the replicas would drift apart. " + _MASTERS_FIX
)


def _masters_mismatch(state: _step.ManagedOptimizer) -> str | None:
    """Checked once per optimizer, at its first distributed step: every fp32 master must
    round to its model weight. DDP overwrites the model's weights with rank 0's at
    construction; masters built before from this rank's own weights would then train a
    different model and drag the replicas apart."""
    for master, model_p in _master_pairs(state):
        if not torch.equal(model_p.detach(), master.detach().to(model_p.dtype)):
            return (
                f"rank {dist.get_rank()}: fp32 master weights do not match the model's "
                f"{model_p.dtype} weights at the first step. The model's weights changed "
                "after ampkit.initialize built the masters -- most likely "
                "DistributedDataParallel broadcast rank 0's weights and this rank's model "
                "was initialized differently. " + _MASTERS_FIX
            )
    return None


class _DistributedAgreement:
    """ampkit's :class:`~ampkit.trainer.decision.StepAgreement`: how a managed step joins
    the other ranks (given to every managed optimizer by ``init_trainer``). Stateless:
    what it needs lives in the per-optimizer settings above."""

    # The module function itself (no forwarding frame: it runs on every step).
    agreement = staticmethod(_agreement_for)


#: The agreement every managed optimizer uses (see :class:`_DistributedAgreement`):
#: installed as the trainer's default when this module is imported.
AGREEMENT = _DistributedAgreement()
_extensions.set_default_agreement(AGREEMENT)
