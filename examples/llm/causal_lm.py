"""Fine-tuning a HuggingFace causal LM, pipelined: the LightningModule and a DataModule of generated or local text."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_gpipe.hf import (
    causal_lm_backbone,
    causal_lm_loss,
    causal_lm_tokens,
    load_pretrained,
    save_pretrained,
)

Batch = dict[str, Tensor]
PAD, BOS, EOS = 0, 1, 2  # byte b is token b + 3: no tokenizer to download


def encode(text: str) -> list[int]:
    return [BOS, *(b + 3 for b in text.encode()), EOS]


def decode(ids: list[int]) -> str:
    return bytes(i - 3 for i in ids if i > EOS).decode(errors="replace")


class CausalLM(pl.LightningModule):
    """A HF causal LM (Llama-configured from these arguments, or the local folder ``pretrained``) as
    ``causal_lm_backbone``'s nn.Sequential, built in configure_model: under GPipeStrategy on the meta device, each rank
    materializing only its stage (with transformers' own initialization) and reading only its stage's tensors of
    ``pretrained``. The loss runs inside the pipeline (``pipeline_loss``); ``save_to`` gets a HF folder at the end."""

    def __init__(
        self,
        pretrained: str | None = None,
        save_to: str | None = None,
        vocab_size: int = 259,
        hidden_size: int = 128,
        intermediate_size: int = 344,
        num_layers: int = 4,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        max_len: int = 256,
        lr: float = 1e-3,
        warmup_steps: int = 50,
        weight_decay: float = 0.1,
        example_batch: tuple[int, int] = (16, 64),
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.backbone: torch.nn.Module | None = None
        # balance="auto" counts each layer's FLOPs on a micro-batch of this.
        self.example_input_array = torch.full(example_batch, BOS, dtype=torch.long)  # input_ids

    def hf_config(self) -> Any:
        from transformers import AutoConfig, LlamaConfig

        hp = self.hparams
        if hp.pretrained is not None:
            return AutoConfig.from_pretrained(hp.pretrained)
        return LlamaConfig(
            vocab_size=hp.vocab_size, hidden_size=hp.hidden_size, intermediate_size=hp.intermediate_size,
            num_hidden_layers=hp.num_layers, num_attention_heads=hp.num_heads, num_key_value_heads=hp.num_kv_heads,
            max_position_embeddings=hp.max_len, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
            tie_word_embeddings=True,
        )  # fmt: skip

    def configure_model(self) -> None:
        if self.backbone is not None:
            return
        from transformers import AutoModelForCausalLM

        self.backbone = causal_lm_backbone(AutoModelForCausalLM.from_config(self.hf_config()))

    def on_fit_start(self) -> None:
        if self.hparams.pretrained is not None and self.trainer.ckpt_path is None:
            assert self.backbone is not None
            load_pretrained(self.backbone, self.hparams.pretrained)

    def forward(self, batch: Batch | Tensor) -> Tensor:
        """The logits of a batch (or of ``input_ids`` alone)."""
        assert self.backbone is not None
        return self.backbone(batch)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = self.pipeline_loss(self(batch), batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=len(batch["input_ids"]))
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        loss = self.pipeline_loss(self(batch), batch)
        self.log("val_loss", loss, prog_bar=True, batch_size=len(batch["input_ids"]))

    def pipeline_loss(self, logits: Tensor, batch: Batch) -> Tensor:
        """The next-token cross-entropy over the tokens that are not padding; per micro-batch on the last stage."""
        return causal_lm_loss(logits, batch["labels"])

    def pipeline_loss_denominator(self, batch: Batch) -> Tensor:
        return causal_lm_tokens(batch["labels"])

    def on_train_end(self) -> None:
        if self.hparams.save_to is not None:  # every rank writes its stage's shard
            assert self.backbone is not None
            save_pretrained(self.backbone, self.hparams.save_to)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        decay = [p for n, p in self.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.ndim < 2]  # norms
        groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=(0.9, 0.95))
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / hp.warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def generated_text(n: int, seed: int) -> list[str]:
    """Sentences about sums, counts and orders: learnable from the text alone."""
    rng = random.Random(seed)
    names = ["Ada", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hana"]
    things = ["apples", "books", "coins", "shells", "stamps", "marbles"]
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 49), rng.randint(1, 49)
        who, what = rng.choice(names), rng.choice(things)
        kind = rng.randrange(3)
        if kind == 0:
            out.append(f"{who} has {a} {what} and finds {b} more, so {who} has {a + b} {what}.")
        elif kind == 1:
            seq = list(range(a, a + rng.randint(3, 9)))
            out.append(f"{who} counts {what}: " + ", ".join(map(str, seq)) + ".")
        else:
            words = sorted(rng.sample(names, rng.randint(2, 6)))
            out.append("In order: " + " ".join(words) + ".")
    return out


class TextLines(Dataset):
    def __init__(self, lines: list[str], max_len: int) -> None:
        self.items = [encode(line)[:max_len] for line in lines if line.strip()]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> list[int]:
        return self.items[i]


def collate(items: list[list[int]]) -> Batch:
    """Right-padded to the batch's longest line: a new length every step, ``attention_mask`` zeros on the padding,
    ``labels`` -100 there."""
    length = max(map(len, items))
    ids = torch.full((len(items), length), PAD, dtype=torch.long)
    for row, item in zip(ids, items):
        row[: len(item)] = torch.tensor(item)
    mask = (torch.arange(length)[None] < torch.tensor([len(i) for i in items])[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class TextData(pl.LightningDataModule):
    """Generated sentences (the offline default) or the lines of a local text file, bytes as tokens."""

    def __init__(
        self,
        text_file: str | None = None,
        train_size: int = 20000,
        val_size: int = 256,
        batch_size: int = 16,
        max_len: int = 256,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.vocab_size = 256 + 3

    def setup(self, stage: str) -> None:
        hp = self.hparams
        if hp.text_file is not None:
            lines = Path(hp.text_file).read_text().splitlines()
            val, train = lines[: hp.val_size], lines[hp.val_size :]
        else:
            train, val = generated_text(hp.train_size, seed=0), generated_text(hp.val_size, seed=1)
        self.train, self.val = TextLines(train, hp.max_len), TextLines(val, hp.max_len)

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        return DataLoader(self.train, hp.batch_size, shuffle=True, collate_fn=collate, num_workers=hp.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, self.hparams.batch_size, collate_fn=collate, num_workers=self.hparams.num_workers)
