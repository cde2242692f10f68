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
