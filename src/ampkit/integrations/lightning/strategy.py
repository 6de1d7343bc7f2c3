"""DDP with ampkit set up before the wrap: :class:`AmpkitDDPStrategy` (``"ampkit_ddp"``)."""

from __future__ import annotations

from typing import Any

from ampkit.integrations import require

from .precision import AmpkitPrecision

require("lightning", "lightning")

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry  # noqa: E402

__all__ = ["AmpkitDDPStrategy", "STRATEGY_NAME"]

#: The name it is registered under: ``Trainer(strategy="ampkit_ddp")``.
STRATEGY_NAME = "ampkit_ddp"


class AmpkitDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` (same arguments) with one change of order while
    fitting: the optimizers are built (``configure_optimizers``) and the
    :class:`~ampkit.integrations.lightning.AmpkitPrecision` plugin sets ampkit up on the plain LightningModule *before*
    ``DistributedDataParallel`` wraps it, as ampkit requires for the levels that cast the
    model (O2, O3, O2K: DDP's buckets and broadcast then see the 16-bit weights, and each
    rank's fp32 masters come from its fp32 weights). The wrapped model is then registered
    with :func:`ampkit.distributed.register_ddp`, which broadcasts O2's masters from rank
    0. With another precision plugin it is ``DDPStrategy`` exactly.

    ``Trainer(strategy="ampkit_ddp", devices=2, plugins=[AmpkitPrecision("O2")])``, or
    ``Trainer(strategy=AmpkitDDPStrategy(find_unused_parameters=True), ...)``.
    """

    strategy_name = STRATEGY_NAME
    # set while one setup has built the optimizers before the wrap
    _ampkit_before_wrap = False

    def setup(self, trainer: Any) -> None:
        self._ampkit_before_wrap = False
        super().setup(trainer)

    def configure_ddp(self) -> None:
        """Optimizers and ampkit first (an :class:`~ampkit.integrations.lightning.AmpkitPrecision` plugin), then the wrap."""
        plugin = self.precision_plugin
        if isinstance(plugin, AmpkitPrecision):
            assert self.lightning_module is not None
            super().setup_optimizers(self.lightning_module.trainer)
            assert self.model is not None
            self.model, self.optimizers, self.lr_scheduler_configs = plugin.connect(
                self.model, self.optimizers, self.lr_scheduler_configs
            )
            self._ampkit_before_wrap = True
        super().configure_ddp()

    def setup_optimizers(self, trainer: Any) -> None:
        """Lightning's (the ``trainer``'s ``configure_optimizers``), unless
        :meth:`configure_ddp` built them already for this setup."""
        if self._ampkit_before_wrap:
            return
        super().setup_optimizers(trainer)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"ampkit_ddp"`` in ``strategy_registry`` (DDP's own names stay Lightning's)."""
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(
                STRATEGY_NAME,
                cls,
                description="DDP with ampkit (AmpkitPrecision) set up before the DistributedDataParallel wrap",
            )


AmpkitDDPStrategy.register_strategies(StrategyRegistry)
