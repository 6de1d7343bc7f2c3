"""A plain Hugging Face Trainer script: a tiny random-init GPT-2 learns to continue
counting sequences (token t is followed by t + 1, modulo the vocabulary), trained by
``transformers.Trainer`` in fp32, then evaluated on held-out sequences. Knows nothing
of mixed precision. Prints ``METRIC train_loss <mean training loss>`` and
``METRIC eval_loss <held-out loss>``.

Its builders (``build_model``, ``CountingDataset``, ``training_arguments``) are also
imported by tests/integrations/test_integration_hf.py, so the integration trains the same model on
the same data."""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.utils import logging

VOCAB, LENGTH = 64, 16


class CountingDataset(torch.utils.data.Dataset):
    """``n`` sequences ``start, start + 1, ...`` (mod VOCAB), labels = inputs."""

    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=gen)
        self.ids = (start + torch.arange(LENGTH)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_model(seed: int = 0) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 with 32-wide embeddings, random init (seeded)."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def training_arguments(output_dir: str, steps: int, args_class=TrainingArguments, **extra) -> TrainingArguments:
    """The script's TrainingArguments (``args_class`` and ``extra`` let a caller add fields)."""
    options = dict(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=8,
        per_device_eval_batch_size=16, learning_rate=3e-3, warmup_steps=2, logging_steps=10,
        save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True, seed=0,
    )
    options.update(extra)
    return args_class(**options)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="Trainer output_dir")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    logging.set_verbosity_error()
    trainer = Trainer(
        model=build_model(),
        args=training_arguments(args.out, args.steps),
        train_dataset=CountingDataset(64, seed=0),
        eval_dataset=CountingDataset(32, seed=1),
    )
    result = trainer.train()
    metrics = trainer.evaluate()
    print(f"METRIC train_loss {result.training_loss:.6f}")
    print(f"METRIC eval_loss {metrics['eval_loss']:.6f}")


if __name__ == "__main__":
    main()
