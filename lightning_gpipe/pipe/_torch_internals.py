"""Every private torch API the engine and the strategy rely on, named once: an upgrade that changes one fails here.

``tests/engine/test_torch_internals.py`` pins each of them (it exists, with the behaviour relied on). Kept here, and
why no public API does it:

- ``tree_flatten``, ``tree_flatten_with_path``, ``tree_map``, ``tree_unflatten``, ``keystr``: torch's pytree
  (``torch.utils._pytree``) walks the nested tuples, lists, dicts and namedtuples of a batch as torch itself does
  (``torch.compile``, ``torch.export``, DTensor); torch has no public pytree module.
- ``BatchNormBase``: ``torch.nn.modules.batchnorm._BatchNorm``, the base of ``BatchNorm1d/2d/3d``, ``SyncBatchNorm``
  and the libraries' subclasses (timm's ``BatchNormAct2d``); checking the public classes one by one would miss those.
- ``profiler_enabled``: ``torch.autograd._profiler_enabled``, whether torch's profiler records; a
  ``record_function`` range costs about 10 µs even with none, the check 0.2 µs.
- ``version``: ``Tensor._version``, the in-place write counter autograd checks saved tensors with; the one way to
  tell that a buffer was written.
- ``storage_key``: ``untyped_storage()._cdata``, the identity of a tensor's storage (views of one storage share it);
  ``data_ptr()`` is 0 for every tensor on the meta device.
- ``forward_hooks_always_called``: ``Module._forward_hooks_always_called``, where
  ``register_forward_hook(always_call=True)`` records its hooks; removing such a hook by its key must clear it too.

- ``accumulate_grads``: ``torch.autograd.graph._engine_run_backward``, the autograd engine's run that
  ``torch.autograd.backward`` ends in, without its Python pass over each (tensor, gradient) pair first (a zb-h1 W
  action hands it every weight of the stage, once per micro-batch); the engine still checks each gradient's shape,
  dtype and device. ``torch.autograd.backward`` has no way to skip that pass.

- ``saved_tensors_pack_hook``: ``torch._C._autograd._top_saved_tensors_default_hooks``, the pack hook of the
  innermost ``saved_tensors_hooks`` in effect: zb-h1's split must not change what autograd saves under
  ``torch.utils.checkpoint``'s non-reentrant forward, whose recompute checks it; torch exposes no getter.

- ``fsdp_post_backward``: each FSDP2 parameter group's ``post_backward`` (``fully_shard.state(module)``'s
  ``_state_ctx.all_states``, their ``_fsdp_param_groups``) and the root state's
  ``_root_post_backward_final_callback``: a stage's gradients reduce-scattered once, after the last backward work of
  the step, as torch's own pipeline schedules do it (``PipelineStage.perform_reduce_grad``). FSDP2 runs them from
  autograd hooks only, which fire after a layer's input gradient: zb-h1's deferred weight gradients come later.
- ``fsdp_forward_hooks_off``: a ``fully_shard`` root state's ``_lazy_init`` and its ``_pre_forward_hook_handle`` /
  ``_post_forward_hook_handle``: while a pipeline holds a layer gathered for the whole step, FSDP2's hooks at each of
  its M forwards, re-materialized forwards and backwards have nothing to do but cost host time (1.2× a CPU step's
  forward and backward, ``benchmarks/results/fsdp``); FSDP2 has no switch for them.

- ``abort_together``: ``ProcessGroupNCCL._group_start`` / ``_group_end`` (ncclGroupStart / ncclGroupEnd), the
  region torch's own ``_abort_process_group`` aborts every NCCL communicator in (torch 2.13 calls them directly,
  2.14 through ``_coalescing_manager``): aborted one after another, one communicator's abort can wait on another's
  (pytorch#119797); torch's public abort takes one group or all of them, the world's among them.

- ``optimizer_state_dict``: ``torch.distributed.checkpoint.state_dict._init_optim_state``, which
  ``get_optimizer_state_dict`` calls first: on an optimizer that has not stepped yet it runs a step with zero
  gradients (lr 0) to create its state, so a checkpoint saved before the first step would start Adam's step counts
  at 1 and change every later update (a pipelined run then leaves the plain one); torch has no option to skip it.

- ``is_optimized_module``: ``torch._dynamo.eval_frame.OptimizedModule``, the module ``torch.compile(m)`` returns
  (``nn.Module.compile`` sets ``Module._compiled_call_impl`` instead); ``graphs_compiled``: dynamo's count of the
  graphs it compiled (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``), read around a layer's call to
  count its graphs; ``RECOMPILE_LIMIT_LOGGER``: the logger dynamo warns on when a code object reaches
  ``recompile_limit`` and runs uncompiled from then on (``torch._dynamo.convert_frame``). torch has no public way to
  tell a compiled module, to count compilations or to hear of the limit.

Not counted, and pinned by the same test: ``Module._modules``, ``_parameters``, ``_buffers``, ``_forward_pre_hooks``
and ``_forward_hooks``, the dicts every ``nn.Module`` method reads and writes (replacing a layer or a buffer under its
name without the checks ``__setattr__`` runs). ``torch.distributed._broadcast_coalesced`` is the strategy's, in
``lightning_gpipe/strategy/_lightning_internals.py``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import _engine_run_backward
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map, tree_unflatten

__all__ = [
    "BatchNormBase",
    "abort_together",
    "accumulate_grads",
    "forward_hooks_always_called",
    "fsdp_forward_hooks_off",
    "fsdp_post_backward",
    "graphs_compiled",
    "is_optimized_module",
    "keystr",
    "profiler_enabled",
    "saved_tensors_pack_hook",
    "storage_key",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_map",
    "tree_unflatten",
    "version",
]


RECOMPILE_LIMIT_LOGGER = "torch._dynamo.convert_frame"


def is_optimized_module(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile(m)``'s wrapper of a module ``m`` (without torch._dynamo imported
    nothing can be)."""
    if "torch._dynamo" not in sys.modules:
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def graphs_compiled() -> int:
    """How many graphs dynamo compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def profiler_enabled() -> bool:
    """Whether torch's profiler is recording now."""
    return bool(torch.autograd._profiler_enabled())


