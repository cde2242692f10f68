"""zb-h1's split backward (pipe.run.weight_grad): I then W give autograd's gradients bit for bit, hooks fire at W."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_gpipe.pipe.run.weight_grad import WeightGrads
from tests.helpers import models


class Transposed(nn.Module):
    """``layer`` on (N, C, T) read as (N, T, C): a non-contiguous input; with N = 1 its matrix is column-major. The
    scale's gradient sums the input gradient times the input: its rounding depends on the input gradient's layout."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.transpose(1, 2) * self.scale)


class InPlaceAfter(nn.Module):
    """``layer`` then an in-place ReLU (its output a view for a 3-d input); ``detach``: on an input without grad, the
    gradient reaching the input around it."""

    def __init__(self, layer: nn.Module, detach: bool = False) -> None:
        super().__init__()
        self.layer, self.detach = layer, detach

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(x.detach() if self.detach else x).relu_()
        return y + x.sum() if self.detach else y


class Twice(nn.Module):
    """One Linear used twice: its two gradients summed before they reach .grad, as autograd sums them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(6, 6), nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(self.norm(x))))


CASES: list[tuple[str, Callable[[], nn.Module], tuple[int, ...]]] = [
    ("linear 2-d", lambda: nn.Linear(6, 5), (7, 6)),
    ("linear 3-d", lambda: nn.Linear(6, 5), (3, 7, 6)),
    ("linear 4-d, no bias", lambda: nn.Linear(6, 5, bias=False), (2, 3, 7, 6)),
    ("linear, non-contiguous input", lambda: Transposed(nn.Linear(6, 5)), (3, 6, 7)),
    ("linear, column-major input", lambda: Transposed(nn.Linear(6, 5)), (1, 6, 9)),
    ("linear used twice, LayerNorm", Twice, (3, 7, 6)),
    ("linear, in-place ReLU after", lambda: nn.Sequential(nn.Linear(6, 5), nn.ReLU(inplace=True)), (3, 7, 6)),
    ("linear without input grad, in-place after", lambda: InPlaceAfter(nn.Linear(6, 5), detach=True), (3, 7, 6)),
    ("conv1d, in-place ReLU after", lambda: InPlaceAfter(nn.Conv1d(6, 5, 3)), (4, 6, 9)),
    ("conv2d without input grad, in-place after", lambda: InPlaceAfter(nn.Conv2d(2, 3, 3), True), (2, 2, 5, 5)),
    ("conv1d", lambda: nn.Conv1d(6, 5, 3, padding=1), (4, 6, 9)),
    ("conv2d, stride 2", lambda: nn.Conv2d(2, 3, 3, stride=2), (4, 2, 9, 9)),
    ("conv3d, groups 2, no bias", lambda: nn.Conv3d(2, 4, 3, groups=2, bias=False), (2, 2, 5, 5, 5)),
    ("embedding, padding_idx", lambda: nn.Embedding(11, 4, padding_idx=0), (3, 5)),
]
DTYPES = {
    "fp32": (torch.float32, None),
    "float64": (torch.float64, None),
    "bf16 autocast": (torch.float32, "bf16"),
    "float64 under bf16 autocast": (torch.float64, "bf16"),  # autocast leaves float64 alone
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("name", "make", "shape"), CASES, ids=[c[0] for c in CASES])
def test_input_then_weight_half_is_autograds_backward_bit_for_bit(
    name: str, make: Callable[[], nn.Module], shape: tuple[int, ...], dtype: str
) -> None:
    torch.manual_seed(0)
    real, autocast = DTYPES[dtype]
    plain = make().to(real)
    split = copy.deepcopy(plain)
    ids = name.startswith("embedding")
    x = torch.randint(0, 11, shape) if ids else torch.randn(shape, dtype=real)
    x_plain, x_split = (x, x) if ids else (x.clone().requires_grad_(), x.clone().requires_grad_())
    fired: list[str] = []
    for n, p in split.named_parameters():
        p.register_hook(lambda g, n=n: fired.append(n))
    cast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast is not None)
    with cast:
        y = plain(x_plain)
    g = torch.randn(y.shape, dtype=y.dtype)
    y.backward(g)
    weights = WeightGrads(split)
    with cast, weights.deferring(0):
        y_split = split(x_split)
    weights.close()
    assert torch.equal(y, y_split)
    y_split.backward(g)  # I: the input gradient, and the parameters outside the split ops (LayerNorm)
    in_i = sorted(n for n, _ in split.named_parameters() if "norm" in n or "scale" in n)
    assert sorted(n for n, p in split.named_parameters() if p.grad is not None) == sorted(fired) == in_i
    fired.clear()
    weights.run(0)  # W
    assert sorted(fired) == sorted(n for n, _ in split.named_parameters() if n not in in_i)  # each once
    for (n, p), q in zip(plain.named_parameters(), split.parameters()):
        assert torch.equal(p.grad, q.grad), n
    if not ids:
        assert torch.equal(x_plain.grad, x_split.grad)


def test_what_the_split_leaves_alone_runs_as_written() -> None:
    """A frozen weight, a sparse or max_norm embedding, padding="same", no grad: autograd (or nothing) as usual."""
    frozen = nn.Linear(4, 4).requires_grad_(False)
    layers = [
        frozen,
        nn.Embedding(5, 4, sparse=True),
        nn.Embedding(5, 4, max_norm=1.0),
        nn.Conv1d(4, 4, 3, padding="same"),
    ]
    weights = WeightGrads(nn.ModuleList(layers))
    with weights.deferring(0):
        x = torch.randn(2, 4, requires_grad=True)
        outs = [
            layers[0](x),
            layers[1](torch.tensor([1, 2])),
            layers[2](torch.tensor([1, 2])),
            layers[3](x.view(1, 4, 2)),
        ]
        with torch.no_grad():
            layers[3](x.view(1, 4, 2))
    assert all(type(o.grad_fn).__name__ not in ("_LinearBackward", "_EmbeddingBackward", "_ConvBackward") for o in outs)
    sum(o.sum() for o in outs).backward()
    assert weights._pending[0] == []
    assert layers[1].weight.grad is not None and layers[3].weight.grad is not None


def test_a_mixed_model_split_under_bf16_autocast_is_autograds_backward_bit_for_bit() -> None:
    """Under CPU autocast (bf16) the deferred matmuls use autocast's casts: embedding, linear, conv, norms and a
    custom parameter together, split into I and W over two micro-batches, give autograd's gradients bit for bit."""
    torch.manual_seed(0)
    plain = models.mixed(0.0)
    split = copy.deepcopy(plain)
    ids = [models.make_input("ids", 4, 9, seed=m) for m in range(2)]
    tgt = torch.randn(4, 9, models.D, generator=torch.Generator().manual_seed(3))
    cast = torch.autocast("cpu", dtype=torch.bfloat16)
    for x in ids:
        with cast:
            loss = models.loss_fn(plain(x), tgt)
        loss.backward()
    weights = WeightGrads(split)
    for m, x in enumerate(ids):
        with cast, weights.deferring(m):
            loss = models.loss_fn(split(x), tgt)
        loss.backward()
    assert all(len(weights._pending[m]) >= 5 for m in range(2))  # each micro-batch's linears, conv, embedding wait
    for m in (1, 0):
        weights.run(m)
    weights.close()
    for (n, p), q in zip(plain.named_parameters(), split.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_the_mode_runs_inside_modules_holding_a_matrix_only() -> None:
    """Activations, containers and norms (vectors) run without the mode, deferred BatchNorm with its own; a Linear on
    an input without grad inside it; a plain Linear on an input with grad without it, its parameters out of autograd
    for the call only; every hook is gone after close()."""
    from lightning_gpipe.pipe.state.batchnorm import convert_deferred_batch_norm

    seen: list[str] = []

    class Probe(nn.Module):  # no parameters: outside the mode
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(type(torch.overrides._get_current_function_mode()).__name__)
            return x

    def mode(name: str) -> Callable[..., None]:
        def probe(m: nn.Module, a: tuple) -> None:
            grads = "".join("+" if p.requires_grad else "-" for p in m.parameters())
            seen.append(f"{name} {type(torch.overrides._get_current_function_mode()).__name__} {grads}")

        return probe

    norm = convert_deferred_batch_norm(nn.BatchNorm1d(4))
    model = nn.Sequential(nn.Linear(4, 4), norm, Probe(), nn.LayerNorm(4), nn.Linear(4, 4))
    weights = WeightGrads(model)
    for name, i in (("first", 0), ("last", 4), ("layernorm", 3)):
        model[i].register_forward_pre_hook(mode(name))  # after the pre-hook that enters the mode
    with weights.deferring(0):
        y = model(torch.randn(6, 4))
    assert seen == ["first Deferring ++", "NoneType", "layernorm NoneType ++", "last NoneType --"]
    assert all(p.requires_grad for p in model.parameters())
    y.sum().backward()
    linears = [model[0], model[4]]  # the first on an input without grad, the second on one with it
    assert all(p.grad is None for lin in linears for p in lin.parameters()) and len(weights._pending[0]) == 2
    weights.run(0)
    weights.close()
    assert all(p.grad is not None for p in model.parameters())
    assert torch.overrides._get_current_function_mode() is None
    assert not any(isinstance(h, type(weights._enter)) for m in model.modules() for h in m._forward_hooks.values())
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 4  # deferred BatchNorm's own, the probes


def test_a_linear_that_raises_gets_its_parameters_back_and_one_with_its_own_forward_runs_in_the_mode() -> None:
    """The toggle is undone when the forward raises; a Linear subclass with a forward of its own, or an instance's
    own forward, is not nn.Linear's one addmm: the mode routes its ops as it would any module's."""

    class Scaled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), Scaled(4, 4), nn.Linear(4, 3))
    split = copy.deepcopy(plain)
    split[2].forward = split[2].forward  # an instance attribute, as a patched forward is
    weights = WeightGrads(split)
    with weights.deferring(0), pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        split[0](torch.randn(2, 5, requires_grad=True))
    assert all(p.requires_grad for p in split.parameters())
    modes: list[str] = []
    for layer in split:
        layer.register_forward_pre_hook(
            lambda m, a: modes.append(type(torch.overrides._get_current_function_mode()).__name__)
        )
    x = torch.randn(6, 4)
    plain(x).square().sum().backward()
    with weights.deferring(0):
        y = split(x.requires_grad_())
    assert modes == ["NoneType", "Deferring", "Deferring"]
    y.square().sum().backward()
    assert all(p.grad is None for p in split.parameters())
    weights.run(0)
    weights.close()
    for (n, p), q in zip(plain.named_parameters(), split.parameters()):
        assert torch.equal(p.grad, q.grad), n


