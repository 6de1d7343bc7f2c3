"""The Trainer mixin of the HF integration (:mod:`ampkit.integrations.hf`, which documents
what it does): :class:`AmpkitTrainerMixin`, :class:`AmpkitTrainer`, :func:`enable` for a
stock Trainer, and the check of the Trainer privates it overrides."""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from ampkit import (
    Fp8Recipe,
    TunePlan,
    autocast,
    convert,
    initialize,
    master_params,
    scale_loss,
    unscale,
)
from ampkit import state_dict as amp_state_dict

from .. import require
from .._files import (
    checkpoint_file_present,
    checkpoint_read_limit,
    checkpoint_what,
    prepare_state_load,
    read_checkpoint_file,
    write_checkpoint_file,
)
from .._shared import (
    OPT_LEVELS,
    check_target,
    checked_plan,
    dtype_from_env,
    install_hint,
    is_fp32_level,
    level_names,
    master_weights_of,
    resolve_opt_level,
)
from ..banner import announce
from .arguments import (
    AmpkitArguments,
    AmpkitOptions,
    HfIntegrationError,
    check_arguments,
    dtype_of,
    level_of,
    resolve_options,
)
from .callbacks import AmpkitSkipSignal, _RegisterDDP
from .weights import (
    _check_weights16,
    _param_names,
    _raw_optimizer,
    _stepped16_names,
    _training_checkpoint,
    _write_config_dtype,
    fp32_state_dict,
)

transformers = require("transformers", "hf")

from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from transformers import Seq2SeqTrainer, Trainer  # noqa: E402
from transformers.utils import is_sagemaker_mp_enabled  # noqa: E402

#: The private methods of ``transformers.Trainer`` :class:`AmpkitTrainerMixin` overrides,
#: each with the parameters its override takes and passes on. transformers may rename
#: or change them in any release; an override of a method that is gone would never run
#: (checkpoints without ampkit's state, clipping of scaled grads), so the installed
#: release is checked against this list when the module is imported
#: (:func:`check_trainer_contract`).
TRAINER_PRIVATES: dict[str, tuple[str, ...]] = {
    "_clip_grad_norm": ("model",),
    "_get_grad_norm": ("model", "grad_norm"),
    "_save_scaler": ("output_dir",),
    "_load_scaler": ("checkpoint",),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_load_best_model": (),
    "_save": ("output_dir", "state_dict"),
}

#: The file ampkit's state is saved to in every checkpoint folder, beside ``optimizer.pt``.
AMPKIT_NAME = "ampkit.pt"
#: /2: ``weights16`` holds every 16-bit weight stepped as it is, so a missing one is
#: seen (/1 held only those the fp32 weights do not round back to).
_FORMAT = "ampkit.integrations.hf/2"

# --- the trainer ------------------------------------------------------------------------


@dataclasses.dataclass
class _Setup:
    """What the mixin set up: the raw optimizer, the level, where names come from."""

    optimizer: torch.optim.Optimizer
    model: weakref.ref[nn.Module]
    level: str
    dtype: torch.dtype | None  # None at O0
    device_type: str
    param_names: list[list[str]]


@dataclasses.dataclass
class _Resume:
    """A resume under way: the checkpoint, its read :data:`AMPKIT_NAME`, the session it
    was checked against, and what applies it (after HF loaded the optimizer state)."""

    checkpoint: str
    saved: dict[str, Any]
    setup: _Setup | None
    apply: Callable[[], None] | None  # None: ampkit was not set up


