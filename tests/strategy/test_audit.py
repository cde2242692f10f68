"""The setup audit on plain modules: every reference to the backbone, and every layer or weight it shares."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_gpipe.strategy._audit import backbone_references, outside_modules, point_at_stage, shared_with_outside
from lightning_gpipe.strategy._weight_copies import outside_parameters


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.trunk = nn.Module()
        self.trunk.blocks = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 5, bias=False))
        self.backbone = self.trunk.blocks  # an alias, as `self.backbone = self.vit.blocks`
        self.trunk.blocks[2].weight = self.embed.weight  # tied across the boundary
        self.first = self.trunk.blocks[0]  # a backbone layer held outside
        self.parts = [self.backbone]
        self.by_name = {"b": self.backbone}


@pytest.mark.timeout(10)
def test_every_reference_is_found_and_pointed_at_the_stage() -> None:
    model = Model()
    references = backbone_references(model, model.backbone)
    assert sorted(path for path, _, _ in references) == ["backbone", "by_name['b']", "parts[0]", "trunk.blocks"]
    stage = nn.Identity()
    point_at_stage(references, stage)
    assert model.backbone is stage and model.trunk.blocks is stage
    assert model.parts[0] is stage and model.by_name["b"] is stage


@pytest.mark.timeout(10)
def test_a_tuple_holding_the_backbone_is_refused() -> None:
    model = Model()
    model.frozen = (model.backbone,)
    with pytest.raises(TypeError, match="frozen is a tuple holding the backbone"):
        backbone_references(model, model.backbone)


@pytest.mark.timeout(10)
def test_layers_and_weights_shared_with_the_outside_are_named() -> None:
    model = Model()
    findings = shared_with_outside(model, model.backbone, "backbone")
    assert len(findings) == 2, findings
    assert findings[0].startswith("layer 0 (Linear) of self.backbone is also self.first")
    assert findings[1].startswith("self.backbone.2.weight is tied to self.embed.weight outside the backbone")
    # Outside the backbone: the embedding (with the tied weight) and the held layer, in the module's order.
    assert [name for name, _ in outside_modules(model, model.backbone)] == ["", "embed", "trunk", "first"]
    params = outside_parameters(model, model.backbone)
    assert [id(p) for p in params] == [id(model.embed.weight), id(model.first.weight), id(model.first.bias)]


@pytest.mark.timeout(10)
def test_averaged_copies_of_the_backbone_follow_the_stage_and_others_are_refused() -> None:
    import copy

    from torch.optim.swa_utils import AveragedModel

    from lightning_gpipe.strategy._audit import BackboneAudit
    from lightning_gpipe.strategy._averaged import StageCopy, WeightAverages

    model = Model()
    model.ema = AveragedModel(model.backbone)  # a deepcopy, made before the split: found by its structure
    model.head_ema = AveragedModel(model.embed)  # an average of something else: left alone
    callback_copy = copy.deepcopy(model)  # as StochasticWeightAveraging's copy of the whole module
    holder = nn.Module()
    holder.average = callback_copy
    audit = BackboneAudit(model, model.backbone, "backbone")
    averages = WeightAverages(model, model.backbone, "backbone", audit.references, [(holder, "average")])
    assert len(averages.copies) == 3, averages.findings  # self.ema, the callback's copy, and the ema inside it
    stage = nn.Sequential()
    stage.add_module("2", nn.Linear(4, 5, bias=False))  # as the last stage: layer 2 under its name
    averages.follow(stage)
    assert isinstance(model.ema.module, StageCopy) and list(model.ema.module.state_dict()) == ["2.weight"]
    assert isinstance(callback_copy.backbone, StageCopy) and callback_copy.trunk.blocks is callback_copy.backbone
    assert isinstance(callback_copy.ema.module, StageCopy) and not isinstance(model.head_ema.module, StageCopy)
    # Averaging pairs the copy with the model tensor for tensor: the same names, in the same order.
    assert list(model.ema.module.state_dict()) == list(stage.state_dict())

    odd = Model()
    odd.ema = AveragedModel(nn.ModuleList([odd.backbone, odd.embed]))  # holds the backbone's copy, is no holder
    refs = BackboneAudit(odd, odd.backbone, "backbone").references
    with pytest.raises(TypeError, match=r"self.ema averages a module that holds a copy of self.backbone"):
        WeightAverages(odd, odd.backbone, "backbone", refs, [])
