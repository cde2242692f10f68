"""A mixture of experts' load-balancing loss (its routers' auxiliary loss) across the pipeline, as the HF model's.

HF's ``load_balancing_loss_func`` (Switch Transformer's) over the whole batch and every layer l::

    aux = E · Σ_e (C_e / R) · (P_e / R)          C_e: the tokens routing to expert e (top-k, not padding)
                                                  P_e = Σ_l Σ_t softmax(router_l(h_t))_e, R: the tokens × layers

is a product of two means over the batch, not a mean of per-sample terms: it does not add up over micro-batches. Each
sample carries its own sums (``routing``, [N, 2E + 2] float32 as HF sums them: P, C, R, and the coefficient) through
the stages, every layer adding its own, so the backbone's output holds them per sample. On the whole output
(validation, the loss outside the pipeline) :func:`router_loss` computes the HF model's term. With the loss inside
the pipeline (one micro-batch at a time, under the schedule "fill-drain": every forward before the first loss), C
and R of the whole batch are known at every loss, since the last layer records them per micro-batch; the gradient
of aux with respect to P is then a constant per expert, which HF's float32 operations give exactly, and micro-batch
m's loss back-propagates ``g · P_m`` (divided by the pipeline's weight of m, which it multiplies back) and adds the
whole batch's aux to its value: the step's loss and every gradient are the HF model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from lightning_gpipe.pipe.context import MicroBatchInfo, current_micro_batch, pipelined_loss


class RoutedLogits(NamedTuple):
    """The backbone's output when the model's config has ``output_router_logits``: the logits [N, T, V] and each
    sample's routing sums [N, 2E + 2] (router probabilities, top-k counts, tokens, the loss coefficient) that
    :func:`lightning_gpipe.hf.causal_lm_loss` adds the routers' auxiliary loss from."""

    logits: Tensor
    routing: Tensor


@dataclass(frozen=True)
class Routers:
    """How one model's routers are found and its auxiliary loss weighted: its ForCausalLM's ``num_experts``,
    ``num_experts_per_tok`` and ``router_aux_loss_coef``; the router class HF records the logits of, and where in
    the router's output they are."""

    experts: int
    top_k: int
    coef: float
    router: type[nn.Module]
    index: int

    @property
    def width(self) -> int:
        return 2 * self.experts + 2

    def start(self, n: int, device: torch.device) -> Tensor:
        """Sums of nothing yet, for the first layer to add to."""
        return torch.zeros(n, self.width, dtype=torch.float32, device=device)

    def capture(self, layer: nn.Module) -> _Capture:
        return _Capture([m for m in layer.modules() if isinstance(m, self.router)], self.index)

    def sums(self, captured: list[Tensor], mask: Tensor) -> Tensor:
        """One layer's per-sample sums from its routers' logits ([N·T, E] each), as HF's loss sums them (the softmax
        in the logits' dtype, the sums in float32, the padding left out)."""
        n, length = mask.shape
        E, rows = self.experts, mask.reshape(-1).to(torch.float32)
        out = self.start(n, mask.device)
        for logits in captured:
            weights = torch.softmax(logits, dim=-1)
            _, chosen = torch.topk(weights, self.top_k, dim=-1)
            probs = (weights.float() * rows[:, None]).reshape(n, length, E).sum(1)
            ones = rows[:, None].expand(-1, self.top_k).contiguous()
            counts = torch.zeros(n * length, E, dtype=torch.float32, device=mask.device).scatter_add_(1, chosen, ones)
            tokens = rows.reshape(n, length).sum(1, keepdim=True)
            out = out + torch.cat([probs, counts.reshape(n, length, E).sum(1), tokens, torch.zeros_like(tokens)], 1)
        return out

    def finish(self, routing: Tensor) -> Tensor:
        """The last layer's: the coefficient in its column."""
        coef = torch.full_like(routing[:, -1:], self.coef)
        return torch.cat([routing[:, :-1], coef], 1)


class _Capture:
    """The routers' logits of one call of a decoder layer, in call order (as HF's output recorder collects them)."""

    def __init__(self, routers: list[nn.Module], index: int) -> None:
        self.routers, self.index, self.got = routers, index, []  # type: ignore[var-annotated]

    def __enter__(self) -> list[Tensor]:
        self.handles = [r.register_forward_hook(self._hook) for r in self.routers]
        return self.got

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        self.got.append(output[self.index] if isinstance(output, tuple) else output)


