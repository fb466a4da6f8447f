"""How a bundle's stages cut a prefill piece into calls of its graph shapes."""

from __future__ import annotations

import itertools

import pytest

from ling3_rknn.model.bundle_stages import CALL_COST_ROWS, plan_pieces


def _brute_force_cost(rows: int, sizes: tuple[int, ...]) -> int:
    """The cheapest cover's cost by trying every multiset of up to 40 calls."""
    best = None
    for calls in range(1, 41):
        for combo in itertools.combinations_with_replacement(sizes, calls):
            if sum(combo) >= rows and sum(combo) - min(combo) < rows:
                cost = sum(combo) + CALL_COST_ROWS * calls
                best = cost if best is None else min(best, cost)
    assert best is not None
    return best


@pytest.mark.parametrize("sizes", [(64,), (64, 256), (16, 48), (16, 64, 256), (32, 128)])
def test_a_plan_covers_every_row_with_no_empty_piece(sizes: tuple[int, ...]) -> None:
    for rows in range(1, 700):
        plan = plan_pieces(rows, sizes)
        assert set(plan) <= set(sizes)
        assert sum(plan) >= rows  # covered
        assert sum(plan[:-1]) < rows  # the last piece has at least one real row


@pytest.mark.parametrize("sizes", [(64, 256), (16, 48), (16, 64, 256)])
def test_a_plan_is_the_cheapest_cover(sizes: tuple[int, ...]) -> None:
    for rows in (1, 15, 17, 47, 49, 63, 65, 130, 200, 241, 300, 511):
        plan = plan_pieces(rows, sizes)
        assert sum(plan) + CALL_COST_ROWS * len(plan) == _brute_force_cost(rows, sizes), rows


def test_big_graphs_take_long_runs_and_small_ones_the_tail() -> None:
    assert plan_pieces(1000, (64, 256)) == (256, 256, 256, 256)
    assert plan_pieces(300, (64, 256)) in ((64, 256), (256, 64))
    assert plan_pieces(130, (64, 256)) == (64, 64, 64)  # 192 computed rows beat 256 + 16
    assert plan_pieces(70, (64,)) == (64, 64)
