"""Translator: the GPipe paper's Transformer T(L, H, A) for (multilingual) translation, as a LightningModule."""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR

from examples.optim import decay_groups, inverse_sqrt
from lightning_gpipe.models.decoding import beam_decode, greedy_decode
from lightning_gpipe.models.transformer import next_token_logits, transformer_nmt

Batch = dict[str, Tensor]


class Translator(pl.LightningModule):
    """T(L, H, A) as ``self.backbone``: label-smoothed cross-entropy, Adam with inverse-square-root warm-up, BLEU.

    Validation reports the loss and, when the datamodule offers ``decode`` and ``references`` (as
    :class:`~examples.nmt.data.translation.TranslationData` does), the SacreBLEU of greedy or beam-search
    translations made through the pipeline against the raw reference sentences. The backbone is built in
    ``configure_model`` (on the meta device under GPipeStrategy: each rank allocates only its stage).

    Args:
        num_layers, ffn_dim, num_heads, d_model: T(L, H, A) at width d_model.
        vocab_size, pad_id, bos_id, eos_id: of the vocabulary (link them to the data's).
        dropout: on embeddings, attention and residual branches.
        tie_embeddings: one table for source and target embeddings and the output projection.
        scale_ffn_init: scale the feed-forward output layers' initialization down with depth (the paper's fix).
        logit_clip: soft-clip the logits to [-c, c] (the paper's other fix); None is off.
        max_len: the longest sequence the positional encoding covers.
        label_smoothing: of the loss (padding positions are ignored).
        lr: peak learning rate, reached after ``warmup_steps``; then ∝ 1/√step.
        betas, eps, weight_decay: Adam's (weight decay not on LayerNorm parameters and biases).
        decoding: ``"greedy"`` or ``"beam"`` (``beam_size``, ``length_penalty``) for the validation BLEU.
        max_new_tokens: a translation stops after ``source length + max_new_tokens`` tokens at most.
        bleu_batches: translate only the first this many validation batches per replica (decoding is the slow
            part); None translates all, 0 none.
        example_batch: (sentences, tokens) of a typical batch: sets ``example_input_array`` (padding ids, no
            memory), which ``GPipeStrategy(balance="auto")`` counts each layer's FLOPs on; None leaves it unset.
    """

    def __init__(
        self,
        num_layers: int = 2,
        ffn_dim: int = 512,
        num_heads: int = 4,
        d_model: int = 128,
        vocab_size: int = 2000,
        pad_id: int = 0,
        bos_id: int = 1,
        eos_id: int = 2,
        dropout: float = 0.1,
        tie_embeddings: bool = True,
        scale_ffn_init: bool = True,
        logit_clip: float | None = None,
        max_len: int = 256,
        label_smoothing: float = 0.1,
        lr: float = 1e-3,
        warmup_steps: int = 4000,
        betas: tuple[float, float] = (0.9, 0.98),
        eps: float = 1e-9,
        weight_decay: float = 0.0,
        decoding: Literal["greedy", "beam"] = "greedy",
        beam_size: int = 4,
        length_penalty: float = 0.6,
        max_new_tokens: int = 16,
        bleu_batches: int | None = None,
        example_batch: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        if decoding not in ("greedy", "beam"):
            raise ValueError(f"Translator(decoding={decoding!r}): choose 'greedy' or 'beam'")
        if min(pad_id, bos_id, eos_id) < 0 or max(pad_id, bos_id, eos_id) >= vocab_size:
            raise ValueError(f"Translator: pad, bos and eos ids must lie in [0, vocab_size={vocab_size})")
        self.save_hyperparameters()
        with torch.device("meta"):  # checks the architecture's arguments now, allocating nothing
            self._build()
        self.backbone: nn.Module | None = None
        if example_batch is not None:  # only the shapes matter: one pad id expanded, no memory
            ids = torch.full((), pad_id, dtype=torch.long).expand(*example_batch)
            self.example_input_array = (ids, ids)
        from torchmetrics.text import SacreBLEUScore

        self.bleu = SacreBLEUScore()

    def _build(self) -> nn.Sequential:
        hp = self.hparams
        return transformer_nmt(
            hp.num_layers,
            hp.ffn_dim,
            hp.num_heads,
            d_model=hp.d_model,
            vocab_size=hp.vocab_size,
            pad_id=hp.pad_id,
            dropout=hp.dropout,
            tie_embeddings=hp.tie_embeddings,
            scale_ffn_init=hp.scale_ffn_init,
            logit_clip=hp.logit_clip,
            max_len=hp.max_len,
        )

    def configure_model(self) -> None:
        if self.backbone is None:
            self.backbone = self._build()

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        assert self.backbone is not None, "call configure_model() first (the Trainer does)"
        return self.backbone((src, tgt_in))

    def pipeline_loss(self, logits: Tensor, batch: Batch, label_smoothing: float | None = None) -> Tensor:
        """Cross-entropy averaged over the target tokens that are not padding. Under GPipeStrategy it runs inside
        the pipeline, per micro-batch on the last stage (weighted by :meth:`pipeline_loss_denominator`)."""
        smoothing = self.hparams.label_smoothing if label_smoothing is None else label_smoothing
        return F.cross_entropy(
            # At least fp32 (a bf16 head's logits), float64 kept (the parity tests' precision).
            logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)),
            batch["tgt_out"].flatten(),
            ignore_index=self.hparams.pad_id,
            label_smoothing=smoothing,
        )

    def pipeline_loss_denominator(self, batch: Batch, label_smoothing: float | None = None) -> Tensor:
        """What :meth:`pipeline_loss` averages over: a micro-batch's share of the loss is its share of these tokens."""
        return (batch["tgt_out"] != self.hparams.pad_id).sum()

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(self(batch["src"], batch["tgt_in"]), batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=len(batch["src"]))
        return loss

    def translate(self, src: Tensor) -> Tensor:
        """Token ids of the translations of ``src`` [N, S] (no BOS; EOS then padding), through the pipeline."""
        hp = self.hparams
        assert self.backbone is not None
        max_new = min(src.shape[1] + hp.max_new_tokens, hp.max_len)
        with torch.no_grad(), next_token_logits(self.backbone):
            if hp.decoding == "beam":
                return beam_decode(
                    self.backbone, src, hp.bos_id, hp.eos_id, max_new, hp.pad_id, hp.beam_size, hp.length_penalty
                )
            return greedy_decode(self.backbone, src, hp.bos_id, hp.eos_id, max_new, hp.pad_id)

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        n = len(batch["src"])
        # Plain cross-entropy: comparable across label-smoothing settings.
        self.log(
            "val_loss",
            self.pipeline_loss(self(batch["src"], batch["tgt_in"]), batch, 0.0),
            sync_dist=True,
            batch_size=n,
        )
        data = getattr(self.trainer, "datamodule", None)
        limit = self.hparams.bleu_batches
        if not (hasattr(data, "decode") and hasattr(data, "references")) or (limit is not None and batch_idx >= limit):
            return
        hypotheses = [data.decode(row) for row in self.translate(batch["src"]).tolist()]
        references = [[ref] for ref in data.references(batch["index"], split="val")]
        self.bleu.update(hypotheses, references)

    def on_validation_epoch_end(self) -> None:
        # Every replica translated the same number of batches (equal batch counts), so all agree on this branch.
        if self.bleu.update_called:
            self.log("val_bleu", 100 * self.bleu.compute(), prog_bar=True)  # compute() sums over all replicas
            self.bleu.reset()

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer = torch.optim.Adam(decay_groups(self, hp.weight_decay), lr=hp.lr, betas=hp.betas, eps=hp.eps)
        scheduler = LambdaLR(optimizer, inverse_sqrt(hp.warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
