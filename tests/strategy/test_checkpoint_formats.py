"""Single-file checkpoints: a plain Trainer and a pipelined one resume each other's exactly, or refuse clearly."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.utils.data import DataLoader, DistributedSampler

from tests.helpers.launch import quiet_trainer, run_distributed
from tests.helpers.tiny_fit import BATCH, TinyPipelined, dataset

TOL = 1e-6


class AdamModule(TinyPipelined):
    """Adam in two groups filtered from named_parameters() (as weight-decay recipes build them): the positions of a
    plain state dict then run through the weights first, then the biases, across both stages."""

    def __init__(self, groups: str = "weights, biases") -> None:
        super().__init__()
        self.groups = groups

    def configure_optimizers(self):
        named = list(self.named_parameters())
        if self.groups == "reversed":  # positions no longer follow the module's order
            named = named[::-1]
        weights = [p for n, p in named if n.endswith("weight")]
        biases = [p for n, p in named if not n.endswith("weight")]
        if self.groups == "one":
            return torch.optim.Adam([p for _, p in named], lr=0.01)
        first, second = (biases, weights) if self.groups == "biases, weights" else (weights, biases)
        return torch.optim.Adam([{"params": first, "weight_decay": 0.01}, {"params": second}], lr=0.01)


def _loader(dp: int, rank: int = 0) -> DataLoader:
    """The same samples in each step: dp replicas of BATCH, or one plain batch of dp × BATCH."""
    if dp == 1:
        return DataLoader(dataset(), batch_size=BATCH)
    sampler = DistributedSampler(dataset(), num_replicas=dp, rank=rank, shuffle=False)
    return DataLoader(dataset(), batch_size=BATCH, sampler=sampler)


def _plain_fit(epochs: int, dp: int, ckpt_path: str | None = None, groups: str = "weights, biases"):
    """A plain single-process Trainer (no strategy) in this process."""
    module = AdamModule(groups)
    trainer = quiet_trainer(devices=1, max_epochs=epochs)
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH * dp), ckpt_path=ckpt_path)
    return trainer, module


def _pipelined_fit(rank: int, world_size: int, epochs: int, ckpt_path: str | None, single_file: bool, groups: str):
    from lightning_gpipe.strategy import GPipeStrategy

    dp = world_size // 2
    module = AdamModule(groups)
    trainer = quiet_trainer(
        devices=world_size,
        strategy=GPipeStrategy(chunks=3, pipeline_parallel_size=2, save_distributed_checkpoint=not single_file),
        max_epochs=epochs,
        use_distributed_sampler=False,  # _loader shards by replica as the plain run's larger batches hold them
    )
    trainer.fit(module, _loader(dp, rank // 2), ckpt_path=ckpt_path)
    return trainer, module


def _max_error(module, reference: dict[str, torch.Tensor]) -> float:
    return max(((p - reference[n]).abs().max() / reference[n].abs().max()).item() for n, p in module.named_parameters())


def resume_plain_worker(rank: int, world_size: int, path: str, reference: dict[str, torch.Tensor]) -> dict:
    warnings.simplefilter("ignore")
    trainer, module = _pipelined_fit(rank, world_size, 2, path, True, "weights, biases")
    return {"err": _max_error(module, reference), "steps": trainer.global_step}


def _flattened(path: Path) -> None:
    """Rewrite a plain checkpoint's optimizer state as earlier versions wrote single files: flattened to names."""
    saved = torch.load(path, weights_only=False)
    module = AdamModule()
    optimizer = module.configure_optimizers()
    optimizer.load_state_dict(saved["optimizer_states"][0])
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    saved["optimizer_states"] = [get_optimizer_state_dict(module, optimizer, options=flat)]
    torch.save(saved, path)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world_size", "written_by"), [(2, "plain"), (2, "earlier version"), (4, "plain")])
def test_plain_checkpoint_resumes_pipelined(tmp_path: Path, one_thread: None, world_size: int, written_by: str) -> None:
    """A plain run checkpointed after epoch 1, resumed pp = 2 (× dp = 2), ends where the plain run of 2 epochs does."""
    warnings.simplefilter("ignore")
    dp = world_size // 2
    _, straight = _plain_fit(2, dp)
    first, _ = _plain_fit(1, dp)
    path = tmp_path / "plain.ckpt"
    first.save_checkpoint(path)
    if written_by == "earlier version":
        _flattened(path)
    reference = {n: p.detach().clone() for n, p in straight.named_parameters()}
    results = run_distributed(resume_plain_worker, world_size, str(path), reference, timeout=280, lightning=True)
    for rank, r in enumerate(results):
        assert r["steps"] == 2 * 8 // dp, r
        assert r["err"] <= TOL, (rank, r)