class _StepRecords:
    """The whole batch's sums of the latest training step on this rank's last stage, per micro-batch (a recompute
    writes the same again)."""

    def __init__(self) -> None:
        self.step, self.parts = -1, {}  # type: ignore[var-annotated]

    def add(self, info: MicroBatchInfo, routing: Tensor) -> None:
        if info.step != self.step:
            self.step, self.parts = info.step, {}
        self.parts[info.m] = routing.detach().sum(0)

    def whole(self, info: MicroBatchInfo | None) -> Tensor:
        if info is not None and (info.step != self.step or len(self.parts) != info.M):
            have = len(self.parts) if info.step == self.step else 0
            raise RuntimeError(
                f"the routers' auxiliary loss of micro-batch {info.m} needs the routing of all {info.M} micro-batches "
                f"of the step, but the last stage has run the forward of {have}: it is a product of two means over "
                "the whole batch, known only once every forward ran. Use GPipeStrategy(schedule='fill-drain') (every "
                "forward before the first loss, on the last stage too), or pipeline_loss=False"
            )
        return torch.stack([self.parts[m] for m in sorted(self.parts)]).sum(0)


RECORDS = _StepRecords()


def record(routing: Tensor, training: bool) -> None:
    """The last layer's, in each forward: what a micro-batch's loss needs of the others'."""
    info = current_micro_batch()
    if training and info is not None and not routing.is_meta:
        RECORDS.add(info, routing)


def _aux(probs: Tensor, counts: Tensor, tokens: Tensor, coef: Tensor) -> Tensor:
    """``coef · aux`` with the operations of HF's load_balancing_loss_func and its ForCausalLM, in float32."""
    tokens_per_expert = counts / tokens
    router_prob_per_expert = probs / tokens
    overall = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0))
    return coef * (overall * counts.shape[-1])


def router_loss(routing: Tensor, loss: Tensor) -> Tensor:
    """``loss`` plus the routers' auxiliary loss, times its coefficient, of the batch whose sums are ``routing``
    (the whole batch's, or one micro-batch's inside the pipeline: see the module's docstring)."""
    E = (routing.shape[-1] - 2) // 2
    coef = routing[0, -1].detach()
    inside, weight = pipelined_loss()
    if not inside:
        whole = routing.sum(0)
        return loss + _aux(whole[:E], whole[E : 2 * E].detach(), whole[2 * E].detach(), coef)
    info = current_micro_batch()
    whole = RECORDS.whole(info)
    probs = whole[:E].clone().requires_grad_()
    with torch.enable_grad():
        term = _aux(probs, whole[E : 2 * E], whole[2 * E], coef)
        (torch.zeros((), dtype=loss.dtype, device=loss.device) + term).backward()  # HF's float32 chain from the loss
    assert probs.grad is not None
    total = loss + term.detach()
    if weight is None or not torch.is_grad_enabled():
        return total
    part = (routing[:, :E] * probs.grad).sum()
    if weight == 0.0:
        if float(routing[:, 2 * E].sum()) > 0:
            raise ValueError(
                f"micro-batch {info.m if info else '?'} has no token the loss counts (pipeline_loss_denominator is "
                "0: every label ignored) but has tokens the routers route: their part of the auxiliary loss cannot "
                "be weighted into the step. Give every micro-batch a label, or use fewer chunks"
            )
        return total
    # Its value is 0; the pipeline multiplies the gradient by weight again, which float32 rounds back to g exactly.
    return total + (part - part.detach()).to(loss.dtype) / weight


def routers(model: nn.Module, base: nn.Module) -> Routers | None:
    """The model's routers when its config asks for their auxiliary loss (``output_router_logits``), else None."""
    if not getattr(model.config, "output_router_logits", False):
        return None
    recorder = getattr(base, "_can_record_outputs", None) or {}
    found: Any = recorder.get("router_logits")
    if found is None:
        raise ValueError(f"{type(model).__name__} records no router_logits: its routers cannot be found")
    router, index = (found, 0) if isinstance(found, type) else (found.target_class, found.index)
    coef = getattr(model, "router_aux_loss_coef", None)
    coef = model.aux_loss_coef if coef is None else coef  # JetMoE's name
    return Routers(model.num_experts, model.num_experts_per_tok, coef, router, index)  # type: ignore[arg-type]
