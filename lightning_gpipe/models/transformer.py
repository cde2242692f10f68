"""The GPipe paper's Transformer T(L, H, A) for translation, as a flat named nn.Sequential that can be cut anywhere."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "DecoderLayer",
    "EncoderLayer",
    "next_token_logits",
    "transformer_nmt",
    "transformer_nmt_num_parameters",
]

# The stage boundaries, batch-first so that the engine can split every tensor into micro-batches along dim 0.
EncoderState = tuple[Tensor, Tensor, Tensor]  # (x [N,S,d], src_pad [N,S] bool, tgt_in_ids [N,T])
DecoderState = tuple[Tensor, Tensor, Tensor, Tensor]  # (y [N,T,d], memory [N,S,d], src_pad [N,S], tgt_pad [N,T])


def _sinusoids(length: int, d_model: int, device: torch.device) -> Tensor:
    """The fixed positional encoding of "Attention Is All You Need": sin on even, cos on odd channels, [length, d]."""
    pos = torch.arange(length, dtype=torch.float32, device=device).unsqueeze(1)
    freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32, device=device) * (-math.log(10000.0) / d_model))
    return torch.stack([torch.sin(pos * freq), torch.cos(pos * freq)], dim=-1).flatten(1)


def _key_mask(pad: Tensor) -> Tensor:
    """Which keys each query may see, [N, 1, 1, S] for SDPA (True = attend), from a key padding mask [N, S].

    A row that is padding only (an empty sentence) attends to all of its pads instead of to nothing: some SDPA kernels
    turn a fully masked row into NaN, and a NaN there reaches the weights' gradients despite its zero loss weight.
    """
    keep = ~pad | pad.all(dim=-1, keepdim=True)
    return keep[:, None, None, :]


def _causal_mask(pad: Tensor) -> Tensor:
    """Decoder self-attention mask [N, 1, T, T]: earlier non-padding positions, and always the position itself.

    The diagonal keeps every row non-empty (a pad at position 0 would otherwise see nothing); a real position sees
    itself anyway, so this changes nothing for the positions that are not padding.
    """
    T = pad.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=pad.device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=pad.device)
    return (causal & (~pad[:, None, :] | eye))[:, None]


class _XavierLinear(nn.Linear):
    """nn.Linear initialized Xavier-uniform × ``gain`` with a zero bias, in ``reset_parameters``.

    The init lives in ``reset_parameters`` rather than in a pass over the built model because a model built on the
    meta device is initialized by calling each module's own ``reset_parameters`` (see GPipeStrategy's
    ``configure_model`` support).
    """

    def __init__(self, in_features: int, out_features: int, gain: float = 1.0) -> None:
        # Set before nn.Linear.__init__, which already calls reset_parameters.
        self.gain = gain
        super().__init__(in_features, out_features)

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.weight, gain=self.gain)
        nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", gain={self.gain:.4g}" if self.gain != 1.0 else "")


class MultiHeadAttention(nn.Module):
    """A heads over d_model; queries from ``x``, keys and values from ``kv``."""

    def __init__(self, d_model: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.dropout = dropout
        self.q = _XavierLinear(d_model, d_model)
        self.k = _XavierLinear(d_model, d_model)
        self.v = _XavierLinear(d_model, d_model)
        self.out = _XavierLinear(d_model, d_model)

    def _heads(self, t: Tensor) -> Tensor:
        N, T, d = t.shape
        return t.view(N, T, self.num_heads, d // self.num_heads).transpose(1, 2)

    def forward(self, x: Tensor, kv: Tensor, mask: Tensor) -> Tensor:
        q, k, v = self._heads(self.q(x)), self._heads(self.k(kv)), self._heads(self.v(kv))
        p = self.dropout if self.training else 0.0
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return self.out(h.transpose(1, 2).flatten(2))


class FeedForward(nn.Sequential):
    """d_model → H → d_model with ReLU; ``w2`` is the projection that writes into the residual stream.

    ``w2_gain`` scales w2's initialization: the paper's fix for deep T(L, H, A) is to scale the feed-forward init down
    with depth, and ``transformer_nmt`` passes 1/sqrt(2L). A pre-norm stream is the sum of its residual branches, 2L of
    them in the encoder (attention + FFN per layer), so the FFNs' summed contribution to the stream's variance stays
    O(1) however deep the model is, as GPT-2 does. w1 keeps gain 1: the LayerNorm before it already fixes its input
    scale, and shrinking both would scale the branch by 1/(2L) rather than 1/sqrt(2L).
    """

    def __init__(self, d_model: int, ffn_dim: int, dropout: float, w2_gain: float = 1.0) -> None:
        super().__init__(
            OrderedDict(
                w1=_XavierLinear(d_model, ffn_dim),
                relu=nn.ReLU(),
                drop=nn.Dropout(dropout),
                w2=_XavierLinear(ffn_dim, d_model, gain=w2_gain),
            )
        )


class EncoderLayer(nn.Module):
    """Pre-norm encoder layer: x + self-attention(LN(x)), then x + FFN(LN(x)); passes the masks and ids on."""

    def __init__(self, d_model: int, ffn_dim: int, num_heads: int, dropout: float, w2_gain: float = 1.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, num_heads, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model, ffn_dim, dropout, w2_gain)
        self.drop = nn.Dropout(dropout)

    def forward(self, state: EncoderState) -> EncoderState:
        x, src_pad, tgt_ids = state
        h = self.norm1(x)
        x = x + self.drop(self.attn(h, h, _key_mask(src_pad)))
        x = x + self.drop(self.ffn(self.norm2(x)))
        return x, src_pad, tgt_ids


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: causal self-attention, attention over the encoder's memory, FFN; each residual."""

    def __init__(self, d_model: int, ffn_dim: int, num_heads: int, dropout: float, w2_gain: float = 1.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.cross_attn = MultiHeadAttention(d_model, num_heads, dropout)
        self.norm3 = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model, ffn_dim, dropout, w2_gain)
        self.drop = nn.Dropout(dropout)

    def forward(self, state: DecoderState) -> DecoderState:
        y, memory, src_pad, tgt_pad = state
        h = self.norm1(y)
        y = y + self.drop(self.self_attn(h, h, _causal_mask(tgt_pad)))
        y = y + self.drop(self.cross_attn(self.norm2(y), memory, _key_mask(src_pad)))
        y = y + self.drop(self.ffn(self.norm3(y)))
        return y, memory, src_pad, tgt_pad


