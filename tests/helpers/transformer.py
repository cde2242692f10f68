"""A tiny T(L, H, A) and ragged, right-padded batches for the Transformer and decoding tests."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_gpipe.models.transformer import transformer_nmt

V, D, PAD, BOS, EOS = 50, 32, 0, 1, 2


def tiny(seed: int = 0, **kwargs) -> nn.Sequential:
    torch.manual_seed(seed)
    kwargs = {"d_model": D, "vocab_size": V, "pad_id": PAD, "dropout": 0.0, **kwargs}
    return transformer_nmt(2, 64, 4, **kwargs)


def batch(N: int, S: int, T: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """(src, tgt_in, tgt_out) with ragged, right-padded rows."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, V, (N, S), generator=g)
    tgt = torch.randint(3, V, (N, T + 1), generator=g)
    for n in range(1, N):  # row 0 keeps full length
        src[n, S - n % S :] = PAD
        tgt[n, T + 1 - n % T :] = PAD
    tgt[:, 0] = BOS
    return src, tgt[:, :-1], tgt[:, 1:]
