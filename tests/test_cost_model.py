"""The owner exchange's cost model: bytes per transport, predicted seconds, the auto choice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hyper_parallel.core.distributed.cost import (
    PROFILE_ENV,
    DeviceProfile,
    LinkCost,
    Trip,
    choose_transport,
    device_profile,
    exchange_trips,
    transport_bytes,
    transport_seconds,
)

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
    assert device_profile("cuda") == PROFILE
    monkeypatch.delenv(PROFILE_ENV)
    assert device_profile("cpu") is not None and device_profile("xpu") is None
    path.write_text('{"name": "x", "all_to_all": {"latency": 1}}')
    with pytest.raises(ValueError, match=r"device profile .*cluster.json: .*A profile is JSON"):
        DeviceProfile.from_json(path)