def _init_table(weight: Tensor) -> None:
    # std d^-1/2: embeddings × sqrt(d) have unit scale, and logits of a LayerNorm'd y have unit scale too.
    nn.init.normal_(weight, std=weight.shape[1] ** -0.5)


class _Embedding(nn.Module):
    """Token embedding × sqrt(d_model) + sinusoidal positions, then dropout; ``weight`` may be shared (tied)."""

    def __init__(self, weight: nn.Parameter, pad_id: int, dropout: float, max_len: int) -> None:
        super().__init__()
        self.weight = weight
        self.pad_id = pad_id
        self.max_len = max_len
        self.drop = nn.Dropout(dropout)

    def reset_parameters(self) -> None:
        # A tied table is reset by each of its holders, each time with the same distribution; materialize() keeps the
        # tie, so the holders end up sharing whichever draw came last.
        _init_table(self.weight)

    def embed(self, ids: Tensor, which: str) -> Tensor:
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(
                f"{which} must be an integer tensor [N, length], got {ids.dtype} of shape {tuple(ids.shape)}"
            )
        if ids.shape[1] > self.max_len:
            raise ValueError(
                f"{which} has length {ids.shape[1]} > max_len={self.max_len}; build the model with a larger max_len"
            )
        x = F.embedding(ids, self.weight) * math.sqrt(self.weight.shape[1])
        # Made per call, not kept as a buffer: it costs a few small kernels, and a buffer would come out of
        # to_empty() (building on the meta device) as garbage that no checkpoint restores.
        return self.drop(x + _sinusoids(ids.shape[1], x.shape[-1], x.device).to(x.dtype))


class SourceEmbedding(_Embedding):
    """(src_ids, tgt_in_ids) → (x, src_pad, tgt_in_ids): the first layer; the target ids ride along to the decoder."""

    def forward(self, batch: tuple[Tensor, Tensor]) -> EncoderState:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError(
                f"the Transformer's input is a pair (src_ids [N, S], tgt_in_ids [N, T]), got {type(batch).__name__}; "
                "call model((src_ids, tgt_in_ids))"
            )
        src, tgt = batch
        return self.embed(src, "src_ids"), src == self.pad_id, tgt


class EncoderNorm(nn.LayerNorm):
    """Final LayerNorm of the pre-norm encoder stack: its output is the memory every decoder layer attends to."""

    def forward(self, state: EncoderState) -> EncoderState:  # type: ignore[override]
        x, src_pad, tgt_ids = state
        return super().forward(x), src_pad, tgt_ids


class TargetEmbedding(_Embedding):
    """(memory, src_pad, tgt_in_ids) → (y, memory, src_pad, tgt_pad): the encoder output travels on with y."""

    def forward(self, state: EncoderState) -> DecoderState:
        memory, src_pad, tgt = state
        return self.embed(tgt, "tgt_in_ids"), memory, src_pad, tgt == self.pad_id


class DecoderNorm(nn.LayerNorm):
    """Final LayerNorm of the pre-norm decoder stack; the memory and masks end here. Under
    :func:`next_token_logits` only the last position goes on."""

    last_position_only = False

    def forward(self, state: DecoderState) -> Tensor:  # type: ignore[override]
        y = state[0][:, -1:] if self.last_position_only else state[0]
        return super().forward(y)


@contextmanager
def next_token_logits(backbone: nn.Module) -> Iterator[None]:
    """The backbone returns the logits of the last position only, ``[N, 1, vocab]``: all that decoding a next token
    needs, so the projection computes one position, not t (pipelined, ``decoding`` then sends the other stages only
    the chosen ids). Call it on every rank (a rank holding no DecoderNorm is unaffected).
    """
    norms = [m for m in backbone.modules() if isinstance(m, DecoderNorm)]
    for norm in norms:
        norm.last_position_only = True
    try:
        yield
    finally:
        for norm in norms:
            norm.last_position_only = False


