"""The strategy's logger, under Lightning's: its messages print where Lightning's setup messages do."""

import logging

logger = logging.getLogger("lightning.pytorch.strategies.gpipe")
