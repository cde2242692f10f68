"""The Lightning strategy: ``GPipeStrategy``, registered as ``Trainer(strategy="gpipe")`` on import."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_gpipe.strategy.gpipe import GPipeStrategy

__all__ = ["GPipeStrategy"]

if GPipeStrategy.strategy_name not in StrategyRegistry:
    StrategyRegistry.register(GPipeStrategy.strategy_name, GPipeStrategy, description=GPipeStrategy.__doc__)
