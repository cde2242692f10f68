"""Translator (T(L, H, A) recipe): pipelined training with tied embeddings and changing lengths equals a plain run;
pipelined decoding gives the plain model's tokens; BLEU is SacreBLEU's, in percent.

The parity runs in float64: Adam divides each gradient by its own magnitude, so float32 roundoff in small gradients
becomes whole learning-rate steps (2.5e-6 apart after 4 steps here). The attention keys' biases have a zero gradient
in exact arithmetic (softmax ignores a shift shared by all keys), so they hold nothing but roundoff: errors are
taken relative to max(|w|, 1e-3).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from examples.nmt.translator import Translator
from lightning_gpipe.strategy._materialize import materialize, record_init
from tests.helpers.launch import quiet_trainer, run_distributed

V, PAD, BOS, EOS, SEED, STEPS, CHUNKS = 40, 0, 1, 2, 5, 4, 3
PRECISION = "64-true"
TINY = {
    "num_layers": 2,
    "ffn_dim": 64,
    "num_heads": 4,
    "d_model": 32,
    "vocab_size": V,
    "dropout": 0.0,
    "tie_embeddings": True,
    "lr": 3e-3,
    "warmup_steps": 2,
    "max_new_tokens": 4,
}
SHAPES = [(7, 5, 6), (5, 9, 4), (8, 3, 8), (6, 6, 5)]  # (N, S, T) per step: N uneven over M = 3, lengths change


class Batches(Dataset):
    """One whole batch per item: ragged rows right-padded, a language-token-like first source token."""

    def __len__(self) -> int:
        return len(SHAPES)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        N, S, T = SHAPES[i]
        g = torch.Generator().manual_seed(100 + i)
        src = torch.randint(3, V, (N, S), generator=g)
        tgt = torch.randint(3, V, (N, T + 1), generator=g)
        for n in range(1, N):
            src[n, S - n % S :] = PAD
            tgt[n, T + 1 - n % T :] = PAD
        tgt[:, 0] = BOS
        return {"src": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:], "index": torch.arange(N)}


def loader() -> DataLoader:
    return DataLoader(Batches(), batch_size=None)


class PlainTranslator(Translator):
    """The reference: one process, the initialization GPipeStrategy gives a model built on the meta device."""

    def configure_model(self) -> None:
        if self.backbone is None:
            with torch.device("meta"), record_init() as record:  # as GPipeStrategy.model_sharded_context does
                super().configure_model()
            materialize(self, dict(self.named_modules()), torch.device("cpu"), SEED, record)


def translations(module: Translator) -> dict[str, list[list[int]]]:
    module.eval()
    src = Batches()[1]["src"]
    greedy = module.translate(src).tolist()
    module.hparams.decoding = "beam"
    beam = module.translate(src).tolist()
    module.hparams.decoding = "greedy"
    return {"greedy": greedy, "beam": beam}


def fit_pipelined(rank: int, world_size: int) -> dict[str, Any]:
    import lightning.pytorch as pl

    from lightning_gpipe import GPipeStrategy

    warnings.simplefilter("ignore")
    pl.seed_everything(SEED)
    module = Translator(**TINY)
    trainer = quiet_trainer(
        devices=2,
        strategy=GPipeStrategy(chunks=CHUNKS, output="placeholder"),
        max_steps=STEPS,
        use_distributed_sampler=False,
        precision=PRECISION,
    )
    trainer.fit(module, loader())
    state = {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}
    return {"state": state, "tokens": translations(module)}


def rel_err(a: Tensor, b: Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-3)).item()


@pytest.mark.timeout(240)
def test_pipelined_training_and_decoding_equal_the_plain_model() -> None:
    per_rank = run_distributed(fit_pipelined, 2, timeout=220, lightning=True)

    torch.manual_seed(SEED)
    plain = PlainTranslator(**TINY)
    quiet_trainer(devices=1, max_steps=STEPS, precision=PRECISION).fit(plain, loader())
    expected = plain.state_dict()
    first, last = per_rank[0]["state"], per_rank[1]["state"]
    # The tied table: the source embedding on the first stage, the output projection on the last, kept equal.
    assert "backbone.project.weight" not in first and "backbone.src_embed.weight" not in last
    assert (first["backbone.src_embed.weight"] == last["backbone.project.weight"]).all()
    assert sorted({k for r in per_rank for k in r["state"]}) == sorted(expected)
    for rank in per_rank:
        for key, value in rank["state"].items():
            assert rel_err(torch.from_numpy(value), expected[key]) <= 1e-6, (
                key,
                rel_err(torch.from_numpy(value), expected[key]),
            )
    want = translations(plain)
    assert per_rank[0]["tokens"] == per_rank[1]["tokens"] == want
    assert any(len(row) > 1 for row in want["greedy"])


def test_bleu_is_sacrebleu_in_percent() -> None:
    module = Translator(**TINY)
    logged: dict[str, Tensor] = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, value)  # type: ignore[method-assign]
    # torchmetrics' documented example: SacreBLEU 0.7598.
    module.bleu.update(["the cat is on the mat"], [["there is a cat on the mat", "a cat is on the mat"]])
    module.on_validation_epoch_end()
    assert logged["val_bleu"].item() == pytest.approx(75.98, abs=0.01)
    module.bleu.update(["a perfect copy of five words"], [["a perfect copy of five words"]])
    module.on_validation_epoch_end()
    assert logged["val_bleu"].item() == pytest.approx(100.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"decoding": "sample"}, "choose 'greedy' or 'beam'"),
        ({"eos_id": V}, "must lie in"),
        ({"d_model": 30}, "divisible by num_heads"),
    ],
)
def test_bad_arguments_are_named_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Translator(**{**TINY, **kwargs})


def test_backbone_is_built_by_configure_model() -> None:
    module = Translator(**TINY)
    assert module.backbone is None
    module.configure_model()
    assert isinstance(module.backbone, nn.Sequential)
    assert module.backbone.src_embed.weight is module.backbone.project.weight


def test_example_batch_lets_balance_count_each_layers_flops() -> None:
    """``example_batch=(N, T)``: an example_input_array of padding ids (no memory), on which balance="flops"
    counts every layer; the vocabulary projection, the last layer, is costlier than the embedding, the first."""
    from lightning_gpipe.strategy._balance import layer_costs

    module = Translator(**TINY, example_batch=(6, 9))
    src, tgt = module.example_input_array
    assert src.shape == tgt.shape == (6, 9) and int(src.max()) == int(src.min()) == PAD
    assert src.untyped_storage().nbytes() == 8  # one id, expanded
    with torch.device("meta"):
        module.configure_model()
    assert module.backbone is not None
    costs = layer_costs(module, module.backbone, "flops", CHUNKS, torch.device("meta"))
    assert len(costs) == len(module.backbone) and all(c > 0 for c in costs[1:])
    assert costs[-1] > costs[0]
