"""TranslationData: multilingual translation batches, bucketed by length, identical on every stage of a pipeline."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader

from examples.nmt.data.buckets import BucketBatchSampler, PadCollate, PairedTokens, TokenTable
from examples.nmt.data.corpus import (
    DEFAULT_PAIR_SIZE,
    PAIR_SIZES,
    ParallelText,
    draw_train,
    generated_text,
    generated_val,
    pair_probabilities,
    parse_pair,
)
from examples.nmt.data.corpus import TRAIN as TRAIN_STREAM
from examples.nmt.data.hf_parallel import load_splits, pick_splits, split_text
from examples.nmt.data.vocab import Vocabulary

DEFAULT_PAIRS = ("en-de", "en-fr", "en-es", "de-en")
VOCAB_SAMPLE = 500_000  # training examples the vocabulary learns from at most (evenly spaced over the split)
_FORMAT = 1  # bump when the cached vocabulary's inputs change meaning


def _default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lightning_gpipe" / "translation"


class TranslationData(LightningDataModule):
    """Translation batches for the Transformer NMT example, the same on every stage of a pipeline.

    Sources: ``"generated"`` (offline, default) renders random meanings by rule in English, German, French and Spanish
    (word order, agreement, spelled-out numbers and dates differ; see :mod:`examples.nmt.data.grammar`), for
    several pairs of deliberately unequal sizes mixed by temperature sampling, p_i ∝ n_i^(1/T). ``"datasets"``: any
    parallel corpus through Hugging Face ``datasets`` (hub name and config, or local ``data_files``).

    The source gets its target-language token (``<2de>``) first. The vocabulary, a byte-level BPE trained on the
    training split, is cached under ``cache_dir`` (file named by a hash of everything it depends on); training is
    deterministic, so every process has the same ids whether it trained or loaded it. Batches (see
    :class:`BucketBatchSampler`) group examples of similar length and pad to their own longest sequence:
    ``{"src": [N, S], "tgt_in": [N, T] (bos + target), "tgt_out": [N, T] (target + eos), "index": [N]}``, LongTensors
    padded with ``pad_id``, N, S and T varying from batch to batch. They shard over data-parallel replicas only
    (``trainer.distributed_sampler_kwargs``), every replica getting as many batches as the others.

    Args:
        source: ``"generated"`` or ``"datasets"``.
        dataset_name: Hugging Face hub dataset (``source="datasets"``), e.g. ``"wmt14"``; or None with ``data_files``.
        dataset_config: its configuration, e.g. ``"de-en"``.
        data_files: ``{"train": path, "validation": path}`` of JSON/JSONL/CSV/Parquet files.
        source_lang: source language (column or key of the ``translation`` dict) of the ``datasets`` source.
        target_lang: target language, likewise.
        pairs: generated language pairs, default ``["en-de", "en-fr", "en-es", "de-en"]``.
        pair_sizes: n_i of generated pairs (the distinct examples each has), default ``PAIR_SIZES`` (20 000 else).
        temperature: T of the pair sampling: 1 = proportional to n_i, larger = flatter, inf (YAML .inf) = uniform.
        train_size: generated training examples per epoch (the same ones each epoch, reshuffled).
        val_size: generated validation examples, the pairs in turn.
        batch_size: sentences per batch and replica at most (the pipeline splits it into micro-batches).
        max_tokens: padded tokens (sentences × longest) per batch at most; with ``batch_size=None`` the only limit.
        max_len: longest source (with its language token) or target (with bos/eos) kept.
        long_examples: what happens to longer examples: ``"drop"`` them or ``"truncate"`` them to ``max_len``.
        vocab_size: target size of the BPE vocabulary (a small corpus may stop short of it; see ``vocab_size``).
        seed: seeds the generated corpus, the pair sampling and the batch order.
        num_workers: loader processes (persistent, ``prefetch_factor`` batches ahead each).
        prefetch_factor: batches each worker keeps ready.
        cache_dir: where the vocabulary (and local ``data_files`` as Arrow) are kept; default
            ``$XDG_CACHE_HOME/lightning_gpipe/translation`` (``~/.cache/...``).
    """

    def __init__(
        self,
        source: Literal["generated", "datasets"] = "generated",
        dataset_name: str | None = None,
        dataset_config: str | None = None,
        data_files: dict[str, str] | None = None,
        source_lang: str | None = None,
        target_lang: str | None = None,
        pairs: list[str] | None = None,
        pair_sizes: dict[str, int] | None = None,
        temperature: float = 5.0,
        train_size: int = 50_000,
        val_size: int = 1_000,
        batch_size: int | None = 64,
        max_tokens: int | None = None,
        max_len: int = 128,
        long_examples: Literal["drop", "truncate"] = "drop",
        vocab_size: int = 2_000,
        seed: int = 0,
        num_workers: int = 1,
        prefetch_factor: int = 2,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.source, self.seed, self.temperature = source, seed, temperature
        self.pairs = list(pairs or DEFAULT_PAIRS)
        self.sizes = [(pair_sizes or {}).get(pair, PAIR_SIZES.get(pair, DEFAULT_PAIR_SIZE)) for pair in self.pairs]
        self.train_size, self.val_size, self.max_len, self.long_examples = train_size, val_size, max_len, long_examples
        self.batch_size, self.max_tokens, self.vocab_target = batch_size, max_tokens, vocab_size
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.dataset_name, self.dataset_config, self.data_files = dataset_name, dataset_config, data_files
        self.source_lang, self.target_lang = source_lang, target_lang
        self.cache_dir = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
        self._check(pair_sizes or {})
        self._text: dict[str, ParallelText] = {}
        self._data: dict[str, PairedTokens] = {}
        self._vocab: Vocabulary | None = None

    def _check(self, pair_sizes: dict[str, int]) -> None:
        where = f"TranslationData(source={self.source!r})"
        if self.source not in ("generated", "datasets"):
            raise ValueError(f"{where}: unknown source; choose 'generated' or 'datasets'")
        if self.source == "datasets" and (self.source_lang is None or self.target_lang is None):
            raise ValueError(f"{where} needs source_lang= and target_lang=, e.g. 'en' and 'de'")
        if self.source == "datasets" and self.dataset_name is None and not self.data_files:
            raise ValueError(
                f"{where} needs dataset_name=<hub dataset> or data_files={{'train': ..., 'validation': ...}}"
            )
        for pair in self.pairs:
            parse_pair(pair)
        unknown = sorted(set(pair_sizes) - set(self.pairs))
        if unknown:
            raise ValueError(f"{where}: pair_sizes names {unknown}, which are not among pairs={self.pairs}")
        pair_probabilities(self.sizes, self.temperature)  # checks temperature and sizes
        if self.batch_size is None and self.max_tokens is None:
            raise ValueError(f"{where} needs batch_size= (sentences), max_tokens= (padded tokens) or both")
        if self.max_len < 2 or min(self.train_size, self.val_size, self.vocab_target, self.batch_size or 1) < 1:
            raise ValueError(
                f"{where}: need max_len >= 2 and positive train_size, val_size, vocab_size and batch_size; got "
                f"max_len={self.max_len}, train_size={self.train_size}, val_size={self.val_size}, "
                f"vocab_size={self.vocab_target}, batch_size={self.batch_size}"
            )
        if self.max_tokens is not None and self.max_tokens < self.max_len:
            raise ValueError(
                f"{where}: max_tokens={self.max_tokens} cannot hold one example of max_len={self.max_len}; "
                f"raise max_tokens to at least {self.max_len} or lower max_len"
            )
        if self.long_examples not in ("drop", "truncate"):
            raise ValueError(f"{where}: long_examples={self.long_examples!r}; choose 'drop' or 'truncate'")

    # ------------------------------------------------------------------------------------------- vocabulary
    @property
    def languages(self) -> list[str]:
        """The languages of the data, each with its ``<2xx>`` token in the vocabulary."""
        if self.source == "datasets":
            return [str(self.source_lang), str(self.target_lang)]
        return sorted({lang for pair in self.pairs for lang in parse_pair(pair)})

    @property
    def vocab(self) -> Vocabulary:
        """Loaded from the cache, or trained on the training split (and cached) on first use."""
        if self._vocab is None:
            path = self.cache_dir / f"vocab-{self._cache_key()}.json"
            self._vocab = Vocabulary.cached(path, self._vocab_texts, self.vocab_target, self.languages)
        return self._vocab

    def _cache_key(self) -> str:
        import tokenizers

        key: dict[str, Any] = {"format": _FORMAT, "tokenizers": tokenizers.__version__, "vocab": self.vocab_target}
        if self.source == "generated":
            key |= {"seed": self.seed, "pairs": self.pairs, "sizes": self.sizes, "T": self.temperature}
            key |= {"train_size": self.train_size}
        else:
            files = {split: [path, *_stamp(path)] for split, path in (self.data_files or {}).items()}
            key |= {"name": self.dataset_name, "config": self.dataset_config, "files": files}
            key |= {"langs": [self.source_lang, self.target_lang]}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def _vocab_texts(self) -> list[str]:
        text = self._split_text("train")
        step = max(1, -(-len(text) // VOCAB_SAMPLE))
        return text.sources[::step] + text.targets[::step]

    @property
    def vocab_size(self) -> int:
        """Size of the trained vocabulary (the model's embedding rows); ``hparams.vocab_size`` is the BPE target.

        Available before ``setup()`` (it loads or trains the vocabulary), so a CLI can link it to the model's.
        """
        return self.vocab.vocab_size

    @property
    def pad_id(self) -> int:
        return Vocabulary.pad_id

    @property
    def bos_id(self) -> int:
        return Vocabulary.bos_id

    @property
    def eos_id(self) -> int:
        return Vocabulary.eos_id

    def encode(self, text: str) -> list[int]:
        return self.vocab.encode(text)

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        return self.vocab.decode(ids)

    @property
    def pair_probabilities(self) -> dict[str, float]:
        """How often each generated pair is drawn for training: p_i ∝ n_i^(1/T)."""
        return dict(zip(self.pairs, pair_probabilities(self.sizes, self.temperature).tolist()))

    # ------------------------------------------------------------------------------------------------ text
    def _split_text(self, split: str) -> ParallelText:
        if split not in self._text:
            if self.source == "generated":
                draws = draw_train(self.seed, self.pairs, self.sizes, self.temperature, self.train_size)
                self._text["train"] = generated_text(self.seed, TRAIN_STREAM, self.pairs, draws)
                self._text["val"] = generated_val(self.seed, self.pairs, self.val_size)
            else:
                self._text["train"], self._text["val"] = self._hf_text()
        return self._text[split]

    def _hf_text(self) -> tuple[ParallelText, ParallelText]:
        where = f"TranslationData(dataset_name={self.dataset_name!r}, data_files={self.data_files})"
        loaded = load_splits(self.dataset_name, self.dataset_config, self.data_files, str(self.cache_dir / "datasets"))
        train, val = pick_splits(loaded, where)
        langs = (str(self.source_lang), str(self.target_lang))
        return split_text(train, *langs, where), split_text(val, *langs, where)

    def prepare_data(self) -> None:
        # Once per node, before setup(): downloads a hub dataset and trains (and caches) the vocabulary.
        _ = self.vocab

    def setup(self, stage: str | None = None) -> None:
        for split in ("train", "val"):
            if split not in self._data:
                self._encode(split)

    def _encode(self, split: str) -> None:
        text, vocab = self._split_text(split), self.vocab
        lang_ids = {pair: vocab.lang_id(parse_pair(pair)[1]) for pair in set(text.pairs)}
        sources = [[lang_ids[pair], *ids] for pair, ids in zip(text.pairs, vocab.encode_batch(text.sources))]
        targets = vocab.encode_batch(text.targets)
        # A target costs one more token than its ids: bos in front (tgt_in) or eos behind (tgt_out).
        fits = [len(s) <= self.max_len and len(t) < self.max_len for s, t in zip(sources, targets)]
        if self.long_examples == "truncate":
            sources = [s[: self.max_len] for s in sources]
            targets = [t[: self.max_len - 1] for t in targets]
        elif not all(fits):
            keep = [i for i, fit in enumerate(fits) if fit]
            sources, targets = [sources[i] for i in keep], [targets[i] for i in keep]
            self._text[split] = text = text.subset(keep)
        if not len(text):
            raise ValueError(f"TranslationData: no {split} example is at most max_len={self.max_len} tokens long")
        self._data[split] = PairedTokens(TokenTable(sources), TokenTable(targets))

    # --------------------------------------------------------------------------------------------- lookups
    def _lookup(self, column: str, indices: Tensor | Sequence[int], split: str) -> list[str]:
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r}: choose 'train' or 'val'")
        if split not in self._data:
            raise RuntimeError("TranslationData: call setup() before looking up examples")
        values = getattr(self._text[split], column)
        return [values[i] for i in (indices.tolist() if isinstance(indices, Tensor) else indices)]

    def references(self, indices: Tensor | Sequence[int], split: str = "val") -> list[str]:
        """The raw target sentences of a batch's ``index`` (for BLEU: not decoded from ids)."""
        return self._lookup("targets", indices, split)

    def source_texts(self, indices: Tensor | Sequence[int], split: str = "val") -> list[str]:
        return self._lookup("sources", indices, split)

    def pair_names(self, indices: Tensor | Sequence[int], split: str = "val") -> list[str]:
        """Each example's language pair, ``"en-de"``: for a BLEU per pair."""
        return self._lookup("pairs", indices, split)

    # --------------------------------------------------------------------------------------------- loaders
    def _replica(self) -> tuple[int, int]:
        """(data-parallel replicas, this replica): a pipeline's stages share a replica and so a shard."""
        trainer = getattr(self, "trainer", None)
        kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
        return (kwargs["num_replicas"], kwargs["rank"]) if kwargs else (1, 0)

    def _loader(self, split: str, train: bool) -> DataLoader:
        if split not in self._data:
            raise RuntimeError("TranslationData: call setup() before asking for a dataloader")
        data = self._data[split]
        replicas, rank = self._replica()
        sampler = BucketBatchSampler(
            data.lengths, self.batch_size, self.max_tokens, replicas, rank, shuffle=train, seed=self.seed
        )
        workers = self.num_workers
        # batch_size=None: the sampler yields whole batches as single indices (see BucketBatchSampler).
        return DataLoader(
            data,
            sampler=sampler,
            batch_size=None,
            collate_fn=PadCollate(self.pad_id, self.bos_id, self.eos_id),
            num_workers=workers,
            persistent_workers=workers > 0,
            prefetch_factor=self.prefetch_factor if workers > 0 else None,
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", train=False)


def _stamp(path: str) -> list[int]:
    """Size and modification time of a local file, so that an edited file gets a new vocabulary; [] elsewhere."""
    stat = Path(path).stat() if Path(path).is_file() else None
    return [stat.st_size, stat.st_mtime_ns] if stat else []


__all__ = ["TranslationData", "Vocabulary"]
