"""ampkit inside Hugging Face Transformers' ``Trainer`` (``pip install -e '.[hf]'``).

The stock ``Trainer`` and ``TrainingArguments``, one line added (:func:`enable`)::

    from ampkit.integrations.hf import enable

    trainer = Trainer(model=model, args=TrainingArguments("out"), train_dataset=train)  # not bf16=True
    enable(trainer, "O2")
    trainer.train()
    trainer.save_model("final")     # fp32 weights, config dtype float32

or ampkit's classes, the settings among the arguments (``--amp_level O2``)::

    from ampkit.integrations.hf import AmpkitTrainer, AmpkitTrainingArguments

    args = AmpkitTrainingArguments(output_dir="out", amp_level="O2")   # not bf16=True
    trainer = AmpkitTrainer(model=model, args=args, train_dataset=train)

:class:`AmpkitTrainer` is ``transformers.Trainer`` with :class:`AmpkitTrainerMixin`;
put the mixin first to add the same to another Trainer subclass
(``class MyTrainer(AmpkitTrainerMixin, Seq2SeqTrainer)``, arguments
:class:`AmpkitSeq2SeqTrainingArguments`). :func:`enable` gives a trainer already built
that class (the mixin first, its settings kept on the trainer, not in ``args``). Not a
callback: HF hands its callbacks no trainer, and no callback event comes where ampkit
must act (before Accelerate wraps the optimizer, inside ``backward``, before a resumed
checkpoint's weights load). What the mixin does, each through a method or hook of the
Trainer:

- ``create_optimizer``: the optimizer the Trainer builds (or was given) and
  ``trainer.model`` go through :func:`ampkit.initialize` at ``amp_level`` before
  Accelerate wraps them (the raw ``torch.optim.Optimizer``, never the
  ``AcceleratedOptimizer``).
- ``autocast_smart_context_manager`` (the scope HF's ``compute_loss_context_manager``
  enters around ``compute_loss`` in training and ``prediction_step`` in evaluation):
  an :class:`ampkit.autocast` scope at O1, so casting covers the forward and the loss
  only, never process-wide; O2/O3/O2K models run their own casting.
- ``training_step``: the Trainer's ``accelerator.backward(loss)`` runs inside
  :func:`ampkit.scale_loss` (the loss HF logs stays unscaled).
- skipped steps: after every optimizer step the ``AcceleratedOptimizer`` reports
  :func:`ampkit.step_skipped` as its own ``step_was_skipped`` (Accelerate's overflow
  flag), so ``accelerator.optimizer_step_was_skipped`` is True on a skipped step and
  HF does not step its LR scheduler (a :class:`AmpkitSkipSignal` callback).
- ``max_grad_norm``: clipping runs on :func:`ampkit.master_params` (the fp32 masters
  under O2) after :func:`ampkit.unscale`: real gradients at every level, summed over
  ``gradient_accumulation_steps`` micro-batches.
- checkpoints: ``ampkit.pt`` (:data:`AMPKIT_NAME`) beside ``optimizer.pt`` holds
  :func:`ampkit.state_dict` (loss scalers, step counters, fp32 masters, compensation,
  fp8 state) and every 16-bit weight the optimizer steps as it is (O2K, O3);
  ``resume_from_checkpoint`` and ``load_best_model_at_end`` load it back, so a resumed
  run continues bit for bit. On a resume ampkit is set up first (``create_optimizer``,
  as ``train()`` would next) and the file is read and checked whole against that
  session before HF sets up anything of the resumed run -- its ``trainer.state``, LR
  scheduler, weights or optimizer state: a bad file refuses the resume with the model,
  the optimizer (state and ``param_groups``), the LR scheduler and ``trainer.state`` as
  they were. A link, FIFO or folder at its name refuses the save (never written through).
- ``save_model`` (checkpoints included) writes the fp32 weights the run trained
  (:func:`fp32_state_dict`: the masters under O2, weight + compensation under O2K) with
  ``"dtype": "float32"`` in ``config.json``, so ``from_pretrained`` loads them back as
  trained; ``amp_save_weights="converted"`` makes ``save_model`` write the
  :func:`ampkit.convert` inference model instead (checkpoints stay fp32).

HF's own ``bf16=True``/``fp16=True`` on a stock ``Trainer``/``Seq2SeqTrainer`` are taken
over by :func:`enable`: ampkit computes in that dtype, the Accelerator's autocast and
GradScaler are turned off.

Not supported (refused with :class:`HfIntegrationError` naming the alternative):
HF's own ``bf16``/``fp16`` elsewhere (ampkit's arguments classes, the mixin, another
Trainer subclass given to :func:`enable`), ``*_full_eval`` and Accelerate's
``mixed_precision`` (they would cast on top of ampkit), DeepSpeed, FSDP and SageMaker model parallelism
(they own the optimizer and the weights' dtype), LOMO optimizers (they update inside
backward). ``torch.distributed`` data
parallelism (DDP) is set up as :mod:`ampkit.distributed` asks: ``initialize`` before
the wrap, :func:`ampkit.distributed.register_ddp` after it.
"""

from __future__ import annotations

from ampkit.integrations import require

require("transformers", "hf")

from .arguments import (  # noqa: E402
    AmpkitArguments,
    AmpkitOptions,
    AmpkitSeq2SeqTrainingArguments,
    AmpkitTrainingArguments,
    HfIntegrationError,
    check_arguments,
)
from .callbacks import AmpkitSkipSignal  # noqa: E402
from .trainer import (  # noqa: E402
    AMPKIT_NAME,
    TRAINER_PRIVATES,
    AmpkitTrainer,
    AmpkitTrainerMixin,
    check_trainer_contract,
    enable,
)
from .weights import fp32_state_dict  # noqa: E402

__all__ = [
    "AMPKIT_NAME",
    "TRAINER_PRIVATES",
    "AmpkitArguments",
    "AmpkitOptions",
    "AmpkitSeq2SeqTrainingArguments",
    "AmpkitSkipSignal",
    "AmpkitTrainer",
    "AmpkitTrainerMixin",
    "AmpkitTrainingArguments",
    "HfIntegrationError",
    "check_arguments",
    "check_trainer_contract",
    "enable",
    "fp32_state_dict",
]
