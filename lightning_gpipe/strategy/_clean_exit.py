"""Destroys the process groups when a process that trained cleanly exits, while Python can still free their tensors."""

from __future__ import annotations

import atexit

import torch.distributed as dist

# Without this, gloo's worker threads can still hold finished work (and its tensors) when the interpreter is torn
# down; freeing them then aborts the process ("terminate called without an active exception", exit code -6) after a
# run that succeeded. torch leaves the call to the application (pytorch/pytorch#190489); a Lightning user's script
# never makes it, so the strategy does. After a failure the groups are left alone: a peer may never answer, and
# destroying a group waits for its pending work.
_state = {"registered": False, "failed": False}


def destroy_at_exit() -> None:
    """Arrange (once per process) for the process groups to be destroyed at a clean exit."""
    _state["failed"] = False
    if not _state["registered"]:
        atexit.register(_destroy)
        _state["registered"] = True


def keep_at_exit() -> None:
    """A run failed: leave the process groups to the operating system."""
    _state["failed"] = True


def _destroy() -> None:
    if not _state["failed"] and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
