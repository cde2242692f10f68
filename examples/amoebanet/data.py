"""ImageClassificationData: generated, folder (ImageFolder) or Hugging Face images, augmented alike on every stage."""

from __future__ import annotations

import colorsys
import math
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SHAPES = ("circle", "square", "triangle", "cross", "ring")
HUES = 7
TEXTURES = ("solid", "stripes", "checker")
MAX_GENERATED_CLASSES = len(SHAPES) * HUES * len(TEXTURES)
# Streams of the per-item seed sequences: train and val images never share a seed, nor images and augmentation.
_TRAIN, _VAL, _AUGMENT = 0, 1, 2


@contextmanager
def seeded_rng(*key: int) -> Iterator[None]:
    """Seeds torch, random and numpy from ``key`` inside the block and restores them after it.

    Restoring matters with num_workers=0: the transform then runs in the training process, whose streams
    (dropout, the sampler) must not be reset by every item.
    """
    words = [int(w) for w in np.random.SeedSequence(key).generate_state(4)]
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed((words[0] << 32) | words[1])
        random.seed(words[2])
        np.random.seed(words[3])
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def _distance(shape: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Signed distance (negative inside) to a unit-sized shape in its own coordinates."""
    if shape == "circle":
        return np.hypot(u, v) - 0.95
    if shape == "ring":
        return np.abs(np.hypot(u, v) - 0.72) - 0.26
    if shape == "square":
        return np.maximum(np.abs(u), np.abs(v)) - 0.8
    if shape == "cross":
        au, av = np.abs(u), np.abs(v)
        return np.minimum(np.maximum(au - 0.3, av - 0.95), np.maximum(av - 0.3, au - 0.95))
    # Equilateral triangle, inradius 0.55: the farthest of its three edge lines.
    return (
        np.max([math.cos(a) * u + math.sin(a) * v for a in (math.pi / 2, 7 * math.pi / 6, 11 * math.pi / 6)], 0) - 0.55
    )


def _paint(
    image: np.ndarray, rng: np.random.Generator, shape: str, rgb: np.ndarray, scale: float, texture: str = "solid"
) -> None:
    """Draws ``shape`` of radius ``scale`` (image half-widths) at a random place and angle, anti-aliased, in place."""
    size = image.shape[-1]
    cx, cy = rng.uniform(-1 + scale, 1 - scale, 2)
    angle = rng.uniform(0, 2 * math.pi)
    # Only the window the shape can reach (its corners lie within 1.2 radii) is computed: clutter is small.
    half = 1.2 * scale + 2 / size
    (x0, x1), (y0, y1) = (np.clip(((c - half + 1) * size / 2, (c + half + 1) * size / 2), 0, size) for c in (cx, cy))
    x0, x1, y0, y1 = int(x0), math.ceil(x1), int(y0), math.ceil(y1)
    x = ((np.arange(x0, x1, dtype=np.float32) + 0.5) * 2 / size - 1 - cx)[None, :] / scale
    y = ((np.arange(y0, y1, dtype=np.float32) + 0.5) * 2 / size - 1 - cy)[:, None] / scale
    cos, sin = math.cos(angle), math.sin(angle)
    u, v = cos * x + sin * y, cos * y - sin * x
    alpha = np.clip(0.5 - _distance(shape, u, v) * (size * scale / 2), 0, 1)
    colour = rgb.astype(np.float32)[:, None, None]
    if texture == "stripes":
        colour = colour * (0.6 + 0.4 * (np.sin(u * 3 * math.pi) > 0))
    elif texture == "checker":
        colour = colour * (0.6 + 0.4 * (np.sin(u * 2.5 * math.pi) * np.sin(v * 2.5 * math.pi) > 0))
    window = image[:, y0:y1, x0:x1]
    window += alpha * (colour - window)


def render_shapes(seed: int, stream: int, index: int, num_classes: int, image_size: int) -> tuple[Tensor, int]:
    """Image ``index`` of a stream: a (shape, hue, texture) object of class ``index % num_classes`` on clutter.

    A pure function of its arguments, so every process renders the same item without sharing a random stream.
    Classes differ in shape *and* hue, so neither the colour of a pixel nor the outline alone gives the label.
    """
    rng = np.random.default_rng([seed, stream, index])
    label = index % num_classes
    shape = SHAPES[label % len(SHAPES)]
    # Only as many hues as the classes need, spread round the wheel so they stay apart under jitter.
    hues_used = min(HUES, -(-num_classes // len(SHAPES)))
    hue = (label // len(SHAPES)) % HUES / hues_used
    texture = TEXTURES[label // (len(SHAPES) * HUES)]

    ramp = (np.arange(image_size) + 0.5) / image_size - 0.5
    tilt = rng.normal(0, 0.15, 2)
    base = colorsys.hsv_to_rgb(rng.random(), rng.uniform(0, 0.3), rng.uniform(0.25, 0.75))
    image = np.empty((3, image_size, image_size), dtype=np.float32)
    image[:] = np.asarray(base)[:, None, None] + tilt[0] * ramp[None, :] + tilt[1] * ramp[:, None]
    for _ in range(rng.integers(2, 5)):  # small, dull distractors: clutter, never the answer
        grey = np.asarray(colorsys.hsv_to_rgb(rng.random(), rng.uniform(0, 0.35), rng.uniform(0.2, 0.9)))
        _paint(image, rng, SHAPES[rng.integers(len(SHAPES))], grey, rng.uniform(0.08, 0.18))
    rgb = colorsys.hsv_to_rgb((hue + rng.normal(0, 0.02)) % 1, rng.uniform(0.6, 1), rng.uniform(0.65, 1))
    _paint(image, rng, shape, np.asarray(rgb), rng.uniform(0.3, 0.55), texture)
    image += rng.standard_normal(image.shape, dtype=np.float32) * 0.05
    return torch.from_numpy(np.clip(image, 0, 1, out=image)), label


class GeneratedImages(Dataset):
    """``size`` generated images of one stream (train or val); see :func:`render_shapes`."""

    def __init__(self, size: int, image_size: int, num_classes: int, seed: int, stream: int) -> None:
        self.size, self.image_size, self.num_classes = size, image_size, num_classes
        self.seed, self.stream = seed, stream

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} generated images")
        return render_shapes(self.seed, self.stream, index, self.num_classes, self.image_size)


class HuggingFaceImages(Dataset):
    """(PIL RGB image, int label) rows of a ``datasets.Dataset``."""

    def __init__(self, rows: Any, image_column: str, label_column: str) -> None:
        self.rows, self.image_column, self.label_column = rows, image_column, label_column

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        row = self.rows[int(index)]
        image = row[self.image_column]
        if not hasattr(image, "convert"):
            raise TypeError(
                f"column {self.image_column!r} holds {type(image).__name__}, not images: cast it with "
                f"dataset.cast_column({self.image_column!r}, datasets.Image()) or set image_column="
            )
        return image.convert("RGB"), int(row[self.label_column])


class SeededTransform(Dataset):
    """Transforms item ``index`` of ``base`` with randomness drawn from (seed, epoch, index) only.

    Keys are ``index`` or ``(epoch, index)`` (from :class:`EpochSampler`). Nothing depends on the process, the
    worker or the global RNG state, so every pipeline stage builds the same augmented batch.
    """

    def __init__(self, base: Dataset, transform: Callable[[Any], Tensor], seed: int) -> None:
        self.base, self.transform, self.seed = base, transform, seed

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Tensor, int]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        image, label = self.base[index]
        with seeded_rng(self.seed, _AUGMENT, epoch, index):
            return self.transform(image), label


class EpochSampler(DistributedSampler):
    """A DistributedSampler yielding ``(epoch, index)``: workers cannot see ``set_epoch`` (persistent workers
    hold their own copy of the dataset), so the epoch travels with each index to seed its augmentation."""

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        epoch = self.epoch
        return ((epoch, index) for index in super().__iter__())


class ImageClassificationData(LightningDataModule):
    """Image classification batches for the AmoebaNet example, identical on every stage of a pipeline.

    GPipeStrategy compares the stages' batches. Lightning's ``seed_everything(workers=True)`` seeds loader workers
    from the *global* rank, and without it they seed from each process's RNG, which stages consume differently;
    per-process augmentation would then differ. So training augmentation here draws only on (seed, epoch, index),
    for every source: :class:`EpochSampler` (sharding over data-parallel replicas only) brings the epoch,
    :class:`SeededTransform` seeds each item. Evaluation transforms are deterministic.

    Augmentation: timm's ImageNet recipe for folder and datasets sources; for generated images a pad-and-crop
    plus flip, as timm's random-resized crop (down to 8% of the area) would often cut the object out at 32 px.

    Args:
        source: ``"generated"`` (offline, default), ``"folder"`` (``path/train/<class>/*``, ``path/val/<class>/*``)
            or ``"datasets"`` (a Hugging Face dataset name, or a local path saved with ``save_to_disk``).
        path: root of the folder tree (``source="folder"``).
        dataset_name: Hugging Face dataset name or local path (``source="datasets"``).
        image_size: side of the square images the model gets.
        num_classes: classes of the model; checked against the folder or dataset.
        batch_size: batch per data-parallel replica (the pipeline splits it into micro-batches).
        num_workers: loader processes; with workers, the next batches are prepared while a step runs.
        prefetch_factor: batches each worker keeps ready.
        train_size: generated training images.
        val_size: generated validation images.
        seed: seeds the generated images, the shuffling and the augmentation.
        erasing: random-erasing probability for training (timm ``re_prob``; ImageNet recipes use 0.25).
        image_column: image column of the Hugging Face dataset.
        label_column: label column of the Hugging Face dataset.
    """

    def __init__(
        self,
        source: Literal["generated", "folder", "datasets"] = "generated",
        path: str | None = None,
        dataset_name: str | None = None,
        image_size: int = 32,
        num_classes: int = 10,
        batch_size: int = 64,
        num_workers: int = 2,
        prefetch_factor: int = 2,
        train_size: int = 10_000,
        val_size: int = 2_000,
        seed: int = 0,
        erasing: float = 0.0,
        image_column: str = "image",
        label_column: str = "label",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        where = f"ImageClassificationData(source={source!r})"
        if source not in ("generated", "folder", "datasets"):
            raise ValueError(f"{where}: unknown source; choose 'generated', 'folder' or 'datasets'")
        if source == "folder" and path is None:
            raise ValueError(f"{where} needs path=<root holding train/ and val/ class folders>")
        if source == "datasets" and dataset_name is None:
            raise ValueError(f"{where} needs dataset_name=<Hugging Face dataset name or save_to_disk path>")
        if source == "generated" and not 2 <= num_classes <= MAX_GENERATED_CLASSES:
            raise ValueError(
                f"{where}: num_classes={num_classes}, but generated images come in 2..{MAX_GENERATED_CLASSES} "
                "classes (shape × hue × texture); choose a num_classes in that range or another source"
            )
        if image_size < 8 or batch_size < 1 or num_workers < 0 or not 0 <= erasing <= 1:
            raise ValueError(
                f"{where}: need image_size >= 8, batch_size >= 1, num_workers >= 0 and 0 <= erasing <= 1; got "
                f"image_size={image_size}, batch_size={batch_size}, num_workers={num_workers}, erasing={erasing}"
            )
        self.source, self.path, self.dataset_name = source, path, dataset_name
        self.image_size, self.num_classes, self.seed, self.erasing = image_size, num_classes, seed, erasing
        self.batch_size, self.num_workers, self.prefetch_factor = batch_size, num_workers, prefetch_factor
        self.train_size, self.val_size = train_size, val_size
        self.image_column, self.label_column = image_column, label_column
        self.train_set: SeededTransform | None = None
        self.val_set: SeededTransform | None = None

    # ------------------------------------------------------------------------------------------------ datasets
    def prepare_data(self) -> None:
        # A hub dataset downloads here, once per node, before setup() loads it from the cache on every process.
        if self.source == "datasets" and not Path(str(self.dataset_name)).exists():
            self._load_hf()

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if self.source == "generated":
            train = GeneratedImages(self.train_size, self.image_size, self.num_classes, self.seed, _TRAIN)
            val = GeneratedImages(self.val_size, self.image_size, self.num_classes, self.seed, _VAL)
        elif self.source == "folder":
            train, val = self._folder()
        else:
            train, val = self._hf()
        train_tf, val_tf = self._transforms()
        self.train_set = SeededTransform(train, train_tf, self.seed)
        self.val_set = SeededTransform(val, val_tf, self.seed)

    def _transforms(self) -> tuple[Callable[[Any], Tensor], Callable[[Any], Tensor]]:
        from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform

        if self.source != "generated":
            train = create_transform(self.image_size, is_training=True, re_prob=self.erasing, re_mode="pixel")
            return train, create_transform(self.image_size, is_training=False)
        from timm.data.random_erasing import RandomErasing
        from torchvision import transforms

        # Objects already vary in place, size and angle: a CIFAR-style pad-and-crop plus flip suffices.
        normalize = transforms.Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)
        steps: list[Callable[[Any], Any]] = [
            transforms.RandomCrop(self.image_size, padding=self.image_size // 8, padding_mode="reflect"),
            transforms.RandomHorizontalFlip(),
            normalize,
        ]
        if self.erasing > 0:
            steps.append(RandomErasing(self.erasing, mode="pixel", device="cpu"))
        return transforms.Compose(steps), normalize

    def _check_classes(self, found: int, what: str) -> None:
        if found != self.num_classes:
            raise ValueError(
                f"ImageClassificationData(num_classes={self.num_classes}): {what} has {found} classes; "
                f"set num_classes={found} (and the model's) or point to the intended data"
            )

    def _folder(self) -> tuple[Dataset, Dataset]:
        from torchvision.datasets import ImageFolder

        root = Path(str(self.path))
        val_dir = next((root / name for name in ("val", "validation") if (root / name).is_dir()), None)
        if not (root / "train").is_dir() or val_dir is None:
            raise FileNotFoundError(
                f"ImageClassificationData(path={str(root)!r}) needs the ImageNet layout path/train/<class>/*.jpg and "
                "path/val/<class>/*.jpg (or validation/); "
                f"found: {sorted(p.name for p in root.iterdir()) if root.is_dir() else 'no such directory'}"
            )
        train, val = ImageFolder(str(root / "train")), ImageFolder(str(val_dir))
        if val.classes != train.classes:
            raise ValueError(
                f"ImageClassificationData(path={str(root)!r}): train/ and {val_dir.name}/ must hold the same class "
                f"folders; only in train: {sorted(set(train.classes) - set(val.classes))}, only in "
                f"{val_dir.name}: {sorted(set(val.classes) - set(train.classes))}"
            )
        self._check_classes(len(train.classes), f"{root / 'train'}")
        return train, val

    def _load_hf(self) -> Any:
        import datasets

        name = str(self.dataset_name)
        # save_to_disk leaves one of these markers; anything else (a hub name, a folder of images) is load_dataset's.
        saved = any((Path(name) / marker).is_file() for marker in ("dataset_dict.json", "state.json"))
        return datasets.load_from_disk(name) if saved else datasets.load_dataset(name)

    def _hf(self) -> tuple[Dataset, Dataset]:
        import datasets

        where = f"ImageClassificationData(dataset_name={self.dataset_name!r})"
        loaded = self._load_hf()
        if not isinstance(loaded, datasets.DatasetDict):
            raise ValueError(f"{where} is a single split; save or load it as a DatasetDict with train and validation")
        val_split = next((s for s in ("validation", "val", "valid", "test") if s in loaded), None)
        if "train" not in loaded or val_split is None:
            raise ValueError(
                f"{where} needs a 'train' split and one of 'validation', 'val', 'valid', 'test'; "
                f"found splits {list(loaded)}"
            )
        train, val = loaded["train"], loaded[val_split]
        missing = [c for c in (self.image_column, self.label_column) if c not in train.column_names]
        if missing:
            raise ValueError(
                f"{where} has no column(s) {missing}; its columns are {train.column_names}: "
                "set image_column= and label_column="
            )
        feature = train.features[self.label_column]
        if isinstance(feature, datasets.ClassLabel):
            found = feature.num_classes
        else:
            found = max(train.unique(self.label_column)) + 1
        self._check_classes(found, f"split 'train' of {self.dataset_name}")
        labels = val.unique(self.label_column)
        if min(labels) < 0 or max(labels) >= found:
            raise ValueError(
                f"{where}: split {val_split!r} has labels outside 0..{found - 1} (e.g. -1 for hidden test labels); "
                "use a dataset whose validation split is labelled"
            )
        return (
            HuggingFaceImages(train, self.image_column, self.label_column),
            HuggingFaceImages(val, self.image_column, self.label_column),
        )

    # ----------------------------------------------------------------------------------------------- loaders
    def _replica(self) -> tuple[int, int]:
        """(data-parallel replicas, this replica): a pipeline's stages share a replica and so a shard."""
        trainer = getattr(self, "trainer", None)
        kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
        return (kwargs["num_replicas"], kwargs["rank"]) if kwargs else (1, 0)

    def _loader(self, dataset: Dataset | None, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError("ImageClassificationData: call setup() before asking for a dataloader")
        sampler = None
        if train:
            # Our own sampler, so Lightning injects none: it carries the epoch to the augmentation.
            replicas, rank = self._replica()
            sampler = EpochSampler(dataset, replicas, rank, shuffle=True, seed=self.seed, drop_last=True)
        workers = self.num_workers
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=train,
            num_workers=workers,
            persistent_workers=workers > 0,
            prefetch_factor=self.prefetch_factor if workers > 0 else None,
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)
