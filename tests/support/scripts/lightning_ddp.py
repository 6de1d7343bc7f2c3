"""One rank of a 2-process Lightning DDP run on the CPU (gloo), started by the test with
Lightning's environment variables (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), so Lightning launches nothing itself.

The same classifier (lightning_classifier.py) is fitted three times in one process
group: fp32 with ``strategy="ddp"``, O1 with ``strategy="ddp"`` and
``AmpkitPrecision("O1")``, and O2 with ``strategy="ampkit_ddp"``; then O2 with plain
``strategy="ddp"``, which must be refused. Each rank writes what it ended with to
``--out``/rank<r>.pt: per run the held-out loss, the weights and the weights the
optimizer stepped (O2: the fp32 masters), ampkit's step counts, the wrapper and ampkit's
sync plan at the first step, and the refusal's message."""

import argparse
import os
import runpy
import sys
import time
from pathlib import Path

START = time.perf_counter()
import torch  # noqa: E402

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402

import ampkit as amp  # noqa: E402
from ampkit.integrations.lightning import AmpkitPrecision  # noqa: E402

SCRIPT = runpy.run_path(str(Path(__file__).with_name("lightning_classifier.py")), run_name="lightning_classifier")


class Seen(pl.Callback):
    """What the first optimizer step sees: the wrapper, and (with ampkit) its sync plan."""

    def __init__(self):
        self.wrapper, self.plan = None, None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.wrapper is None:
            self.wrapper = type(trainer.strategy.model).__name__
            if isinstance(trainer.precision_plugin, AmpkitPrecision):
                plan = amp.distributed.sync_plan(optimizer)
                self.plan = (plan.agree, plan.reason)


def fit(strategy, plugin, steps, root):
    model, train, heldout = SCRIPT["build"](batch=16, total=steps)  # 16 per rank: 32 per step
    seen = Seen()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin] if plugin else None,
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, num_sanity_val_steps=0, callbacks=[seen],
    )
    trainer.fit(model, train)
    out = {
        "loss": SCRIPT["heldout_loss"](model, heldout),
        "weights": [p.detach().clone() for p in model.parameters()],
        "wrapper": seen.wrapper,
        "sync_plan": seen.plan,
    }
    if plugin is not None:
        opt = trainer.optimizers[0]
        stats = amp.stats(opt)
        out["steps"], out["skipped"] = stats.steps, stats.skipped
        out["masters"] = [p.detach().clone() for p in amp.master_params(opt)]
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    times = {"imports": time.perf_counter() - START}
    results = {}
    for name, strategy, plugin in (
        ("fp32", "ddp", None), ("O1", "ddp", AmpkitPrecision("O1")), ("O2", "ampkit_ddp", AmpkitPrecision("O2")),
    ):
        t0 = time.perf_counter()
        results[name] = fit(strategy, plugin, args.steps, args.out)
        times[name] = time.perf_counter() - t0
    try:
        fit("ddp", AmpkitPrecision("O2"), 1, args.out)
    except amp.AmpError as err:
        results["refused"] = str(err)
    torch.save(results, Path(args.out) / f"rank{rank}.pt")
    print(f"rank {rank} done: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()), file=sys.stderr)


if __name__ == "__main__":
    main()
    # With gloo, torch sometimes aborts while tearing the process down ("terminate called
    # without an active exception") after all work is done and written; leave without
    # that teardown so the test sees the real exit status.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
