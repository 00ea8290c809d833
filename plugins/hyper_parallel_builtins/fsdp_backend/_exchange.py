"""Running a plan: the in-place blocks, and the owner exchange bucket by bucket, overlapped."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

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
from hyper_parallel_builtins.fsdp_backend._plan import (
    BACK,
    OWN,
    SPREAD,
    Bucket,
    ExchangePlan,
    Landing,
    Leg,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


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


_Step = tuple[ExchangePlan, list[int], Bucket]  # a plan, its tensors' positions, one of its buckets
_Returning = tuple[_Step, dict[int, torch.Tensor], AsyncExchange]  # results on their way back
_Spreading = tuple[_Step, list[tuple[Landing, torch.Tensor]], Callable[[], list[torch.Tensor]]]


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

    def in_turn(self, steps: list[_Step]) -> None:
        """Each bucket's trip to its members, transform, trip back and spread, one after the other."""
        for step in steps:
            results = self._transform(step, self._send(step).wait())
            landed = self._landed(step, results, self._return(step, results).wait())
            self._put(step, landed, self._spread(step, landed)())

    def overlapped(self, steps: list[_Step], meanwhile: Callable[[], None]) -> None:
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
            returning = (step, results, sent_back)
        self._arrive(None, self._arrive(returning, spreading))

    def _arrive(
        self, returning: _Returning | None, spreading: _Spreading | None
    ) -> _Spreading | None:
        """Land one bucket's returned results and start spreading them; finish the bucket before."""
        started = None
        if returning is not None:
            step, results, sent_back = returning
            landed = self._landed(step, results, sent_back.wait())
            started = (step, landed, self._spread(step, landed))
        if spreading is not None:
            step, landed, spread = spreading
            self._put(step, landed, spread())
        return started

    def _send(self, step: _Step) -> AsyncExchange:
        """Start sending this rank's pieces of the bucket to their members."""
        plan, positions, bucket = step
        parts = [[where.take(self.local[positions[i]]) for i, where in to] for to in bucket.send]
        like = self.local[positions[bucket.like]]
        return _start(parts, bucket.legs[0], bucket.transport, like, plan.group)

    def _transform(self, step: _Step, received: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Assemble the regions this rank computes in the bucket; the transform on all, in one call."""
        plan, positions, bucket = step
        regions = []
        for owned in bucket.owned:
            mine = self.local[positions[owned.index]]
            region = mine.new_empty(owned.region.shape)
            for where, source, sender, offset in owned.parts:
                if sender < 0:
                    data = source.take(mine)
                else:
                    data = received[sender][offset : offset + where.numel].view(where.shape)
                where.copy_into(region, data)
            regions.append(region)
        if plan.team is not None:
            assert self.team is not None
            shapes = [self.tensors[positions[o.index]].shape for o in bucket.owned]
            results = self.team(regions, shapes, plan.team)
        else:
            results = map_held_blocks(
                self.fn,
                regions,
                [Layout.whole(r.shape) for r in regions],
                [self.needs[positions[o.index]] for o in bucket.owned],
            )
        return {o.index: r for o, r in zip(bucket.owned, results, strict=True)}

    def _return(self, step: _Step, results: dict[int, torch.Tensor]) -> AsyncExchange:
        """Start sending every rank its piece of each result this rank computed."""
        plan, positions, bucket = step
        parts = [[where.take(results[i]) for i, where in to] for to in bucket.back]
        like = self.local[positions[bucket.like]]
        return _start(parts, bucket.legs[1], bucket.transport, like, plan.group)

    def _landed(
        self, step: _Step, results: dict[int, torch.Tensor], returned: list[torch.Tensor]
    ) -> list[tuple[Landing, torch.Tensor]]:
        """This rank's parts of the results its replica row computed: its own, and what came back."""
        landed = []
        for landing in step[2].land:
            if landing.source == OWN:
                assert landing.out_of is not None
                landed.append((landing, landing.out_of.take(results[landing.index])))
            elif landing.source == BACK:
                landed.append((landing, _slice(returned[landing.peer], landing)))
        return landed

    def _spread(
        self, step: _Step, landed: list[tuple[Landing, torch.Tensor]]
    ) -> Callable[[], list[torch.Tensor]]:
        """Start the all-gather of the landed parts over this rank's replicas; its ``wait``."""
        plan, positions, bucket = step
        if plan.column is None or not any(bucket.spread):
            return list
        like = self.local[positions[bucket.like]]
        width = max(bucket.spread)
        gather = AsyncExchange(
            [[data for _, data in landed]], bucket.spread, group=plan.column, like=like,
            transport="all_gather", gather_width=width, gather_offsets=[0] * len(bucket.spread),
        )  # fmt: skip
        return gather.wait

    def _put(
        self,
        step: _Step,
        landed: list[tuple[Landing, torch.Tensor]],
        spread: list[torch.Tensor],
    ) -> None:
        """Each param's result for this rank, from its row's results and what its replicas spread."""
        plan, positions, bucket = step
        parts: dict[int, list[tuple[Layout, torch.Tensor]]] = {}
        arrived = [(g, _slice(spread[g.peer], g)) for g in bucket.land if g.source == SPREAD]
        for landing, data in landed + arrived:
            parts.setdefault(landing.index, []).append((landing.into, data))
        like = self.local[positions[bucket.like]]
        for index in bucket.empty:
            parts[index] = [(plan.mine[index], like.new_empty(plan.mine[index].shape))]
        for index, pieces in parts.items():
            mine = plan.mine[index]
            if len(pieces) == 1 and pieces[0][0] == Layout.whole(mine.shape):
                part = pieces[0][1]
            else:
                part = pieces[0][1].new_empty(mine.shape)
                for into, data in pieces:
                    into.copy_into(part, data)
            position = positions[index]
            self.out[position] = shard_like(part, self.tensors[position])


def _slice(flat: torch.Tensor, landing: Landing) -> torch.Tensor:
    """``landing``'s data in what its peer sent: ``into``'s shape, from its offset."""
    start, into = landing.offset, landing.into
    return flat[start : start + into.numel].view(into.shape)


def _start(
    parts: Sequence[Sequence[torch.Tensor]],
    leg: Leg,
    transport: str,
    like: torch.Tensor,
    group: ProcessGroup,
) -> AsyncExchange:
    """One trip of a bucket, as the plan's ``leg`` sizes it."""
    return AsyncExchange(
        parts, leg.gets, group=group, like=like, transport=transport,
        gather_width=leg.width, gather_offsets=leg.starts,
    )  # fmt: skip
