"""TranslationData: rule-based multilingual corpus, temperature mixing, BPE vocabulary, length buckets, dp shards."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from examples.nmt.data.buckets import BucketBatchSampler
from examples.nmt.data.corpus import VAL, draw_train, generate_pair, pair_probabilities
from examples.nmt.data.grammar import Clause, NounPhrase, Sentence, render
from examples.nmt.data.lexicon import ADJECTIVES, NOUNS, PLACES, TRAVEL_VERBS, VERBS
from examples.nmt.data.numbers import de_cardinal, en_cardinal, es_cardinal, fr_cardinal
from examples.nmt.data.translation import TranslationData
from tests.helpers import root_on_path
from tests.helpers.launch import quiet_trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
PAIRS = ["en-de", "en-fr", "en-es", "de-en"]


def _dm(tmp_path: Path, **kwargs: object) -> TranslationData:
    args = {"train_size": 600, "val_size": 90, "batch_size": 16, "num_workers": 0, "vocab_size": 800, "seed": 3}
    dm = TranslationData(cache_dir=str(tmp_path / "cache"), **{**args, **kwargs})  # type: ignore[arg-type]
    dm.prepare_data()
    dm.setup("fit")
    return dm


def _noun(en: str):
    return next(noun for noun in NOUNS if noun.en[0] == en)


def _verb(en: str, verbs=VERBS):
    return next(verb for verb in verbs if verb.en[0] == en)


@pytest.mark.timeout(30)
def test_generation_is_deterministic_by_seed_pair_index() -> None:
    first = [generate_pair(0, 0, "en-de", i) for i in range(50)]
    assert first == [generate_pair(0, 0, "en-de", i) for i in range(50)]
    assert len(set(first)) > 45, "examples must vary"
    other_seed = [generate_pair(1, 0, "en-de", i) for i in range(50)]
    assert sum(a != b for a, b in zip(first, other_seed)) > 45
    assert [generate_pair(0, VAL, "en-de", i) for i in range(50)] != first, "val must be another stream"
    assert generate_pair(0, 0, "en-fr", 7)[0] != first[7][0] or generate_pair(0, 0, "en-fr", 8)[0] != first[8][0]
    source, target = generate_pair(0, 0, "de-en", 10**12)  # unlimited
    assert source and target
    for src, tgt in first:
        assert src != tgt and 4 <= len(src.split()) <= 24 and 4 <= len(tgt.split()) <= 24
    with pytest.raises(ValueError, match="src-tgt"):
        generate_pair(0, 0, "en-xx", 0)


@pytest.mark.timeout(30)
def test_numbers_and_word_order_follow_each_languages_rules() -> None:
    assert [en_cardinal(24), de_cardinal(24), fr_cardinal(24), es_cardinal(24)] == [
        "twenty-four",
        "vier und zwanzig",
        "vingt-quatre",
        "veinticuatro",
    ]
    assert [fr_cardinal(71), fr_cardinal(80), fr_cardinal(97), fr_cardinal(200), fr_cardinal(201)] == [
        "soixante et onze",
        "quatre-vingts",
        "quatre-vingt-dix-sept",
        "deux cents",
        "deux cent un",
    ]
    assert [es_cardinal(21), es_cardinal(21, feminine=True), es_cardinal(100), es_cardinal(231, True)] == [
        "veintiún",
        "veintiuna",
        "cien",
        "doscientas treinta y una",
    ]
    dog = NounPhrase(_noun("dog"), "def", False)
    car = NounPhrase(_noun("car"), "def", False, adj=next(a for a in ADJECTIVES if a.en == "red"))
    sees = Clause("action", dog, _verb("see"), past=True, obj=car, place=PLACES[0])
    assert render(Sentence(sees), "en") == "the dog saw the red car in the garden."
    # German: participle last; French and Spanish: adjective after the noun.
    assert render(Sentence(sees), "de") == "der Hund hat das rote Auto im Garten gesehen."
    assert render(Sentence(sees), "fr") == "le chien a vu la voiture rouge dans le jardin."
    assert render(Sentence(sees), "es") == "el perro vio el coche rojo en el jardín."
    # German verb-final subordinate clause with the separable particle rejoined; Spanish personal "a".
    woman = NounPhrase(_noun("woman"), "indef", False)
    arrives = Clause("travel", dog, _verb("arrive", TRAVEL_VERBS), day=21, month=4)
    assert (
        render(Sentence(arrives, speaker=woman), "de")
        == "eine Frau sagt, dass der Hund am ein und zwanzigsten Mai ankommt."
    )
    assert (
        render(Sentence(arrives, speaker=woman), "en")
        == "a woman says that the dog arrives on the twenty-first of May."
    )
    finds = Clause("action", woman, _verb("find"), negated=True, obj=dog)
    assert render(Sentence(finds), "es") == "una mujer no encuentra al perro."
    assert render(Sentence(finds), "fr") == "une femme ne trouve pas le chien."
    assert render(Sentence(finds), "en") == "a woman does not find the dog."


@pytest.mark.timeout(30)
def test_pairs_are_mixed_by_temperature() -> None:
    sizes = [16_000, 4_000, 1_000]
    for temperature in (1.0, 5.0, 100.0, float("inf")):
        expected = np.asarray(sizes, dtype=float) ** (0 if temperature == float("inf") else 1 / temperature)
        expected /= expected.sum()
        assert np.allclose(pair_probabilities(sizes, temperature), expected)
        draws = draw_train(0, ["en-de", "en-fr", "en-es"], sizes, temperature, 30_000)
        share = np.bincount(draws[:, 0], minlength=3) / len(draws)
        assert np.abs(share - expected).max() < 0.015, (temperature, share, expected)
        assert all(draws[draws[:, 0] == p, 1].max() < sizes[p] for p in range(3))
    assert np.allclose(pair_probabilities(sizes, 1.0), [16 / 21, 4 / 21, 1 / 21])
    assert np.allclose(pair_probabilities(sizes, 1e6), 1 / 3, atol=1e-4)
    with pytest.raises(ValueError, match="temperature"):
        pair_probabilities(sizes, 0.0)


@pytest.mark.timeout(30)
def test_target_language_token_and_vocabulary(tmp_path: Path) -> None:
    dm = _dm(tmp_path, pairs=PAIRS)
    assert (dm.pad_id, dm.bos_id, dm.eos_id) == (0, 1, 2) and dm.vocab.unk_id == 3
    assert [dm.vocab.tokenizer.id_to_token(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]
    batch = next(iter(dm.val_dataloader()))
    pairs = dm.pair_names(batch["index"])
    assert batch["src"][:, 0].tolist() == [dm.vocab.lang_id(pair[-2:]) for pair in pairs]
    assert {dm.vocab.tokenizer.id_to_token(dm.vocab.lang_id(lang)) for lang in ["de", "fr", "es", "en"]} == {
        "<2de>",
        "<2fr>",
        "<2es>",
        "<2en>",
    }
    for text in ["der große Hund hat das Auto gesehen.", "l'enfant n'a pas vu les œufs.", "veintiún niños, café!"]:
        ids = dm.encode(text)
        assert dm.decode(ids) == text
        assert dm.decode([dm.vocab.lang_id("de"), dm.bos_id, *ids, dm.eos_id, *ids, dm.pad_id]) == text
    for row, reference in zip(batch["tgt_out"], dm.references(batch["index"])):
        assert dm.decode(row) == reference
    assert dm.vocab_size == dm.vocab.tokenizer.get_vocab_size() <= 800
    assert len(list((tmp_path / "cache").glob("vocab-*.json"))) == 1


@pytest.mark.timeout(40)
def test_vocabulary_training_is_the_same_in_every_process(tmp_path: Path) -> None:
    script = (
        "import hashlib, sys\n"
        "from examples.nmt.data.corpus import generate_pair\n"
        "from examples.nmt.data.vocab import Vocabulary\n"
        "texts = [t for i in range(400) for t in generate_pair(5, 0, 'en-fr', i)]\n"
        "vocab = Vocabulary.train(texts, 600, ['en', 'fr'])\n"
        "print(hashlib.sha256(vocab.tokenizer.to_str().encode()).hexdigest())\n"
    )
    digests = set()
    for hash_seed in ("1", "2"):
        env = {**root_on_path(), "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1


@pytest.mark.timeout(30)
def test_batches_pad_to_their_own_longest_and_shift_targets(tmp_path: Path) -> None:
    dm = _dm(tmp_path)
    batches = list(dm.train_dataloader())
    assert len(batches) == len(dm.train_dataloader()) == -(-600 // 16)
    shapes = set()
    for batch in batches:
        src, tgt_in, tgt_out = batch["src"], batch["tgt_in"], batch["tgt_out"]
        assert all(t.dtype == torch.long for t in batch.values()) and tgt_in.shape == tgt_out.shape
        assert (src[:, -1] != dm.pad_id).any() and (tgt_out[:, -1] != dm.pad_id).any(), "padded past the longest"
        assert (tgt_in[:, 0] == dm.bos_id).all()
        lengths = (tgt_out != dm.pad_id).sum(1)
        assert (tgt_out.gather(1, (lengths - 1)[:, None]).squeeze(1) == dm.eos_id).all()
        keep = tgt_in[:, 1:] != dm.pad_id  # tgt_in is tgt_out shifted right by one, bos in front
        assert torch.equal(tgt_in[:, 1:][keep], tgt_out[:, :-1][keep])
        shapes.add((src.shape[1], tgt_in.shape[1]))
    assert len(shapes) > 3, "bucketed batches must differ in length"
    indices = torch.cat([b["index"] for b in batches])
    assert len(set(indices.tolist())) == len(indices)


@pytest.mark.timeout(30)
def test_replicas_get_disjoint_shards_of_equal_length() -> None:
    lengths = np.random.default_rng(0).integers(3, 40, 1001)
    for limits in ({"batch_size": 16}, {"max_tokens": 200}, {"batch_size": 8, "max_tokens": 150}):
        for epoch in range(3):
            shards = []
            for rank in range(2):
                sampler = BucketBatchSampler(lengths, **limits, num_replicas=2, rank=rank, seed=1)  # type: ignore[arg-type]
                sampler.set_epoch(epoch)
                shards.append(list(sampler))
                assert len(shards[-1]) == len(sampler)
                for batch in shards[-1]:
                    assert len(batch) <= limits.get("batch_size", 10**9)
                    assert len(batch) * lengths[batch].max() <= limits.get("max_tokens", 10**9)
            assert len(shards[0]) == len(shards[1])
            seen = [{i for b in shard for i in b} for shard in shards]
            assert not seen[0] & seen[1]
            assert len(seen[0] | seen[1]) > 0.9 * len(lengths)


@pytest.mark.timeout(30)
def test_batches_follow_seed_epoch_and_rank_only(tmp_path: Path) -> None:
    def epoch_batches(dm: TranslationData, epoch: int) -> list[list[int]]:
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(epoch)
        return [b["index"].tolist() for b in loader]

    dm, again = _dm(tmp_path), _dm(tmp_path)
    torch.manual_seed(123)
    np.random.seed(5)  # the global RNG state must not matter
    assert epoch_batches(dm, 0) == epoch_batches(again, 0)
    assert epoch_batches(dm, 2) == epoch_batches(again, 2)
    assert epoch_batches(dm, 0) != epoch_batches(dm, 1)
    assert sorted(map(sorted, epoch_batches(dm, 0))) != sorted(map(sorted, epoch_batches(dm, 1))), "regrouped"
    assert epoch_batches(dm, 0) != epoch_batches(_dm(tmp_path / "s", seed=4), 0)


@pytest.mark.timeout(30)
def test_validation_uses_every_example_once_across_replicas(tmp_path: Path) -> None:
    dm = _dm(tmp_path, val_size=101, pairs=PAIRS)
    lengths = dm._data["val"].lengths
    shards = [list(BucketBatchSampler(lengths, 16, None, 3, rank, shuffle=False)) for rank in range(3)]
    assert len({len(shard) for shard in shards}) == 1
    indices = sorted(i for shard in shards for batch in shard for i in batch)
    assert indices == list(range(101))
    batch = next(iter(dm.val_dataloader()))
    pairs = dm.pair_names(batch["index"])
    expected = [generate_pair(3, VAL, PAIRS[i % 4], i // 4) for i in batch["index"].tolist()]
    assert dm.references(batch["index"]) == [tgt for _, tgt in expected]
    assert dm.source_texts(batch["index"]) == [src for src, _ in expected]
    assert pairs == [PAIRS[i % 4] for i in batch["index"].tolist()]


@pytest.mark.timeout(30)
def test_max_len_drops_or_truncates(tmp_path: Path) -> None:
    dropped = _dm(tmp_path, max_len=10)
    assert 0 < len(dropped._data["train"]) < 600
    assert dropped._data["train"].lengths.max() <= 10
    batch = next(iter(dropped.val_dataloader()))
    assert [dropped.decode(row) for row in batch["tgt_out"]] == dropped.references(batch["index"])
    truncated = _dm(tmp_path, max_len=10, long_examples="truncate")
    assert len(truncated._data["train"]) == 600 and truncated._data["train"].lengths.max() <= 10
    with pytest.raises(ValueError, match="max_tokens"):
        TranslationData(max_tokens=50, max_len=128)


def _write_parallel(tmp_path: Path) -> dict[str, str]:
    pairs = [generate_pair(0, 0, "en-de", i) for i in range(60)]
    files = {}
    with open(tmp_path / "train.jsonl", "w", encoding="utf-8") as f:
        for en, de in pairs[:50]:
            f.write(json.dumps({"translation": {"en": en, "de": de}}, ensure_ascii=False) + "\n")
    files["train"] = str(tmp_path / "train.jsonl")
    with open(tmp_path / "valid.jsonl", "w", encoding="utf-8") as f:
        for en, de in pairs[50:]:
            f.write(json.dumps({"translation": {"en": en, "de": de}}, ensure_ascii=False) + "\n")
    files["validation"] = str(tmp_path / "valid.jsonl")
    for split, rows in (("train", pairs[:50]), ("validation", pairs[50:])):
        with open(tmp_path / f"{split}.csv", "w", encoding="utf-8", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["de", "en"])
            writer.writerows([(de, en) for en, de in rows])
    return files


@pytest.mark.timeout(60)
def test_datasets_source_reads_local_files_in_both_row_formats(tmp_path: Path) -> None:
    files = _write_parallel(tmp_path)
    expected = [generate_pair(0, 0, "en-de", i) for i in range(50, 60)]
    csv_files = {"train": str(tmp_path / "train.csv"), "validation": str(tmp_path / "validation.csv")}
    for data_files in (files, csv_files):
        dm = _dm(tmp_path, source="datasets", data_files=data_files, source_lang="en", target_lang="de", batch_size=4)
        indices = torch.cat([b["index"] for b in dm.val_dataloader()])
        assert sorted(indices.tolist()) == list(range(10))
        assert dm.references(indices) == [expected[i][1] for i in indices.tolist()]
        assert dm.source_texts(indices) == [expected[i][0] for i in indices.tolist()]
        batch = next(iter(dm.train_dataloader()))
        assert (batch["src"][:, 0] == dm.vocab.lang_id("de")).all()
        assert [dm.decode(row) for row in batch["tgt_out"]] == dm.references(batch["index"], "train")
    with pytest.raises(ValueError, match="validation split"):
        _dm(tmp_path, source="datasets", data_files={"train": files["train"]}, source_lang="en", target_lang="de")
    with pytest.raises(ValueError, match="no column"):
        _dm(tmp_path, source="datasets", data_files=csv_files, source_lang="en", target_lang="fr")
    with pytest.raises(ValueError, match="source_lang"):
        TranslationData(source="datasets", data_files=files)


class _Recorder(nn.Module):
    """Stands in for the model: a loss from the embeddings, and the batches it saw."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 4)
        self.seen: list[tuple[int, list[int], tuple[int, ...]]] = []


