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
        ({"activation_checkpointing": "sometimes"}, "choose one of ['always', 'except_last', 'never']"),
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
    # (world size, K, processes per node): replicas of a stage on one node and on others only in the first.
    assert hierarchical("auto", 8, 2, 4) and hierarchical("auto", 4, 1, 2)
    assert not hierarchical("auto", 4, 2, 2)  # one replica of each stage per node
    assert not hierarchical("auto", 4, 1, 4)  # one node
    assert hierarchical("hierarchical", 4, 1, 4) and not hierarchical("flat", 8, 2, 4)
