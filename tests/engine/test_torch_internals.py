"""Every private torch API the package relies on, pinned: an upgrade that changes one fails here, in a second.

Each test names the internal (see ``lightning_gpipe/pipe/_torch_internals.py``) and what the code needs of it.
"""

from __future__ import annotations

import inspect
from collections import namedtuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_gpipe.pipe import _torch_internals as internals


def test_pytree_flattens_batches_as_the_micro_batches_need() -> None:
    """Leaves in order through tuples, lists, dicts and namedtuples; the spec rebuilds the same types; paths name the
    leaf as ``keystr`` writes them (the error messages quote them); None is a leaf."""
    Pair = namedtuple("Pair", ["a", "b"])
    batch = {"x": (torch.zeros(1), [torch.ones(1), 3]), "p": Pair(torch.full((1,), 2.0), None)}
    leaves, spec = internals.tree_flatten(batch)
    assert [float(t) if isinstance(t, torch.Tensor) else t for t in leaves] == [
        0.0,
        1.0,
        3,
        2.0,
        None,
    ]  # None is a leaf
    rebuilt = internals.tree_unflatten(leaves, spec)
    assert isinstance(rebuilt["p"], Pair) and isinstance(rebuilt["x"], tuple) and isinstance(rebuilt["x"][1], list)
    doubled = internals.tree_map(lambda t: t * 2 if isinstance(t, torch.Tensor) else t, batch)
    assert float(doubled["x"][1][0]) == 2.0 and doubled["x"][1][1] == 3
    paths, _ = internals.tree_flatten_with_path(batch)
    assert [internals.keystr(path) for path, _ in paths] == [
        "['x'][0]",
        "['x'][1][0]",
        "['x'][1][1]",
        "['p'].a",
        "['p'].b",
    ]


def test_batchnorm_base_covers_every_batchnorm() -> None:
    for layer in (nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.BatchNorm3d(2), nn.SyncBatchNorm(2), nn.LazyBatchNorm2d()):
        assert isinstance(layer, internals.BatchNormBase), type(layer)
    assert not isinstance(nn.LayerNorm(2), internals.BatchNormBase)
    assert not isinstance(nn.InstanceNorm2d(2), internals.BatchNormBase)


def test_profiler_enabled_only_while_the_profiler_records() -> None:
    assert internals.profiler_enabled() is False
    with torch.autograd.profiler.profile():
        assert internals.profiler_enabled() is True
    assert internals.profiler_enabled() is False


def test_version_counts_in_place_writes_and_inference_tensors_have_none() -> None:
    t = torch.zeros(3)
    before = internals.version(t)
    t.add_(1)
    t[0] = 5
    assert internals.version(t) == before + 2
    assert internals.version(t.view(3)) == internals.version(t)  # a view shares its base's counter
    with torch.inference_mode():
        frozen = torch.zeros(1)
    try:
        internals.version(frozen)
    except RuntimeError:
        pass
    else:
        raise AssertionError("an inference tensor's version no longer raises: buffers.py and batchnorm.py expect it")


def test_storage_key_is_shared_by_views_and_works_on_meta() -> None:
    for device in ("cpu", "meta"):
        a, b = torch.empty(4, device=device), torch.empty(4, device=device)
        assert internals.storage_key(a) == internals.storage_key(a[1:]) == internals.storage_key(a.view(2, 2))
        assert internals.storage_key(a) != internals.storage_key(b)


def test_always_called_hooks_are_recorded_by_key() -> None:
    layer = nn.Linear(2, 2)
    handle = layer.register_forward_hook(lambda *_: None, always_call=True)
    assert handle.id in internals.forward_hooks_always_called(layer) and handle.id in layer._forward_hooks
    handle.remove()
    assert handle.id not in internals.forward_hooks_always_called(layer)


