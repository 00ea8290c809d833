"""The owner exchange's cost model: bytes per transport, predicted seconds, the auto choice."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from benchmarks.scale import muon_group
from hyper_parallel_builtins.fsdp_backend.cost import (
    PROFILE_ENV,
    DeviceProfile,
    LinkCost,
    Trip,
    choose_team_size,
    choose_transport,
    device_profile,
    exchange_trips,
    named_profile,
    team_link,
    team_seconds,
    transport_bytes,
    transport_seconds,
)
from hyper_parallel_builtins.muon import MuonTeam
from hyper_parallel_builtins.newton_schulz import newton_schulz_flops

#: Per-peer messages cost 20x a ring step: all_gather wins where latency dominates.
PROFILE = DeviceProfile(
    name="test",
    all_to_all=LinkCost(latency_s=2e-5, seconds_per_byte=1e-10),
    all_gather=LinkCost(latency_s=1e-6, seconds_per_byte=1e-10),
)


def fsdp_trip(ranks: int, rows: int, cols: int) -> Trip:
    """One matrix per rank, row-sharded over all ranks: every rank sends every owner its shard."""
    shard = rows // ranks * cols
    pieces = [(q, shard) for q in range(ranks)]
    to_owners, back = exchange_trips(
        [(o, pieces, torch.full((ranks,), shard)) for o in range(ranks)], ranks
    )
    assert torch.equal(to_owners.sent, back.sent) and torch.equal(to_owners.peers, back.peers)
    return to_owners


def test_bytes_of_each_transport() -> None:
    trip = Trip.from_sizes([[0, 6, 2], [4, 0, 0], [1, 1, 0]])  # elements q sends o
    assert transport_bytes(trip, 4, "all_to_all") == [(32, 20), (16, 28), (8, 8)]
    # every rank contributes the longest rank's 8 elements and receives the other two
    assert transport_bytes(trip, 4, "all_gather") == [(32, 64)] * 3
    assert trip.peers.tolist() == [2, 2, 2]


def test_exchange_trips_match_the_size_matrices_they_stand_for() -> None:
    # rank 0 owns a matrix whose two pieces ranks 1 and 2 hold; rank 2 owns one rank 0 holds
    items = [(0, [(1, 5), (2, 3)], torch.tensor([0, 5, 3])), (2, [(0, 4)], torch.tensor([4, 0, 0]))]
    to_owners, back = exchange_trips(items, 3)
    want_to = Trip.from_sizes([[0, 0, 4], [5, 0, 0], [3, 0, 0]])
    want_back = Trip.from_sizes([[0, 5, 3], [0, 0, 0], [4, 0, 0]])
    for got, want in ((to_owners, want_to), (back, want_back)):
        assert torch.equal(got.sent, want.sent) and torch.equal(got.received, want.received)
        assert torch.equal(got.peers, want.peers)


@pytest.mark.parametrize(("ranks", "rows", "cols", "expected"), [
    (256, 256, 128, "all_gather"),  # 255 pieces of 256 bytes per rank: latency-bound
    (4, 8192, 1024, "all_to_all"),  # few ranks, megabyte pieces: bytes-bound
    (256, 8192, 8192, "all_to_all"),  # many ranks, large pieces: all_gather moves P x more
])  # fmt: skip
def test_auto_picks_the_transport_the_model_predicts_faster(
    ranks: int, rows: int, cols: int, expected: str
) -> None:
    trips = [fsdp_trip(ranks, rows, cols)] * 2  # to the owners and back
    seconds = {
        t: sum(transport_seconds(trip, 2, t, PROFILE) for trip in trips)
        for t in ("all_to_all", "all_gather")
    }
    assert min(seconds, key=seconds.__getitem__) == expected, seconds
    assert choose_transport(trips, 2, PROFILE) == expected
    assert choose_transport(trips, 2, None) == "all_to_all"  # no profile: the default


def test_profiles_round_trip_through_json_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "cluster.json"
    PROFILE.to_json(path)
    assert DeviceProfile.from_json(path) == PROFILE
    monkeypatch.setenv(PROFILE_ENV, str(path))
    assert device_profile("cuda", named_profile()) == PROFILE
    monkeypatch.delenv(PROFILE_ENV)
    assert named_profile() is None
    assert device_profile("cpu") is not None and device_profile("xpu") is None
    path.write_text('{"name": "x", "all_to_all": {"latency": 1}}')
    with pytest.raises(ValueError, match=r"device profile .*cluster.json: .*A profile is JSON"):
        DeviceProfile.from_json(path)


def test_a_method_s_own_rates_are_used_where_the_profile_has_them(tmp_path: Path) -> None:
    profile = DeviceProfile(
        name="rates",
        all_to_all=LinkCost(1e-5, 1e-10),
        all_gather=LinkCost(1e-5, 1e-10),
        matmul_flops={"bfloat16": [[128.0, 1e11], [512.0, 4e11]], "bfloat16/gram": [[128.0, 5e10]]},
    )
    assert profile.matmul_rate("bfloat16", 512) == 4e11
    assert profile.matmul_rate("bfloat16", 256, "standard") == pytest.approx(2.5e11)  # log-midway
    assert profile.matmul_rate("bfloat16", 512, "gram") == 5e10  # its own, held past its points
    profile.to_json(path := tmp_path / "rates.json")
    assert DeviceProfile.from_json(path).matmul_rate("bfloat16", 128, "gram") == 5e10
    with pytest.raises(ValueError, match=r"no matmul_flops for float32; it has \['bfloat16', "):
        profile.matmul_rate("float32", 512, "gram")


def test_a_team_member_pays_its_share_of_the_flops_and_ring_collectives() -> None:
    link = LinkCost(latency_s=1e-3, seconds_per_byte=1e-9)
    collectives = [("all_reduce", 1000), ("all_gather", 1000)]
    # 4 members: the all-reduce is 6 ring steps moving 6/4 of its bytes, the all-gather 3, 3/4
    expected = 8e6 / 1e9 + 1e-3 * (6 + 3) + 1e-9 * 4 * 1000 * (6 + 3) / 4
    assert team_seconds(8e6, collectives, 4, 4, 1e9, link) == pytest.approx(expected)
    assert team_seconds(8e6, collectives, 1, 4, 1e9, link) == 8e6 / 1e9  # no team: no talk


#: A team's collectives cost little here, so splitting the one large matrix pays.
FAST_TEAMS = DeviceProfile(
    name="fast links",
    all_to_all=LinkCost(latency_s=1e-6, seconds_per_byte=1e-12),
    all_gather=LinkCost(latency_s=1e-6, seconds_per_byte=1e-12),
    matmul_flops={"float32": [[64.0, 1e10]]},
)


def test_teams_are_chosen_where_the_model_predicts_them_faster() -> None:
    team = MuonTeam(muon_group(), torch.float32)
    shapes = [torch.Size((4096, 1024))] + [torch.Size((256, 256))] * 3
    flops = [newton_schulz_flops(*s, 5, "standard") for s in shapes]
    size = choose_team_size(shapes, flops, team, 8, FAST_TEAMS)
    assert size in (2, 4, 8), size  # one matrix carries nearly all the work: share it
    slow = dataclasses.replace(FAST_TEAMS, all_gather=LinkCost(1e-2, 1e-6))
    assert choose_team_size(shapes, flops, team, 8, slow) == 1  # talking costs more than it saves
    assert choose_team_size(shapes, flops, team, 8, None) == 1  # no profile: one owner each
    # no matmul rate for the team's dtype (float64 here): nothing to decide by, one owner each
    assert (
        choose_team_size(shapes, flops, MuonTeam(muon_group(), torch.float64), 8, FAST_TEAMS) == 1
    )
    # slow between nodes, fast within one: teams stay inside a node of 2
    nodes = dataclasses.replace(slow, node_link=FAST_TEAMS.all_gather)
    assert choose_team_size(shapes, flops, team, 8, nodes, node_size=2) == 2
    assert (
        team_link(nodes, 2, 2) == FAST_TEAMS.all_gather
        and team_link(nodes, 4, 2) == slow.all_gather
    )
    # as many equal matrices as ranks: every rank already has a whole share
    even = [torch.Size((1024, 1024))] * 8
    whole = [newton_schulz_flops(*s, 5, "standard") for s in even]
    assert choose_team_size(even, whole, team, 8, FAST_TEAMS) == 1
