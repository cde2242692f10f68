"""Where a forward-only call's output goes: every output mode, and a head run on the last stage (decoding's next ids),
each counted in the bytes the last stage sends."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gpipe.models import beam_decode, greedy_decode
from lightning_gpipe.pipe import GPipeStage
from tests.helpers.launch import run_distributed

N, D, V, BOS, EOS = 5, 8, 11, 1, 2


class Embed(nn.Module):
    """(src, prefix) → the prefix's embeddings plus the source's mean: a tiny decoder's first layer."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(V, D)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        src, prefix = x
        return self.table(prefix) + self.table(src).mean(dim=1, keepdim=True)


def decoder() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Embed(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, V))


def _from_last(stage: GPipeStage) -> int:
    """Bytes this stage has received from the last stage so far."""
    return int(stage._failures._links.transport.bytes_received[stage.num_stages - 1])  # type: ignore[union-attr]


def _worker(rank: int, world_size: int) -> dict:
    stage = GPipeStage(decoder(), chunks=2, balance=[2, 2, 2], timeout=30)
    src = torch.randint(3, V, (N, 4), generator=torch.Generator().manual_seed(1))
    prefix = torch.full((N, 3), BOS)
    got: dict = {}
    with torch.no_grad():
        for mode in ("last", "all", "placeholder", "first"):
            stage.output_mode = mode
            before = _from_last(stage)
            out = stage((src, prefix))
            got[mode] = (None if out is None else out.tolist(), _from_last(stage) - before)
        stage.output_mode = "placeholder"  # a head's result goes to every stage whatever the mode
        before = _from_last(stage)
        with stage.output_head(lambda logits: logits[:, -1].argmax(dim=-1)):
            got["head"] = (stage((src, prefix)).tolist(), _from_last(stage) - before)
        before = _from_last(stage)
        got["greedy"] = greedy_decode(stage, src, BOS, EOS, max_len=6).tolist()
        got["greedy_bytes"] = _from_last(stage) - before
        got["beam"] = beam_decode(stage, src, BOS, EOS, max_len=6, beam_size=3).tolist()
    with stage.output_head(lambda y: y), pytest.raises(RuntimeError, match="forward-only calls"):
        stage((src, prefix))
    # The plain model on the pipeline's two micro-batches: a host's matrix kernels may round the whole batch apart.
    plain, sizes = decoder(), stage.micro_batch_sizes(src)
    got["reference"] = torch.cat([plain(part) for part in zip(src.split(sizes), prefix.split(sizes))]).tolist()
    got["plain"] = (
        greedy_decode(decoder(), src, BOS, EOS, max_len=6).tolist(),
        beam_decode(decoder(), src, BOS, EOS, max_len=6, beam_size=3).tolist(),
    )
    return got


@pytest.mark.timeout(120)
def test_each_output_mode_and_a_head_send_only_what_is_kept() -> None:
    """K = 3. "all": the output to both other stages; "placeholder": to none (zeros of its shape); "first" (what
    predicting uses): to stage 0 only, zeros on stage 1; a head: its result, to both. Decoding through a pipeline
    gives the plain model's tokens on every stage, and each greedy step sends N ids, not N × t × V logits."""
    ranks = run_distributed(_worker, 3, timeout=110)
    ref = ranks[0]["reference"]
    logits_bytes = N * 3 * V * 4
    for rank, r in enumerate(ranks):
        last = rank == 2
        assert r["last"] == ((ref if last else None), 0), rank
        assert r["all"] == (ref, 0 if last else logits_bytes), rank
        zeros = [[[0.0] * V] * 3] * N
        assert r["placeholder"] == ((ref if last else zeros), 0), rank
        assert r["first"] == ((ref if rank in (0, 2) else zeros), logits_bytes if rank == 0 else 0), rank
        ids = torch.tensor(ref)[:, -1].argmax(dim=-1).tolist()
        assert r["head"] == (ids, 0 if last else N * 8), rank
        assert (r["greedy"], r["beam"]) == r["plain"], rank
        steps = len(r["greedy"][0])
        assert r["greedy_bytes"] == (0 if last else steps * N * 8), (rank, r["greedy_bytes"], steps)
    assert any(len(row) > 1 for row in ranks[0]["greedy"])