def test_accumulate_grads_is_autograds_backward_on_leaves() -> None:
    """Into ``.grad`` (set, then summed) with the parameters' hooks fired, as ``torch.autograd.backward``; a
    gradient of the wrong shape is refused by the engine itself."""
    p, q = nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(4))
    seen = []
    p.register_post_accumulate_grad_hook(lambda t: seen.append("p"))
    q.register_hook(lambda g: seen.append("q") or g * 2)
    internals.accumulate_grads([p, q], [torch.ones(2, 3), torch.ones(4)])
    internals.accumulate_grads([p], [torch.full((2, 3), 2.0)])
    assert torch.equal(p.grad, torch.full((2, 3), 3.0)) and torch.equal(q.grad, torch.full((4,), 2.0))
    assert sorted(seen) == ["p", "p", "q"]
    with pytest.raises(RuntimeError, match="shape"):
        internals.accumulate_grads([p], [torch.ones(3, 2)])


def test_saved_tensors_pack_hook_is_the_innermost_in_effect() -> None:
    """None outside any ``saved_tensors_hooks``; the innermost pack hook inside, torch.utils.checkpoint's own in its
    non-reentrant forward (zb-h1 does not split there)."""
    from torch.utils.checkpoint import checkpoint

    def outer(t: torch.Tensor) -> torch.Tensor:
        return t

    def inner(t: torch.Tensor) -> int:
        return 0

    assert internals.saved_tensors_pack_hook() is None
    with torch.autograd.graph.saved_tensors_hooks(outer, outer):
        assert internals.saved_tensors_pack_hook() is outer
        with torch.autograd.graph.saved_tensors_hooks(inner, outer):
            assert internals.saved_tensors_pack_hook() is inner
        assert internals.saved_tensors_pack_hook() is outer
    seen = []
    checkpoint(lambda t: seen.append(internals.saved_tensors_pack_hook()) or t * 2, torch.ones(2), use_reentrant=False)
    assert seen[0] is not None and seen[0].__qualname__.startswith("_checkpoint_hook")


def test_module_slots_are_the_dicts_module_methods_use() -> None:
    """Not routed through the module, used directly: ``_modules``, ``_parameters``, ``_buffers`` and the hook dicts."""
    net = nn.Sequential(nn.BatchNorm1d(2))
    bn = net[0]
    assert list(net._modules) == ["0"] and net._modules["0"] is bn
    assert set(bn._parameters) == {"weight", "bias"} and bn._parameters["weight"] is bn.weight
    assert bn._buffers["running_mean"] is bn.running_mean
    replacement = torch.ones(2)
    bn._buffers["running_mean"] = replacement  # what a swap without __setattr__'s checks relies on
    assert bn.running_mean is replacement and bn.state_dict(keep_vars=True)["running_mean"] is replacement
    pre = bn.register_forward_pre_hook(lambda *_: None)
    post = bn.register_forward_hook(lambda *_: None)
    assert pre.id in bn._forward_pre_hooks and post.id in bn._forward_hooks


def test_fsdp_post_backward_reaches_fsdp2s_own_steps() -> None:
    """FSDP2's state of a ``fully_shard`` module, its per-state parameter groups' ``post_backward`` and the root's
    final callback (their behaviour: tests/engine/test_fsdp.py, one reduce-scatter per layer per step)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState, FSDPStateContext

    assert callable(fully_shard.state)  # type: ignore[attr-defined]
    assert callable(FSDPParamGroup.post_backward) and callable(FSDPState._root_post_backward_final_callback)
    state = FSDPState()
    assert isinstance(state._state_ctx, FSDPStateContext) and state._state_ctx.all_states == []
    assert state._fsdp_param_groups == []


def test_fsdp_forward_hooks_off_reaches_fsdp2s_hook_handles() -> None:
    """FSDP2's state keeps the handles of the forward hooks it registers and a lazy init a root runs at its first
    forward (their behaviour: tests/engine/test_fsdp.py, no FSDP2 hook within a step)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    assert callable(FSDPState._lazy_init) and callable(FSDPState._pre_forward) and callable(FSDPState._post_forward)
    source = inspect.getsource(FSDPState.init)
    assert "self._pre_forward_hook_handle = modules[0].register_forward_pre_hook(" in source
    assert "self._post_forward_hook_handle = modules[0].register_forward_hook(" in source