class Projection(nn.Module):
    """Logits over the vocabulary (no bias, so that the whole projection can be tied to the embeddings)."""

    def __init__(self, weight: nn.Parameter, logit_clip: float | None) -> None:
        super().__init__()
        self.weight = weight
        self.logit_clip = logit_clip

    def reset_parameters(self) -> None:
        _init_table(self.weight)

    def forward(self, y: Tensor) -> Tensor:
        logits = F.linear(y, self.weight)
        if self.logit_clip is None:
            return logits
        # A soft clip, c·tanh(z/c): bounded in [-c, c] like a clamp, ≈ z for |z| ≪ c, and its gradient never drops to
        # exactly zero, so a confidently wrong logit can still be pulled back (a hard clamp would freeze it).
        c = self.logit_clip
        return c * torch.tanh(logits / c)


def transformer_nmt(
    num_layers: int,
    ffn_dim: int,
    num_heads: int,
    d_model: int = 1024,
    vocab_size: int = 32000,
    pad_id: int = 0,
    dropout: float = 0.1,
    tie_embeddings: bool = False,
    scale_ffn_init: bool = True,
    logit_clip: float | None = None,
    max_len: int = 1024,
) -> nn.Sequential:
    """T(L, H, A): L pre-norm encoder and L decoder layers, feed-forward width H, A heads, as one flat Sequential.

    Layers, in order: ``src_embed``, ``enc0`` … ``enc{L-1}``, ``enc_norm``, ``tgt_embed``, ``dec0`` … ``dec{L-1}``,
    ``dec_norm``, ``project``. Input: ``(src_ids [N, S], tgt_in_ids [N, T])``; output: logits ``[N, T, vocab_size]``.
    Every boundary is batch-first, so the model can be cut between any two layers and run as a GPipe pipeline.

    Args:
        tie_embeddings: source embedding, target embedding and output projection share one ``nn.Parameter``.
        scale_ffn_init: divide the FFN output matrices' initialization by sqrt(2L) (see ``FeedForward``).
        logit_clip: if set to c, logits are soft-clipped to [-c, c] by c·tanh(logits / c).
        max_len: the longest source or target sequence accepted.
    """
    for name, value in (("num_layers", num_layers), ("ffn_dim", ffn_dim), ("num_heads", num_heads)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int ≥ 1, got {value!r}")
    if d_model % num_heads or d_model % 2:
        raise ValueError(f"d_model={d_model} must be even and divisible by num_heads={num_heads}; change either")
    if not 0 <= pad_id < vocab_size:
        raise ValueError(f"pad_id={pad_id} is not a token of the vocabulary [0, {vocab_size}); pass a valid pad_id")
    if logit_clip is not None and logit_clip <= 0:
        raise ValueError(f"logit_clip must be > 0 (or None to disable clipping), got {logit_clip}")

    def table() -> nn.Parameter:
        # Drawn here once per distinct table, not in each holder's __init__: a tied table would be drawn three times.
        w = nn.Parameter(torch.empty(vocab_size, d_model))
        _init_table(w)
        return w

    w2_gain = 1.0 / math.sqrt(2 * num_layers) if scale_ffn_init else 1.0

    src_w = table()
    tgt_w = src_w if tie_embeddings else table()
    out_w = src_w if tie_embeddings else table()
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    layers["src_embed"] = SourceEmbedding(src_w, pad_id, dropout, max_len)
    for i in range(num_layers):
        layers[f"enc{i}"] = EncoderLayer(d_model, ffn_dim, num_heads, dropout, w2_gain)
    layers["enc_norm"] = EncoderNorm(d_model)
    layers["tgt_embed"] = TargetEmbedding(tgt_w, pad_id, dropout, max_len)
    for i in range(num_layers):
        layers[f"dec{i}"] = DecoderLayer(d_model, ffn_dim, num_heads, dropout, w2_gain)
    layers["dec_norm"] = DecoderNorm(d_model)
    layers["project"] = Projection(out_w, logit_clip)
    return nn.Sequential(layers)


def transformer_nmt_num_parameters(
    num_layers: int, ffn_dim: int, d_model: int = 1024, vocab_size: int = 32000, tie_embeddings: bool = False
) -> int:
    """Closed form of the parameter count; the number of heads does not enter it.

    Per layer, with d = d_model and H = ffn_dim: an attention block is 4(d² + d), an FFN 2dH + H + d, a LayerNorm 2d.
    Encoder layer 1 attention + 1 FFN + 2 norms, decoder layer 2 + 1 + 3: together 12d² + 4dH + 2H + 24d per L.
    Plus the two final norms (4d) and the vocabulary tables: 3Vd, or Vd when tied.
    """
    d, H, V = d_model, ffn_dim, vocab_size
    return num_layers * (12 * d * d + 4 * d * H + 2 * H + 24 * d) + 4 * d + (1 if tie_embeddings else 3) * V * d
