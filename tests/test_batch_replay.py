"""``benchmarks/batch_replay.py``: the batched replay's bookkeeping, on records made up by hand (no model)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from batch_replay import Constant, CostAware, CostTable, Load, replay_batched  # noqa: E402


def record(length: int, run: int) -> list[tuple]:
    """A row of ``length`` new tokens where the drafter offers 8 and the target accepts ``run`` in a row."""
    return [(8, run, None)] * length


TABLE = CostTable({1: [1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2, 2.4, 2.6], 2: [1.5, 1.8, 2.1, 2.4, 2.7, 3.0, 3.3, 3.6, 3.9]}, 8)


def test_every_row_commits_its_whole_record_and_leaves_when_done():
    records = [record(5, 0), record(2, 0)]
    tokens, cost, iterations = replay_batched(records, 2, TABLE, Constant(0))
    # plain steps: two rows for two iterations, then the longer row alone for three
    assert (tokens, iterations) == (7, 5)
    assert cost == pytest.approx(2 * 1.5 + 3 * 1.0)


def test_a_draft_commits_what_the_target_accepts_plus_one_and_no_more_than_is_left():
    tokens, cost, iterations = replay_batched([record(6, 8)], 1, TABLE, Constant(2))
    # 3 tokens an iteration (2 accepted + 1); the widths are capped by what is left: 2, then 2
    assert (tokens, iterations) == (6, 2)
    assert cost == pytest.approx(2 * 1.4)
    tokens, cost, iterations = replay_batched([record(6, 8)], 1, TABLE, Constant(8))
    assert (tokens, iterations) == (6, 1) and cost == pytest.approx(2.0)  # 5 drafts left to make: T(1, 5)
    tokens, _, iterations = replay_batched([record(6, 1)], 1, TABLE, Constant(4))
    assert (tokens, iterations) == (6, 3)  # one accepted draft + the target's token, every time


def test_batch_sizes_between_two_measured_ones_interpolate():
    table = CostTable({1: [1.0] * 9, 3: [3.0] * 9}, 8)
    assert table(2, 0) == pytest.approx(2.0) and table(5, 0) == pytest.approx(3.0)
    with pytest.raises(SystemExit, match="batch 1 has 2 values"):
        CostTable({1: [1.0, 2.0]}, 8)


def test_cost_aware_drafts_where_it_pays_and_not_where_it_does_not():
    accepting = [record(120, 8), record(120, 8)]
    drafted = CostAware(max_k=8)
    tokens, _, iterations = replay_batched(accepting, 2, TABLE, drafted)
    assert tokens == 240 and iterations < 60  # every draft accepted: long drafts, few iterations
    dear = CostTable({1: [1.0] + [5.0] * 8, 2: [1.0] + [5.0] * 8}, 8)
    plain = CostAware(max_k=8)
    tokens, _, iterations = replay_batched([record(120, 0), record(120, 0)], 2, dear, plain)
    assert tokens == 240 and iterations > 110  # nothing accepted and drafting dear: plain steps


def test_the_noisy_clock_is_seeded_and_the_quiet_one_exact():
    quiet = Load(0.0, 0.0)
    assert [quiet(1.0) for _ in range(3)] == [1.0, 1.0, 1.0]
    a, b = Load(0.15, 0.05, 0.01, 0.03, seed=3), Load(0.15, 0.05, 0.01, 0.03, seed=3)
    seen = [a(1.0) for _ in range(200)]
    assert seen == [b(1.0) for _ in range(200)] and len(set(seen)) == 200