@pytest.mark.timeout(60)
def test_lightning_keeps_the_sampler_and_sets_its_epoch(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.trainer.states import RunningStage

    class Module(pl.LightningModule):
        def __init__(self, vocab_size: int) -> None:
            super().__init__()
            self.net = _Recorder(vocab_size)

        def training_step(self, batch: dict[str, torch.Tensor], _: int) -> torch.Tensor:
            self.net.seen.append((self.current_epoch, batch["index"].tolist(), tuple(batch["src"].shape)))
            return self.net.embed(batch["src"]).mean() + self.net.embed(batch["tgt_in"]).mean()

        def validation_step(self, batch: dict[str, torch.Tensor], _: int) -> None:
            self.net.seen.append((-1, batch["index"].tolist(), tuple(batch["src"].shape)))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = _dm(tmp_path, train_size=160, num_workers=1)
    module = Module(dm.vocab_size)
    trainer = quiet_trainer(devices=1, max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(module, datamodule=dm)
    assert isinstance(trainer.train_dataloader.sampler, BucketBatchSampler)
    assert isinstance(trainer.val_dataloaders.sampler, BucketBatchSampler)
    seen = Counter(epoch for epoch, _, _ in module.net.seen)
    assert seen == {0: 10, 1: 10, -1: 2 * 6}  # 90 validation examples in 6 batches, after each epoch
    val = [i for e, idx, _ in module.net.seen if e == -1 for i in idx]
    assert sorted(val) == sorted(2 * list(range(90)))
    orders = [[i for e, idx, _ in module.net.seen if e == epoch for i in idx] for epoch in (0, 1)]
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1]) == list(range(160))
    assert len({shape for _, _, shape in module.net.seen}) > 2

    # Under a distributed strategy Lightning would inject a DistributedSampler; it must leave this loader alone.
    ddp = quiet_trainer(devices=1, strategy="ddp")
    assert ddp._accelerator_connector.is_distributed and ddp._accelerator_connector.use_distributed_sampler
    loader = dm.train_dataloader()
    assert ddp._data_connector._prepare_dataloader(loader, shuffle=True, mode=RunningStage.TRAINING) is loader