class Checkpointed(nn.Module):
    """Two linears under the model's own ``torch.utils.checkpoint`` (its recompute runs in backward, outside the
    split), after a linear outside it."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.before, self.a, self.b, self.reentrant = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 5), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = lambda t: self.b(torch.tanh(self.a(t)))  # noqa: E731
        return checkpoint(inner, torch.tanh(self.before(x)), use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_models_own_checkpoint_is_left_to_autograd(reentrant: bool) -> None:
    """Inside the non-reentrant checkpoint's forward nothing splits (its recompute, in backward, checks that it saves
    what the forward saved); the reentrant one's forward runs without grad, its recompute and backward in backward,
    outside the split. The linear before it splits; the gradients are autograd's bit for bit."""
    torch.manual_seed(0)
    plain = Checkpointed(reentrant).double()
    split = copy.deepcopy(plain)
    x = torch.randn(4, 6, dtype=torch.float64)
    plain(x.requires_grad_()).square().sum().backward()
    weights = WeightGrads(split)
    with weights.deferring(0):
        y = split(x.detach().requires_grad_())
    y.square().sum().backward()
    assert len(weights._pending[0]) == 1  # the linear before the checkpoint
    assert split.before.weight.grad is None and split.a.weight.grad is not None
    weights.run(0)
    weights.close()
    for (n, p), q in zip(plain.named_parameters(), split.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_the_engines_own_forward_that_saves_nothing_still_splits() -> None:
    """Under ``rematerialize.discarded_graph`` (a checkpointed micro-batch's first forward on a GPU: grad on, nothing
    saved) the ops route as in any forward with a graph, so the step's first forward tells which modules split: a
    module judged not to route there would lose its hooks, and zb-h1 would run as 1F1B."""
    from lightning_gpipe.pipe.run.weight_grad_ops import saves_as_autograd
    from lightning_gpipe.pipe.state.rematerialize import discarded_graph

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    weights = WeightGrads(model, (2, 3))
    x = torch.randn(5, 4, requires_grad=True)
    with discarded_graph():
        assert saves_as_autograd()
        with weights.deferring(0):
            model(x)
    assert weights._told and all(weights._calls.values()) and len(weights._handles) == 2
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not saves_as_autograd()
    weights.close()


def test_w_puts_each_ops_gradients_into_grad_before_the_next_op_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """W holds one op's results at a time (a stage's every weight gradient at once wrote fresh memory page by page),
    and a weight used twice reaches .grad once, its two gradients summed first: autograd's sums, bit for bit."""
    from lightning_gpipe.pipe.run import weight_grad

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), Twice(), nn.Linear(6, 6, bias=False), nn.Linear(6, 3))
    plain = copy.deepcopy(model)
    x = torch.randn(5, 6, requires_grad=True)
    plain(x).square().sum().backward()

    calls: list[list[str]] = []
    names = {id(p): name for name, p in model.named_parameters()}
    accumulate = weight_grad.accumulate_grads

    def recording(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        calls.append([names[id(p)] for p in params])
        accumulate(params, grads)

    monkeypatch.setattr(weight_grad, "accumulate_grads", recording)
    weights = WeightGrads(model)
    with weights.deferring(0):
        y = model(x.detach().requires_grad_())
    y.square().sum().backward()
    assert all(p.grad is None for name, p in model.named_parameters() if "norm" not in name)  # the norm's: in I
    weights.run(0)
    weights.close()
    # Autograd reaches the ops last to first; the twice-used Linear's first use (reached last) completes its sum.
    assert calls == [["3.weight", "3.bias"], ["2.weight"], ["1.lin.weight", "1.lin.bias"], ["0.weight", "0.bias"]]
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name