def test_abort_together_uses_the_region_torch_aborts_its_groups_in() -> None:
    """torch aborts all its groups between ncclGroupStart and ncclGroupEnd (pytorch#119797): 2.13 through the NCCL
    backend's ``_group_start`` / ``_group_end``, 2.14 through ``_coalescing_manager``, which calls them."""
    from torch.distributed import distributed_c10d

    assert callable(dist.ProcessGroup.abort) and callable(dist.ProcessGroup._get_backend)
    source = inspect.getsource(distributed_c10d._abort_process_group)
    assert "119797" in source and "pg_to_abort.abort()" in source
    if dist.is_nccl_available():
        nccl = dist.ProcessGroupNCCL
        assert callable(nccl._group_start) and callable(nccl._group_end)
    calls: list[str] = []

    class Backend:
        def _group_start(self) -> None:
            calls.append("start")

        def _group_end(self) -> None:
            calls.append("end")

    class Group:
        def __init__(self, name: str) -> None:
            self.name = name

        def _get_backend(self, device: torch.device) -> Backend:
            return Backend()

        def abort(self) -> None:
            calls.append(self.name)
            if self.name == "b":
                raise RuntimeError("already aborted")

    internals.abort_together([Group("a"), Group("b"), Group("c")], torch.device("cuda", 0))
    assert calls == ["start", "a", "b", "c", "end"]  # one region; one group's error does not stop the others


def test_optimizer_state_dict_takes_no_step_where_torchs_would() -> None:
    """torch's get_optimizer_state_dict runs a step (zero gradients, lr 0) on an optimizer without state, through
    ``_init_optim_state``; ours reads it as it is: no state before the first step, the same state after one."""
    import torch.distributed.checkpoint.state_dict as dcp_state

    from lightning_gpipe.pipe._torch_internals import optimizer_state_dict

    assert "_init_optim_state(optim)" in inspect.getsource(dcp_state._get_optim_state_dict)
    model = torch.nn.Linear(3, 2)
    options = dcp_state.StateDictOptions(flatten_optimizer_state_dict=True)
    ours, theirs = torch.optim.Adam(model.parameters()), torch.optim.Adam(model.parameters())
    before = optimizer_state_dict(model, ours, options)
    assert not [k for k in before if k.startswith("state.")] and not ours.state
    dcp_state.get_optimizer_state_dict(model, theirs, options=options)
    assert float(theirs.state[model.weight]["step"]) == 1.0  # what the step of theirs did
    model(torch.randn(4, 3)).sum().backward()
    ours.step()
    stepped = optimizer_state_dict(model, ours, options)
    assert float(stepped["state.weight.step"]) == 1.0 and stepped["state.weight.exp_avg"].abs().sum() > 0


def test_compiled_modules_and_dynamos_graph_count_are_recognized() -> None:
    """``torch.compile(m)`` wraps m (``is_optimized_module``), ``m.compile()`` sets ``_compiled_call_impl``; each new
    graph counts once, a cached one not. The recompile limit's logger: ``tests/engine/test_compiled.py``."""
    graphs_compiled, is_optimized_module = internals.graphs_compiled, internals.is_optimized_module

    class Scaled(nn.Module):  # a class of its own: torch 2.13 compiles no torch.nn class in place
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    layer, in_place = nn.Linear(2, 2), Scaled()
    assert not is_optimized_module(layer) and layer._compiled_call_impl is None
    wrapped = torch.compile(layer, backend="eager")
    in_place.compile(backend="eager")
    assert is_optimized_module(wrapped) and wrapped._orig_mod is layer and in_place._compiled_call_impl is not None
    before = graphs_compiled()
    wrapped(torch.randn(3, 2))
    wrapped(torch.randn(3, 2))
    assert graphs_compiled() == before + 1
    in_place(torch.randn(3, 3))
    assert graphs_compiled() == before + 2
    torch._dynamo.reset()
