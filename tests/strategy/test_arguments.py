"""GPipeStrategy's own arguments: each bad value fails at construction, in this process, with one clear error."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_gpipe import GPipeStrategy


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"chunks": 0}, "chunks, M, must be an int ≥ 1"),
        ({"chunks": 2.0}, "chunks, M, must be an int ≥ 1"),
        ({"chunks": True}, "chunks, M, must be an int ≥ 1"),
        ({"pipeline_parallel_size": 0}, "give an int ≥ 1 or 'auto'"),
        ({"pipeline_parallel_size": "all"}, "give an int ≥ 1 or 'auto'"),
        ({"activation_checkpointing": "sometimes"}, "choose one of ['always', 'except_last', 'never', 'auto']"),
        (
            {"pipeline_loss": "yes"},
            "choose 'auto' (inside the pipeline when the module defines the pipeline_loss hook)",
        ),
        ({"output": "loss"}, "choose 'all' or 'placeholder'"),
        ({"batch_dim": -1}, "the dimension that holds the samples"),
        ({"batch_dim": False}, "the dimension that holds the samples"),
        ({"trace_steps": [-1]}, "give one or more optimizer-step indices ≥ 0"),
        ({"trace_steps": []}, "give one or more optimizer-step indices ≥ 0"),
        ({"check_batches": "sometimes"}, "choose one of ['first', 'always', 'never']"),
        ({"check_batches": True}, "choose one of ['first', 'always', 'never']"),
        ({"balance": "params"}, "choose one of ['auto', 'flops', 'time', 'parameters'], a list of layer counts"),
        ({"data_parallel": "zero3"}, "choose 'ddp' (each replica holds its stage whole) or 'fsdp'"),
        ({"reshard_after_forward": True}, "only data_parallel='fsdp' shards them; set data_parallel='fsdp'"),
        ({"reshard_after_forward": "yes", "data_parallel": "fsdp"}, "give True or False"),
    ],
    ids=lambda v: repr(v) if isinstance(v, dict) else None,
)
def test_bad_argument_is_named_with_its_fix(kwargs: dict[str, Any], expected: str) -> None:
    (name, value), *_ = kwargs.items()
    with pytest.raises(ValueError, match="GPipeStrategy") as raised:
        GPipeStrategy(**kwargs)
    message = str(raised.value)
    assert f"{name}={value!r}" in message, message
    assert expected in message, message


def test_good_arguments_are_kept() -> None:
    strategy = GPipeStrategy(
        chunks=4, pipeline_parallel_size=2, activation_checkpointing="never", output="placeholder", batch_dim=1
    )
    kept = (strategy.chunks, strategy.activation_checkpointing, strategy.output, strategy.batch_dim)
    assert kept == (4, "never", "placeholder", 1)
    assert GPipeStrategy.strategy_name == "gpipe"


def test_dp_reduction_is_named_and_auto_goes_hierarchical_only_where_it_saves_traffic() -> None:
    from lightning_gpipe.strategy._mesh import hierarchical

    with pytest.raises(
        ValueError, match=r"data_parallel_reduction='tree'\): choose one of \['auto', 'flat', 'hierarchical'\]"
    ):
        GPipeStrategy(data_parallel_reduction="tree")  # type: ignore[arg-type]

    # Each stage's ranks, and processes per node: hierarchical where a stage's replicas share a node and span several.
    def stages_together(world: int, K: int) -> list[list[int]]:
        return [list(range(k, world, K)) for k in range(K)]

    assert hierarchical("auto", stages_together(8, 2), 4) and hierarchical("auto", stages_together(4, 1), 2)
    assert not hierarchical("auto", stages_together(4, 2), 2)  # one replica of each stage per node
    assert not hierarchical("auto", stages_together(4, 1), 4)  # one node
    # replicas_together at K = 2, D = 4 on nodes of 2: each stage's replicas on 2 nodes, 2 a node.
    assert hierarchical("auto", [[0, 1, 2, 3], [4, 5, 6, 7]], 2)
    assert not hierarchical("auto", [[0, 1, 2, 3], [4, 5, 6, 7]], 4)  # each stage's replicas on one node
    assert hierarchical("hierarchical", stages_together(4, 1), 4) and not hierarchical("flat", stages_together(8, 2), 4)


def test_compile_is_checked_at_construction_and_the_split_refused_with_compiled_layers() -> None:
    """``compile=``: a bad option at construction; at setup a zero-bubble schedule with compiled layers (the
    shorthand's or the user's own), and a compiled nn.Sequential backbone, each with the way out."""
    import torch
    from torch import nn

    from lightning_gpipe.strategy._arguments import check_compiled_layers, find_backbone

    with pytest.raises(ValueError, match=r"GPipeStrategy\(compile=\.\.\.\): compile=\{'fullgraf': True\}"):
        GPipeStrategy(compile={"fullgraf": True})
    backbone = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    check_compiled_layers(backbone, False, "zb-h1", inside=True, sync_batchnorm=False)  # nothing compiled
    check_compiled_layers(backbone, True, "1f1b", inside=True, sync_batchnorm=False)  # no split
    check_compiled_layers(backbone, True, "zb-h1", inside=False, sync_batchnorm=False)  # the loss outside: no split
    with pytest.raises(ValueError, match=r"schedule='zb-v'\) splits each backward op by op.*compile=True.*'1f1b'"):
        check_compiled_layers(backbone, True, "zb-v", inside=True, sync_batchnorm=False)
    backbone[1].compile()
    with pytest.raises(ValueError, match=r"the backbone's compiled layers \(1\) cannot do"):
        check_compiled_layers(backbone, False, "zb-h1", inside=True, sync_batchnorm=False)
    normed = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    check_compiled_layers(normed, False, "1f1b", inside=True, sync_batchnorm=True)  # nothing compiled
    normed[0].compile()
    check_compiled_layers(normed, False, "1f1b", inside=True, sync_batchnorm=True)  # the BatchNorm runs eagerly
    with pytest.raises(ValueError, match=r"sync_batchnorm=True\) synchronizes .* compiled layers \(1\) cannot"):
        check_compiled_layers(normed, True, "1f1b", inside=True, sync_batchnorm=True)

    class Module(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = torch.compile(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))

    with pytest.raises(TypeError, match=r"GPipeStrategy\(backbone='backbone'\): the nn\.Sequential backbone itself"):
        find_backbone(Module(), "backbone")
