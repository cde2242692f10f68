"""How a stage fails: any error becomes a PipelineError that reaches every stage, and the pipeline stays unusable."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, NoReturn

from lightning_gpipe.pipe.comm.links import Links
from lightning_gpipe.pipe.comm.transport import GRAD_TAG, OUTPUT_TAG, skip_tags
from lightning_gpipe.pipe.errors import PipelineError, PipelineTimeout
from lightning_gpipe.pipe.run.records import OutputMode
from lightning_gpipe.pipe.skips import StageSkips, skip_pairs
from lightning_gpipe.pipe.trace.events import Timeline


class FailureHandler:
    """The error paths of stage ``index``'s phases, kept apart from the schedule that runs them.

    Remembers the first failure: from then on the pipeline's process group is in an unknown state, and every phase
    refuses to run. ``output_mode`` is the stage's at the time (an output shared with every stage is also how the
    others learn that the last stage failed).
    """

    def __init__(
        self,
        index: int,
        num_stages: int,
        links: Links | None,
        timeline: Timeline,
        ring: bool = False,
        skip_notices: tuple[tuple[int, int], ...] = (),
        last: int | None = None,
    ) -> None:
        self._index = index
        self._num_stages = num_stages
        self._ring = ring  # interleaving: rank 0 also waits for the last rank and the last rank for rank 0
        self._last = num_stages - 1 if last is None else last  # the rank of the last stage (rank 0 in a V)
        # (rank, tag): where a peer may wait for a long skip or its gradient from this rank (skips.py)
        self._skip_notices = skip_notices
        self._links = links
        self._timeline = timeline
        self._broken: PipelineError | None = None

    @property
    def broken(self) -> PipelineError | None:
        """The failure that made the pipeline unusable, if any."""
        return self._broken

    def check_usable(self) -> None:
        if self._broken is not None:
            raise RuntimeError(
                "this pipeline failed earlier and its process group is in an unknown state; "
                f"restart the processes. The earlier failure: {self._broken}"
            )

    @contextmanager
    def phase(self, phase: str, output_mode: OutputMode) -> Iterator[list[Any]]:
        """Turns any error into a PipelineError that reaches every stage, then checks that all stages succeeded.

        Yields a list in which the phase keeps the micro-batch it works on and, with several virtual stages per rank,
        the executor's ``place`` (which chunk), for the error message.
        """
        self.check_usable()
        where: list[Any] = [None, None]
        try:
            with self._timeline.record("step", label=phase):
                yield where
        except Exception as e:
            err = (
                e
                if isinstance(e, PipelineError)
                else PipelineError.from_exception(
                    e, stage=self._index, phase=phase, micro_batch=where[0], chunk=where[1]
                )
            )
            self._fail(err, phase, output_mode)
            if err is e:
                raise
            raise err from e

    def abort(self, exc: BaseException, phase: str, output_mode: OutputMode) -> NoReturn:
        """Report a failure outside the pipelined module, during ``phase``, to every stage, then raise it."""
        err = PipelineError.from_exception(exc, stage=self._index, phase="step", micro_batch=None)
        self._fail(err, phase, output_mode)
        raise err from exc

    def _fail(self, err: PipelineError, phase: str, output_mode: OutputMode) -> None:
        self._broken = err
        links = self._links
        if links is None:
            return
        if err.settled:  # it came out of the status check: every stage knows already
            links.transport.abort_data()
            return
        # Before queuing the error notices: dropping a gloo send's handle cancels it. A silent peer reads nothing.
        links.transport.abandon_sends(grace_s=0.0 if isinstance(err, PipelineTimeout) else 2.0)
        # Wake the neighbours that may wait for this stage; whoever receives it passes it on.
        K, k = self._num_stages, self._index
        neighbours = {(k - 1) % K, (k + 1) % K} if self._ring else {k - 1, k + 1}
        for dst in sorted(neighbours):
            if 0 <= dst < K and dst != k and dst != err.via:
                self._notify(links, dst, err)  # where it may wait for an activation
                self._notify(links, dst, err, tag=GRAD_TAG)  # or for a gradient
        for dst, tag in self._skip_notices:
            if dst != err.via:
                self._notify(links, dst, err, tag=tag)
        if self._index == self._last and output_mode != "last" and phase in ("forward", "evaluation"):
            for dst in range(self._num_stages):
                if dst != self._last:
                    self._notify(links, dst, err, tag=OUTPUT_TAG)
        # Transfers posted ahead (a gradient's receive whose header brought the error) are never matched now.
        links.transport.abort_data()
        # Every stage that raises meets the others here, which also keeps this process alive until its notices are
        # delivered. Not after a timeout or a lost peer: the check would only wait for the same silent peer again.
        if not isinstance(err, PipelineTimeout):
            links.status.check(err)  # raises err once every stage knows

    @staticmethod
    def _notify(links: Links, dst: int, err: PipelineError, tag: int = 0) -> None:
        # Best effort: if that peer's process is gone already, nobody waits on this message.
        with suppress(RuntimeError):
            links.transport.send_error(dst, err, tag=tag)


def skip_notices(skips: list[StageSkips] | None, rank: int) -> tuple[tuple[int, int], ...]:
    """(rank, tag): each wait for a long skip, or its gradient, from this rank on another (see ``FailureHandler``)."""
    if skips is None:
        return ()
    notices = set()
    for i, (s, p) in enumerate(skip_pairs(skips)):
        forward, backward = skip_tags(i)
        a, b = skips[s].rank_of(s), skips[p].rank_of(p)
        if a == rank != b:
            notices.add((b, forward))
        if b == rank != a:
            notices.add((a, backward))
    return tuple(sorted(notices))