def version(t: torch.Tensor) -> int:
    """``t``'s in-place write counter; raises RuntimeError for an inference tensor, which has none."""
    return int(t._version)


def storage_key(t: torch.Tensor) -> int:
    """The same number for every tensor that views one storage, meta tensors included."""
    return int(t.untyped_storage()._cdata)


def forward_hooks_always_called(module: nn.Module) -> dict[int, Any]:
    """The keys of ``module``'s forward hooks registered with ``always_call=True``."""
    return module._forward_hooks_always_called


def accumulate_grads(leaves: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """``torch.autograd.backward(leaves, grads)`` for leaves and gradients of their shapes: into ``.grad`` as autograd
    accumulates, their hooks fired."""
    _engine_run_backward(tuple(leaves), tuple(grads), False, False, (), True, True)


def saved_tensors_pack_hook() -> Callable[[torch.Tensor], Any] | None:
    """The pack hook of the innermost ``torch.autograd.graph.saved_tensors_hooks`` in effect, or None."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return None if hooks is None else hooks[0]


def fsdp_post_backward(module: nn.Module) -> None:
    """What FSDP2's autograd hooks run after ``module``'s (a ``fully_shard`` root's) last backward: each of its
    parameter groups reduce-scatters its unsharded gradients (as the module's flags say) and reshards, then the root
    waits for the reductions."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)  # type: ignore[attr-defined]
    for each in state._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def fsdp_forward_hooks_off(module: nn.Module) -> Callable[[], None]:
    """Takes FSDP2's forward hooks off ``module`` (a single-module ``fully_shard`` root), lazily initialized first as
    its first forward would be; returns what puts them back in their places among the module's other hooks. Without
    them nothing gathers, frees or registers backward hooks: the caller gathers (``unshard``) and reduces
    (:func:`fsdp_post_backward`)."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)  # type: ignore[attr-defined]
    state._lazy_init()
    ours = {state._pre_forward_hook_handle.id, state._post_forward_hook_handle.id}
    taken = []
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        before = dict(hooks)
        taken.append((hooks, before))
        for key in ours & before.keys():
            del hooks[key]

    def put_back() -> None:
        for hooks, before in taken:
            now = dict(hooks)
            hooks.clear()
            hooks.update((key, hook) for key, hook in before.items() if key in ours or key in now)
            hooks.update((key, hook) for key, hook in now.items() if key not in before)

    return put_back


def abort_together(groups: Sequence[Any], device: torch.device) -> None:
    """Abort the NCCL process ``groups`` (each a ``ProcessGroup``) between one ncclGroupStart and ncclGroupEnd (the
    first group's NCCL backend on ``device`` opens the region; it holds for every communicator of the thread), as
    torch aborts all of its groups; where that cannot be had, one after another (a failure path must go on)."""
    if not groups:
        return
    try:
        backend = groups[0]._get_backend(device)
        start, end = backend._group_start, backend._group_end
    except (AttributeError, RuntimeError):
        start = end = None
    if start is None or end is None:
        for group in groups:
            with contextlib.suppress(Exception):
                group.abort()
        return
    start()
    try:
        for group in groups:
            with contextlib.suppress(Exception):  # the failure being handled matters more than how its groups end
                group.abort()
    finally:
        end()


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, options: Any) -> dict[str, Any]:
    """``get_optimizer_state_dict`` of ``optimizer`` as it is: an optimizer that has not stepped yet stays so."""
    import torch.distributed.checkpoint.state_dict as dcp_state

    real = dcp_state._init_optim_state
    dcp_state._init_optim_state = lambda optim: None
    try:
        return dcp_state.get_optimizer_state_dict(model, optimizer, options=options)
    finally:
        dcp_state._init_optim_state = real
