"""ImageClassifier: AmoebaNet-D image classification with the GPipe paper's recipe, as a LightningModule."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR

from examples.optim import DecaySchedule, decay_groups, global_batch_size, steps_per_epoch
from examples.optim import warmup_then_decay as _warmup_then_decay
from lightning_gpipe.models.amoebanet import amoebanet_d
from lightning_gpipe.strategy._checkpoint_files import load_weights

Optimizer = Literal["rmsprop", "lars", "sgd"]


class ImageClassifier(pl.LightningModule):
    """AmoebaNet-D (L, D) as ``self.backbone``, trained with label smoothing and RMSProp; top-1/top-5 accuracy.

    The defaults follow TensorFlow's TPU AmoebaNet reference (``tensorflow/tpu`` ``amoeba_net.py`` flags):
    TF-style RMSProp (decay 0.9, momentum 0.9, ε 1.0 inside the square root — timm's ``RMSpropTF``), label smoothing
    0.1, weight decay 4e-5, 3 epochs of linear warm-up, then ×0.9 per epoch. The learning rate is given for a global
    batch of ``lr_batch_size`` and scaled linearly with the actual one (batch per replica × replicas × accumulation).
    Weight decay skips BatchNorm parameters and biases. ``optimizer="lars"`` uses timm's LARS for large batches.

    The backbone is built in ``configure_model``: under GPipeStrategy on the meta device, so each rank allocates only
    its own stage. ``pretrained`` fine-tunes from another run's checkpoint (the paper's transfer learning): every
    weight but the classifier's is loaded, the classifier (sized ``num_classes``) starts newly initialized, and
    optimizer and schedule start afresh. Resuming (``ckpt_path=``) takes precedence over it. ``batch_shape`` gives it
    an ``example_input_array``, so that GPipeStrategy's default ``balance="auto"`` splits the backbone by FLOPs.

    Args:
        num_classes: classes of the data (and of the classifier).
        num_layers: L, normal cells of AmoebaNet-D (a multiple of 3).
        num_filters: D, channels of the first group of normal cells.
        drop_path: stochastic depth of the last cell (earlier cells linearly less); 0 is off.
        label_smoothing: of the cross-entropy loss.
        optimizer: ``"rmsprop"`` (TF-style), ``"lars"`` (with momentum) or ``"sgd"`` (Nesterov momentum).
        lr: learning rate at a global batch of ``lr_batch_size``; None there uses ``lr`` as it is.
        momentum, rmsprop_decay, rmsprop_eps: optimizer constants.
        weight_decay: L2 on weights (not on BatchNorm parameters and biases).
        warmup_epochs: linear warm-up, in epochs (fractions allowed).
        lr_decay, lr_decay_epochs, lr_schedule: multiply the LR by ``lr_decay`` every ``lr_decay_epochs`` epochs,
            smoothly (``"exponential"``) or in stairs (``"step"``); ``"constant"`` keeps it.
        pretrained: a checkpoint (``.ckpt`` file or sharded folder) of an ImageClassifier with the same L and D.
        batch_shape: (N, 3, H, W) of a training batch (the CLI links it to the data's); None: no example input.
    """

    def __init__(
        self,
        num_classes: int = 10,
        num_layers: int = 6,
        num_filters: int = 64,
        drop_path: float = 0.0,
        label_smoothing: float = 0.1,
        optimizer: Optimizer = "rmsprop",
        lr: float = 0.64,
        lr_batch_size: int | None = 256,
        momentum: float = 0.9,
        rmsprop_decay: float = 0.9,
        rmsprop_eps: float = 1.0,
        weight_decay: float = 4e-5,
        warmup_epochs: float = 3.0,
        lr_decay: float = 0.9,
        lr_decay_epochs: float = 1.0,
        lr_schedule: DecaySchedule = "exponential",
        pretrained: str | None = None,
        batch_shape: list[int] | None = None,
    ) -> None:
        super().__init__()
        if optimizer not in ("rmsprop", "lars", "sgd"):
            raise ValueError(f"ImageClassifier(optimizer={optimizer!r}): choose 'rmsprop', 'lars' or 'sgd'")
        if lr_schedule not in ("exponential", "step", "constant"):
            raise ValueError(
                f"ImageClassifier(lr_schedule={lr_schedule!r}): choose 'exponential', 'step' or 'constant'"
            )
        if pretrained is not None and not Path(pretrained).exists():
            raise FileNotFoundError(f"ImageClassifier(pretrained={pretrained!r}): no such checkpoint file or folder")
        self.save_hyperparameters()
        with torch.device("meta"):  # checks the architecture's arguments now, before any setup, allocating nothing
            amoebanet_d(num_classes, num_layers, num_filters, drop_path)
        self.backbone: nn.Sequential | None = None
        if batch_shape is not None:  # only its shape matters: one zero expanded, no memory
            self.example_input_array = torch.zeros(()).expand(*batch_shape)
        from torchmetrics.classification import MulticlassAccuracy

        self.top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.top5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro")

    def configure_model(self) -> None:
        if self.backbone is None:
            hp = self.hparams
            self.backbone = amoebanet_d(hp.num_classes, hp.num_layers, hp.num_filters, hp.drop_path)

    def forward(self, images: Tensor) -> Tensor:
        assert self.backbone is not None, "call configure_model() first (the Trainer does)"
        return self.backbone(images)

    def on_fit_start(self) -> None:
        if self.hparams.pretrained is not None and self.trainer.ckpt_path is None:
            load_weights(Path(self.hparams.pretrained), self, skip=("backbone.classifier.",))

    def pipeline_loss(self, logits: Tensor, batch: tuple[Tensor, Tensor]) -> Tensor:
        """Cross-entropy, a mean over the images. Under GPipeStrategy it runs inside the pipeline, per micro-batch
        on the last stage."""
        return F.cross_entropy(logits, batch[1], label_smoothing=self.hparams.label_smoothing)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(self(batch[0]), batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def _evaluate(self, batch: tuple[Tensor, Tensor], prefix: str) -> None:
        images, labels = batch
        logits = self(images)
        self.log(f"{prefix}_loss", F.cross_entropy(logits, labels), sync_dist=True)
        self.top1(logits, labels)
        self.top5(logits, labels)
        self.log(f"{prefix}_top1", self.top1, prog_bar=True)
        self.log(f"{prefix}_top5", self.top5)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        images = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(images).argmax(dim=-1)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        lr = hp.lr if hp.lr_batch_size is None else hp.lr * global_batch_size(self.trainer) / hp.lr_batch_size
        groups = decay_groups(self, hp.weight_decay)
        optimizer: torch.optim.Optimizer
        if hp.optimizer == "rmsprop":
            from timm.optim import RMSpropTF

            optimizer = RMSpropTF(groups, lr=lr, alpha=hp.rmsprop_decay, eps=hp.rmsprop_eps, momentum=hp.momentum)
        elif hp.optimizer == "lars":
            from timm.optim import Lars

            optimizer = Lars(groups, lr=lr, momentum=hp.momentum)
        else:
            optimizer = torch.optim.SGD(groups, lr=lr, momentum=hp.momentum, nesterov=hp.momentum > 0)
        per_epoch = steps_per_epoch(self.trainer)
        factor = _warmup_then_decay(
            round(hp.warmup_epochs * per_epoch), hp.lr_decay, hp.lr_decay_epochs * per_epoch, hp.lr_schedule
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": LambdaLR(optimizer, factor), "interval": "step"}}
