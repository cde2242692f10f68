"""Every private Lightning and torchmetrics API GPipeStrategy relies on, pinned: an upgrade that changes one fails here.

Each test names the internal (see ``lightning_gpipe/strategy/_lightning_internals.py``) and what the strategy needs of
it, in one process and in a few seconds.
"""

from __future__ import annotations

import inspect
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

from lightning_gpipe.strategy import GPipeStrategy
from lightning_gpipe.strategy import _lightning_internals as internals
from tests.helpers.launch import quiet_trainer


def parameters(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_process_start_and_join() -> None:
    """The launcher takes (environment, processes, nodes); the connection takes the backend and init_process_group's
    keyword arguments (timeout, device_id)."""
    assert issubclass(internals.SubprocessScriptLauncher, _Launcher)
    assert parameters(internals.SubprocessScriptLauncher.__init__)[1:] == [
        "cluster_environment",
        "num_processes",
        "num_nodes",
    ]
    launcher = internals.SubprocessScriptLauncher(LightningEnvironment(), 2, 1)
    assert not launcher.is_interactive_compatible
    init = inspect.signature(internals.init_dist_connection).parameters
    assert list(init)[:2] == ["cluster_environment", "torch_distributed_backend"]
    assert init["kwargs"].kind is inspect.Parameter.VAR_KEYWORD


def test_threads_optimizer_states_and_reduction() -> None:
    assert parameters(internals.set_num_threads_if_needed) == ["num_processes"]
    assert parameters(internals.optimizers_to_device) == ["optimizers", "device"]
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([weight])
    weight.grad = torch.ones(2)
    optimizer.step()
    internals.optimizers_to_device([optimizer], torch.device("cpu"))
    assert optimizer.state[weight]["exp_avg"].device.type == "cpu"
    assert parameters(internals.sync_ddp_if_available) == ["result", "group", "reduce_op"]
    value = torch.tensor([3.0])  # no process group: returned as it is
    assert internals.sync_ddp_if_available(value, None, reduce_op="mean") is value
    assert parameters(internals.all_gather_ddp_if_available) == ["tensor", "group", "sync_grads"]
    assert internals.all_gather_ddp_if_available(value, None) is value  # no process group: returned as it is


def test_the_connector_hands_over_sync_batchnorm_num_nodes_and_world_ranks() -> None:
    """Trainer(sync_batchnorm=True) reaches the strategy as ``_layer_sync``; ``num_nodes`` and ``set_world_ranks``
    are set and called for any strategy that has them, ``is_distributed`` read with hasattr."""
    called = []

    class Probe(GPipeStrategy):
        def set_world_ranks(self) -> None:
            called.append(True)
            super().set_world_ranks()

    for sync in (False, True):
        strategy = Probe(chunks=2)
        trainer = quiet_trainer(devices=2, num_nodes=1, strategy=strategy, sync_batchnorm=sync)
        assert trainer.strategy is strategy
        assert internals.layer_sync_requested(strategy) is sync
        assert strategy.num_nodes == 1 and strategy.num_processes == 2
        assert trainer._accelerator_connector.is_distributed
        assert isinstance(strategy.launcher, internals.SubprocessScriptLauncher)
    assert called == [True, True]


def test_device_mesh_of_the_module() -> None:
    module = pl.LightningModule()
    mesh = object()
    internals.set_device_mesh(module, mesh)  # type: ignore[arg-type]
    assert module.device_mesh is mesh


def test_logged_values_and_their_tensors() -> None:
    """``Trainer._results`` is the running loop's collection; each entry keeps its running value, its batch-size
    weight (mean) and this step's value (forward cache)."""
    assert isinstance(inspect.getattr_static(pl.Trainer, "_results"), property)
    results = _ResultCollection(training=True)
    results.log("training_step", "loss", torch.tensor(2.0), on_step=True, on_epoch=True, batch_size=4)
    results.log("training_step", "top", torch.tensor(5.0), on_step=False, on_epoch=True, reduce_fx="max", batch_size=4)

    class Trainer:
        _results = results

    keys, tensors = internals.logged_values(Trainer())  # type: ignore[arg-type]
    assert keys == ["training_step.loss", "training_step.top"]
    loss, top = results["training_step.loss"], results["training_step.top"]
    expected = [loss.value, loss.cumulated_batch_size, loss._forward_cache, top.value]
    assert len(tensors) == len(expected) and all(a is b for a, b in zip(tensors, expected)), tensors
    assert float(loss.value) == 8.0 and float(loss.cumulated_batch_size) == 4.0 and float(top.value) == 5.0

    class Empty:
        _results = None

    assert internals.logged_values(Empty()) == ([], [])  # type: ignore[arg-type]


def test_metric_forward_cache_and_public_state() -> None:
    torchmetrics = pytest.importorskip("torchmetrics")
    metric = torchmetrics.MeanMetric()
    out = metric(torch.tensor([1.0, 3.0]))
    assert internals.forward_cache(metric) is out
    assert set(metric.metric_state) == {"mean_value", "weight"}  # the public view of every state


def test_norm_clipping_reaches_the_routed_function() -> None:
    """The Trainer clips through ``Precision.clip_gradients``, which calls ``self.clip_grad_by_norm`` for "norm"."""
    plugin = Precision()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    seen = []
    internals.route_norm_clipping(plugin, lambda opt, clip_val: seen.append((opt, clip_val)))
    plugin.clip_gradients(optimizer, 0.5, "norm")
    assert seen == [(optimizer, 0.5)]
    assert "clip_grad_by_norm" not in vars(Precision())  # one instance only: the class keeps its method


def test_prediction_return_is_a_public_switch() -> None:
    trainer = quiet_trainer(devices=1)
    trainer.predict_loop.return_predictions = False
    assert trainer.predict_loop.return_predictions is False


def test_model_summary_callbacks_build_the_given_summary() -> None:
    """``ModelSummary._summary(trainer, module)`` is what ``on_fit_start`` calls (and prints on rank 0)."""
    from lightning.pytorch.callbacks import ModelSummary, RichModelSummary

    assert list(inspect.signature(ModelSummary._summary).parameters) == ["self", "trainer", "pl_module"]
    assert issubclass(RichModelSummary, ModelSummary)  # (building one needs `rich`)

    class Subclassed(ModelSummary):  # as RichModelSummary: only the printing differs
        pass

    callbacks = [ModelSummary(max_depth=2), Subclassed(max_depth=3)]
    trainer = pl.Trainer(accelerator="cpu", callbacks=list(callbacks), logger=False, enable_progress_bar=False)
    built: list[tuple[object, int]] = []
    internals.summarize_with(trainer, lambda module, depth: built.append((module, depth)))
    module = pl.LightningModule()
    for callback in callbacks:
        callback._summary(trainer, module)
    assert built == [(module, 2), (module, 3)]


def test_broadcast_coalesced_overwrites_in_place_from_the_source(tmp_path: Any) -> None:
    """torch's ``_broadcast_coalesced(group, tensors, bucket bytes, src)``: in place, tensors of several dtypes (one
    rank is enough to pin the signature and that the tensors keep their values and identity)."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        tensors = [torch.arange(3.0), torch.tensor([7], dtype=torch.int64), torch.ones(2, dtype=torch.float64)]
        before = [t.clone() for t in tensors]
        ids = [id(t) for t in tensors]
        internals.broadcast_coalesced(dist.group.WORLD, tensors, 16, 0)
        assert [id(t) for t in tensors] == ids
        assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    finally:
        dist.destroy_process_group()


def test_averaging_callbacks_keep_their_copy_of_the_module_in_average_model() -> None:
    """WeightAveraging holds an AveragedModel of the module (its copy in ``.module``), StochasticWeightAveraging a
    deepcopy of the module, both in ``_average_model`` and both made in ``setup``, before the strategy's."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging
    from lightning.pytorch.callbacks.weight_averaging import EMAWeightAveraging

    ema, swa = EMAWeightAveraging(decay=0.5), StochasticWeightAveraging(swa_lrs=0.1)
    module = pl.LightningModule()
    module.layer = torch.nn.Linear(2, 2)
    trainer = quiet_trainer(callbacks=[ema, swa])
    module.trainer = trainer
    for callback in (ema, swa):
        callback.setup(trainer, module, "fit")
    found = internals.averaged_copies(module)
    assert found == [(ema._average_model, "module"), (swa, "_average_model")]
    for holder, attribute in found:
        copy = getattr(holder, attribute)
        assert copy is not module and list(copy.state_dict()) == list(module.state_dict())
    assert internals.averaged_copies(pl.LightningModule()) == []  # no Trainer attached
