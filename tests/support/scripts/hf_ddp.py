"""One rank of a 2-process DDP run (gloo, CPU) of AmpkitTrainer on the model of
tests/support/scripts/hf_trainer.py, for tests/integrations/test_integration_hf.py.

``python tests/support/scripts/hf_ddp.py LEVELS RANK WORLD PORT OUTDIR`` (the command line of
tests/_dist_workers.launch): for each level of the comma-separated LEVELS, trains 6
steps with each rank's model built from a different seed (DDP broadcasts rank 0's
weights; ampkit must broadcast rank 0's fp32 masters too), then saves what this rank
holds to OUTDIR/rank{RANK}.pt."""

import os
import runpy
import sys
from pathlib import Path

levels, rank, world, port, outdir = sys.argv[1].split(","), sys.argv[2], sys.argv[3], sys.argv[4], Path(sys.argv[5])
os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)

import torch  # noqa: E402

torch.set_num_threads(1)

from transformers.utils import logging  # noqa: E402

import ampkit as amp  # noqa: E402
from ampkit.integrations.hf import AmpkitTrainer, AmpkitTrainingArguments  # noqa: E402

logging.set_verbosity_error()
lib = runpy.run_path(str(Path(__file__).with_name("hf_trainer.py")), run_name="hf_trainer_lib")
results = {}
for level in levels:
    args = lib["training_arguments"](
        str(outdir / level), 6, args_class=AmpkitTrainingArguments, amp_level=level,
        ddp_backend="gloo", per_device_train_batch_size=4, logging_steps=100,
    )
    trainer = AmpkitTrainer(
        model=lib["build_model"](seed=int(rank)), args=args, train_dataset=lib["CountingDataset"](64, seed=0)
    )
    loss = trainer.train().training_loss
    results[level] = {
        "wrapped": type(trainer.model_wrapped).__name__,
        "loss": loss,
        "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "masters": [p.detach().clone() for p in amp.master_params(trainer.amp_optimizer)],
        "stats": amp.stats(trainer.amp_optimizer),
    }
torch.save(results, outdir / f"rank{rank}.pt")
# With gloo, torch sometimes aborts while tearing the process down ("terminate called
# without an active exception") after all work is done and written; leave without
# that teardown so the test sees the real exit status.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
