"""The run's optimizers: one :class:`_OptRecord` per optimizer the script builds,
and :class:`_Optimizers`, which puts them under ampkit (one ``init_trainer`` for O1,
one ``initialize`` with the models they train for O2/O2K), supersedes an optimizer
built again over the same parameters, and reads their step counts back."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampkit.errors import AmpError
from ampkit.levels.opt_level import OPT_LEVELS
from ampkit.levels.precision_plan import PlanError
from ampkit.trainer.extensions import StepExtension

from .config import RunConfig, RunRefused, _Refusal, casts_model
from .find_models import _models_of
from .forward_scope import _ForwardScope


@dataclasses.dataclass
class _OptRecord:
    """One optimizer the script built: where, what ampkit applied, its step counts."""

    ref: weakref.ref
    index: int
    kind: str
    site: str
    level: str  # what ampkit applied: "O1", "O2", "O2K", "fp32" (left alone), "superseded"
    steps: int = 0
    skipped: int = 0
    scale: float | None = None
    born: int = 0  # the run's event count (builds and steps) when it was built
    last_step: int = -1  # ... at its last step
    backwards_at_step: int = -1  # the run's backward() count at its last step
    repeated: int = 0  # steps taken with no backward() since its previous step
    repeated_site: str | None = None  # the first of them


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


class _Optimizers:
    """The optimizers of a run, in the order built (:attr:`records`), and their
    management under ``config``'s level.

    ``note`` receives a sentence for the report (an optimizer left alone, a fallback to
    O1); ``watch(opt)`` makes the extension added to each managed optimizer (the run's
    view of its steps, :class:`~.steps._StepWatch`); ``forward`` (None at fp32) tells
    which models' graphs still wait for their backward."""

    def __init__(
        self,
        config: RunConfig,
        note: Callable[[str], None],
        watch: Callable[[torch.optim.Optimizer], StepExtension],
        forward: _ForwardScope | None,
    ) -> None:
        self.config = config
        self.dtype = config.torch_dtype
        self.records: list[_OptRecord] = []
        #: what ampkit applies: the level asked, or "O1" after a fallback
        self.level_applied = config.level
        self._note = note
        self._watch = watch
        self._forward = forward
        self._scaler: Any = None
        self._o2_models: list[nn.Module] = []

    def live(self) -> list[_OptRecord]:
        """The records of the managed optimizers still alive."""
        return [r for r in self.records if r.ref() is not None and r.level in OPT_LEVELS]

    def unmanaged(self) -> list[torch.optim.Optimizer]:
        """The optimizers the script built that ampkit does not manage now (the fp32
        run's, one left alone, one superseded and released), alive."""
        return [opt for opt in self._alive() if not _is_managed(opt)]

    def _alive(self) -> list[torch.optim.Optimizer]:
        return [opt for opt in (rec.ref() for rec in self.records) if opt is not None]

    def supersede(self, new: _OptRecord) -> None:
        """Earlier optimizers over the new one's parameters are dropped, managed ones
        released from the trainer (the script built a new optimizer for the same model:
        a new phase, or per epoch); the new one marks the iterations in their place."""
        new_ids = {id(p) for p in _params(new.ref())}
        for rec in self.records:
            opt = rec.ref()
            if rec is new or opt is None or rec.level == "superseded":
                continue
            if any(id(p) in new_ids for p in self.model_params(opt)):
                self.fold_stats(rec)
                rec.level = "superseded"

    def model_params(self, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The model tensors ``opt`` trains: its parameters, or the 16-bit model weights
        behind its fp32 masters (O2/O2K)."""
        from ampkit.levels.setup import master_weights_of

        mw = master_weights_of(opt)
        if mw is not None:
            return list(mw.backward_params())
        return _params(opt)

    def manage(self, record: _OptRecord) -> None:
        """Put ``record``'s optimizer under ampkit at the run's level (O2/O2K: with the
        models it trains, else O1 with a note saying why). Raises :class:`RunRefused` for an
        optimizer that steps the 16-bit weights of a model cast for an earlier one."""
        opt = record.ref()
        low = [p for p in _params(opt) if p.is_floating_point() and p.dtype != torch.float32]
        if low and self._o2_models:
            raise RunRefused(
                f"the optimizer built at {record.site} steps {len(low)} 16-bit tensor(s): the weights "
                f"of a model {self.config.level} cast for an earlier optimizer, whose fp32 masters it "
                "cannot rebuild from them. Run with --level O1."
            )
        if casts_model(self.level_applied):
            why = self._setup_cast(record)
            if why is None:
                return
            self._note(
                f"{self.config.level} not applied: the optimizer built at {record.site} "
                f"({record.kind}) {why}; falling back to O1 for it (casting in forward passes, "
                "fp32 weights)"
            )
            record.level = "O1"
            if self._o2_models:  # earlier optimizers stay as they are; this one on its own
                self._manage_alone(record)
                return
            self.level_applied = "O1"
        record.level = "O1"
        self._setup_o1()

    def _manage_alone(self, record: _OptRecord) -> None:
        from ampkit.scaling.loss_scaler import LossScaler
        from ampkit.trainer.api import init_trainer

        opt = record.ref()
        scaler = LossScaler() if self.dtype == torch.float16 else LossScaler(init_scale=1.0, dynamic=False)
        init_trainer(opt, scaler=scaler)
        self._restore({}, [opt])

    def _carry(self) -> dict[int, tuple[int, int, bool]]:
        from ampkit.trainer.api import managed_state

        out = {}
        for rec in self.live():
            opt = rec.ref()
            try:
                st = managed_state(opt)
            except AmpError:
                continue
            out[id(opt)] = (st.steps, st.skipped, st.last_skipped)
        return out

    def _release_all(self) -> None:
        from ampkit.trainer.api import release

        for opt in self._alive():
            if _is_managed(opt):
                release(opt)

    def _restore(self, carried: dict[int, tuple[int, int, bool]], opts: list[torch.optim.Optimizer]) -> None:
        from ampkit.trainer.api import managed_state

        for opt in opts:
            st = managed_state(opt)
            if id(opt) in carried:
                st.steps, st.skipped, st.last_skipped = carried[id(opt)]
            st.add_extension(self._watch(opt))

    def _setup_o1(self) -> None:
        """One ``init_trainer`` over every live managed optimizer (one shared scaler)."""
        from ampkit.scaling.loss_scaler import LossScaler
        from ampkit.trainer.api import init_trainer

        carried = self._carry()
        self._release_all()
        opts = [r.ref() for r in self.live()]
        if self._scaler is None:
            self._scaler = LossScaler() if self.dtype == torch.float16 else LossScaler(init_scale=1.0, dynamic=False)
        init_trainer(opts, scaler=self._scaler)
        self._restore(carried, opts)

    def _setup_cast(self, record: _OptRecord) -> str | None:
        """O2/O2K for every live managed optimizer and the models that own their
        parameters (one ``initialize``); returns why not, changing nothing, or None."""
        from ampkit.levels.setup import initialize

        records = self.live()
        record.level = self.level_applied
        records = [*records, record] if record not in records else records
        opts = [r.ref() for r in records]
        params = [p for opt in opts for p in self.model_params(opt)]
        models, why = _models_of(params)
        if why is not None:
            record.level = "fp32"
            return why.format(level=self.config.level)
        stepped = {id(p) for p in params}
        if self._forward is not None and any(
            id(p) in stepped for ref in self._forward.pending.values() if ref() is not None for p in ref().parameters()
        ):
            record.level = "fp32"
            return (
                "comes after a forward pass of its model whose backward() has not run yet: that graph "
                f"holds the fp32 weights {self.config.level} would cast to 16 bits"
            )
        for model in models:
            trainable = [p for p in model.parameters() if p.requires_grad]
            extra = [p for p in trainable if id(p) not in stepped]
            if extra:
                record.level = "fp32"
                return (
                    f"steps {len(trainable) - len(extra)} of the {len(trainable)} trainable parameter "
                    f"tensors of {type(model).__name__}; {self.config.level} would cast the others to "
                    "16 bits without fp32 masters"
                )
        carried = self._carry()
        overrides: dict[str, Any] = {"dtype": self.dtype}
        if self.config.plan is not None:
            overrides["plan"] = self.config.plan
        try:
            initialize(models, opts, opt_level=self.config.level, **overrides)
        except PlanError as err:  # the plan was asked for: no silent fp32 run instead
            raise _Refusal(RunRefused(f"the plan cannot be applied to this script's model: {err}")) from None
        except AmpError as err:
            record.level = "fp32"
            return f"cannot be set up ({err})"
        self._o2_models = models
        self._restore(carried, opts)
        return None

    def fold_stats(self, rec: _OptRecord) -> None:
        """Copy the managed optimizer's steps, skips and loss scale into ``rec``."""
        from ampkit.trainer.api import managed_state

        opt = rec.ref()
        if opt is None:
            return
        try:
            st = managed_state(opt)
        except AmpError:
            return
        rec.steps, rec.skipped = st.steps, st.skipped
        rec.scale = st.scalers[0].scale if st.scalers else None

    def collect_stats(self) -> None:
        """:meth:`fold_stats` for every managed record (before the run is undone)."""
        for rec in self.records:
            if rec.level in OPT_LEVELS:
                self.fold_stats(rec)

    def param_owners(self) -> dict[int, torch.optim.Optimizer]:
        """``id(parameter)`` -> the managed optimizer that steps it (its masters, for O2)."""
        owners: dict[int, torch.optim.Optimizer] = {}
        for rec in self.live():
            opt = rec.ref()
            for p in self.model_params(opt):
                owners[id(p)] = opt
        return owners


def _is_managed(opt: torch.optim.Optimizer) -> bool:
    from ampkit.trainer.api import managed_state

    try:
        managed_state(opt)
    except AmpError:
        return False
    return True
