"""The page ranges a load to CUDA registers (ptcfs.client.devcopy.MapPins),
with the CUDA runtime's register and unregister calls recorded: each page
is registered once while any load uses it, and a range is cut where
registrations meet. The copies themselves run in the gpu tests of
test_client_torchstate.py."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("torch")

from ptcfs.client.devcopy import PAGE, MapPins  # noqa: E402


class Runtime:
    def __init__(self, refuse_from: int | None = None) -> None:
        self.live: dict[int, int] = {}  # start -> length
        self.calls = 0
        self.refuse_from = refuse_from

    def register(self, addr: int, n: int) -> bool:
        self.calls += 1
        if self.refuse_from is not None and self.calls >= self.refuse_from:
            return False
        assert addr % PAGE == 0 and n % PAGE == 0 and n > 0
        assert all(addr + n <= a or a + m <= addr for a, m in self.live.items()), "overlap"
        self.live[addr] = n
        return True

    def unregister(self, addr: int) -> None:
        del self.live[addr]


def test_pages_are_registered_once_and_released_by_their_last_load() -> None:
    rng = random.Random(3)
    rt = Runtime()
    pins = MapPins(rt.register, rt.unregister)
    loads: list[set[int]] = [set(), set(), set()]
    for _ in range(300):
        mine = rng.choice(loads)
        addr, n = rng.randrange(0, 40 * PAGE), rng.randrange(1, 6 * PAGE)
        cuts = pins.cover(addr, n, mine)
        assert cuts is not None
        assert cuts[0][0] == addr and cuts[-1][1] == addr + n
        assert all(b == c for (_, b), (c, _) in zip(cuts, cuts[1:]))
        for a, b in cuts:  # each cut lies inside one registration
            assert any(s <= a and b <= s + m for s, m in rt.live.items())
        if rng.random() < 0.1:
            pins.release(mine)
    for mine in loads:
        pins.release(mine)
    assert rt.live == {} and len(pins) == 0


def test_a_refusal_falls_back_for_good() -> None:
    rt = Runtime(refuse_from=2)
    pins = MapPins(rt.register, rt.unregister)
    mine: set[int] = set()
    assert pins.cover(0, 10, mine) == [(0, 10)]
    assert pins.cover(3 * PAGE, 10, mine) is None
    assert pins.cover(0, 10, mine) is None and pins.failed
    pins.release(mine)
    assert rt.live == {}
