"""GPipeStrategy(data_loading=...): every stage loads its batches, or stage 0 loads them once for its pipeline."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal, get_args

from lightning_gpipe.pipe.batch_feed import BatchFeed
from lightning_gpipe.strategy._audit import logger
from lightning_gpipe.strategy._mesh import PipelineMesh

DataLoading = Literal["every_stage", "first_stage"]
DATA_LOADINGS: tuple[str, ...] = get_args(DataLoading)

# A stateful loader's state would be stage 0's, taken up to the feed's depth batches ahead of the step: resuming
# from it would skip batches, so the fed loader offers none (Lightning then saves no loader state, as for a DataLoader).
_HIDDEN = frozenset({"state_dict", "load_state_dict"})


class FedLoader:
    """A data loader whose batches come through a ``BatchFeed``: Lightning sees the loader itself (its length,
    sampler and workers' settings), while iterating it opens a stream of the feed."""

    def __init__(self, loader: Any, feed: BatchFeed) -> None:
        object.__setattr__(self, "loader", loader)
        object.__setattr__(self, "feed", feed)

    def __iter__(self) -> Iterator[Any]:
        # Keyed by this wrapper: one loader passed for training and validation gets one per loop.
        return self.feed.stream(self.loader, key=self)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name in _HIDDEN:
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.loader, name, value)  # Lightning sets worker_init_fn on the loader it was given


def open_feed(mesh: PipelineMesh, is_first: bool, log: bool) -> BatchFeed | None:
    """This rank's part of its pipeline's feed, where ``data_loading="first_stage"`` gave the mesh an input group."""
    if mesh.input_group is None:
        return None
    if log and mesh.rank == 0:
        logger.info(
            f"GPipeStrategy: each pipeline's batches are loaded once, on its stage 0 (up to two ahead), and sent to "
            f"its {mesh.K - 1} other stage(s) (data_loading='first_stage')"
        )
    return BatchFeed(mesh.input_group, is_first, mesh.timeout_s)


def check_data_loading(data_loading: Any) -> None:
    if data_loading not in DATA_LOADINGS:
        raise ValueError(
            f"GPipeStrategy(data_loading={data_loading!r}): choose 'every_stage' (each stage iterates its own loader) "
            "or 'first_stage' (stage 0 loads each batch and sends it to the other stages of its pipeline)"
        )
