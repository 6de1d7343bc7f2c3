"""The fields ampkit adds to Hugging Face's ``TrainingArguments`` (:class:`AmpkitArguments`
and the two combined classes) and their validation (:func:`check_arguments`); imported
by, and documented as part of, :mod:`ampkit.integrations.hf`."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch

from ampkit.errors import AmpError

from .. import require
from .._shared import (
    DTYPES_BY_NAME,
    LOW_PRECISION_BY_NAME,
    OPT_LEVELS,
    checked_plan,
    dtype_from_env,
    is_fp32_level,
    level_name,
    level_names,
    level_or_env,
)

require("transformers", "hf")

from transformers import Seq2SeqTrainingArguments, TrainingArguments  # noqa: E402

__all__ = [
    "SAVE_WEIGHTS",
    "AmpkitArguments",
    "AmpkitOptions",
    "AmpkitSeq2SeqTrainingArguments",
    "AmpkitTrainingArguments",
    "HfIntegrationError",
    "check_arguments",
    "dtype_of",
    "level_of",
    "resolve_options",
]

_DTYPES = LOW_PRECISION_BY_NAME  # ampkit's and torch's names of the 16-bit dtypes
SAVE_WEIGHTS = ("fp32", "converted")


class HfIntegrationError(AmpError, ValueError):
    """The Trainer or its arguments are set up in a way ampkit's integration cannot
    run (HF's own mixed precision turned on too, an unknown level, DeepSpeed, ...), or
    a checkpoint does not fit the run. The message says what to change."""


# --- arguments --------------------------------------------------------------------------


def dtype_of(value: str | None) -> torch.dtype | None:
    return None if value is None else _DTYPES[value]


def level_of(args: Any) -> Any:
    """``args.amp_level`` upper-cased; when unset (a plain ``TrainingArguments``, or None),
    ``AMPKIT_LEVEL`` if set, else ``"O1"``. Anything else is returned as it is, for
    :func:`check_arguments` to refuse."""
    level = level_or_env(getattr(args, "amp_level", None))
    return level.upper() if isinstance(level, str) else level


def check_arguments(args: TrainingArguments, options: AmpkitOptions | None = None) -> None:
    """Raise :class:`HfIntegrationError` unless ``args`` can run under ampkit: the
    ``amp_*`` settings are valid and none of HF's own mixed-precision switches of
    ``args`` is on.

    Args:
        args: the Trainer's arguments.
        options: where the ``amp_*`` settings come from (:func:`ampkit.integrations.hf.enable`'s);
            None: from ``args`` itself (defaults where a plain ``TrainingArguments`` has
            none). Default: ``None``."""
    source: Any = args if options is None else options
    level = level_name(level_of(source), "amp_level", HfIntegrationError)
    base = OPT_LEVELS[level]
    dtype = getattr(source, "amp_dtype", None)
    fp8 = getattr(source, "amp_fp8", False)
    save = getattr(source, "amp_save_weights", "fp32")
    if dtype is not None and dtype not in _DTYPES:
        raise HfIntegrationError(
            f"amp_dtype={dtype!r} is not a 16-bit dtype ampkit computes in; use 'bfloat16', "
            "'float16', or None for the device's default (bf16 on CPU, fp16 on CUDA)."
        )
    sixteen = ", ".join(level_names(lambda d: not d.fp32))
    if base.bf16_only and dtype_of(dtype) == torch.float16:
        raise HfIntegrationError(
            f"amp_level={level!r} ({base.description}) is bf16 only; drop amp_dtype='float16', "
            f"or use a level that takes fp16 ({', '.join(level_names(lambda d: not d.bf16_only))})."
        )
    if base.fp32 and dtype is not None:
        raise HfIntegrationError(
            f"amp_level={level!r} trains in fp32, so amp_dtype={dtype!r} has no effect; drop it or "
            f"choose a mixed-precision level ({sixteen})."
        )
    if not isinstance(fp8, bool):
        raise HfIntegrationError(f"amp_fp8 must be True or False, got {fp8!r}.")
    if fp8 and base.fp32:
        raise HfIntegrationError(
            f"amp_fp8=True computes linears in fp8 on top of a mixed-precision level; {level} is fp32. "
            f"Use one of {sixteen} with amp_fp8=True."
        )
    if save not in SAVE_WEIGHTS:
        raise HfIntegrationError(
            f"amp_save_weights={save!r}; choose 'fp32' (the trained fp32 weights, loadable "
            "with from_pretrained as trained) or 'converted' (ampkit.convert's 16-bit "
            "inference model)."
        )
    hf_own = [name for name in ("bf16", "fp16", "bf16_full_eval", "fp16_full_eval") if getattr(args, name, False)]
    choose = _choose_dtype(args, options)
    if hf_own:
        what = ", ".join(f"{name}=True" for name in hf_own)
        raise HfIntegrationError(
            f"{what} turns on HF's own mixed precision (Accelerate's autocast and GradScaler, or "
            "a model cast in place for evaluation) on top of ampkit's "
            f"amp_level={level!r}: the model would be cast twice and HF's path does not skip "
            f"inf/NaN steps. Drop {what}; {choose} (ampkit's casting covers evaluation too)."
        )
    optim = getattr(getattr(args, "optim", None), "value", getattr(args, "optim", None))
    if optim in ("lomo", "adalomo"):
        raise HfIntegrationError(
            f"optim={optim!r} updates the weights inside backward, where ampkit cannot check "
            "the gradients or skip a step; use an optimizer that steps after backward "
            "(e.g. optim='adamw_torch')."
        )
    mixed = getattr(args, "mixed_precision", "no")
    if mixed not in (None, "no"):
        raise HfIntegrationError(
            f"Accelerate's mixed_precision is {mixed!r} (from ACCELERATE_MIXED_PRECISION, e.g. "
            "`accelerate launch --mixed_precision`): it would cast on top of ampkit. Launch "
            f"with --mixed_precision no; {choose}."
        )


def _choose_dtype(args: Any, options: AmpkitOptions | None) -> str:
    """How the user on this path chooses ampkit's dtype: :func:`enable`'s ``dtype=`` on a
    stock Trainer, ``amp_dtype`` of :class:`AmpkitArguments`; with plain
    ``TrainingArguments`` and no ``enable`` (an :class:`AmpkitTrainer` or the mixin), either."""
    if options is not None:
        return "choose the dtype with enable(trainer, level, dtype=torch.bfloat16 or torch.float16)"
    if isinstance(args, AmpkitArguments):
        return "choose the dtype with amp_dtype='bfloat16' or 'float16'"
    return ("choose the dtype with AmpkitTrainingArguments(amp_dtype='bfloat16' or 'float16'), or build "
            "the stock Trainer and call enable(trainer, level, dtype=torch.bfloat16 or torch.float16)")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class AmpkitOptions:
    """ampkit's settings of a stock ``Trainer`` set up by
    :func:`ampkit.integrations.hf.enable` (resolved as :class:`AmpkitArguments` resolves
    its fields), named as those fields so that one reader serves both.

    Attributes:
        amp_level (str): the opt level (upper case).
        amp_dtype (str | None): ``"bfloat16"``, ``"float16"``, or None (the device's).
        amp_fp8 (bool): fp8 linears (:class:`ampkit.Fp8Recipe`'s default choice).
        amp_save_weights (str): ``"fp32"`` or ``"converted"``.
        amp_plan (str | None): the path of an :func:`ampkit.tune` plan, or None.
    """

    amp_level: str
    amp_dtype: str | None
    amp_fp8: bool
    amp_save_weights: str
    amp_plan: str | None


def resolve_options(
    opt_level: str | None,
    dtype: torch.dtype | None,
    fp8: bool,
    save_weights: str,
    plan: str | None,
) -> AmpkitOptions:
    """:class:`AmpkitOptions` as :class:`AmpkitArguments` resolves its fields: the plan's
    level and dtype where ``opt_level``/``dtype`` are None (the plan read and checked),
    then ``AMPKIT_LEVEL``/``AMPKIT_DTYPE``, then O1 and the device's dtype. Raises
    :class:`HfIntegrationError` for a ``dtype`` that is not bf16 or fp16 (the other
    values are checked by :func:`check_arguments`)."""
    name: str | None = None
    if dtype is not None:
        names = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
        if dtype not in names:
            raise HfIntegrationError(
                f"dtype={dtype!r} is not a 16-bit dtype ampkit computes in; pass "
                "torch.bfloat16 or torch.float16, or None for the device's default."
            )
        name = names[dtype]
    level, name = _level_and_dtype(opt_level, name, plan)
    return AmpkitOptions(level, name, fp8, save_weights, plan)


def _level_and_dtype(level: Any, dtype: str | None, plan: str | None) -> tuple[Any, str | None]:
    """``amp_level`` and ``amp_dtype`` resolved: the plan's (read and checked) where None,
    then ``AMPKIT_LEVEL``/``AMPKIT_DTYPE`` (an argument > the environment > the default),
    then O1 and None (the device's dtype)."""
    if plan is not None:
        loaded = checked_plan(plan, "amp_plan")
        level = loaded.level if level is None else level
        if dtype is None and loaded.lowered:
            dtype = str(DTYPES_BY_NAME[loaded.dtype]).removeprefix("torch.")
    level = level_of(SimpleNamespace(amp_level=level))
    if dtype is None and not is_fp32_level(level):
        env = dtype_from_env()
        dtype = None if env is None else str(env).removeprefix("torch.")
    return level, dtype


@dataclasses.dataclass
class AmpkitArguments:
    """ampkit's fields for a ``TrainingArguments`` dataclass; combine it with one,
    mixin first (``class MyArgs(AmpkitArguments, TrainingArguments)``). The fields
    parse from the command line with ``HfArgumentParser`` like HF's own.

    Attributes:
        amp_level (str): ampkit's opt level: ``"O0"``, ``"O1"``, ``"O2"``,
            ``"O3"`` or ``"O2K"`` (see :func:`ampkit.initialize`). Default: ``"O1"``.
        amp_dtype (str | None): ``"bfloat16"`` or ``"float16"`` (``"bf16"``,
            ``"fp16"`` too); None: the device's default (bf16 on CPU, fp16 on CUDA;
            O2K is always bf16). Default: ``None``.
        amp_fp8 (bool): compute the linears of :class:`ampkit.Fp8Recipe`'s
            default choice in fp8 (any level but O0). Default: ``False``.
        amp_save_weights (str): what ``trainer.save_model()`` writes: the
            trained fp32 weights (``config.json`` dtype float32) or ``"converted"``,
            the :func:`ampkit.convert` inference model (16-bit weights, norm layers
            fp32, config dtype the 16-bit one). Checkpoints always hold fp32 weights. Default: ``"fp32"``.
        amp_plan (str | None): the path of a plan :func:`ampkit.tune` saved: its
            level and dtype where ``amp_level``/``amp_dtype`` are None, its kept modules
            pinned to fp32 (``ampkit.initialize(plan=...)``). Read and checked here. Default: ``None``.

    Validation (:class:`HfIntegrationError`) runs in ``__post_init__``, after HF's own:
    HF's ``bf16``/``fp16``/``bf16_full_eval``/``fp16_full_eval`` are refused (HF's
    mixed precision would cast on top of ampkit's).
    """

    amp_level: str | None = dataclasses.field(
        default=None, metadata={"help": "ampkit opt level: O0, O1, O2, O3 or O2K (default: $AMPKIT_LEVEL, else O1)"}
    )
    amp_dtype: str | None = dataclasses.field(
        default=None,
        metadata={"help": "16-bit compute dtype: bfloat16 or float16 (default: $AMPKIT_DTYPE, else the device's)"},
    )
    amp_fp8: bool = dataclasses.field(
        default=False, metadata={"help": "compute linears in fp8 (ampkit.Fp8Recipe)"}
    )
    amp_save_weights: str = dataclasses.field(
        default="fp32",
        metadata={"help": "what save_model writes: fp32 (trained weights) or converted"},
    )
    amp_plan: str | None = dataclasses.field(
        default=None,
        metadata={"help": "path of a per-module plan from ampkit.tune (its level and dtype are the defaults)"},
    )

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]  # the TrainingArguments class it is combined with
        self.amp_level, self.amp_dtype = _level_and_dtype(self.amp_level, self.amp_dtype, self.amp_plan)
        check_arguments(self)  # type: ignore[arg-type]


@dataclasses.dataclass
class AmpkitTrainingArguments(AmpkitArguments, TrainingArguments):
    """``transformers.TrainingArguments`` with ampkit's fields (:class:`AmpkitArguments`):
    ``amp_level`` (None: ``AMPKIT_LEVEL``, else "O1"), ``amp_dtype`` (None:
    ``AMPKIT_DTYPE``, else the device's), ``amp_fp8`` (False),
    ``amp_save_weights`` ("fp32"). Leave ``bf16``/``fp16`` False."""


@dataclasses.dataclass
class AmpkitSeq2SeqTrainingArguments(AmpkitArguments, Seq2SeqTrainingArguments):
    """``transformers.Seq2SeqTrainingArguments`` with ampkit's fields (see
    :class:`AmpkitTrainingArguments`)."""