class AmpkitTrainerMixin:
    """ampkit's mixed precision for a ``transformers.Trainer`` subclass; list it first:
    ``class MyTrainer(AmpkitTrainerMixin, Seq2SeqTrainer)``. Reads ``amp_level``,
    ``amp_dtype``, ``amp_fp8``, ``amp_save_weights`` and ``amp_plan`` from the
    :class:`AmpkitOptions` :func:`enable` kept on the trainer, else from ``self.args``
    (:class:`AmpkitArguments`; a plain ``TrainingArguments`` gets their defaults: O1,
    the device's dtype). See the module docstring for what each overridden method does.

    After ``train()`` has set ampkit up, :attr:`amp_optimizer` is the raw optimizer
    ampkit manages: pass it to :func:`ampkit.stats`, :func:`ampkit.master_params`,
    :func:`ampkit.step_skipped`.
    """

    _ampkit: _Setup | None = None
    _ampkit_resume: _Resume | None = None

    # -- arguments and setup ---------------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        """HF's accelerator, then the checks: arguments valid, no DeepSpeed, FSDP or
        SageMaker model parallelism (each owns the weights' dtype and the optimizer)."""
        check_arguments(self.args, self.__dict__.get("_ampkit_options"))
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        _refuse_backends(self)

    def _amp_source(self) -> Any:
        """Where the ``amp_*`` settings come from: :func:`enable`'s options, else the arguments."""
        return self.__dict__.get("_ampkit_options") or self.args

    @property
    def amp_level(self) -> str:
        """The ampkit opt level of this trainer: :func:`enable`'s, else ``args.amp_level``
        (upper case), else ``AMPKIT_LEVEL``, else ``"O1"``."""
        return level_of(self._amp_source())

    @property
    def amp_dtype(self) -> torch.dtype | None:
        """The 16-bit compute dtype (None at O0): ``amp_dtype`` (:func:`enable`'s or the
        arguments'), else ``AMPKIT_DTYPE``, else the level's default on the device (bf16
        at O2K, else bf16 on CPU, fp16 on CUDA)."""
        if is_fp32_level(self.amp_level):
            return None
        chosen = dtype_of(getattr(self._amp_source(), "amp_dtype", None)) or dtype_from_env()
        return chosen or resolve_opt_level(self.amp_level, self.args.device.type).dtype

    @property
    def amp_plan(self) -> TunePlan | None:
        """The plan at ``amp_plan`` (:func:`enable`'s or the arguments'; read once per
        trainer), or None."""
        path = getattr(self._amp_source(), "amp_plan", None)
        if path is None:
            return None
        cached = self.__dict__.get("_ampkit_plan")
        if cached is None or cached[0] != path:
            cached = self.__dict__["_ampkit_plan"] = (path, checked_plan(path, "amp_plan"))
        return cached[1]

    @property
    def amp_optimizer(self) -> torch.optim.Optimizer | None:
        """The raw ``torch.optim.Optimizer`` ampkit manages (None before ``train()``)."""
        return None if self._ampkit is None else self._ampkit.optimizer

    def amp_fp8_recipe(self) -> Fp8Recipe | None:
        """The fp8 recipe passed to :func:`ampkit.initialize`: the default
        :class:`ampkit.Fp8Recipe` when ``amp_fp8`` is True, else None. Override it
        in a subclass for another recipe (e.g. ``Fp8Recipe(min_features=256)``)."""
        return Fp8Recipe() if getattr(self._amp_source(), "amp_fp8", False) else None

    def create_optimizer(self, model: nn.Module | None = None) -> Any:
        """HF's optimizer (built from the arguments, or the one given to the Trainer),
        then :func:`ampkit.initialize` of ``trainer.model`` and that optimizer at
        ``amp_level``, before Accelerate wraps either. Called again with the same
        optimizer (a second ``train()``), it keeps the setup."""
        optimizer = super().create_optimizer(model)  # type: ignore[misc]
        raw = _raw_optimizer(optimizer)
        if not isinstance(raw, torch.optim.Optimizer):
            raise HfIntegrationError(
                f"the Trainer's optimizer is a {type(optimizer).__name__} holding no "
                "torch.optim.Optimizer; ampkit manages torch optimizers only."
            )
        if self._ampkit is not None and self._ampkit.optimizer is raw:
            return optimizer
        self._setup_ampkit(raw)
        return optimizer

    def _setup_ampkit(self, raw: torch.optim.Optimizer) -> None:
        model = self.model
        if not isinstance(model, nn.Module):
            raise HfIntegrationError("the Trainer has no model to set up; pass model= or model_init=.")
        names = _param_names(model, raw)
        level, dtype = self.amp_level, self.amp_dtype
        overrides: dict[str, Any] = {}
        if dtype is not None:
            overrides["dtype"] = dtype
        if OPT_LEVELS[level].op_casting:
            # casting only inside compute_loss (autocast_smart_context_manager), not process-wide
            overrides["op_casting"] = False
        plan = self.amp_plan
        if plan is not None:
            overrides["plan"] = plan
        initialize(model, raw, level, fp8=self.amp_fp8_recipe(), **overrides)
        device_type = next((t.device.type for t in model.parameters()), self.args.device.type)
        self._ampkit = _Setup(raw, weakref.ref(model), level, dtype, device_type, names)
        announce("Hugging Face", "Trainer", level, dtype)
        if not any(isinstance(cb, AmpkitSkipSignal) for cb in self.callback_handler.callbacks):
            self.add_callback(AmpkitSkipSignal())
        if not any(isinstance(cb, _RegisterDDP) for cb in self.callback_handler.callbacks):
            self.add_callback(_RegisterDDP(self))

    # -- forward, backward, clipping -------------------------------------------------------

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> AbstractContextManager[Any]:
        """The scope HF enters around ``compute_loss`` (training and ``prediction_step``):
        :class:`ampkit.autocast` in ``amp_dtype`` at O1; nothing at other levels (O2,
        O3, O2K models cast their own forward; O0 is fp32)."""
        if not OPT_LEVELS[self.amp_level].op_casting:
            return nullcontext()
        device_type = self._ampkit.device_type if self._ampkit is not None else self.args.device.type
        plan = self.amp_plan
        return autocast(
            policy=None if plan is None or not plan.lowered else plan.policy(),
            device_type=device_type, dtype=self.amp_dtype, cache_enabled=cache_enabled is not False,
        )

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """HF's training step with its ``accelerator.backward(loss)`` inside
        :func:`ampkit.scale_loss`."""
        with self._scaled_backward():
            return super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]

    @contextmanager
    def _scaled_backward(self) -> Iterator[None]:
        setup = self._ampkit
        if setup is None:
            yield
            return
        accelerator = self.accelerator
        had_own = "backward" in vars(accelerator)
        backward = accelerator.backward

        def scaled_backward(loss: torch.Tensor, **kwargs: Any) -> None:
            with scale_loss(loss, setup.optimizer) as scaled:
                backward(scaled, **kwargs)

        accelerator.backward = scaled_backward
        try:
            yield
        finally:
            if had_own:
                accelerator.backward = backward
            else:
                del accelerator.backward

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        """``max_grad_norm`` clipping on the parameters the optimizer steps (the fp32
        masters under O2), unscaled first: the norm of the real gradients."""
        setup = self._ampkit
        if setup is None:
            return super()._clip_grad_norm(model)  # type: ignore[misc]
        unscale(setup.optimizer)
        params = [p for p in master_params(setup.optimizer) if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        """The gradient norm HF logs: with ``max_grad_norm=0`` (no clipping), the norm of
        the real gradients of the parameters the optimizer steps."""
        setup = self._ampkit
        if setup is None or grad_norm is not None:
            return super()._get_grad_norm(model, grad_norm)  # type: ignore[misc]
        unscale(setup.optimizer)
        grads = [p.grad for p in master_params(setup.optimizer) if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads)

    # -- checkpoints -----------------------------------------------------------------------

    def _save_scaler(self, output_dir: str) -> None:
        """HF's scaler file (none under ampkit), then :data:`AMPKIT_NAME`."""
        super()._save_scaler(output_dir)  # type: ignore[misc]
        setup = self._ampkit
        if setup is None or not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        write_checkpoint_file(os.path.join(output_dir, AMPKIT_NAME), self._ampkit_state(setup), HfIntegrationError)

    def _ampkit_state(self, setup: _Setup) -> dict[str, Any]:
        model = self._setup_model(setup)
        # every 16-bit weight stepped as it is (O2K, O3): the checkpoint's fp32 weights
        # may not round back to it (O2K: weight + compensation can round to the weight's
        # neighbour on a tie), and a whole set lets a resume see one missing; weights
        # with an fp32 master (O2) come back from the master
        state = model.state_dict(keep_vars=True)
        clones: dict[int, torch.Tensor] = {}  # tied weights stay one tensor in the file
        exact = {}
        for name in _stepped16_names(model, setup.optimizer):
            t = state[name]
            if id(t) not in clones:
                clones[id(t)] = t.detach().clone()
            exact[name] = clones[id(t)]
        return {
            "format": _FORMAT,
            "level": setup.level,
            "dtype": None if setup.dtype is None else str(setup.dtype).split(".")[1],
            "amp": amp_state_dict(),
            "weights16": exact,
        }

    def _setup_model(self, setup: _Setup) -> nn.Module:
        model = setup.model()
        if model is None:
            raise HfIntegrationError("the model ampkit was set up with is gone; call train() again.")
        return model

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """HF's load of the checkpoint's model weights, once ampkit's file has been read
        and checked whole: readable, of this run's level and dtype, its 16-bit weights the
        model's, its state fitting ampkit's session (set up here by ``create_optimizer``,
        which ``train()`` calls next and which then keeps that setup). ``train()`` calls
        this before it sets up the resumed run (``trainer.state``, callbacks, a new LR
        scheduler that resets ``lr``), so a bad file refuses the resume with all of that
        as it was. A checkpoint without the file is loaded by HF alone."""
        self._ampkit_resume = None
        saved = self._read_ampkit_file(resume_from_checkpoint)
        if saved is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
            if self._ampkit is not None and (masters := master_weights_of(self._ampkit.optimizer)) is not None:
                masters.reset_from_model()  # set up before (a refused resume): masters from these weights
            return
        # the optimizer the Trainer has, or the one it builds from the arguments, as train()
        # does next; ampkit is set up with it unless it already is
        self.create_optimizer()
        setup = self._ampkit  # None: a subclass's own create_optimizer set nothing up
        apply = None if setup is None else self._prepare_ampkit_load(resume_from_checkpoint, saved)
        super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        self._ampkit_resume = _Resume(resume_from_checkpoint, saved, setup, apply)

    def _load_scaler(self, checkpoint: str | None) -> None:
        """HF's scaler file, then ampkit's state checked by ``_load_from_checkpoint``
        (after HF loaded the optimizer state)."""
        super()._load_scaler(checkpoint)  # type: ignore[misc]
        resume, self._ampkit_resume = self._ampkit_resume, None
        if resume is None or resume.checkpoint != checkpoint:
            return
        apply = resume.apply
        if resume.setup is not self._ampkit:  # set up anew since the check: check again
            apply = None if self._ampkit is None else self._prepare_ampkit_load(resume.checkpoint, resume.saved)
        if apply is not None:
            apply()

    def _read_ampkit_file(self, checkpoint: str) -> dict[str, Any] | None:
        """``checkpoint``'s :data:`AMPKIT_NAME`, read with ``torch.load(weights_only=True)``
        (a regular file, at most :func:`checkpoint_read_limit` of the model's size) and
        checked without ampkit's session: this integration's format, every entry
        present, this run's ``amp_level``/``amp_dtype``, 16-bit weights the model has
        (same shape, finite, sane). None, with a warning, when the checkpoint has
        nothing of that name; a FIFO, device, folder or link to one there is refused.
        Raises :class:`HfIntegrationError`; changes nothing."""
        path = os.path.join(checkpoint, AMPKIT_NAME)
        if not checkpoint_file_present(path):
            warnings.warn(
                f"ampkit: {checkpoint} holds no {AMPKIT_NAME} (saved without ampkit?): the "
                f"loss scale and step counters start afresh, {self.amp_level}'s fp32 state from "
                "the checkpoint's weights, so the resume is not exact.",
                UserWarning,
                stacklevel=3,
            )
            return None
        if not isinstance(self.model, nn.Module):
            raise HfIntegrationError("the Trainer has no model to resume; pass model= or model_init=.")
        limit = checkpoint_read_limit([*self.model.parameters(), *self.model.buffers()])
        saved = read_checkpoint_file(path, HfIntegrationError, map_location=self.args.device, limit=limit)
        if isinstance(saved, Mapping) and saved.get("format") == "ampkit.integrations.hf/1":
            raise HfIntegrationError(
                f"{path} was written by an earlier ampkit (format ampkit.integrations.hf/1), which "
                "saved only some 16-bit weights, so a resume from it cannot be checked whole. "
                f"Resume with that ampkit release, or delete {AMPKIT_NAME} to resume from the "
                "checkpoint's weights alone (not bit for bit)."
            )
        if not isinstance(saved, Mapping) or saved.get("format") != _FORMAT:
            raise HfIntegrationError(f"{path} is not an ampkit checkpoint of this integration ({_FORMAT}).")
        missing = sorted({"level", "dtype", "amp", "weights16"} - set(saved))
        if missing:
            raise HfIntegrationError(f"{path} lacks {missing}: not a whole ampkit checkpoint (truncated or edited).")
        dtype = None if self.amp_dtype is None else str(self.amp_dtype).split(".")[1]
        if saved.get("level") != self.amp_level or saved.get("dtype") != dtype:
            raise HfIntegrationError(
                f"{path} was saved at amp_level={saved.get('level')!r}, amp_dtype="
                f"{saved.get('dtype')!r}; this run is set up at amp_level={self.amp_level!r}, "
                f"amp_dtype={dtype!r}. Resume with the arguments the checkpoint was trained with."
            )
        _check_weights16(path, saved["weights16"], self.model.state_dict(keep_vars=True), self.amp_dtype)
        return dict(saved)

    def _prepare_ampkit_load(self, checkpoint: str, saved: dict[str, Any]) -> Callable[[], None]:
        """Check a read :data:`AMPKIT_NAME` against ampkit's session (the set-up model's
        dtypes, the masters, scalers and counters), changing nothing, and return what
        loads it: its exact 16-bit weights into the model, then ampkit's state."""
        path = os.path.join(checkpoint, AMPKIT_NAME)
        setup = self._ampkit
        assert setup is not None
        model = self._setup_model(setup)
        state = model.state_dict(keep_vars=True)
        weights16 = _check_weights16(
            path, saved["weights16"], state, None, expected=_stepped16_names(model, setup.optimizer)
        )
        load_amp = prepare_state_load(saved["amp"], path, HfIntegrationError)

        def apply() -> None:
            with torch.no_grad():
                for name, value in weights16.items():
                    state[name].copy_(value)
            load_amp()

        return apply

    def _load_best_model(self) -> None:
        """HF loads the best checkpoint's weights; ampkit's state (masters, scale) too,
        read and checked whole before HF changes the model."""
        best = self.state.best_model_checkpoint
        apply = None
        if best is not None and self._ampkit is not None:
            saved = self._read_ampkit_file(best)
            apply = None if saved is None else self._prepare_ampkit_load(best, saved)
        super()._load_best_model()  # type: ignore[misc]
        if apply is not None:
            apply()

    # -- saving the model ------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """HF's ``save_model``, writing ``amp_save_weights``: the trained fp32
        weights with ``config.json`` dtype float32 (default, and always for the
        checkpoints HF saves with ``_internal_call=True``), or the :func:`ampkit.convert`
        inference model (``"converted"``)."""
        target = os.path.join(output_dir, AMPKIT_NAME) if _internal_call and output_dir is not None else None
        if target is not None and self._ampkit is not None and self.args.should_save and os.path.lexists(target):
            check_target(target, checkpoint_what(target), HfIntegrationError)  # refused before HF writes the checkpoint
        self._ampkit_save_mode = "fp32" if _internal_call else getattr(self._amp_source(), "amp_save_weights", "fp32")
        try:
            super().save_model(output_dir, _internal_call)  # type: ignore[misc]
        finally:
            self._ampkit_save_mode = "fp32"

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        setup = self._ampkit
        if setup is None or state_dict is not None:
            super()._save(output_dir, state_dict)  # type: ignore[misc]
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        model = self._setup_model(setup)
        if getattr(self, "_ampkit_save_mode", "fp32") == "converted":
            converted = convert(
                model,
                dtype=setup.dtype,
                checkpoint=_training_checkpoint(model, setup.optimizer),
                param_names=[setup.param_names],
            )
            weights = converted.state_dict()
            dtype = next((p.dtype for p in converted.parameters() if p.is_floating_point()), torch.float32)
        else:
            weights, dtype = fp32_state_dict(model, setup.optimizer, setup.param_names), torch.float32
        super()._save(output_dir, weights)  # type: ignore[misc]
        if self.args.should_save:
            _write_config_dtype(model, output_dir, dtype)


class AmpkitTrainer(AmpkitTrainerMixin, Trainer):
    """``transformers.Trainer`` trained with ampkit (:class:`AmpkitTrainerMixin`);
    takes HF's arguments, with :class:`AmpkitTrainingArguments` as ``args``."""


def _refuse_backends(trainer: Any) -> None:
    """Raise :class:`HfIntegrationError` when ``trainer``'s accelerator runs DeepSpeed,
    FSDP or SageMaker model parallelism (each owns the weights' dtype and the optimizer)."""
    refused = [
        name
        for name, on in (
            ("DeepSpeed", getattr(trainer, "is_deepspeed_enabled", False)),
            ("FSDP", getattr(trainer, "is_fsdp_enabled", False)),
            ("FSDP on XLA", getattr(trainer, "is_fsdp_xla_enabled", False)),
            ("SageMaker model parallelism", is_sagemaker_mp_enabled()),
        )
        if on
    ]
    if refused:
        raise HfIntegrationError(
            f"{refused[0]} keeps its own copy of the weights and optimizer (and casts "
            "them itself), so ampkit cannot set them up; use its own mixed precision "
            "with a plain Trainer, or DDP (no DeepSpeed/FSDP config) with ampkit."
        )


# Module state: the ampkit class of each Trainer class enable() was given (made once).
_ENABLED: dict[type, type] = {Trainer: AmpkitTrainer}


def _enabled_class(cls: type) -> type:
    """``cls`` with :class:`AmpkitTrainerMixin` first: :class:`AmpkitTrainer` for
    ``transformers.Trainer``, else a class ``Ampkit<Name>`` made once per class."""
    made = _ENABLED.get(cls)
    if made is None:
        doc = f"``{cls.__qualname__}`` with :class:`AmpkitTrainerMixin` (made by :func:`enable`)."
        made = _ENABLED[cls] = type(f"Ampkit{cls.__name__}", (AmpkitTrainerMixin, cls), {"__doc__": doc})
    return made


def enable(
    trainer: Trainer,
    opt_level: str | None = None,
    *,
    dtype: torch.dtype | None = None,
    fp8: bool = False,
    save_weights: str = "fp32",
    plan: str | os.PathLike[str] | None = None,
) -> Trainer:
    """Make a stock ``transformers.Trainer`` (or any subclass of it, built with a plain
    ``TrainingArguments``) train under ampkit, as :class:`AmpkitTrainer` does; call it
    before ``trainer.train()``::

        trainer = enable(Trainer(model=model, args=args, train_dataset=train), "O2")

    Everything :class:`AmpkitTrainerMixin` does then runs on this trainer: ampkit set up
    in ``create_optimizer``, the loss scaled in HF's ``accelerator.backward``, skipped
    steps held from HF's LR scheduler, ``ampkit.pt`` in every checkpoint (a bitwise
    resume), fp32 weights from ``save_model``. The trainer's class becomes its class
    with the mixin first (:class:`AmpkitTrainer` for a ``transformers.Trainer``,
    ``Ampkit<Name>`` for a subclass; ``isinstance(trainer, Trainer)`` still holds);
    ``trainer.args`` is left as it is.

    A ``transformers.Trainer`` or ``Seq2SeqTrainer`` built with HF's own ``bf16=True`` or
    ``fp16=True`` is taken over, so that adding ``enable`` is the whole change: ampkit
    computes in that dtype (``dtype`` may be None or the same), and this Trainer's
    Accelerator, made when the Trainer was built, gets its autocast and GradScaler turned
    off (``native_amp`` False, no ``scaler``: the two switches Accelerate casts and
    scales by), so nothing casts or scales on top of ampkit. ``trainer.args`` still says
    ``bf16=True``, and ``trainer.accelerator.mixed_precision`` still reads Accelerate's
    process-wide state (``"bf16"``), which is left alone: any later Accelerator of the
    process, e.g. of another Trainer built with the same arguments, needs it as it is.

    Args:
        trainer: the Trainer, constructed, not trained yet (its optimizer not prepared
            by Accelerate).
        opt_level (str | None): ``"O0"``, ``"O1"``, ``"O2"``, ``"O3"`` or ``"O2K"``;
            None: the plan's level, else ``AMPKIT_LEVEL``, else ``"O1"``. Default: ``None``.
        dtype (torch.dtype | None): ``torch.bfloat16`` or ``torch.float16``; None: the
            plan's, else ``AMPKIT_DTYPE``, else the device's (bf16 on CPU, fp16 on CUDA;
            O2K is always bf16). Default: ``None``.
        fp8 (bool): fp8 linears (:class:`ampkit.Fp8Recipe`'s default choice), as
            ``amp_fp8``. Default: ``False``.
        save_weights (str): what ``trainer.save_model()`` writes: ``"fp32"`` (the
            trained fp32 weights) or ``"converted"`` (the :func:`ampkit.convert`
            inference model), as ``amp_save_weights``. Default: ``"fp32"``.
        plan (str | os.PathLike | None): the path of an :func:`ampkit.tune` plan, as
            ``amp_plan``. Default: ``None``.

    Returns:
        ``trainer`` itself.

    Raises:
        HfIntegrationError: not a ``transformers.Trainer``; already ampkit's (an
            :class:`AmpkitTrainer`, the mixin, or enabled before); arguments of
            :class:`AmpkitArguments` (their ``amp_*`` fields and these would both set
            the level: use :class:`AmpkitTrainer`); a Trainer that already trained (its
            optimizer prepared); HF's ``bf16=True``/``fp16=True`` on another Trainer
            subclass (which may act on them itself), with O0, with another ``dtype``, or
            ``fp16=True`` with O2K; HF's ``bf16_full_eval``/``fp16_full_eval``;
            Accelerate's ``mixed_precision`` from the environment or ``accelerate
            launch``; DeepSpeed, FSDP, SageMaker model parallelism; a bad setting.
            Nothing is changed then.
        ampkit.PlanError: a plan that cannot be read.
    """
    if not isinstance(trainer, Trainer):
        raise HfIntegrationError(
            f"enable() takes a transformers.Trainer, got {type(trainer).__name__}; pass the "
            "Trainer you built (Trainer(model=..., args=...))."
        )
    if isinstance(trainer, AmpkitTrainerMixin):
        raise HfIntegrationError(
            f"this {type(trainer).__name__} already trains under ampkit (AmpkitTrainer, the "
            "mixin, or enable() called before); its level is set once: drop this enable() call."
        )
    if isinstance(trainer.args, AmpkitArguments):
        raise HfIntegrationError(
            f"trainer.args is a {type(trainer.args).__name__}, whose amp_level/amp_dtype would "
            "set the level besides enable()'s; use AmpkitTrainer with those arguments, or plain "
            "TrainingArguments with enable()."
        )
    if isinstance(trainer.optimizer, AcceleratedOptimizer):
        raise HfIntegrationError(
            "this Trainer has trained already (its optimizer is prepared by Accelerate), so "
            "ampkit cannot set it up before the wrap; call enable() right after building the "
            "Trainer, before trainer.train()."
        )
    options = resolve_options(opt_level, dtype, fp8, save_weights, None if plan is None else os.fspath(plan))
    flag = next((name for name in ("bf16", "fp16") if getattr(trainer.args, name, False)), None)
    if flag is not None:
        options = _taking_over(trainer, flag, dtype, options)
    check_arguments(trainer.args if flag is None else _without_hf_precision(trainer.args), options)
    mixed = getattr(trainer.accelerator, "mixed_precision", "no")
    if mixed != "no" and flag is None:
        raise HfIntegrationError(
            f"this Trainer's Accelerator has mixed_precision={mixed!r} (from "
            "ACCELERATE_MIXED_PRECISION or `accelerate launch --mixed_precision`): it would cast "
            "on top of ampkit. Launch with --mixed_precision no and choose the dtype with dtype=."
        )
    _refuse_backends(trainer)
    if flag is not None:  # the last check passed: nothing is refused from here on
        trainer.accelerator.native_amp = False  # no autocast around the model's forward (prepare_model)
        trainer.accelerator.scaler = None  # no GradScaler in backward, clipping or the optimizer's step
    enabled = _enabled_class(type(trainer))
    trainer.__class__ = enabled
    trainer.__dict__["_ampkit_options"] = options
    return trainer


#: The Trainer classes whose use of HF's ``bf16``/``fp16`` flags is known: they reach only
#: the Accelerator made at construction, whose autocast and scaler :func:`enable` turns off.
_FLAGS_TAKEN_OVER = (Trainer, Seq2SeqTrainer)


def _taking_over(trainer: Trainer, flag: str, dtype: torch.dtype | None, options: AmpkitOptions) -> AmpkitOptions:
    """``options`` computing in the dtype of HF's ``flag`` (``"bf16"``/``"fp16"``) set on
    ``trainer.args``, which :func:`enable` then takes over; raises
    :class:`HfIntegrationError` where it cannot (changing nothing)."""
    name = {"bf16": "bfloat16", "fp16": "float16"}[flag]
    base = OPT_LEVELS.get(options.amp_level)  # None: an unknown level, which check_arguments refuses
    instead = (f"drop {flag}=True from the TrainingArguments and pass the dtype to enable() "
               f"(enable(trainer, {options.amp_level!r}, dtype=torch.{name}))")  # fmt: skip
    if type(trainer) not in _FLAGS_TAKEN_OVER:
        problem = (f"this {type(trainer).__name__} was built with {flag}=True, which a Trainer subclass may act on "
                   "itself (casting the model, its own autocast), so ampkit takes the flag over only for "
                   f"transformers' Trainer and Seq2SeqTrainer: {instead}")  # fmt: skip
    elif not all(hasattr(trainer.accelerator, switch) for switch in ("native_amp", "scaler")):
        problem = (f"this Accelerate release's Accelerator has no native_amp/scaler switches, so {flag}=True's "
                   f"autocast and scaler cannot be turned off: {instead}")  # fmt: skip
    elif base is not None and base.fp32:
        problem = (f"{options.amp_level} trains in fp32, while {flag}=True asks for {name} mixed precision: drop "
                   f"{flag}=True, or choose a mixed-precision level ({', '.join(level_names(lambda d: not d.fp32))}), "
                   f"which then computes in {name}")  # fmt: skip
    elif dtype is not None and dtype != getattr(torch, name):
        problem = (f"{flag}=True asks for {name} and enable(dtype={dtype}) for another dtype: drop {flag}=True "
                   "(dtype= then decides), or drop dtype=")  # fmt: skip
    elif base is not None and base.bf16_only and flag == "fp16":
        problem = (f"{options.amp_level} ({base.description}) is bf16 only, while fp16=True asks for float16: use "
                   f"bf16=True, or a level that takes fp16 ({', '.join(level_names(lambda d: not d.bf16_only))})")  # fmt: skip
    else:
        return dataclasses.replace(options, amp_dtype=name)
    raise HfIntegrationError(f"{problem}.")


def _without_hf_precision(args: Any) -> Any:
    """A shallow copy of ``args`` with HF's ``bf16``/``fp16`` flags off and Accelerate's
    ``mixed_precision`` "no" (what :func:`enable` takes over), for :func:`check_arguments`."""
    checked = copy.copy(args)
    checked.bf16 = checked.fp16 = False
    checked.mixed_precision = "no"
    return checked


def check_trainer_contract(trainer_cls: type = Trainer) -> None:
    """Raise :class:`HfIntegrationError` unless ``trainer_cls`` (default: the installed
    ``transformers.Trainer``) has every private method of :data:`TRAINER_PRIVATES`, taking
    (at least) the parameters listed there. Called when this module is imported."""
    import inspect

    problems = []
    for name, params in TRAINER_PRIVATES.items():
        method = getattr(trainer_cls, name, None)
        if not callable(method):
            problems.append(f"{name} is gone")
            continue
        found = list(inspect.signature(method).parameters)[1:]
        missing = [p for p in params if p not in found]
        if missing:
            problems.append(f"{name}({', '.join(found)}) lacks {', '.join(missing)}")
    if problems:
        raise HfIntegrationError(
            f"ampkit's HF integration overrides private methods of transformers.Trainer that "
            f"transformers {transformers.__version__} changed: {'; '.join(problems)}. Install "
            f"a release the integration is tested with: {install_hint('hf')}"
        )


check_trainer_contract()
