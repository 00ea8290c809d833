"""Running a plan: the in-place blocks, and the owner exchange bucket by bucket, overlapped."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hyper_parallel.core.distributed import (
    BlocksFn,
    Need,
    PrepareFn,
    TeamTransform,
)
from hyper_parallel.core.distributed.toolkit import (
    AsyncExchange,
    Layout,
    local_tensor,
    map_held_blocks,
    shard_like,
)
from hyper_parallel_builtins.fsdp_backend._plan_types import (
    Assembly,
    Bucket,
    ExchangePlan,
    Landing,
    Leg,
    Source,
)

# -- running it ----------------------------------------------------------------------


class Prepared:
    """The tensors of one ``map_prepared_blocks`` call, made in parts."""

    def __init__(self, prepare: PrepareFn, layouts: Sequence[torch.Tensor]) -> None:
        self.prepare = prepare
        self.made: list[torch.Tensor] = list(layouts)  # placeholders until made
        self.local: list[torch.Tensor] = [torch.empty(0)] * len(layouts)

    def make(self, positions: list[int]) -> None:
        if not positions:
            return
        for i, t in zip(positions, self.prepare(positions), strict=True):
            self.made[i], self.local[i] = t, local_tensor(t)


def map_in_place(
    fn: BlocksFn,
    tensors: Sequence[torch.Tensor],
    needs: Sequence[Need],
    layouts: dict[int, Layout],
    out: list[torch.Tensor | None],
) -> None:
    """One ``fn`` call on the whole blocks this rank already holds (``layouts``: index -> its layout)."""
    indices = list(layouts)
    results = map_held_blocks(
        fn,
        [local_tensor(tensors[i]) for i in indices],
        [layouts[i] for i in indices],
        [needs[i] for i in indices],
    )
    for i, result in zip(indices, results, strict=True):
        out[i] = shard_like(result, tensors[i])


@dataclass(frozen=True)
class Step:
    """One bucket to run: its plan, where the plan's tensors are in the call, and the bucket."""

    plan: ExchangePlan
    positions: list[int]  # by the plan's index: that tensor's position in the call
    bucket: Bucket


@dataclass(frozen=True)
class Landed:
    """A part of a result this rank keeps: where it lands, and its data."""

    landing: Landing
    data: torch.Tensor


@dataclass(frozen=True)
class _Returning:
    """A bucket whose results are on their way back to the ranks that hold them."""

    step: Step
    results: dict[int, torch.Tensor]  # by the plan's index: what this rank computed
    sent_back: AsyncExchange


@dataclass(frozen=True)
class _Spreading:
    """A bucket whose landed results are spreading to the other replica rows."""

    step: Step
    landed: list[Landed]
    wait: Callable[[], list[torch.Tensor]]  # what each column rank spread, once done


