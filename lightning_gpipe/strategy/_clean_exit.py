"""Destroys the process groups when a process that trained cleanly exits, while Python can still free their tensors."""

from __future__ import annotations

import atexit
import time

import torch.distributed as dist

# Without this, gloo's worker threads can still hold finished work (and its tensors) when the interpreter is torn
# down; freeing them then aborts the process ("terminate called without an active exception", exit code -6) after a
# run that succeeded. torch leaves the call to the application (pytorch/pytorch#190489); a Lightning user's script
# never makes it, so the strategy does. After a failure the groups are left alone: a peer may never answer, and
# destroying a group waits for its pending work.
#
# Destroying does not join gloo's worker threads while something still references a group, and such a thread drops
# its reference to the last collective's work only after waking the caller. Should that release come after the
# interpreter began finalizing, taking the GIL ends the thread by a forced unwind and the process aborts all the same
# (seen in benchmark workers: gdb showed ProcessGroupGloo::AsyncWork's destructor in that thread). The pause lets the
# threads get there first; under load they can be off the CPU for a few milliseconds.
_SETTLE_S = 0.05
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
        time.sleep(_SETTLE_S)
