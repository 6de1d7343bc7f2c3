"""ampkit in PyTorch Lightning (``pip install -e '.[lightning]'``).

A ``Trainer`` precision plugin; the LightningModule is unchanged::

    from ampkit.integrations.lightning import AmpkitPrecision

    trainer = Trainer(plugins=[AmpkitPrecision("O2")])         # was precision="bf16-mixed"
    trainer = Trainer(strategy="ampkit_ddp", devices=2,        # DDP at any level
                      plugins=[AmpkitPrecision("O2")])

- :class:`AmpkitPrecision`: every opt level (O0, O1, O2, O3, O2K), bf16 or fp16, fp8
  recipes; ampkit's casting scope around the training/validation/test/predict steps;
  the loss scaled in ``backward``; steps skipped on inf/NaN gradients inside
  Lightning's own closure step; ``"step"``-interval LR schedulers held on skipped
  steps (:class:`HeldScheduler`); clipping and ``on_after_backward`` on real gradients
  (O2: the fp32 masters); ampkit's state (with O2's fp32 masters) in every Lightning
  checkpoint, restored by ``fit(ckpt_path=...)``; manual optimization, several
  optimizers.
- :class:`AmpkitDDPStrategy` (``strategy="ampkit_ddp"``): Lightning's DDP with ampkit
  set up before the ``DistributedDataParallel`` wrap (needed by O2, O3, O2K; O0/O1 also
  run under ``strategy="ddp"``).
- :class:`AmpkitFabricPrecision`: the same for ``lightning.fabric`` (``Fabric(plugins=
  [AmpkitFabricPrecision("O2")])``, with :meth:`AmpkitFabricPrecision.setup` in place of
  ``fabric.setup``).

``Trainer(precision="ampkit-O2")`` is not offered: Lightning checks ``precision`` against
a fixed list of its own names (no registry), so a plugin instance is the way in.
Importing this module registers ``"ampkit_ddp"`` in Lightning's strategy registry.
"""

from __future__ import annotations

from ampkit.integrations import require

require("lightning", "lightning")

from ._core import STATE_FORMAT, MirrorRequiresGrad  # noqa: E402
from .fabric import AmpkitFabricPrecision  # noqa: E402
from .precision import AmpkitPrecision  # noqa: E402
from .schedulers import HeldScheduler  # noqa: E402
from .strategy import STRATEGY_NAME, AmpkitDDPStrategy  # noqa: E402

__all__ = [
    "STATE_FORMAT",
    "STRATEGY_NAME",
    "AmpkitDDPStrategy",
    "AmpkitFabricPrecision",
    "AmpkitPrecision",
    "HeldScheduler",
    "MirrorRequiresGrad",
]
