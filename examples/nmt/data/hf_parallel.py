"""Parallel text through Hugging Face ``datasets``: a hub dataset (wmt14 de-en) or local JSON, CSV, Parquet files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from examples.nmt.data.corpus import ParallelText

VALIDATION_SPLITS = ("validation", "valid", "val", "dev")
_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def _builder(data_files: dict[str, str]) -> str:
    suffixes = {Path(path).suffix.lower() for path in data_files.values()}
    builders = {_BUILDERS.get(suffix) for suffix in suffixes}
    if len(builders) != 1 or None in builders:
        raise ValueError(
            f"data_files={data_files}: give files of one format, named *.json, *.jsonl, *.csv or *.parquet "
            f"(found suffixes {sorted(suffixes)})"
        )
    return builders.pop()  # type: ignore[return-value]


def load_splits(
    dataset_name: str | None, dataset_config: str | None, data_files: dict[str, str] | None, cache_dir: str | None
) -> Any:
    """The ``DatasetDict``: a hub dataset (downloaded once, into the Hugging Face cache) or local files."""
    import datasets

    if dataset_name is not None:
        return datasets.load_dataset(dataset_name, dataset_config, data_files=data_files)
    if not data_files:
        raise ValueError(
            "TranslationData(source='datasets') needs dataset_name=<hub name, e.g. 'wmt14'> (with dataset_config, "
            "e.g. 'de-en') or data_files={'train': ..., 'validation': ...} (local JSON/JSONL/CSV/Parquet files)"
        )
    # Local files are converted to Arrow next to the vocabulary, not into the user's global cache.
    return datasets.load_dataset(_builder(data_files), data_files=data_files, cache_dir=cache_dir)


def pick_splits(loaded: Any, where: str) -> tuple[Any, Any]:
    """(train, validation) of a ``DatasetDict``; a clear error where either is missing."""
    import datasets

    if not isinstance(loaded, datasets.DatasetDict):
        raise ValueError(f"{where} is a single split; load it as a DatasetDict with train and validation splits")
    val_split = next((name for name in VALIDATION_SPLITS if name in loaded), None)
    if "train" not in loaded or val_split is None:
        raise ValueError(
            f"{where} needs a 'train' split and a validation split (one of {list(VALIDATION_SPLITS)}); found splits "
            f"{list(loaded)}: add e.g. data_files={{'train': ..., 'validation': ...}}"
        )
    return loaded["train"], loaded[val_split]


def split_text(split: Any, source_lang: str, target_lang: str, where: str) -> ParallelText:
    """Rows as ``{"translation": {src: ..., tgt: ...}}`` (the hub's translation format) or two columns named
    ``source_lang`` and ``target_lang``; a missing sentence reads as empty."""
    if "translation" in split.column_names:
        split = split.flatten()
        names = (f"translation.{source_lang}", f"translation.{target_lang}")
    else:
        names = (source_lang, target_lang)
    missing = [name for name in names if name not in split.column_names]
    if missing:
        raise ValueError(
            f"{where}: no column(s) {missing}; the columns are {split.column_names}. Rows need either "
            f'{{"translation": {{"{source_lang}": ..., "{target_lang}": ...}}}} or columns "{source_lang}" and '
            f'"{target_lang}": set source_lang= and target_lang= to the languages the data holds'
        )
    sources, targets = ([str(text or "") for text in split[name]] for name in names)
    return ParallelText(sources, targets, [f"{source_lang}-{target_lang}"] * len(sources))
