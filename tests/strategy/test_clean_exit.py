"""The process groups are destroyed at a clean exit and left alone after a failure."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_gpipe.strategy import _mesh as clean_exit


@pytest.mark.timeout(60)
def test_destroyed_after_a_clean_run_and_kept_after_a_failure() -> None:
    store = dist.HashStore()
    try:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        clean_exit.destroy_at_exit()
        clean_exit.keep_at_exit()
        clean_exit._destroy()
        assert dist.is_initialized()
        clean_exit.destroy_at_exit()  # the next run starts clean again
        clean_exit._destroy()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