def save_pipelined_worker(rank: int, world_size: int, path: str, groups: str) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _ = _pipelined_fit(rank, world_size, 1, None, True, groups)
        trainer.save_checkpoint(path)
    return {"warnings": [str(w.message) for w in caught if "GPipeStrategy:" in str(w.message)]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_pipelined_single_file_resumes_plain(tmp_path: Path, one_thread: None, world_size: int) -> None:
    """pp = 2 (× dp = 2) writes torch's own optimizer format; a plain Trainer resumes it and ends where it would."""
    dp = world_size // 2
    path = tmp_path / "pipelined.ckpt"
    results = run_distributed(
        save_pipelined_worker, world_size, str(path), "weights, biases", timeout=280, lightning=True
    )
    assert results[0]["warnings"] == [], results
    saved = torch.load(path, weights_only=False)["optimizer_states"][0]
    n_weights = sum(n.endswith("weight") for n, _ in AdamModule().named_parameters())
    n_all = len(list(AdamModule().parameters()))
    assert [g["params"] for g in saved["param_groups"]] == [list(range(n_weights)), list(range(n_weights, n_all))]
    assert sorted(saved["state"]) == list(range(n_all))
    warnings.simplefilter("ignore")
    _, straight = _plain_fit(2, dp)
    resumed_trainer, resumed = _plain_fit(2, dp, ckpt_path=str(path))
    assert resumed_trainer.global_step == 2 * 8 // dp
    reference = {n: p.detach() for n, p in straight.named_parameters()}
    assert _max_error(resumed, reference) <= TOL


def refuse_worker(rank: int, world_size: int, folder: str) -> dict:
    warnings.simplefilter("ignore")
    errors = {}
    for groups in ("reversed", "biases, weights", "one"):
        try:
            _pipelined_fit(rank, world_size, 2, str(Path(folder) / "plain.ckpt"), True, groups)
            errors[groups] = "resumed"
        except ValueError as e:
            errors[groups] = str(e)
    # Its own checkpoint (optimizer state by name: a warning says why) resumes exactly, as before.
    out = save_pipelined_worker(rank, world_size, str(Path(folder) / "reversed.ckpt"), "reversed")
    saved = torch.load(Path(folder) / "reversed.ckpt", weights_only=False)["optimizer_states"][0]
    kind = "by name" if all(k.startswith(("state.", "param_groups.")) for k in saved) else "other"
    straight = {
        n: p.detach().clone()
        for n, p in _pipelined_fit(rank, world_size, 2, None, True, "reversed")[1].named_parameters()
    }
    resumed = _pipelined_fit(rank, world_size, 2, str(Path(folder) / "reversed.ckpt"), True, "reversed")[1]
    return {"errors": errors, "warnings": out["warnings"], "kind": kind, "err": _max_error(resumed, straight)}


@pytest.mark.timeout(300)
def test_positions_not_provable_are_refused(tmp_path: Path, one_thread: None) -> None:
    """A plain checkpoint into an optimizer listing parameters in another order, grouping them otherwise, or in
    another number of groups: one ValueError naming the cause and the fix, the same on every rank."""
    warnings.simplefilter("ignore")
    first, _ = _plain_fit(1, 1)
    first.save_checkpoint(tmp_path / "plain.ckpt")
    results = run_distributed(refuse_worker, 2, str(tmp_path), timeout=280, lightning=True)
    assert results[0]["errors"] == results[1]["errors"]
    errors = results[0]["errors"]
    for message in errors.values():
        assert message.startswith(f"cannot restore optimizer 0 from {str(tmp_path / 'plain.ckpt')!r}"), message
        assert "from self.parameters() or from filters over self.named_parameters()" in message, message
    assert "lists its parameters in another order than the module's named_parameters()" in errors["reversed"]
    assert (
        "its state 'exp_avg' of parameter 0 has shape (8, 8), but parameter 0 is prefix.bias"
        in errors["biases, weights"]
    ), errors
    assert "it has 2 param groups, this run's optimizer 1" in errors["one"], errors
    warned = results[0]["warnings"]
    assert len(warned) == 1 and "lists its parameters in another order" in warned[0], warned
    assert "a plain (single-device or DDP) Trainer cannot" in warned[0]
    for r in results:
        assert r["kind"] == "by name" and r["err"] <= TOL, r


class TinyAdam(TinyPipelined):
    """Adam, whose state a checkpoint taken before its first step must leave uncreated (its step counts)."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def early_save_worker(rank: int, world_size: int, folder: str, save: bool, sharded: bool) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_gpipe.strategy import GPipeStrategy

    warnings.simplefilter("ignore")

    class SaveAtStart(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if save:
                trainer.save_checkpoint(Path(folder) / "start.ckpt")

    strategy = GPipeStrategy(chunks=2, pipeline_parallel_size=2, save_distributed_checkpoint=sharded)
    trainer = quiet_trainer(devices=world_size, strategy=strategy, max_steps=3, callbacks=[SaveAtStart()])
    module = TinyAdam(tied=True)  # a weight on the first and the last stage, as the LLM example's embedding
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH))
    return {n: p.detach().numpy().copy() for n, p in module.named_parameters()}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("sharded", [True, False])
def test_a_checkpoint_before_the_first_step_changes_nothing(tmp_path: Path, one_thread: None, sharded: bool) -> None:
    """torch's get_optimizer_state_dict steps an optimizer that has no state yet to make one (zero gradients, lr 0):
    Adam's step counts then began at 1, and every later update of the run changed (2e-3 after 3 steps here)."""
    saved = run_distributed(early_save_worker, 2, str(tmp_path), True, sharded, timeout=180, lightning=True)
    straight = run_distributed(early_save_worker, 2, str(tmp_path), False, sharded, timeout=180, lightning=True)
    for rank in range(2):
        assert saved[rank].keys() == straight[rank].keys()
        for name in saved[rank]:
            assert (saved[rank][name] == straight[rank][name]).all(), (rank, name)
    if not sharded:  # as a plain Trainer writes it before its first step: no state
        state = torch.load(tmp_path / "start.ckpt", weights_only=False)["optimizer_states"][0]
        assert state["state"] == {}, state["state"]
