"""Run a function on W gloo processes on 127.0.0.1 with a hard deadline; collect each rank's result or traceback."""

from __future__ import annotations

import contextlib
import os
import queue
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers.devices import ACCELERATOR, require_devices

COLLECTIVE_TIMEOUT_S = 60.0


def _entry(
    fn: Callable, rank: int, world_size: int, port: int, results: Any, args: tuple, pg_timeout: float, env: dict
) -> None:
    # A forkserver child has the server's environment, not the test's: give it the test's, as spawn would.
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        if pg_timeout > 0:
            timeout = timedelta(seconds=pg_timeout)
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:
            # As torchrun would: Lightning finds these and lets its own setup create the process group.
            os.environ.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                WORLD_SIZE=str(world_size),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size),
                GROUP_RANK="0",
                TORCHELASTIC_RUN_ID="tests",
            )
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
        # Skip destroy_process_group: after an injected failure some sends are never received and would block it.
        os._exit(0)


_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "lightning_gpipe", "tests.helpers.models"]


def _context() -> Any:
    """A forkserver that has imported torch and Lightning once: each rank forks from it (~0.1 s) instead of
    importing them again (~5 s of CPU per rank on this 2-core machine, several hundred times a suite)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = COLLECTIVE_TIMEOUT_S,
    expect_errors: bool = False,
    lightning: bool = False,
    allow_missing: bool = False,
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank; returns the results in rank order.

    With ``lightning=True`` no process group is made; the processes get torchrun's environment variables instead,
    so that a Trainer inside ``fn`` sets up the group itself (its rank 0 hosts the store on the given port).

    Raises if any rank raised (unless ``expect_errors``, in which case a rank's entry is its traceback string) or if
    not every rank reported within ``timeout`` seconds (then all processes are killed).
    """
    if lightning:
        require_devices(world_size)
    ctx = _context()
    results = ctx.Queue()
    # The parent hosts the rendezvous store, so no rank can take it down while the others still connect.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))
    port = store.port
    if lightning:
        del store  # hand the port to the Trainer's own store on rank 0
        pg_timeout = 0
    procs = [
        ctx.Process(
            target=_entry, args=(fn, rank, world_size, port, results, args, pg_timeout, dict(os.environ)), daemon=False
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(got))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s; reported: {got}")
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
                got[rank] = (ok, value)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    missing = sorted(set(range(world_size)) - set(got))
                    if allow_missing:  # a test that kills a rank on purpose
                        got.update({r: (True, None) for r in missing})
                        break
                    raise RuntimeError(f"ranks {missing} exited without reporting") from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    failures = {r: v for r, (ok, v) in got.items() if not ok}
    if failures and not expect_errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items())))
    return [got[r][1] for r in range(world_size)]


def quiet_trainer(**kwargs: Any) -> Any:
    """A ``lightning.pytorch.Trainer`` on the tests' accelerator (``tests/helpers/devices.py``), without the files
    and printing tests do not look at; ``kwargs`` win."""
    import lightning.pytorch as pl

    devices = kwargs.get("devices", 1)
    require_devices(devices if isinstance(devices, int) else 1)
    quiet = {
        "accelerator": ACCELERATOR,
        "enable_checkpointing": False,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(**{**quiet, **kwargs})


@contextlib.contextmanager
def counted_fsdp_collectives() -> Iterator[dict[str, int]]:
    """Counts FSDP2's all-gathers and reduce-scatters (``dist.all_gather_single``, ``dist.reduce_scatter_single``)
    made in the block, in this process."""
    calls = {"all_gather": 0, "reduce_scatter": 0}
    real = {"all_gather": dist.all_gather_single, "reduce_scatter": dist.reduce_scatter_single}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real[name](*args, **kwargs)

        return call

    dist.all_gather_single, dist.reduce_scatter_single = counted("all_gather"), counted("reduce_scatter")
    try:
        yield calls
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = real["all_gather"], real["reduce_scatter"]