class Exchange:
    """The owner exchange of one ``map_blocks`` call, bucket by bucket; results land in ``out``."""

    def __init__(
        self,
        fn: BlocksFn,
        team: TeamTransform | None,
        tensors: Sequence[torch.Tensor],
        local: list[torch.Tensor],
        needs: Sequence[Need],
        out: list[torch.Tensor | None],
    ) -> None:
        self.fn, self.team, self.tensors, self.local = fn, team, tensors, local
        self.needs, self.out = needs, out

    def in_turn(self, steps: list[Step]) -> None:
        """Each bucket's trip to its members, transform, trip back and spread, one after the other."""
        for step in steps:
            results = self._transform(step, self._send(step).wait())
            landed = self._landed(step, results, self._return(step, results).wait())
            self._put(step, landed, self._spread(step, landed)())

    def overlapped(self, steps: list[Step], meanwhile: Callable[[], None]) -> None:
        """:meth:`in_turn` with the next bucket travelling while the current one computes.

        ``meanwhile`` (the in-place work) runs while the first bucket travels.
        At most four buckets are in flight: the next one arriving, the
        current one computing, the previous one's results returning, and
        the one before spreading to the replicas.
        """
        incoming = self._send(steps[0]) if steps else None
        meanwhile()
        returning: _Returning | None = None
        spreading: _Spreading | None = None
        for k, step in enumerate(steps):
            assert incoming is not None
            received = incoming.wait()
            incoming = self._send(steps[k + 1]) if k + 1 < len(steps) else None
            results = self._transform(step, received)
            sent_back = self._return(step, results)
            spreading = self._arrive(returning, spreading)
            returning = _Returning(step=step, results=results, sent_back=sent_back)
        self._arrive(None, self._arrive(returning, spreading))

    def _arrive(
        self, returning: _Returning | None, spreading: _Spreading | None
    ) -> _Spreading | None:
        """Land one bucket's returned results and start spreading them; finish the bucket before."""
        started = None
        if returning is not None:
            step = returning.step
            landed = self._landed(step, returning.results, returning.sent_back.wait())
            started = _Spreading(step=step, landed=landed, wait=self._spread(step, landed))
        if spreading is not None:
            self._put(spreading.step, spreading.landed, spreading.wait())
        return started

    def _like(self, step: Step) -> torch.Tensor:
        """A tensor of the bucket's dtype and device, for its buffers."""
        return self.local[step.positions[step.bucket.like]]

    def _send(self, step: Step) -> AsyncExchange:
        """Start sending this rank's pieces of the bucket to their members."""
        local, positions = self.local, step.positions
        parts = [[o.where.take(local[positions[o.index]]) for o in to] for to in step.bucket.send]
        return _start(parts, step.bucket.to_members, step, self._like(step))

    def _transform(self, step: Step, received: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Assemble the regions this rank computes in the bucket; the transform on all, in one call."""
        plan, positions, owned = step.plan, step.positions, step.bucket.owned
        regions = [_assemble(o, self.local[positions[o.index]], received) for o in owned]
        if plan.team is not None:
            assert self.team is not None
            shapes = [self.tensors[positions[o.index]].shape for o in owned]
            results = self.team(regions, shapes, plan.team)
        else:
            results = map_held_blocks(
                self.fn,
                regions,
                [Layout.whole(r.shape) for r in regions],
                [self.needs[positions[o.index]] for o in owned],
            )
        return {o.index: r for o, r in zip(owned, results, strict=True)}

    def _return(self, step: Step, results: dict[int, torch.Tensor]) -> AsyncExchange:
        """Start sending every rank its piece of each result this rank computed."""
        parts = [[o.where.take(results[o.index]) for o in to] for to in step.bucket.back]
        return _start(parts, step.bucket.from_members, step, self._like(step))

    def _landed(
        self, step: Step, results: dict[int, torch.Tensor], returned: list[torch.Tensor]
    ) -> list[Landed]:
        """This rank's parts of the results its replica row computed: its own, and what came back."""
        landed = []
        for landing in step.bucket.land:
            if landing.source is Source.OWN:
                assert landing.out_of is not None
                landed.append(Landed(landing, landing.out_of.take(results[landing.index])))
            elif landing.source is Source.BACK:
                landed.append(Landed(landing, _slice(returned[landing.peer], landing)))
        return landed

    def _spread(self, step: Step, landed: list[Landed]) -> Callable[[], list[torch.Tensor]]:
        """Start the all-gather of the landed parts over this rank's replicas; its ``wait``."""
        column, spread = step.plan.column, step.bucket.spread
        if column is None or not any(spread):
            return list
        gather = AsyncExchange(
            [[one.data for one in landed]],
            spread,
            group=column,
            like=self._like(step),
            transport="all_gather",
            gather_width=max(spread),
            gather_offsets=[0] * len(spread),
        )
        return gather.wait

    def _put(self, step: Step, landed: list[Landed], spread: list[torch.Tensor]) -> None:
        """Each param's result for this rank, from its row's results and what its replicas spread."""
        plan, bucket = step.plan, step.bucket
        arrived = [
            Landed(g, _slice(spread[g.peer], g)) for g in bucket.land if g.source is Source.SPREAD
        ]
        by_param: dict[int, list[Landed]] = {}
        for one in landed + arrived:
            by_param.setdefault(one.landing.index, []).append(one)
        like = self._like(step)
        for index in bucket.empty:
            self._write(step, index, like.new_empty(plan.mine[index].shape))
        for index, parts in by_param.items():
            self._write(step, index, _joined(plan.mine[index], parts))

    def _write(self, step: Step, index: int, shard: torch.Tensor) -> None:
        """``shard`` as the result of the plan's tensor ``index``, laid out like it."""
        position = step.positions[index]
        self.out[position] = shard_like(shard, self.tensors[position])


def _assemble(owned: Assembly, mine: torch.Tensor, received: list[torch.Tensor]) -> torch.Tensor:
    """The region ``owned`` describes, from this rank's shard ``mine`` and what arrived."""
    region = mine.new_empty(owned.region.shape)
    for piece in owned.pieces:
        if piece.in_shard is not None:
            data = piece.in_shard.take(mine)
        else:
            start, into = piece.offset, piece.into
            data = received[piece.sender][start : start + into.numel].view(into.shape)
        piece.into.copy_into(region, data)
    return region


def _joined(mine: Layout, parts: list[Landed]) -> torch.Tensor:
    """This rank's shard of one result, from the parts that landed (one whole part as it is)."""
    first = parts[0]
    if len(parts) == 1 and first.landing.into == Layout.whole(mine.shape):
        return first.data
    shard = first.data.new_empty(mine.shape)
    for one in parts:
        one.landing.into.copy_into(shard, one.data)
    return shard


def _slice(flat: torch.Tensor, landing: Landing) -> torch.Tensor:
    """``landing``'s data in what its peer sent: ``into``'s shape, from its offset."""
    start, into = landing.offset, landing.into
    return flat[start : start + into.numel].view(into.shape)


def _start(
    parts: Sequence[Sequence[torch.Tensor]], leg: Leg, step: Step, like: torch.Tensor
) -> AsyncExchange:
    """One trip of ``step``'s bucket, as the plan's ``leg`` sizes it."""
    return AsyncExchange(
        parts,
        leg.gets,
        group=step.plan.group,
        like=like,
        transport=step.bucket.transport,
        gather_width=leg.width,
        gather_offsets=leg.starts,
    )
