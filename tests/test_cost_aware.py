"""Policy ``cost-aware``: the cost model's arithmetic, the k it picks for given costs and acceptance,
truncation-aware acceptance, probing, bad options, and greedy exactness in the loop (k = 0 rows are
plain target steps). Every clock here is fake: no assertion depends on wall time."""

from __future__ import annotations

import copy
import math

import attrs
from types import SimpleNamespace

import pytest
import torch

from specdec import ConfigError, SpeculativeDecoder, Step, Verdict
from specdec.core.types import Draft
from specdec.core.packed_linear import cpu_name
from specdec.drafters import ModelDrafter
from specdec.plugins import get_registry
from specdec.policies import CostAwareLookahead, cost_aware
from specdec.policies.cost_aware import (AlternativesLedger, CostFit, _logit, _sigmoid, bucket_of, expected_tokens,
                                         generated_bucket)
from specdec.verifiers import GreedyVerifier

from .conftest import Recorder, left_padded, perturbed_copy, tiny_llama

VOCAB = 32
PROMPTS = [[1, 2, 3, 1, 2], [4, 5], [6, 7, 8, 9, 10, 11, 6, 7], [12]]
NEW_TOKENS = 24


class Ticks:
    """A fake clock read once per lookahead, before the choice: each call advances time by
    ``cost(k)`` for the k chosen last, so an iteration of lookahead k lasts exactly ``cost(k)``."""

    def __init__(self, cost):
        self.cost, self.now, self.policy = cost, 0.0, None

    def __call__(self) -> float:
        # Read at the start of a lookahead: the iteration that just ended had the last decision's k.
        decision = self.policy.decision if self.policy is not None else None
        self.now += self.cost(decision.k if decision is not None else 0)
        return self.now


def fed(policy: CostAwareLookahead, batch: int, times: dict[int, float], repeats: int = 3) -> CostAwareLookahead:
    """``policy`` with ``repeats`` observations of ``times[k]`` seconds per k at ``batch`` rows."""
    fit = policy._fits.setdefault(bucket_of(batch), CostFit(log_batch=torch.tensor(float(batch)).log2().item()))
    for _ in range(repeats):
        for k, seconds in times.items():
            fit.add(k, seconds, policy.decay)
    return policy


def step_of(rows, drafted, accepted) -> Step:
    """A Step with what cost-aware reads: rows, drafted and accepted counts."""
    batch = len(rows)
    zeros = torch.zeros(batch, dtype=torch.long)
    accepted_t = torch.tensor(accepted)
    return Step(
        iteration=1,
        rows_host=torch.tensor(rows),
        draft=Draft.empty(batch, torch.device("cpu")),
        verdict=Verdict(accepted=accepted_t, next_token=zeros),
        drafted_host=torch.tensor(drafted),
        accepted_host=accepted_t,
        appended_host=accepted_t + 1,
        finished_host=torch.zeros(batch, dtype=torch.bool),
        appended_tokens=zeros[:, None],
    )


def fake_state(batch: int, remaining: int = 100):
    rows = torch.arange(batch)
    return SimpleNamespace(
        batch_size=batch, active=batch, rows_host=rows, iteration=1, row_cuts=0,
        progress_host=lambda: ([0] * batch, [remaining] * batch),
    )


class TestCostModel:
    """The arithmetic: expected tokens, the recency-weighted fit, buckets."""

    def test_expected_tokens(self):
        assert float(expected_tokens(0.5, 2)) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
        assert float(expected_tokens(0.8, 0)) == pytest.approx(1.0)
        assert float(expected_tokens(1.0, 4)) == pytest.approx(5.0)
        assert float(expected_tokens(0.0, 4)) == pytest.approx(1.0)
        assert expected_tokens(torch.tensor([0.5, 0.9]), torch.tensor([1, 3])).tolist() == pytest.approx([1.5, 1 + 0.9 + 0.81 + 0.729])

    def test_fit_recovers_a_line_and_a_separate_plain_step(self):
        fit = CostFit(log_batch=0.0)
        for k, seconds in [(0, 8.0), (1, 12.0), (3, 16.0), (5, 20.0)]:
            fit.add(k, seconds, decay=1.0)
        costs = fit.costs([0, 1, 2, 8])
        assert costs == pytest.approx({0: 8.0, 1: 12.0, 2: 14.0, 8: 26.0})  # a + b k on k >= 1; T(0) measured

    def test_a_k_measured_off_the_line_keeps_its_own_cost(self):
        """Costs that are not a line (a verify width that falls on a cheap kernel, one that jumps):
        each observed k is its own cell, pulled towards the line by ``CELL_PRIOR`` observations'
        worth; an unobserved k is the line's."""
        fit = CostFit(log_batch=0.0)
        table = {0: 10.0, 1: 16.0, 2: 17.7, 4: 21.3, 5: 28.0}  # k = 4 cheap, k = 5 a jump
        for _ in range(30):
            for k, seconds in table.items():
                fit.add(k, seconds, decay=1.0)
        a, b = CostFit._line(fit._cells(1e-3, speculative_only=True))
        costs = fit.costs([0, 1, 2, 3, 4, 5])
        for k in (1, 2, 4, 5):
            shrunk = (30 * table[k] + CostFit.CELL_PRIOR * (a + b * k)) / (30 + CostFit.CELL_PRIOR)
            assert costs[k] == pytest.approx(shrunk)
        assert costs[3] == pytest.approx(a + b * 3)
        assert costs[4] < a + b * 4 and costs[5] > a + b * 5  # the line alone would hide both
        once = CostFit(log_batch=0.0)  # a cell seen once weighs a third against the line (prior 2)
        for k, seconds in [(1, 10.0), (3, 14.0), (5, 18.0)]:
            for _ in range(20):
                once.add(k, seconds, decay=1.0)
        once.add(2, 30.0, decay=1.0)
        line = CostFit._line(once._cells(1e-3))
        assert once.costs([2])[2] == pytest.approx((30.0 + CostFit.CELL_PRIOR * (line[0] + 2 * line[1])) / (1 + CostFit.CELL_PRIOR))

    def test_a_fits_answer_is_kept_until_its_next_timing(self):
        """The makespan reads every bucket's costs at each iteration: a fit answers the same ks from
        what it computed until a timing changes it, and then anew."""
        fit = CostFit(log_batch=0.0)
        for k, seconds in [(0, 8.0), (1, 12.0), (3, 16.0)]:
            fit.add(k, seconds, decay=1.0)
        first = fit.costs([0, 1, 2])
        assert fit.costs([0, 1, 2]) is first and fit.costs([0, 2]) == {0: first[0], 2: first[2]}
        fit.add(2, 30.0, decay=1.0)
        again = fit.costs([0, 1, 2])
        assert again is not first and again[2] > first[2] + 5.0

    def test_the_choice_follows_a_cheap_k_off_the_line(self):
        """The bundled pair's model drafter on the Zen 3 EPYC (stop 27): k = 4 costs 2.13 plain
        steps and k = 5 2.80. A line through every k hides k = 4's bargain; its own cell finds it."""
        table = {0: 1.0, 1: 1.595, 2: 1.774, 3: 2.038, 4: 2.133, 5: 2.798, 6: 2.947, 7: 3.080, 8: 3.190}
        policy = fed(CostAwareLookahead(max_k=8), 1, table, repeats=20)
        for alpha in (0.75, 0.85):  # the line says k = 3 and k = 5
            decision = policy.choose(1, torch.tensor([alpha]), torch.tensor([100]))
            rates = {k: float(expected_tokens(alpha, k)) / seconds for k, seconds in table.items()}
            assert decision.k == max(rates, key=rates.get) == 4

    def test_a_plain_steps_prediction_for_the_load_is_what_costs_says(self):
        """``_predicted`` skips the line fits for a plain step with a cell of its own: the same number."""
        for times in ({0: 10.0}, {0: 10.0, 1: 14.0}, {1: 14.0, 3: 20.0}, {0: 10.0, 2: 17.0, 5: 26.0}):
            fit = fed(CostAwareLookahead(), 1, times)._fits[1]
            for k in (0, 1, 4):
                costs = fit.costs([k])
                assert fit._predicted(k) == (None if costs is None else costs[k])

    def test_fit_needs_two_distinct_k(self):
        fit = CostFit(log_batch=0.0)
        fit.add(4, 1.0, decay=0.9)
        fit.add(4, 3.0, decay=0.9)
        assert fit.costs([0, 4]) is None and fit.single()[0] == 4
        fit.add(0, 1.0, decay=0.9)
        assert fit.costs([0, 4]) is not None  # one line through k = 0 and k = 4

    def test_recency_weighting(self):
        fit = CostFit(log_batch=0.0)
        fit.add(2, 10.0, decay=0.5)
        fit.add(2, 12.0, decay=0.5)  # the older observation now weighs 0.5, the new one 1
        assert fit.mean[2] == pytest.approx((0.5 * 10 + 1 * 12) / 1.5)
        assert fit.weight[2] == pytest.approx(1.5)

    def test_a_common_slowdown_moves_the_load_not_the_shape(self):
        fit = CostFit(log_batch=0.0)
        for _ in range(20):
            for k, seconds in [(0, 8.0), (1, 12.0), (3, 16.0)]:
                fit.add(k, seconds, decay=0.98, load_rate=0.2)
        before = fit.costs([0, 1, 3])
        for _ in range(30):  # the machine gets twice as slow; only k = 3 is being run
            fit.add(3, 32.0, decay=0.98, load_rate=0.2)
        fit.add(0, 16.0, decay=0.98, load_rate=0.2)  # a probe, at the same slowdown
        after = fit.costs([0, 1, 3])
        assert fit.load > 1.5  # most of the slowdown went to the load ...
        assert after[0] / after[3] == pytest.approx(before[0] / before[3], rel=0.2)  # ... not the shape
        untracked = CostFit(log_batch=0.0)
        for _ in range(20):
            for k, seconds in [(0, 8.0), (1, 12.0), (3, 16.0)]:
                untracked.add(k, seconds, decay=0.98)
        for _ in range(30):
            untracked.add(3, 32.0, decay=0.98)
        untracked.add(0, 16.0, decay=0.98)
        skewed = untracked.costs([0, 3])
        assert abs(skewed[0] / skewed[3] - 0.5) > 2 * abs(after[0] / after[3] - 0.5)

    def test_one_timing_after_a_long_run_of_another_k_does_not_replace_its_cell(self):
        """A cell ages as other k run (its weight), but its mean, at load 1, moves by the share of its
        own timings: one fast k = 1 iteration after 200 plain steps is one timing of many, not its cost."""
        fit = CostFit(log_batch=4.0)
        for _ in range(30):
            for k, seconds in [(0, 0.040), (1, 0.044)]:
                fit.add(k, seconds, decay=0.98, load_rate=0.1)
        for _ in range(200):
            fit.add(0, 0.040, decay=0.98, load_rate=0.1)
        assert fit.weight[1] < fit.weight[0] / 50  # stale: what exploration and the line's weights go by
        own = fit.count[1]
        fit.add(1, 0.030, decay=0.98, load_rate=0.1)  # a fast moment of the host
        assert fit.count[1] == pytest.approx(own * 0.98 + 1)
        costs = fit.costs([0, 1])
        assert costs[1] / costs[0] > 1.05  # 1.10 before; the aged weight's share made it 0.94
        assert fit.mean[1] == pytest.approx(0.044 + (0.030 / fit.load - 0.044) / fit.count[1], rel=1e-3)

    @staticmethod
    def _timed_a_few_times() -> CostFit:
        """A bucket whose k = 2 and 3 were timed three times each (what a probed width gets)."""
        fit = CostFit(log_batch=2.0)
        for _ in range(3):
            for k, seconds in [(0, 0.023), (1, 0.028), (2, 0.034), (3, 0.042)]:
                fit.add(k, seconds, decay=0.995, load_rate=0.1)
        return fit

    def test_one_burst_of_a_neighbour_does_not_price_a_width_out(self, monkeypatch):
        """Stop 69: one dear timing each of k = 2 and 3 at batch 4 moved their costs by a fifth, and
        the policy stayed at k = 1 (a width that looks dear is seldom timed again). A timing counts
        as at most ``SPIKE`` times the k's own mean."""
        def after_a_burst() -> tuple[dict, dict]:
            fit = self._timed_a_few_times()
            before = dict(fit.costs([1, 2, 3]))
            fit.add(2, 3 * 0.034, decay=0.995, load_rate=0.1)  # a neighbour's burst: 3x slower, once
            return before, fit.costs([1, 2, 3])

        before, after = after_a_burst()
        assert after[2] / before[2] < 1 + (CostFit.SPIKE - 1) / 4  # one of four timings, at most SPIKE
        assert after[3] / before[3] < 1.05
        monkeypatch.setattr(CostFit, "SPIKE", math.inf)  # taken whole, as before stop 70
        before, after = after_a_burst()
        assert after[2] / before[2] > 1.25

    def test_a_real_change_of_one_widths_cost_is_followed(self, monkeypatch):
        def after_a_change() -> CostFit:
            fit = self._timed_a_few_times()
            for _ in range(12):  # k = 2 now really costs twice as much; k = 1 the same
                fit.add(2, 2 * 0.034, decay=0.995, load_rate=0.1)
                fit.add(1, 0.028, decay=0.995, load_rate=0.1)
            return fit

        clipped = after_a_change()
        monkeypatch.setattr(CostFit, "SPIKE", math.inf)
        whole = after_a_change()
        # A cell's mean is over its recent timings (3 at the old cost, 12 at the new), so neither
        # reaches 0.068 yet; clipped, it gets 94% as far as taking every timing whole.
        assert clipped.mean[2] * clipped.load > 1.6 * 0.034
        assert clipped.mean[2] * clipped.load > 0.9 * whole.mean[2] * whole.load

    def test_a_widths_first_timing_counts_whole(self):
        fit = self._timed_a_few_times()
        fit.add(6, 0.5, decay=0.995)  # nothing to judge it against: a first run may cost anything
        assert fit.mean[6] == 0.5

    def test_buckets(self):
        assert [bucket_of(b) for b in (1, 2, 3, 4)] == [1, 2, 3, 4]
        assert bucket_of(16) == bucket_of(15) != bucket_of(8)


class TestChoice:
    """The k it picks for given costs and acceptance (no clock involved)."""

    def test_cheap_drafts_and_high_acceptance_draft_long(self):
        policy = fed(CostAwareLookahead(max_k=8), 1, {0: 10.0, 1: 11.0, 8: 18.0})
        alpha = torch.tensor([0.95])
        decision = policy.choose(1, alpha, torch.tensor([100]))
        expected = {k: float(expected_tokens(0.95, k)) / (10.0 + k if k else 10.0) for k in range(0, 9)}
        assert decision.k == max(expected, key=expected.get) == 8

    def test_picks_the_argmax_of_tokens_per_second(self):
        policy = fed(CostAwareLookahead(max_k=8, objective="throughput"), 4, {0: 10.0, 1: 14.0, 5: 22.0})  # T = 12 + 2k for k >= 1
        alpha = torch.tensor([0.7, 0.8, 0.6, 0.75], dtype=torch.float64)
        decision = policy.choose(4, alpha, torch.full((4,), 100))
        gains = {0: 4 / 10.0, **{k: float(expected_tokens(alpha, k).sum()) / (12 + 2 * k) for k in range(1, 9)}}
        assert decision.k == max(gains, key=gains.get)
        assert decision.goodput == pytest.approx(gains)

    def test_makespan_waits_for_the_slowest_row(self):
        """Three rows that accept 95% and one that accepts 30%, all with 100 tokens to go: the
        rows' tokens per second say draft, but the batch ends with the slow row, which gains less
        from drafting than the wider iteration costs."""
        costs = {0: 10.0, 1: 14.0, 5: 22.0}  # T = 12 + 2k for k >= 1
        alpha = torch.tensor([0.95, 0.95, 0.95, 0.3], dtype=torch.float64)
        budget = torch.full((4,), 99)
        throughput = fed(CostAwareLookahead(objective="throughput"), 4, costs).choose(4, alpha, budget)
        makespan = fed(CostAwareLookahead(), 4, costs).choose(4, alpha, budget)
        assert throughput.k > 0 and makespan.k == 0
        slow = {0: 1 / 10.0, **{k: float(expected_tokens(0.3, k)) / (12 + 2 * k) for k in range(1, 9)}}
        assert makespan.goodput == pytest.approx({k: 4 * 100 * rate / 100 for k, rate in slow.items()})

    def test_makespan_prices_the_tail_at_the_smaller_batch(self):
        """Once the fast row is done the slow one decodes alone, where an iteration costs half as much:
        drafting pays although the slow row alone would not pay for it at two rows' cost."""
        policy = fed(fed(CostAwareLookahead(), 2, {0: 10.0, 1: 14.0, 5: 22.0}), 1, {0: 5.0, 1: 6.0, 5: 8.0})
        alpha, budget = [0.9, 0.3], [99, 99]
        two, one = policy.cost_model(2), policy.cost_model(1)
        decision = policy.choose(2, alpha, budget)
        gains = {}
        for k in decision.goodput:
            first, last = sorted(100 / float(expected_tokens(a, k)) for a in alpha)
            gains[k] = 200 / (first * two[k] + (last - first) * one[k])
        assert decision.goodput == pytest.approx(gains)
        assert decision.k == max(gains, key=gains.get) > 0
        # Priced at two rows throughout, the slow row's 1.3 tokens per iteration do not pay for k = 1.
        assert 100 / float(expected_tokens(0.3, 1)) * two[1] > 100 * two[0]

    def test_makespan_ignores_a_slow_row_that_is_nearly_done(self):
        costs = {0: 10.0, 1: 14.0, 5: 22.0}
        decision = fed(CostAwareLookahead(), 2, costs).choose(2, torch.tensor([0.95, 0.3]), torch.tensor([99, 1]))
        assert decision.k > 0

    def test_the_objectives_agree_on_one_row(self):
        costs = {0: 10.0, 1: 14.0, 5: 22.0}
        alpha, budget = torch.tensor([0.8]), torch.tensor([40])
        one = fed(CostAwareLookahead(objective="throughput"), 1, costs).choose(1, alpha, budget)
        other = fed(CostAwareLookahead(), 1, costs).choose(1, alpha, budget)
        assert one.k == other.k and one.goodput == pytest.approx(other.goodput)

    def test_expensive_drafts_or_low_acceptance_fall_back_to_plain_steps(self):
        policy = fed(CostAwareLookahead(), 1, {0: 10.0, 1: 20.0, 4: 50.0})
        assert policy.choose(1, torch.tensor([0.9]), torch.tensor([100])).k == 0
        policy = fed(CostAwareLookahead(), 1, {0: 10.0, 1: 11.0, 4: 14.0})
        assert policy.choose(1, torch.tensor([0.05]), torch.tensor([100])).k == 0
        assert policy.choose(1, torch.tensor([0.9]), torch.tensor([100])).k > 0

    def test_budget_caps_the_width(self):
        """Rows with 2 tokens left draft 1 at most: wider k buys nothing and the pick says so."""
        policy = fed(CostAwareLookahead(), 2, {0: 10.0, 1: 10.5, 8: 14.0})
        decision = policy.choose(2, torch.tensor([0.99, 0.99]), torch.tensor([1, 1]))
        assert decision.k == 1

    def test_exploration_before_a_fit(self):
        policy = CostAwareLookahead(initial_k=3, min_k=2, max_k=6)
        assert policy.choose(1, torch.tensor([0.5]), torch.tensor([100])).k == 3
        fed(policy, 1, {3: 1.0}, repeats=1)
        assert policy.choose(1, torch.tensor([0.5]), torch.tensor([100])).k == 0  # then a plain step

    def test_predicted_costs_follow_each_new_timing(self):
        """cost_model keeps its answer between timings (the makespan asks for every smaller batch's at
        each iteration) and drops it at the next one."""
        policy = fed(CostAwareLookahead(), 4, {0: 10.0, 1: 11.0, 4: 14.0})
        before = policy.cost_model(4)
        assert policy.cost_model(4) is before
        fed(policy, 4, {0: 12.0}, repeats=5)
        assert policy.cost_model(4)[0] > before[0] + 1

    def test_a_new_bucket_borrows_the_nearest_fit(self):
        policy = fed(CostAwareLookahead(), 4, {0: 10.0, 1: 11.0, 4: 14.0})
        assert policy.cost_model(5) == pytest.approx(policy.cost_model(4))
        fed(policy, 16, {2: 40.0}, repeats=1)  # one own point: the neighbour's shape, scaled through it
        costs = policy.cost_model(16)
        assert costs[2] == pytest.approx(40.0) and costs[0] == pytest.approx(40.0 * 10 / 12)
        # ... but the choice measures this batch size's own plain step before trusting that shape.
        assert policy.choose(16, torch.full((16,), 0.9), torch.full((16,), 100)).k == 0

    def test_a_bucket_that_timed_only_plain_steps_drafts_before_trusting_a_neighbour(self):
        """A neighbour that says drafting is dear does not keep a new batch size on plain steps
        unmeasured: having timed only plain steps, it explores the initial k (the H200's batch 64)."""
        policy = fed(CostAwareLookahead(initial_k=3), 16, {0: 10.0, 1: 60.0, 4: 90.0})
        alpha, budget = torch.full((64,), 0.7), torch.full((64,), 100)
        assert policy.choose(64, alpha, budget).k == 0  # the neighbour's choice, scaled
        fed(policy, 64, {0: 12.0}, repeats=1)
        decision = policy.choose(64, alpha, budget)
        assert (decision.k, decision.probing) == (3, True)
        fed(policy, 64, {3: 20.0}, repeats=1)  # its own drafted k: now a fit of its own decides
        decision = policy.choose(64, alpha, budget)
        assert not decision.probing and decision.costs[3] == pytest.approx(20.0)
        # A drafted k's cells that decay out are explored again: ~1,400 plain steps at the default
        # decay (0.995), not after a few hundred, where its cells still price the choice.
        fed(policy, 64, {0: 12.0}, repeats=1200)
        assert policy.choose(64, alpha, budget).costs is not None
        fed(policy, 64, {0: 12.0}, repeats=400)
        decision = policy.choose(64, alpha, budget)
        assert (decision.k, decision.probing, decision.costs) == (3, True, None)


class TestTiming:
    """An iteration is timed from its lookahead to the next one, with no clock read elsewhere."""

    def test_period_includes_work_after_on_step_and_skips_the_prompt_iteration(self):
        now = [0.0]
        policy = CostAwareLookahead(clock=lambda: now[0], load_rate=0.0)
        state = fake_state(1)
        policy.begin(state, None)
        for iteration, (before, after) in enumerate([(5.0, 1.0), (2.0, 0.5), (2.0, 0.5)]):
            state.iteration = iteration
            policy.lookahead(state)  # k = initial (4) while exploring
            now[0] += before  # draft + verify + sync
            policy.on_step(state, step_of([0], [4], [4]))
            now[0] += after  # the drafter's bookkeeping after on_step, rows leaving the batch
        state.iteration = 3
        policy.lookahead(state)
        fit = policy._fits[1]
        # iteration 0 (prompt) not recorded; 1 and 2 were k = 4 then k = 0 (exploration), 2.5 s each
        assert {k: fit.mean[k] for k in fit.mean} == pytest.approx({4: 2.5, 0: 2.5})

    def test_an_iteration_in_which_no_row_got_a_draft_is_timed_as_a_plain_step(self):
        """Prompt lookup that finds nothing to copy drafts nothing: the iteration asked for k ran as a
        plain step, so its time goes to k = 0, and the cost of asking for k is a drafted
        iteration's mixed with a plain step's by how often that happens."""
        now = [0.0]
        policy = CostAwareLookahead(clock=lambda: now[0], load_rate=0.0, probe_rate=0.0, initial_k=2)
        state = fake_state(1)
        policy.begin(state, None)
        found = [True, False, True, False, True, False, True, False]
        for iteration, match in enumerate(found):
            state.iteration = iteration
            policy.lookahead(state)  # exploring: k = 2, then one plain step, then its own choice
            asked = policy.decision.k
            now[0] += 3.0 if asked and match else 2.0  # a drafted iteration, or a plain step
            drafted = 2 if asked and match else 0
            policy.on_step(state, step_of([0], [drafted], [1 if drafted else 0]))
        fit = policy._fits[1]
        drafted_widths = {k for k in fit.mean if k > 0}
        assert drafted_widths and all(fit.mean[k] == pytest.approx(3.0) for k in drafted_widths) and fit.mean[0] == pytest.approx(2.0)
        gets = policy._row_proposal_rates([0])
        assert 0.3 < gets[0] < 0.7
        drafted = policy.cost_model(1)
        asked = policy.asked_costs(drafted, policy.none_proposed(gets))
        assert asked[0] == drafted[0] == pytest.approx(2.0)
        for k in drafted_widths:
            assert asked[k] == pytest.approx((1 - gets[0]) * 2.0 + gets[0] * drafted[k])
        # In a batch the iteration is a plain step only where no row gets a draft.
        both = policy.asked_costs(drafted, policy.none_proposed([0.5, 0.5]))
        assert both[1] == pytest.approx(0.25 * 2.0 + 0.75 * drafted[1])

    def test_without_a_draft_asking_costs_nothing_so_a_lone_row_weighs_what_a_draft_buys(self):
        """A lone row's choice is whether a draft, when there is one, is worth its iteration: how often
        the drafter proposes nothing scales the gain and the price alike. Counted as rejections
        (until stop 42), the same drafts looked worse than a plain step."""
        policy = fed(CostAwareLookahead(max_k=2), 1, {0: 10.0, 1: 12.0, 2: 14.0})
        alpha, budget = [0.3], [50]  # a draft accepted 30% of the time pays 1.3 tokens for 1.2 steps
        for share in (0.0, 0.5, 0.9):
            gains = policy.choose(1, alpha, budget, proposes=[1 - share]).goodput
            assert gains[1] > gains[0]
            assert gains[1] / gains[0] == pytest.approx((1 + (1 - share) * 0.3) / (1 + (1 - share) * 0.2))
        # Counted as rejections, half the iterations without a draft make it 0.15: a plain step wins.
        gains = policy.choose(1, [0.15], budget).goodput
        assert gains[0] > gains[1]

    def test_drafting_after_a_plain_step_is_not_recorded(self):
        """The drafter's catch-up on the tokens it sat out is a one-off, not the cost of k."""
        now = [0.0]
        policy = CostAwareLookahead(clock=lambda: now[0], load_rate=0.0, probe_rate=0.0)
        fed(policy, 1, {0: 1.0, 2: 2.0, 4: 3.0})
        state = fake_state(1)
        policy.begin(state, None)
        policy._pending = (1, 1, 0, now[0], True, False)  # iteration 1 was a plain step
        policy._drafted, policy._drafted_in_request = False, True  # after the draft's first read
        for iteration, seconds in [(2, 9.0), (3, 2.0)]:  # iteration 2 drafts (catching up), then 3
            state.iteration = iteration
            policy.plan(state, alpha=torch.tensor([0.99]))
            assert policy.decision.k > 0
            now[0] += seconds
        weights = dict(policy._fits[1].weight)
        state.iteration = 4
        policy.plan(state, alpha=torch.tensor([0.99]))
        fit = policy._fits[1]
        grew = [kk for kk in fit.weight if fit.weight[kk] > weights.get(kk, 0.0) * policy.decay + 0.5]
        assert len(grew) == 1  # only iteration 3 was recorded
        assert max(fit.mean.values()) < 9.0

    def test_an_iteration_that_cut_a_cache_is_not_timed(self):
        """A cache cut to fewer rows copies every staying row (an encoder's cross-attention caches
        are large): that time is not k's."""
        now = [0.0]
        policy = fed(CostAwareLookahead(clock=lambda: now[0], load_rate=0.0, probe_rate=0.0), 2,
                     {0: 1.0, 2: 2.0, 4: 3.0}, repeats=1)
        state = fake_state(2)
        policy.begin(state, None)
        weights = dict(policy._fits[2].weight)
        for iteration in (1, 2, 3, 4):
            state.iteration = iteration
            policy.plan(state, alpha=torch.full((2,), 0.99))
            k = policy.decision.k
            policy.on_step(state, step_of([0, 1], [k, k], [k, k]))
            if iteration == 3:
                state.row_cuts += 1  # what CachedModel does when it cuts its cache
            now[0] += 50.0 if iteration == 3 else 2.5
        fit = policy._fits[2]
        recorded = sum(fit.weight.values()) - sum(w * policy.decay for w in weights.values())
        assert recorded == pytest.approx(1.0)  # 2 only: 1 drafted first (the catch-up), 3 cut a cache, 4 is open
        assert max(fit.mean.values()) < 10.0

    def test_off_the_cpu_each_shapes_first_run_is_not_timed(self):
        """An iteration takes 9 s the first time its k runs and 2 s after: on a CUDA device the fit
        holds the 2 s alone; on the CPU, where a first run costs what the next do, every run counts."""
        for device in ("cuda", "cpu"):
            now, seen = [0.0], set()
            policy = CostAwareLookahead(clock=lambda: now[0], load_rate=0.0, probe_rate=0.5)
            state = fake_state(1)
            state.device = torch.device(device)  # only read, never used: no device is needed
            policy.begin(state, None)
            for iteration in range(12):
                state.iteration = iteration
                k = int(policy.lookahead(state)[0])
                now[0] += 2.0 if k in seen else 9.0
                seen.add(k)
                policy.on_step(state, step_of([0], [k], [k // 2]))
            fit = policy._fits[1]
            assert len(seen) >= 3
            if device == "cuda":
                assert fit.mean and all(mean == pytest.approx(2.0) for mean in fit.mean.values())
            else:
                assert max(fit.mean.values()) > 2.5

    def test_a_new_request_does_not_time_across_the_gap(self):
        now = [0.0]
        policy = CostAwareLookahead(clock=lambda: now[0])
        state = fake_state(1)
        policy.begin(state, None)
        state.iteration = 5
        policy.lookahead(state)
        now[0] += 100.0
        policy.begin(state, None)
        state.iteration = 0
        policy.lookahead(state)
        assert not policy._fits


class TestAcceptance:
    """Per-row acceptance from drafted/accepted counts, truncation-aware, on a pooled prior."""

    def test_full_acceptance_is_not_a_failure(self):
        policy = CostAwareLookahead(prior_alpha=0.5, prior_strength=2.0, clock=lambda: 0.0)
        state = fake_state(2)
        policy.begin(state, None)
        policy.lookahead(state)  # k = 4 for both rows
        policy.on_step(state, step_of([0, 1], [4, 4], [4, 1]))
        assert policy._success == [4.0, 1.0]
        assert policy._failure == [0.0, 1.0]  # row 0 accepted all it was asked: no failure
        alpha = policy.row_alpha(torch.tensor([0, 1]))
        # The recent counts on the row's request so far, itself on the pool (both with prior_strength
        # pseudo-counts until a finished request has measured how much rows differ), all read against
        # what the pool accepted where the rows drafted (nothing counted yet: the prior, 0.5), and
        # carried in log-odds to the pool where the rows are now (it has counted both rows' drafts).
        reference, here = 0.5, policy.pooled_at(0)
        # a step's rows count as one draft, on prior_strength pseudo-counts of the whole pool
        assert here == pytest.approx((2.5 + 2 * policy.pooled_alpha()) / (3.0 + 2))
        for row, (kept, missed) in enumerate([(4, 0), (1, 1)]):
            own = (kept + 2 * reference) / (kept + missed + 2)  # on the reference: no shift above it
            recent = (kept + 2 * own) / (kept + missed + 2)
            assert alpha[row] == pytest.approx(_sigmoid(_logit(here) + _logit(recent) - _logit(reference)))
        assert alpha[0] > 0.8 > alpha[1]

    def test_a_row_that_got_no_draft_is_not_counted(self):
        """An n-gram drafter may find nothing to propose: the row was asked for k and got 0 tokens.
        That says nothing about what it proposes, and costs a plain step: it is counted in the share
        of rows without a draft, not as a rejection."""
        policy = CostAwareLookahead(clock=lambda: 0.0)
        state = fake_state(2)
        policy.begin(state, None)
        policy.lookahead(state)
        policy.on_step(state, step_of([0, 1], [0, 2], [0, 1]))
        assert policy._success == [0.0, 1.0] and policy._failure == [0.0, 1.0]
        assert policy.proposal_rate(0) == pytest.approx(0.5, abs=0.01)  # one row of two got none
        assert policy.proposal_rate(40) == 1.0  # an octave not counted yet: asking is how it learns

    def test_an_octave_drafted_in_once_reads_near_the_pool_not_the_octaves_before_it(self):
        """Prompt lookup has least to copy early in a text: a run that failed there and took plain
        steps after read the octaves it never drafted in as those early ones (each octave leaned on
        the one before it) and never drafted late in a text, where it accepts most (stop 71)."""
        policy = CostAwareLookahead(clock=lambda: 0.0)
        policy._pool = [4.0, 16.0]
        policy._by_generated = {0: [0.0, 12.0]}  # the first 8 tokens' drafts all rejected
        pooled = policy.pooled_alpha()
        assert pooled == pytest.approx((4.0 + 12 * 0.5) / (20.0 + 12))
        assert policy.pooled_at(3) == pytest.approx(12 * pooled / (12.0 + 12))
        assert policy.pooled_at(40) == pytest.approx(pooled)  # never drafted at 32-63: the pool
        policy._by_generated[3] = [0.0, 1.0]  # drafted there once, rejected
        assert policy.pooled_at(40) == pytest.approx(12 * pooled / 13)
        assert policy.pooled_at(20) == pytest.approx(pooled)  # 16-31, between two octaves counted
        assert policy.pooled_at(500) == pytest.approx(pooled)  # past the last octave counted

    def test_an_octave_asked_in_twice_for_nothing_is_not_read_as_one_that_never_proposes(self):
        """Two asks at 32-63 that found nothing to copy read as a share of 0 there, and the run never
        asked there again; the octave's share leans on the share over every octave (stop 71)."""
        policy = CostAwareLookahead(clock=lambda: 0.0)
        policy._unproposed_by_generated = {0: [20.0, 0.5], 3: [2.0, 1.0]}
        pool = policy.proposal_pool()
        assert pool == pytest.approx(10.0 / 22.0)
        prior = CostAwareLookahead.PROPOSAL_PRIOR
        assert policy.proposal_rate(40) == pytest.approx(prior * pool / (2.0 + prior))
        assert policy.proposal_rate(40) > 0.25
        assert policy.proposal_rate(3) == pytest.approx((10.0 + prior * pool) / (20.0 + prior))
        assert policy.proposal_rate(20) == 1.0  # not asked there yet: asking is how it learns

    def test_a_policy_that_stopped_the_draft_itself_counts_a_rejection(self):
        """draft-confidence sets the width it drafted (``time_at_width``): a stop before the first
        token is the policy's judgement of the draft, not a drafter with nothing to propose."""
        policy = CostAwareLookahead(clock=lambda: 0.0)
        state = fake_state(1)
        policy.begin(state, None)
        policy.lookahead(state)
        policy.time_at_width(0)
        policy.on_step(state, step_of([0], [0], [0]))
        assert policy._failure == [1.0] and policy._row_proposals[0] == [0.0, 0.0, 0.0]

    def test_how_often_a_row_gets_no_draft_is_read_where_it_is_in_its_text(self):
        """Prompt lookup has little to copy early in a text: the share of rows without a draft is
        kept per octave of tokens generated, and a row's expected tokens follow where it is."""
        policy = CostAwareLookahead(clock=lambda: 0.0, probe_rate=0.0, initial_k=2)
        state = fake_state(1)
        generated = [0]
        state.progress_host = lambda: (list(generated), [100 - generated[0]])
        policy.begin(state, None)
        for done, found in ((0, 0.2), (40, 0.9)):
            generated[0] = done
            for step in range(40):
                policy.lookahead(state)
                got = step % 10 < 10 * found
                policy.on_step(state, step_of([0], [2 if got else 0], [1 if got else 0]))
        assert policy.proposal_rate(3) < 0.35 and policy.proposal_rate(40) > 0.75
        early, late = policy.row_tokens([0.5, 0.5], proposes=[policy.proposal_rate(3), policy.proposal_rate(40)])
        assert early[1] == pytest.approx(1 + 0.5 * policy.proposal_rate(3))
        assert late[2] == pytest.approx(1 + (0.5 + 0.25) * policy.proposal_rate(40))

    def test_a_text_that_never_repeats_itself_reads_as_one(self):
        """Rows differ in how often prompt lookup finds anything to copy: a row's own request moves its
        chance of a draft away from the pool's, where the pool alone would read both rows alike."""
        policy = CostAwareLookahead(clock=lambda: 0.0, probe_rate=0.0, initial_k=2)
        state = fake_state(2)
        policy.begin(state, None)
        for step in range(30):
            policy.lookahead(state)
            policy.on_step(state, step_of([0, 1], [2, 0], [1, 0]))  # row 0 always gets a draft, row 1 never
        pooled = policy.proposal_rate(0)
        assert 0.4 < pooled < 0.6
        repeats, never = policy._row_proposal_rates([0, 1])
        assert repeats > 0.8 and never < 0.2

    def test_a_short_draft_accepted_whole_is_not_a_failure(self):
        """Prompt lookup found 2 tokens to copy where 4 were asked, and both were right."""
        policy = CostAwareLookahead(clock=lambda: 0.0)
        state = fake_state(2)
        policy.begin(state, None)
        policy.lookahead(state)  # k = 4 for both rows
        policy.on_step(state, step_of([0, 1], [2, 3], [2, 1]))
        assert policy._success == [2.0, 1.0]
        assert policy._failure == [0.0, 1.0]  # row 1 had its second token rejected

    def test_a_first_position_alternative_taken_is_not_an_accepted_draft_where_they_are_priced(self):
        """Row 0's first draft was rejected and one of its alternatives taken: 0 drafts kept, 2 tokens
        appended. Priced (the default), the alternative's gain is counted apart (TestAlternatives);
        for the acceptance of the chain it is a rejection, like row 1's."""
        policy = CostAwareLookahead(clock=lambda: 0.0)
        state = fake_state(2)
        policy.begin(state, None)
        policy.lookahead(state)  # k = 4 for both rows
        step = step_of([0, 1], [3, 3], [0, 0])
        step.appended_host[:] = torch.tensor([2, 1])
        policy.on_step(state, step)
        assert policy._success == [0.0, 0.0]
        assert policy._failure == [1.0, 1.0]
        # Read at every draft, it counts as one accepted draft: the gain of the wider verify paid for.
        always = CostAwareLookahead(clock=lambda: 0.0, alternatives="always")
        always.begin(state, None)
        always.lookahead(state)
        always.on_step(state, step)
        assert always._success == [1.0, 0.0]
        assert always._failure == [1.0, 1.0]

    def test_two_early_rejections_of_one_row_do_not_hold_a_batch_of_16_in_plain_steps(self):
        """The batch's choice follows its slowest row (makespan), so the lowest of 16 row estimates
        must not read two rejections as a bad row: at 0.72 acceptance drafting 2 pays 24% here.
        With a prior of 4 pseudo-counts (the default until stop 37) the same batch took plain steps."""
        def choice(**options):
            policy = CostAwareLookahead(clock=lambda: 0.0, probe_rate=0.0, **options)
            policy.begin(fake_state(16, remaining=60), None)
            policy._pool = [60.0, 20.0]
            rate = policy.pooled_at(0)  # what the pool accepted where the rows drafted
            for row in range(15):
                policy._success[row], policy._failure[row], policy._expected[row] = 6.0, 2.0, 8 * rate
            policy._failure[15], policy._expected[15] = 2.0, 2 * rate  # drafted twice, rejected twice
            fed(policy, 16, {0: 1.0, 1: 1.5, 2: 1.8, 3: 2.1, 4: 2.4})
            return policy.choose(16, policy._row_alphas(list(range(16))), [59] * 16).k

        assert choice() == 2
        assert choice(prior_strength=4.0) == 0

    def test_a_row_that_stopped_drafting_drifts_back_to_its_request_so_far(self):
        """After a bad patch a row that drafted well before returns to about its whole request's rate
        while the batch takes plain steps; one that drafted badly throughout stays bad (it drifted to
        the pool until stop 40: at batch 16 with prompt lookup the slowest row then looked better after
        a few plain steps than it is, and the batch went back to drafting at a loss, over and over)."""
        policy = CostAwareLookahead(clock=lambda: 0.0, probe_rate=0.0)
        state = fake_state(2)
        policy.begin(state, None)
        policy._pool = [30.0, 30.0]  # earlier requests: 0.5
        policy.lookahead(state)
        for _ in range(20):  # row 0 accepts its 4 drafts, row 1 has its first rejected
            policy.on_step(state, step_of([0, 1], [4, 4], [4, 0]))
        for _ in range(15):  # a bad patch for row 0
            policy.on_step(state, step_of([0, 1], [4, 4], [0, 0]))
        low = policy.row_alpha(torch.tensor([0, 1])).tolist()
        fed(policy, 2, {0: 1.0, 1: 100.0, 4: 400.0})  # drafting is far too dear: k = 0 steps
        for _ in range(40):
            assert int(policy.lookahead(state).max()) == 0
            policy.on_step(state, step_of([0, 1], [0, 0], [0, 0]))
        good, bad = policy.row_alpha(torch.tensor([0, 1])).tolist()
        pooled, lean = policy.pooled_at(0), policy.history_strength()

        def request_so_far(row):  # its counts on the pool where it drafted, carried to the pool now
            kept, missed, kept_expected = policy._row_history[row]
            reference = kept_expected / (kept + missed)
            own = (kept + lean * reference) / (kept + missed + lean)
            return _sigmoid(_logit(pooled) + _logit(own) - _logit(reference))

        assert good > low[0] + 0.1 and good > pooled + 0.1
        assert good == pytest.approx(request_so_far(0), abs=0.01)
        assert bad < pooled - 0.3
        assert bad == pytest.approx(request_so_far(1), abs=0.01)

    def test_a_row_is_read_against_the_pool_where_it_drafted(self):
        """Prompt lookup accepts more the more text a row has generated (it has more to copy from): a
        row that accepted what the pool accepts early in a text reads as the pool does later in it,
        not as its early rate; a row that did worse than the pool early stays below it."""
        assert [generated_bucket(g) for g in (0, 7, 8, 15, 16, 31, 32, 63, 64, 1000)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 7]
        policy = CostAwareLookahead(clock=lambda: 0.0, probe_rate=0.0)
        state = fake_state(2)
        generated = [0, 0]
        state.progress_host = lambda: (list(generated), [100 - g for g in generated])
        policy.begin(state, None)
        policy._by_generated = {0: [20.0, 80.0], 3: [40.0, 10.0]}  # earlier requests: 0.2 early, 0.8 at 32-63
        policy.lookahead(state)
        for step in range(30):  # one-token drafts in the first 8 tokens: row 0 accepts 1 in 5, row 1 none
            policy.on_step(state, step_of([0, 1], [1, 1], [int(step % 5 == 0), 0]))
        generated[:] = [40, 40]
        policy.lookahead(state)
        here = policy.pooled_at(40)
        assert here > 0.6 and policy.pooled_at(0) < 0.25
        like_the_pool, worse = policy.row_alpha(torch.tensor([0, 1])).tolist()
        assert like_the_pool == pytest.approx(here, abs=0.05)
        assert worse < like_the_pool - 0.2

    def test_how_far_a_row_leans_on_the_pool_follows_how_much_rows_differ(self):
        """Rows that draft alike (a draft model) lean on the pool, so the lowest of 16 noisy estimates is
        not read as a slow row; rows that differ for good (prompt lookup: some prompts repeat
        themselves, others never) keep their own rates."""
        def after_a_request(rates):
            policy = CostAwareLookahead(clock=lambda: 0.0, probe_rate=0.0)
            state = fake_state(len(rates))
            policy.begin(state, None)
            assert policy.history_strength() == policy.prior_strength  # nothing measured yet
            policy.lookahead(state)
            for step in range(40):  # one-token drafts, row b accepted at its rate (evenly spread)
                accepted = [int((step + 1) * rate) - int(step * rate) for rate in rates]
                policy.on_step(state, step_of(list(range(len(rates))), [1] * len(rates), accepted))
            policy.begin(state, None)  # the next request folds the finished one's rows in
            return policy

        alike = after_a_request([0.7] * 16)
        apart = after_a_request([0.9] * 8 + [0.1] * 8)
        assert alike.history_strength() == CostAwareLookahead.MAX_HISTORY_STRENGTH
        assert apart.history_strength() < 2.0
        # A new request's rows start at the pool either way.
        assert apart.row_alpha(torch.arange(16)).tolist() == pytest.approx([apart.pooled_at(0)] * 16)


class TestAcceptanceByPosition:
    """The pooled profile of conditional acceptance per draft position, shifted per row."""

    def test_counts_each_position_reached_and_kept(self):
        policy = CostAwareLookahead(max_k=4, per_position=True, clock=lambda: 0.0)
        state = fake_state(3)
        policy.begin(state, None)
        policy.lookahead(state)  # k = 4 for every row
        # Row 0 kept all 4; row 1 kept 1 of 3 (rejected at position 2); row 2 got no draft, which
        # reaches no position (the share of rows without one says how often that happens).
        policy.on_step(state, step_of([0, 1, 2], [4, 3, 0], [4, 1, 0]))
        assert policy._reached.tolist() == pytest.approx([2 / 2, 2 / 2, 1 / 2, 1 / 2])
        assert policy._kept.tolist() == pytest.approx([2 / 2, 1 / 2, 1 / 2, 1 / 2])

    def test_a_short_draft_accepted_whole_reaches_no_further(self):
        """Prompt lookup copied 2 of the 4 asked, both right: positions 3 and 4 were never tried."""
        policy = CostAwareLookahead(max_k=4, per_position=True, clock=lambda: 0.0)
        state = fake_state(1)
        policy.begin(state, None)
        policy.lookahead(state)
        policy.on_step(state, step_of([0], [2], [2]))
        assert policy._reached.tolist() == [1.0, 1.0, 0.0, 0.0]
        assert policy._kept.tolist() == [1.0, 1.0, 0.0, 0.0]

    def test_geometric_before_any_count_or_when_off(self):
        alpha = torch.tensor([0.3, 0.8, 0.95], dtype=torch.float64)
        geometric = expected_tokens(alpha[:, None].numpy(), torch.arange(9).numpy())
        assert CostAwareLookahead().row_tokens(alpha) == pytest.approx(geometric)
        off = with_profile(CostAwareLookahead(per_position=False), [0.5] + [0.9] * 7)
        assert off.row_tokens(alpha) == pytest.approx(geometric)

    def test_the_profile_shifted_by_each_rows_alpha(self):
        profile = [0.5, 0.8, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]
        policy = with_profile(CostAwareLookahead(per_position=True), profile)
        pooled = policy.pooled_alpha()
        high, same = policy.position_acceptance([0.9, pooled])
        assert same == pytest.approx(profile, abs=1e-4)  # a row like the pool follows the profile
        odds = high / (1 - high)
        assert odds / (torch.tensor(profile).numpy() / (1 - torch.tensor(profile).numpy())) == pytest.approx(
            [(0.9 / 0.1) / (pooled / (1 - pooled))] * 8, rel=1e-3)  # the same log-odds shift everywhere
        tokens = policy.row_tokens([pooled])[0]
        assert tokens[:3] == pytest.approx([1.0, 1.5, 1.5 + 0.5 * 0.8], abs=1e-3)

    def test_runs_of_accepted_drafts_make_longer_drafts_worth_it(self):
        """A weak first position, then strong ones: the profile values long drafts above what one
        alpha for every position does, and the choice is the argmax of tokens per second under it."""
        profile = [0.5] + [0.9] * 7
        costs = {0: 10.0, 1: 14.0, 5: 22.0}  # T = 12 + 2k for k >= 1
        positional = fed(with_profile(CostAwareLookahead(objective="throughput", per_position=True), profile), 1, costs)
        geometric = fed(with_profile(CostAwareLookahead(objective="throughput", per_position=False), profile), 1, costs)
        alpha = torch.tensor([positional.pooled_alpha()], dtype=torch.float64)
        by_hand = {0: 1 / 10.0}
        for k in range(1, 9):
            reach = torch.tensor(profile[:k], dtype=torch.float64).cumprod(0)
            by_hand[k] = float(1 + reach.sum()) / (12 + 2 * k)
        chosen = positional.choose(1, alpha, torch.tensor([100]))
        assert chosen.goodput == pytest.approx(by_hand, rel=1e-3)
        assert chosen.k == max(by_hand, key=by_hand.get)
        assert chosen.k > geometric.choose(1, alpha, torch.tensor([100])).k


def with_profile(policy: CostAwareLookahead, profile: list[float], drafts: float = 1e6) -> CostAwareLookahead:
    """``policy`` having counted ``drafts`` drafts per position that kept the given conditional
    acceptance at each position, and a pooled alpha of 0.7."""
    policy._reached = torch.full((policy.max_k,), drafts).numpy()
    policy._kept = (torch.tensor(profile) * drafts).numpy()
    policy._pool = [0.7 * drafts, 0.3 * drafts]
    return policy


class TestProbing:
    """A share ``probe_rate`` of decisions tries another k, deterministically."""

    def test_probe_schedule_and_targets(self):
        policy = fed(CostAwareLookahead(probe_rate=0.25, max_k=8, probe_backoff=1), 1, {0: 10.0, 1: 11.0, 8: 18.0})
        alpha, budget = torch.tensor([0.9]), torch.tensor([100])
        decisions = [policy.choose(1, alpha, budget) for _ in range(8)]
        assert [d.probing for d in decisions] == [False, False, False, True] * 2
        best = decisions[0].k
        assert all(d.k == best for d in decisions if not d.probing)
        assert {d.k for d in decisions if d.probing} == {0, best - 2 if best + 2 > 8 else best + 2}

    def test_when_not_speculating_probes_draft_twice_as_often_as_their_price_allows(self):
        """Out of plain steps a probe drafts for two iterations: the first pays the drafter's
        catch-up (not recorded), the second is the one timed. It waits until the plain steps since
        the last one, times probe_rate, are worth what both cost beyond two plain steps."""
        policy = fed(CostAwareLookahead(probe_rate=0.5, probe_backoff=1), 1, {0: 10.0, 1: 20.0, 4: 50.0})
        alpha, budget = torch.tensor([0.9]), torch.tensor([100])
        decisions = [policy.choose(1, alpha, budget) for _ in range(10)]
        assert all(d.best_k == 0 for d in decisions)
        # k = 1 twice: 20 + 20 - 2 x 10 = 2 plain steps of price, 4 iterations of credit at rate 0.5
        assert [i for i, d in enumerate(decisions) if d.probing] == [3, 4, 8, 9]
        assert all(d.k == 1 for d in decisions if d.probing) and all(d.k == 0 for d in decisions if not d.probing)
        policy._resume[1] = [1.0, 5.0]  # the drafter's catch-up measured at 5 s
        decisions = [policy.choose(1, alpha, budget) for _ in range(20)]
        # now k = 2 (35 s with the catch-up, then 30 s): 35 + 30 - 2 x 10 = 4.5 plain steps, 9 iterations
        assert [i for i, d in enumerate(decisions) if d.probing] == [8, 9, 18, 19]
        assert all(d.k == 2 for d in decisions if d.probing)

    def test_out_of_plain_steps_a_lone_timed_width_is_not_the_only_one_probed(self):
        """With one speculative width timed, the drafting line runs through it and the plain step,
        so the cheapest width always looks best; a probe drafts the initial k instead, and once a
        second width is timed, the best speculative k again (prompt lookup under sampling, stop 54)."""
        policy = fed(CostAwareLookahead(probe_rate=0.5, probe_backoff=1), 1, {0: 10.0, 1: 13.0})
        alpha, budget = torch.tensor([0.2]), torch.tensor([100])
        decisions = [policy.choose(1, alpha, budget) for _ in range(40)]
        assert all(d.best_k == 0 for d in decisions)
        probes = [d.k for d in decisions if d.probing]
        assert probes and set(probes) == {4}  # the width timed (1) looked best, at 3 s a token
        assert decisions[0].goodput[1] > decisions[0].goodput[4]
        # k = 4 timed at 10.5 s: the line through the drafted cells is flat, and drafting 4 pays
        policy = fed(CostAwareLookahead(probe_rate=0.5, probe_backoff=1), 1, {0: 10.0, 1: 13.0, 4: 10.5})
        chosen = policy.choose(1, alpha, budget)
        assert chosen.k == chosen.best_k == 4 and not chosen.probing
        assert chosen.goodput[4] > chosen.goodput[0] > chosen.goodput[1]
        # the initial k is the lone width: the probe goes two wider
        policy = fed(CostAwareLookahead(probe_rate=0.5, probe_backoff=1, initial_k=1), 1, {0: 10.0, 1: 13.0})
        assert {d.k for d in (policy.choose(1, alpha, budget) for _ in range(40)) if d.probing} == {3}

    def test_the_width_probed_in_place_of_a_lone_timed_one_is_priced_at_the_timed_ones_cost(self):
        """Stop 70: at batch 4 with compiled draft steps, k = 1's one timing came out at 54 ms, twice
        a plain step (a neighbour compiling; later runs took 26 ms). The line through it and the plain
        step put k = 4 at 140 ms, so the probe that would time k = 4 was priced at 9 plain steps, and
        in 512 iterations it never came: the batch took plain steps for two passes. Priced at what
        the lone width cost, the probe comes, and its timing corrects the line."""
        def probes(requests: int = 4, length: int = 64) -> list[int]:
            policy = fed(CostAwareLookahead(), 4, {0: 0.025}, repeats=20)
            policy._fits[4].add(1, 0.054, policy.decay, policy.load_rate)
            policy._drafted_in_request = False
            seen = []
            for i in range(requests * length):
                policy._iteration = i % length
                decision = policy.choose(4, torch.full((4,), 0.7), torch.full((4,), 100))
                assert decision.best_k == 0
                if decision.probing:
                    seen.append((i, decision.k))
                    policy._probe_next = None
            return seen

        seen = probes()
        assert seen and {k for _, k in seen} == {4}  # the initial k, to give the line a slope
        # 2.3 plain steps' credit at 1/32 an iteration, spent at a request's first iteration (the
        # first read is unpriced): the third request's; priced at k = 4's 140 ms (9 plain steps),
        # none came in these four requests.
        assert seen[0][0] == 128
    def test_probes_that_confirm_the_choice_back_off(self):
        """Each probe that leaves the best k where it was halves the probe rate, down to
        probe_rate / probe_backoff."""
        policy = fed(CostAwareLookahead(probe_rate=0.25, probe_backoff=4), 1, {0: 10.0, 1: 11.0, 8: 18.0})
        alpha, budget = torch.tensor([0.9]), torch.tensor([100])
        probes = [i for i in range(60) if policy.choose(1, alpha, budget).probing]
        assert probes[:4] == [3, 11, 27, 43]  # gaps 4, 8, 16, then 16 (backoff capped at 4)

    def test_a_probe_that_moves_the_best_restores_the_rate(self):
        policy = fed(CostAwareLookahead(probe_rate=0.25, probe_backoff=8), 1, {0: 10.0, 1: 11.0, 8: 18.0})
        alpha, budget = torch.tensor([0.9]), torch.tensor([100])
        for _ in range(12):  # probes at 3 and 11: the rate is a quarter of probe_rate now
            policy.choose(1, alpha, budget)
        assert policy._backoff == 2 and policy._probe_best is not None
        fed(policy, 1, {0: 1.0, 1: 50.0, 8: 400.0}, repeats=30)  # drafting became dear: the best k moves to 0
        assert policy.choose(1, alpha, budget).k == 0
        assert policy._backoff == 2  # watched: a move undone within PROBE_WATCH choices is not one
        for _ in range(policy.PROBE_WATCH):
            assert policy.choose(1, alpha, budget).best_k == 0
        assert policy._backoff == 1 and policy._probe_moved is None  # it held

    def test_a_move_undone_within_the_watch_confirms_the_old_choice(self):
        """One lucky timing of a probe's drafted iteration can move the best k for an iteration or
        two; the fit's next timings move it back. That probe confirmed the old k: the backoff grows."""
        policy = fed(CostAwareLookahead(probe_rate=0.25, probe_backoff=8), 1, {0: 10.0, 1: 11.0, 8: 18.0})
        alpha, budget = torch.tensor([0.9]), torch.tensor([100])
        for _ in range(12):  # probes at 3 and 11
            policy.choose(1, alpha, budget)
        assert policy._backoff == 2 and policy._probe_best is not None
        first, fits = policy._probe_best, policy._fits
        policy._fits = fed(CostAwareLookahead(), 1, {0: 1.0, 1: 50.0, 8: 400.0})._fits  # for a moment, drafting looks dear
        policy._costs_stamp = -1  # the predicted costs are kept per fit timings: these are other fits
        assert policy.choose(1, alpha, budget).best_k == 0 != first
        assert policy._probe_moved == (first, policy.PROBE_WATCH) and policy._backoff == 2
        policy._fits, policy._costs_stamp = fits, -1  # and then not
        assert policy.choose(1, alpha, budget).best_k == first
        assert policy._backoff == 4 and policy._probe_moved is None

    @staticmethod
    def _plain_run(replan_every: int, batches: list[int]):
        """Drives plan and on_step where drafting never pays (a plain step 10 s, each drafted token
        20 s more, half the drafts accepted), one lookahead per entry of ``batches`` (the batch size
        then). Returns the decisions and how often the policy chose (``choose`` calls)."""
        ticks = Ticks(lambda k: 10.0 + 20.0 * k)
        policy = CostAwareLookahead(clock=ticks, probe_rate=0.25, probe_backoff=1, replan_every=replan_every)
        ticks.policy = policy
        chosen = []
        choose = policy.choose
        policy.choose = lambda *args, **kwargs: chosen.append(1) or choose(*args, **kwargs)
        state = fake_state(batches[0])
        policy.begin(state, None)
        decisions = []
        for iteration, batch in enumerate(batches):
            state.iteration, state.rows_host = iteration, torch.arange(batch)
            state.progress_host = lambda batch=batch: ([iteration] * batch, [100] * batch)
            k = int(policy.lookahead(state)[0])
            decisions.append(policy.decision)
            policy.on_step(state, step_of(list(range(batch)), [k] * batch, [k // 2] * batch))
        return decisions, len(chosen)

    def test_out_of_plain_steps_it_chooses_again_every_replan_every_iterations(self):
        """Between two choices of k = 0 nothing that decides the next one moves fast (no draft is
        counted, evidence only ages), so the policy chooses again every ``replan_every`` plain
        steps, and its probes come where they would if it chose at every one (give or take an
        iteration: between choices a probe waits for the price the last choice put on it)."""
        every, every_eighth = self._plain_run(1, [2] * 200), self._plain_run(8, [2] * 200)
        assert every[1] == 200
        assert 200 / 8 < every_eighth[1] < 200 / 3  # plus the probes and the choices right after them
        assert all(d.best_k == 0 for decisions, _ in (every, every_eighth) for d in decisions[3:])
        probes = [[i for i, d in enumerate(decisions) if d.probing and d.k > 0] for decisions, _ in (every, every_eighth)]
        assert len(probes[0]) == len(probes[1]) >= 20
        assert all(0 <= b - a <= 1 for a, b in zip(*probes))
        assert all(d.k == 0 for decisions, _ in (every, every_eighth) for d in decisions[3:] if not d.probing)

    @staticmethod
    def _backoffs_after_two_probes(policy: CostAwareLookahead, ticks: Ticks, found: bool = True) -> list[int]:
        """The backoff as each of the first two probes out of plain steps is judged, two rows
        decoding with ``policy`` on ``ticks``; with ``found`` False a probe's rows get no draft."""
        ticks.policy = policy
        state = fake_state(2)
        policy.begin(state, None)
        probes, after = [], []
        for iteration in range(400):
            state.iteration = iteration
            state.progress_host = lambda iteration=iteration: ([iteration] * 2, [1000] * 2)
            k = int(policy.lookahead(state)[0])
            decision = policy.decision
            if decision.probing and decision.best_k == 0 and k > 0 and (not probes or iteration > probes[-1] + 1):
                probes.append(iteration)  # a probe out of plain steps: two drafted iterations
            if probes and iteration == probes[-1] + 2:
                after.append(policy._backoff)  # the probe was judged at this choice
                if len(after) == 2:
                    break
            drafted = k if found or not decision.probing else 0
            policy.on_step(state, step_of([0, 1], [drafted] * 2, [0] * 2))
        return after

    def test_a_probe_left_untimed_confirms_nothing(self, monkeypatch):
        """Off the CPU a probe's drafted iterations are often their shapes' first runs, and with
        compiled steps they compile: left untimed, the probe measured nothing. Judged as a probe that
        confirmed plain steps, it made probing twice as rare (before stop 69). Here drafting never
        pays: the first probe's shapes are new, the second's are not."""
        backoffs = {}
        for apart in (True, False):
            monkeypatch.setattr(cost_aware, "FIRST_RUNS_APART_ON_CPU", apart)
            ticks = Ticks(lambda k: 10.0 + 20.0 * k)
            backoffs[apart] = self._backoffs_after_two_probes(
                CostAwareLookahead(clock=ticks, probe_rate=0.25, probe_backoff=8), ticks)
        assert backoffs[False] == [2, 4]  # every run timed: each probe confirmed plain steps
        assert backoffs[True] == [1, 2]  # the first probe's runs were its shapes' first: no evidence

    def test_a_probe_that_got_no_draft_confirms_nothing(self):
        """Prompt lookup's probes out of plain steps come at a text's first iterations, where it has
        mostly nothing to copy: the probe's drafted iteration ran as a plain step and timed no width.
        Judged as one that confirmed plain steps, it made probing twice as rare (before stop 71)."""
        backoffs = {}
        for found in (True, False):
            ticks = Ticks(lambda k: 10.0 + 20.0 * k)  # drafting never pays
            policy = fed(CostAwareLookahead(clock=ticks, probe_rate=0.25, probe_backoff=8), 2,
                         {0: 10.0, 1: 30.0, 2: 50.0})
            policy._first_read[bucket_of(2)] = [1.0, 0.0]  # timed once before: probes may come mid-request
            backoffs[found] = self._backoffs_after_two_probes(policy, ticks, found)
        assert backoffs[True] == [2, 4]  # each probe drafted and confirmed plain steps
        assert backoffs[False] == [1, 1]  # nothing to copy: no width was timed

    def test_only_the_probes_own_iterations_make_it_one_that_measured_nothing(self):
        """Between a probe and its judgement (delayed where rows leave the batch) an untimed iteration
        that was no probe's leaves the probe's evidence standing."""
        policy = fed(CostAwareLookahead(probe_rate=0.25, probe_backoff=8), 1, {0: 10.0, 1: 11.0, 8: 18.0})
        alpha, budget = torch.tensor([0.9]), torch.tensor([100])
        while not policy.choose(1, alpha, budget).probing:
            pass
        policy.decision = attrs.evolve(policy.choose(1, alpha, budget), probing=False)  # an iteration after it
        policy._probe_best = policy.decision.best_k  # not judged yet
        policy._left_untimed()
        assert not policy._probe_untimed
        policy.decision = attrs.evolve(policy.decision, probing=True)  # the probe's own
        policy._left_untimed()
        assert policy._probe_untimed

    def test_a_batch_that_lost_rows_chooses_again_at_once(self):
        decisions, _ = self._plain_run(8, [4] * 40 + [3] * 3)
        assert decisions[39].batch == 4 and decisions[39].k == 0
        assert decisions[40].batch == 3  # chosen again for 3 rows, not the choice made for 4

    def test_no_probes_at_rate_zero(self):
        policy = fed(CostAwareLookahead(probe_rate=0.0), 1, {0: 10.0, 1: 11.0, 8: 18.0})
        assert not any(policy.choose(1, torch.tensor([0.9]), torch.tensor([100])).probing for _ in range(50))


class TestOptions:
    """Nonsensical options are ConfigErrors naming the field."""

    @pytest.mark.parametrize(
        "options,field",
        [
            ({"probe_rate": -0.1}, "probe_rate"),
            ({"probe_rate": 2}, "probe_rate"),
            ({"min_k": 5, "max_k": 3}, "max_k"),
            ({"min_k": 0}, "min_k"),
            ({"max_k": 2, "initial_k": 4}, "initial_k"),
            ({"decay": 0}, "decay"),
            ({"load_rate": -0.5}, "load_rate"),
            ({"alpha_decay": 1.5}, "alpha_decay"),
            ({"prior_alpha": 1.0}, "prior_alpha"),
            ({"prior_strength": -1}, "prior_strength"),
            ({"probe_backoff": 0}, "probe_backoff"),
            ({"max_k": "8"}, "max_k"),
            ({"objective": "fastest"}, "objective"),
            ({"resume_margin": -0.05}, "resume_margin"),
            ({"per_position": "yes"}, "per_position"),
            ({"alternatives": "sometimes"}, "alternatives"),
            ({"alternatives": True}, "alternatives"),
            ({"replan_every": 0}, "replan_every"),
            ({"replan_every": 2.5}, "replan_every"),
        ],
    )
    def test_invalid_options_name_the_field(self, options, field):
        with pytest.raises(ConfigError, match=field):
            get_registry().create("policy", "cost-aware", options)

    def test_the_clock_is_a_python_argument_not_a_config_option(self):
        """Tests hand the policy a fake clock; a config or the CLI cannot, and `specdec plugins` does not list it."""
        assert "clock" not in [option.name for option in get_registry().get("policy", "cost-aware").options()]
        with pytest.raises(ConfigError, match=r"unknown option\(s\) clock; its options are: alpha_decay, "):
            get_registry().create("policy", "cost-aware", {"clock": "fast"})
        with pytest.raises(ValueError, match="clock must be a callable"):
            CostAwareLookahead(clock="fast")  # in Python it is an argument, checked

    def test_initial_k_defaults_inside_the_range(self):
        assert CostAwareLookahead(max_k=2).choose(1, torch.tensor([0.5]), torch.tensor([9])).k == 2



@pytest.fixture(scope="module")
def target():
    return tiny_llama(20, vocab=VOCAB, layers=2, dtype=torch.float64, init=0.3)


class FirstRunsDear(Ticks):
    """``Ticks`` where an iteration is ``once`` seconds dearer the first time its lookahead runs at its
    batch size, as on a GPU, where a shape's first run loads and chooses kernels and reserves memory."""

    def __init__(self, cost, once: float):
        super().__init__(cost)
        self.once, self.seen = once, set()

    def __call__(self) -> float:
        decision = self.policy.decision if self.policy is not None else None
        if decision is not None and (decision.batch, decision.k) not in self.seen:
            self.seen.add((decision.batch, decision.k))
            self.now += self.once
        return super().__call__()


def decode(target, draft_model, cost, clock=None, decoder_options=None, **options):
    """Two requests of ``PROMPTS`` through ``cost-aware`` (``options``) on a fake clock (``Ticks(cost)``
    unless ``clock``), with ``decoder_options`` for the decoder: (outputs, generate's, steps, policy)."""
    clock = clock or Ticks(cost)
    policy = CostAwareLookahead(clock=clock, **options)
    clock.policy = policy
    recorder = Recorder()
    decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft_model), policy=policy,
                                 verifier=GreedyVerifier(), observers=[recorder], **(decoder_options or {}))
    input_ids, mask = left_padded(PROMPTS)
    outs = [decoder.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False) for _ in range(2)]
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    return outs, expected, recorder.steps, policy


class TestInTheLoop:
    """Driven by a fake clock: the policy converges where the costs say, and the output stays greedy."""

    def test_expensive_drafting_gives_plain_target_steps_exactly(self, target):
        draft = perturbed_copy(target, 0.1)
        outs, expected, steps, policy = decode(target, draft, lambda k: 1.0 + 5.0 * k, probe_rate=0.1)
        for out in outs:
            assert torch.equal(out.sequences, expected)
        plain = [s for s in steps if s.draft.width == 0]
        assert len(plain) > len(steps) / 2
        assert all(int(s.drafted_host.sum()) == 0 and bool((s.appended_host == 1).all()) for s in plain)
        assert policy.cost_model(4)[0] == pytest.approx(1.0)

    def test_off_the_cpu_a_shapes_first_run_is_not_what_its_k_costs(self, target, monkeypatch):
        """Each batch size and lookahead costs 6 s more the first time it runs (a GPU's one-time work;
        on the H200 of stop 33 every drafted iteration cost-aware timed was its width's first, 165-180
        ms where constant k = 5's took 36 ms, and it took plain steps from then on). Off the CPU (here
        the CPU as if it were not) the first run of each is not timed, so the costs the policy plans
        with are the steady ones; on the CPU, timed, they come out several times too dear (where a
        first run costs what the next do, that loses nothing)."""
        steady = lambda k: 1.0 if k == 0 else 1.2 + 0.06 * k  # noqa: E731
        draft = perturbed_copy(target, 0.1)
        for every_run_timed in (False, True):
            monkeypatch.setattr(cost_aware, "FIRST_RUNS_APART_ON_CPU", not every_run_timed)
            clock = FirstRunsDear(steady, once=6.0)
            outs, expected, steps, policy = decode(target, draft, steady, clock=clock)
            for out in outs:
                assert torch.equal(out.sequences, expected)
            widths = {k for _, k in clock.seen}
            assert len(clock.seen) > 8 and {0, 4} <= widths  # the first runs were charged, at several batch sizes
            costs = policy.cost_model(4)
            off = max(abs(costs[k] / steady(k) - 1.0) for k in widths)
            if every_run_timed:
                assert off > 1.0
            else:
                assert off < 0.05, costs

    def test_an_iteration_in_which_steps_were_compiled_is_not_timed(self, target, monkeypatch):
        """With compiled steps (``compile="all"``, on any device) an iteration that meets a new shape
        compiles it: 10 s more on this fake clock (with ``compile="draft"`` on the bundled pair on a
        CPU, 1.4 s a drafted iteration, and the policy that timed them took plain steps for every
        later request). Those iterations are not timed, so the costs planned with are the steady
        ones (timed, they come out several times too dear: the next test's control). Dynamo's
        capture runs; inductor's code generation is left out (``backend="eager"``)."""
        import functools

        from torch._dynamo.utils import counters

        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
        steady = lambda k: 1.0 if k == 0 else 1.2 + 0.06 * k  # noqa: E731

        class CompilesDear(Ticks):
            def __call__(self) -> float:
                graphs = counters["stats"]["unique_graphs"]
                if graphs != self.graphs:
                    self.graphs, self.compiles = graphs, self.compiles + 1
                    self.now += 10.0
                return super().__call__()

        torch._dynamo.reset()  # a draft of the same shapes compiled by another test would find its graphs made
        clock = CompilesDear(steady)
        clock.graphs, clock.compiles = counters["stats"]["unique_graphs"], 0
        model = copy.deepcopy(target)  # compiling leaves its forward on the model
        outs, expected, steps, policy = decode(model, perturbed_copy(target, 0.1), steady, clock=clock,
                                               decoder_options=dict(static_cache=True, compile="all"))
        for out in outs:
            assert torch.equal(out.sequences, expected)
        assert clock.compiles >= 3
        costs, widths = policy.cost_model(4), policy._fits[bucket_of(4)].weight
        assert max(abs(costs[k] / steady(k) - 1.0) for k in widths) < 0.05, costs

    def test_an_iteration_that_recorded_a_cuda_graph_is_not_timed(self, target, monkeypatch):
        """On a GPU compiled steps (``mode="reduce-overhead"``) record a CUDA graph at a shape's second
        run, after its first traced it. No dynamo graph is made then; dynamo's compile callbacks
        announce the recording. A stand-in for ``torch.compile`` does here what CUDA-graph trees do,
        through torch's own callback handler, on a fake clock: a shape's first call traces (10 s more)
        and its second records (10 s more), the rest replay. With the recording announced, the costs
        planned with are the steady ones; unannounced (what counting dynamo's graphs saw, before
        stop 69), they come out several times too dear."""
        from torch._dynamo.callback import CallbackTrigger, callback_handler

        steady = lambda k: 1.0 if k == 0 else 1.2 + 0.06 * k  # noqa: E731
        for announced in (True, False):
            clock, records = Ticks(steady), []

            def graph_trees(forward, **options):
                runs: dict[tuple, int] = {}

                def replay(**inputs):
                    shape = tuple((name, tuple(v.shape)) for name, v in inputs.items() if isinstance(v, torch.Tensor))
                    runs[shape] = run = runs.get(shape, 0) + 1
                    if run > 2:
                        return forward(**inputs)
                    clock.now += 10.0
                    records.append(run == 2)
                    trigger = CallbackTrigger.DYNAMO if run == 1 else CallbackTrigger.CUDAGRAPH_RECORDING
                    if run == 2 and not announced:
                        return forward(**inputs)
                    with callback_handler.install_callbacks(trigger, "0/0"):
                        return forward(**inputs)

                return replay

            monkeypatch.setattr(torch, "compile", graph_trees)
            model = copy.deepcopy(target)  # compiling leaves its forward on the model
            outs, expected, steps, policy = decode(model, perturbed_copy(target, 0.1), steady, clock=clock,
                                                   decoder_options=dict(static_cache=True, compile="all"))
            for out in outs:
                assert torch.equal(out.sequences, expected)
            assert sum(records) >= 3
            costs, widths = policy.cost_model(4), policy._fits[bucket_of(4)].weight
            off = max(abs(costs[k] / steady(k) - 1.0) for k in widths)
            assert (off < 0.05) if announced else (off > 1.0), costs

    def test_cheap_drafting_with_a_perfect_draft_drafts_long(self, target):
        draft = copy.deepcopy(target)
        outs, expected, steps, policy = decode(target, draft, lambda k: 1.0 + 0.01 * k, probe_rate=0.0, max_k=6)
        for out in outs:
            assert torch.equal(out.sequences, expected)
        assert policy.decision is not None
        widths = [s.draft.width for s in steps[len(steps) // 2 :]]
        assert max(widths) == 6 and sum(w == 6 for w in widths) >= len(widths) / 2


def after_a_plain_step(probe_rate: float):
    """A policy with a fit at batch 1 whose iteration 1, a plain step of 1 s, has just ended:
    ``(policy, fit, state, now)`` with ``state.iteration`` at 2, ready to plan."""
    now = [0.0]
    policy = CostAwareLookahead(clock=lambda: now[0], load_rate=0.0, probe_rate=probe_rate)
    fed(policy, 1, {0: 1.0, 2: 2.0, 4: 3.0}, repeats=1)
    state = fake_state(1)
    policy.begin(state, None)
    policy._pending, policy._drafted = (1, 1, 0, now[0], True, False), False  # iteration 1: a plain step
    policy._drafted_in_request = True  # the draft model has read the prompt (an earlier drafting iteration)
    now[0] += 1.0
    state.iteration = 2
    return policy, policy._fits[1], state, now


def test_the_draft_models_first_read_of_a_request_is_not_the_price_of_resuming():
    """The request's first drafting iteration reads the whole prompt into the draft model (Whisper's
    draft also computes its cross-attention keys there): a once-per-request cost. It is recorded
    neither as k's cost nor as the price of resuming; the next resume after plain steps is."""
    policy, fit, state, now = after_a_plain_step(probe_rate=0.0)
    policy._drafted_in_request = False  # a fresh request: the draft model has read nothing yet
    policy.plan(state, alpha=torch.tensor([0.99]))  # records the plain step; iteration 2 drafts
    k = policy.decision.k
    assert k > 0
    cells = {kk: (fit.weight[kk], fit.mean[kk]) for kk in fit.weight}
    now[0] += fit.costs([k])[k] + 40.0  # the prompt's read: 40 s more
    state.iteration = 3
    policy.plan(state, alpha=torch.tensor([0.99]))
    assert 1 not in policy._resume  # not the price of resuming
    assert {kk: (fit.weight[kk], fit.mean[kk]) for kk in fit.weight} == cells  # nor k's cost
    assert policy._first_read[1] == pytest.approx([1.0, 40.0])  # the first read's own price
    policy._pending, policy._drafted = (3, 1, 0, now[0], True, False), False  # iteration 3: a plain step
    now[0] += 1.0
    state.iteration = 4
    policy.plan(state, alpha=torch.tensor([0.99]))  # iteration 4 drafts again: a resume
    k = policy.decision.k
    now[0] += fit.costs([k])[k] + 4.0
    state.iteration = 5
    policy.plan(state, alpha=torch.tensor([0.99]))
    assert policy._resume[1] == pytest.approx([1.0, 4.0])


def test_the_catch_up_is_the_price_of_resuming():
    """A drafted iteration after a plain one took 4 s more than the fit says k costs: the excess is
    the price of resuming, kept apart (neither k's cell nor the plain steps' takes it), and what the
    policy plans with when the iteration before was a plain step, not after a drafted one."""
    policy, fit, state, now = after_a_plain_step(probe_rate=0.0)
    policy.plan(state, alpha=torch.tensor([0.99]))  # records the plain step (1 s); iteration 2 drafts
    k = policy.decision.k
    assert k > 0
    cells = {kk: (fit.weight[kk], fit.mean[kk]) for kk in fit.weight}
    now[0] += fit.costs([k])[k] + 4.0  # the catch-up adds 4 s
    state.iteration = 3
    policy.plan(state, alpha=torch.tensor([0.99]))  # after a drafted iteration: the fit's own costs
    assert {kk: (fit.weight[kk], fit.mean[kk]) for kk in fit.weight} == cells
    assert policy._resume[1] == pytest.approx([1.0, 4.0])
    assert policy.decision.costs == pytest.approx(fit.costs(list(range(policy.max_k + 1))))
    policy._pending, policy._drafted = None, False  # as if iteration 3 had been a plain step
    state.iteration = 4
    policy.plan(state, alpha=torch.tensor([0.99]))
    warm = fit.costs(list(range(policy.max_k + 1)))
    assert policy.decision.costs == pytest.approx({kk: c + (4.0 if kk else 0.0) for kk, c in warm.items()})


def test_where_drafting_pays_only_without_its_catch_up_the_policy_stays_in_the_mode_it_is_in():
    """Plain steps of 1 s, k = 4 in 3 s at acceptance 0.99 (5 tokens: 1.7 tokens/s), resuming 4 s
    dearer (5 tokens in 7 s: 0.7 tokens/s): out of plain steps it stays plain, while drafting it
    goes on drafting."""
    policy, fit, state, now = after_a_plain_step(probe_rate=0.0)
    policy._resume[1] = [1.0, 4.0]
    policy.plan(state, alpha=torch.tensor([0.99]))
    assert policy.decision.k == 0
    policy._pending, policy._drafted = None, True  # the iteration before drafted
    state.iteration = 5
    policy.plan(state, alpha=torch.tensor([0.99]))
    assert policy.decision.k > 0


def test_the_price_of_resuming_is_spread_over_the_drafted_iterations_it_buys():
    """The catch-up is paid once per return from plain steps, for as many drafted iterations in a row
    as a return has lasted: after returns of 4, the 4 s catch-up of the test above adds 1 s to each,
    and k = 4 (5 tokens in 4 s against 1 token a second) pays out of plain steps too."""
    policy, fit, state, now = after_a_plain_step(probe_rate=0.0)
    policy._resume[1] = [1.0, 4.0]
    policy._stretch[1] = [1.0, 4.0]
    policy.plan(state, alpha=torch.tensor([0.99]))
    warm = fit.costs(list(range(policy.max_k + 1)))
    assert policy.decision.costs == pytest.approx({kk: c + (1.0 if kk else 0.0) for kk, c in warm.items()})
    assert policy.decision.k > 0


def test_only_stretches_that_began_with_a_resume_are_counted():
    """A request's first drafted stretch paid no catch-up and is not counted (on summaries it is long,
    and would make resuming look cheap); a resumed one is, up to the next plain step or the end of
    the request."""
    policy = fed(CostAwareLookahead(load_rate=0.0, probe_rate=0.0), 1, {0: 1.0, 2: 2.0, 4: 3.0}, repeats=1)
    state = fake_state(1)
    policy.begin(state, None)
    state.iteration = 0
    # drafts 3 from the request's start, plain 2, drafts 1 (a resume), plain 1, drafts 2 (a resume)
    for alpha in [0.99, 0.99, 0.99, 0.01, 0.01, 0.99, 0.01, 0.99, 0.99]:
        policy.plan(state, alpha=torch.tensor([alpha]))
        assert (policy.decision.k > 0) == (alpha > 0.5)
        policy._pending = None  # untimed: the fit stays as fed
        state.iteration += 1
    assert policy._stretch[1] == pytest.approx([1.0, 1.0])  # the request's first stretch not counted
    policy.begin(fake_state(1), None)  # the next request: the resumed stretch of 2 ended with the last
    weight, mean = policy._stretch[1]
    assert weight == pytest.approx(policy.decay + 1.0) and mean == pytest.approx((policy.decay * 1 + 2) / weight)
    assert policy._stretch_length(1) == pytest.approx(mean) and policy._stretch_length(4) == 1.0


def test_a_stretch_ends_where_a_confidence_stop_made_the_iteration_plain():
    """A policy whose lookahead is only a cap (draft-confidence) reports the width it drafted through
    ``time_at_width``: an iteration planned as drafting that drafted nothing ends the resumed stretch
    before it; one that was the resume itself is no stretch at all."""
    policy = fed(CostAwareLookahead(load_rate=0.0, probe_rate=0.0), 1, {0: 1.0, 2: 2.0, 4: 3.0}, repeats=1)
    state = fake_state(1)
    policy.begin(state, None)
    state.iteration = 0
    for alpha, width in [(0.99, None), (0.01, None), (0.99, None), (0.99, None), (0.99, 0), (0.01, None),
                         (0.99, 0)]:  # first stretch, plain, a resume of 2 cut by a stop, plain, a resume stopped
        policy.plan(state, alpha=torch.tensor([alpha]))
        if width is not None:
            policy.time_at_width(width)
        policy._pending = None
        state.iteration += 1
    assert policy._stretch[1] == pytest.approx([1.0, 2.0])
    assert policy._run is None


def test_a_probe_in_a_request_that_has_not_drafted_pays_the_draft_models_first_read():
    """Out of plain steps in a request that has not drafted yet, a probe's first drafted iteration
    reads the prompt and every token so far into the draft model (at batch 16 on the bundled pair
    11 plain steps, where a resume costs 1): it waits for credit worth that whole read, not the price
    of resuming, and not a share of it spread over a stretch."""
    def probed(drafted_in_request: bool, drafted: bool = False) -> list[int]:
        policy = fed(CostAwareLookahead(probe_rate=0.5, probe_backoff=1), 1, {0: 10.0, 1: 20.0, 4: 50.0})
        policy._resume[1] = [1.0, 5.0]
        policy._stretch[1] = [1.0, 5.0]  # a resume buys 5 drafted iterations: 1 s of catch-up each
        policy._first_read[1] = [1.0, 40.0]
        policy._drafted_in_request, policy._drafted = drafted_in_request, drafted
        return [i for i in range(30) if policy.choose(1, torch.tensor([0.9]), torch.tensor([100])).probing]

    # k = 1 twice: 20 + 20 + 40 - 2 x 10 = 6 plain steps of price, 12 iterations of credit at rate 0.5
    assert probed(False)[:4] == [11, 12, 24, 25]
    # once the draft model has read the prompt, a probe pays a resume:
    # 20 + 20 + 5 - 2 x 10 = 2.5 plain steps, 5 iterations
    assert probed(True)[:4] == [4, 5, 10, 11]
    # right after a drafted iteration the draft model is up to date: 20 + 20 - 2 x 10 = 2, 4 iterations
    assert probed(True, drafted=True)[0] == 3


def test_an_unpriced_first_read_holds_a_probe_until_a_requests_first_iteration():
    """Where no first read has been timed at this batch size, a probe in a request that has not
    drafted waits, whatever its credit, for a request's first iteration (the draft model then reads
    the prompt alone); once a first read is priced, or once the request has drafted, probes come
    mid-request at their price."""
    def probed(first_read: bool, drafted_in_request: bool = False) -> list[int]:
        policy = fed(CostAwareLookahead(probe_rate=0.5, probe_backoff=1), 16, {0: 10.0, 1: 20.0, 4: 50.0})
        if first_read:
            policy._first_read[bucket_of(16)] = [1.0, 40.0]
        policy._drafted_in_request = drafted_in_request
        seen = []
        for i in range(30):
            policy._iteration = i % 20  # a new request every 20 iterations
            if policy.choose(16, torch.full((16,), 0.9), torch.full((16,), 100)).probing:
                seen.append(i)
                policy._probe_next = None  # only when each probe starts
        return seen

    assert probed(False) == [20]  # credit from iteration 4 on, but the first read is unpriced
    assert probed(True)[:2] == [11, 23]  # 20 + 20 + 40 - 2 x 10 = 6 plain steps at rate 0.5
    assert probed(False, drafted_in_request=True)[0] == 3  # no first read to pay: a resume's price


def test_out_of_plain_steps_drafting_must_beat_them_by_the_resume_margin():
    """In a batch, drafting is taken up only where it beats plain steps by ``resume_margin`` (the
    estimate of the slowest row near break-even errs, and drafting leaves holes that later plain
    steps pay for), and, once taken up, kept while it beats them at all. A lone row has neither
    excuse: no margin."""
    times = {0: 10.0, 1: 14.7, 2: 19.4}  # k = 1 at alpha 0.5: 1.5 tokens in 14.7 s, 2% more per second
    alpha, budget = torch.tensor([0.5, 0.5]), torch.tensor([100, 100])
    policy = fed(CostAwareLookahead(probe_rate=0.0), 2, times)
    decision = policy.choose(2, alpha, budget)
    assert decision.goodput[1] == pytest.approx(1.02 * decision.goodput[0], rel=1e-3)
    assert decision.k == 0  # out of plain steps: 2% is inside the 5% margin
    policy._drafted = True  # the iteration before drafted
    assert policy.choose(2, alpha, budget).k == 1
    policy = fed(CostAwareLookahead(probe_rate=0.0, resume_margin=0.0), 2, times)
    assert policy.choose(2, alpha, budget).k == 1
    policy = fed(CostAwareLookahead(probe_rate=0.0), 1, times)
    assert policy.choose(1, alpha[:1], budget[:1]).k == 1


def test_a_probes_catch_up_is_the_price_of_resuming_too():
    """The same 4 s catch-up after a probe out of plain steps: it is what resuming costs, whoever
    chose it; charged to no cell of the fit."""
    policy, fit, state, now = after_a_plain_step(probe_rate=1.0)
    policy.plan(state, alpha=torch.tensor([0.01]))  # plain steps are best: the probe drafts
    k = policy.decision.k
    assert policy.decision.probing and policy.decision.best_k == 0 and k > 0
    cells = {kk: (fit.weight[kk], fit.mean[kk]) for kk in fit.weight}
    now[0] += fit.costs([k])[k] + 4.0
    state.iteration = 3
    policy.plan(state, alpha=torch.tensor([0.01]))
    assert {kk: (fit.weight[kk], fit.mean[kk]) for kk in fit.weight} == cells
    assert policy._resume[1] == pytest.approx([1.0, 4.0])


class TestAlternatives:
    """First-position alternatives (``Draft.alternatives``) priced: read where the tokens they add are
    worth their measured time, not where they are not, and counted whether read or not."""

    def test_the_ledger_prices_them_per_width_seen_both_ways(self):
        ledger = AlternativesLedger()

        def timed(width, read, seconds, times=3):
            for _ in range(times):
                ledger.add_time(width, read, seconds, 1.0)

        timed(2, True, 3.0)
        assert ledger.price() is None  # width 2 not yet timed without them
        timed(3, False, 1.0)
        assert ledger.price() is None  # nor is any width timed both ways
        timed(2, False, 2.0, times=2)
        assert ledger.price() is None  # twice is not enough: a first forward at a width can be far off
        timed(2, False, 2.0, times=1)
        assert ledger.price() == pytest.approx(1.0)
        timed(3, True, 1.5)  # width 3: 0.5 s, weighted as much as width 2
        assert ledger.price() == pytest.approx(0.75)
        assert ledger.gain() == 0.0
        ledger.add_hits(2, 1.0)
        ledger.add_hits(0, 1.0)
        assert ledger.gain() == pytest.approx(1.0)

    def test_a_price_once_known_stays_known_while_they_are_not_read(self):
        """Three timings each way price a width for good; the means keep ageing. With a decayed count
        instead, the price vanished a few iterations after the policy stopped reading them, and the
        policy read them half the time until it was known again (SmolLM2 at batch 4, stop 26)."""
        ledger = AlternativesLedger()
        for _ in range(3):
            ledger.add_time(2, True, 3.0, 0.9)
            ledger.add_time(2, False, 2.0, 0.9)
        assert ledger.price() == pytest.approx(1.0)
        for _ in range(200):
            ledger.add_time(2, False, 1.5, 0.9)  # the chain alone gets cheaper; they are not read again
        assert ledger.price() == pytest.approx(1.5)
        policy = CostAwareLookahead(clock=lambda: 0.0, probe_rate=0.0)
        policy._ledgers[1] = ledger
        ledger.add_hits(0, 1.0)  # never right: never worth reading
        fed(policy, 1, {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3})
        decision = policy.choose(1, [0.6], [20])
        policy._alt_read = False  # the last iteration did not read them: unpriced, the next one would
        assert [policy._read_alternatives(1, decision) for _ in range(6)] == [False] * 6

    def test_the_choice_weighs_their_tokens_against_their_time_at_the_batchs_rate(self):
        policy = CostAwareLookahead(clock=lambda: 0.0, probe_rate=0.0)
        ledger = policy._ledgers.setdefault(1, AlternativesLedger())
        for _ in range(3):
            ledger.add_time(2, True, 1.2, 1.0)
            ledger.add_time(2, False, 1.0, 1.0)  # they cost 0.2 s an iteration
        ledger.add_hits(1, 1.0)
        ledger.add_hits(0, 1.0)  # and add 0.5 tokens an iteration
        decision = policy.choose(1, [0.6], [20])  # no fit yet: exploring
        assert policy._read_alternatives(1, decision) is policy._alt_read
        fed(policy, 1, {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3})
        decision = policy.choose(1, [0.6], [20])
        rate = decision.goodput[decision.best_k]  # about 1.5 tokens/s: 0.2 s of it is worth 0.3 tokens
        assert 0.2 * rate < 0.5
        assert policy._read_alternatives(1, decision) is True
        ledger.add_hits(0, 0.5)  # fewer hits: 0.25 tokens an iteration
        for _ in range(3):
            ledger.add_time(2, True, 2.0, 1.0)  # and dearer: 0.6 s
        assert ledger.price() * rate > ledger.gain()
        assert policy._read_alternatives(1, decision) is False

    def test_a_probe_tries_the_other_way_and_backs_off_when_it_changes_nothing(self):
        policy = CostAwareLookahead(clock=lambda: 0.0, probe_rate=0.5, probe_backoff=4)
        ledger = policy._ledgers.setdefault(1, AlternativesLedger())
        for _ in range(3):
            ledger.add_time(2, True, 5.0, 1.0)
            ledger.add_time(2, False, 1.0, 1.0)  # far too dear
        fed(policy, 1, {0: 1.0, 1: 1.1, 2: 1.2})
        decision = policy.choose(1, [0.6], [20])
        choices = []
        for _ in range(24):
            policy._alt_credit += policy.probe_rate / policy._alt_backoff  # what each step with them adds
            choices.append(policy._read_alternatives(1, decision))
        assert choices[:2] == [False, True]  # credit 0.5, then 1.0: the probe
        assert sum(choices) == 4 and policy._alt_backoff == 4  # each probe changed nothing: rarer, up to 4x

    @pytest.mark.parametrize("price,reads", [(5.0, False), (0.0, True)])
    def test_in_the_loop_they_are_read_where_they_pay_and_the_output_stays_greedy(self, target, price, reads):
        """A fake clock charges ``price`` seconds more for an iteration that read alternatives. Dear,
        the policy stops reading them but for probes; free, it keeps reading them (the perturbed
        draft's second or third choice is the target's token now and then)."""
        draft = perturbed_copy(target, 0.1)
        now = [0.0]
        policy = CostAwareLookahead(clock=lambda: now[0], probe_rate=1 / 16)
        recorder = Recorder()

        chosen = []  # (the policy's choice, whether the verify read them) where the draft had some

        class Charge(Recorder):
            def on_step(self, state, step):
                now[0] += 1.0 + 0.1 * step.draft.width + (price if step.siblings else 0.0)
                if step.draft.alternatives is not None:
                    chosen.append((policy.decision.alternatives, step.siblings > 0))

        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft, alternatives=3), policy=policy,
                                     verifier=GreedyVerifier(), observers=[recorder, Charge()])
        input_ids, mask = left_padded(PROMPTS[:1])
        expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        for _ in range(6):
            out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
            assert torch.equal(out.sequences, expected)
        later = recorder.steps[len(recorder.steps) // 2 :]
        assert sum(s.draft.width > 0 for s in later) >= 0.8 * len(later)  # drafting itself still pays
        with_them = [s for s in recorder.steps if s.draft.alternatives is not None]
        read = [s.siblings > 0 for s in with_them[len(with_them) // 2 :]]
        assert all(decided == done for decided, done in chosen)  # the verify reads them as the policy chose
        assert policy._ledgers[1].price() == pytest.approx(price, abs=1e-9)
        if reads:
            assert policy._ledgers[1].gain() > 0
            assert sum(read) >= 0.8 * len(read)
        else:
            assert sum(read) <= 0.2 * len(read)

    def test_a_batch_whose_rows_finish_apart_behind_prompt_lookup(self, target):
        """Rows leave the batch at different iterations (their caches cut, those iterations untimed):
        the policy's bookkeeping of the alternatives follows the batch size."""
        from specdec.drafters import FallbackDrafter, NGramDrafter

        draft = perturbed_copy(target, 0.1)
        for price in (0.0, 5.0):
            now = [0.0]
            policy = CostAwareLookahead(clock=lambda: now[0], probe_rate=1 / 4)

            class Charge(Recorder):
                def on_step(self, state, step):
                    super().on_step(state, step)
                    now[0] += 1.0 + 0.1 * step.draft.width + (price if step.siblings else 0.0)

            recorder = Charge()
            drafter = FallbackDrafter(NGramDrafter(max_ngram=2, min_ngram=1), ModelDrafter(draft, alternatives=3))
            decoder = SpeculativeDecoder(target=target, drafter=drafter, policy=policy, verifier=GreedyVerifier(),
                                         observers=[recorder])
            input_ids, mask = left_padded(PROMPTS)
            expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
            for budget in (NEW_TOKENS, NEW_TOKENS // 2, NEW_TOKENS):
                out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=budget, do_sample=False)
                assert torch.equal(out.sequences, expected[:, : input_ids.shape[1] + budget])
            steps = recorder.steps
            assert len({s.rows_host.shape[0] for s in steps}) > 1  # the batch shrank
            assert any(s.siblings for s in steps)

    def test_an_untimed_iteration_with_them_is_forgotten(self):
        """An iteration at batch 4 read alternatives, then rows left (a cut: that iteration is not
        timed), and the next, at batch 1, was prompt lookup's with none: its time is k's, and what
        the batch-4 iteration read does not follow it (a batch-4 run of SmolLM2 once failed here)."""
        policy = CostAwareLookahead(clock=lambda: 0.0)
        state = fake_state(4)
        policy.begin(state, None)
        policy.lookahead(state)
        draft = Draft(tokens=torch.zeros(4, 4, dtype=torch.long), lengths=torch.full((4,), 4),
                      alternatives=torch.zeros(4, 3, dtype=torch.long))
        policy.on_step(state, attrs.evolve(step_of([0, 1, 2, 3], [4] * 4, [1] * 4), draft=draft, siblings=3))
        state = fake_state(1)
        state.row_cuts, state.iteration = 1, 2
        policy.lookahead(state)
        policy.on_step(state, step_of([0], [2], [2]))
        state.iteration = 3
        policy.lookahead(state)  # records iteration 2 as k's alone
        assert sum(policy._fits[1].weight.values()) == 1.0
        assert 1 not in policy._ledgers

    def test_always_reads_them_whenever_the_draft_has_them(self, target):
        draft = perturbed_copy(target, 0.1)
        recorder = Recorder()
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft, alternatives=2),
                                     policy=CostAwareLookahead(alternatives="always"), observers=[recorder])
        input_ids, mask = left_padded(PROMPTS)
        out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(out.sequences, expected)
        with_them = [s for s in recorder.steps if s.draft.alternatives is not None]
        assert with_them and all(s.siblings == 2 for s in with_them)


class TestMemory:
    """``memory``: what the policy learned, in a file that the next process starts from."""

    @staticmethod
    def learned_something() -> CostAwareLookahead:
        """A policy with fits at batch 1 and 4, acceptance counted, a price of resuming, a ledger."""
        policy = fed(fed(CostAwareLookahead(per_position=True), 1, {0: 1.0, 2: 1.5, 4: 2.2}), 4, {0: 2.0, 1: 3.1, 3: 4.4})
        policy.begin(fake_state(4), None)
        policy.requested = torch.tensor([3, 3, 3, 3])
        policy.on_step(None, step_of([0, 1, 2, 3], drafted=[3, 3, 3, 3], accepted=[3, 1, 0, 2]))
        policy._resume[1] = [1.0, 0.25]
        ledger = policy._ledgers.setdefault(1, AlternativesLedger())
        ledger.add_time(2, True, 1.6, policy.decay)
        ledger.add_hits(1.0, policy.decay)
        policy._backoff, policy._probe_credit, policy._probe_moved = 4, 0.75, (2, 5)
        return policy

    def test_what_it_learned_survives_its_file_and_decides_alike(self):
        import json

        policy = self.learned_something()
        fresh = CostAwareLookahead(per_position=True)
        assert fresh.restore(json.loads(json.dumps(policy.learned("here"))), "here") is True
        assert fresh.learned("here") == policy.learned("here")
        for batch, alpha in ((1, [0.7]), (4, [0.6, 0.8, 0.5, 0.9]), (3, [0.6, 0.7, 0.8])):
            budget = [20] * batch
            assert fresh.choose(batch, alpha, budget) == policy.choose(batch, alpha, budget)
        assert fresh._fits[1].costs([0, 1, 2, 3]) == policy._fits[1].costs([0, 1, 2, 3])
        assert fresh.choose(1, [0.7], [20]).probing is False  # costs known: no exploring

    def test_costs_from_another_machine_are_left_and_the_acceptance_is_taken(self):
        policy = self.learned_something()
        fresh = CostAwareLookahead(per_position=True)
        assert fresh.restore(policy.learned("a Zen 3, 1 thread"), "a Xeon, 1 thread") is False
        assert fresh._fits == {} and fresh._resume == {} and fresh._ledgers == {} and fresh._backoff == 1
        assert fresh._probe_credit == 0.0
        assert fresh.pooled_alpha() == policy.pooled_alpha() != CostAwareLookahead().pooled_alpha()
        assert fresh.choose(1, [0.7], [20]).probing is True  # it explores this machine's costs

    def test_costs_a_gpu_remembered_with_its_first_runs_timed_are_left(self, monkeypatch):
        """Before stop 68 a GPU's first runs were timed as what k costs; its memory's costs (not its
        acceptance) are left, while the CPU's memory stays valid."""
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
        state = fake_state(1)
        for device, taken in (("cuda", False), ("cpu", True)):
            state.device = torch.device(device)
            where = "NVIDIA H200" if device == "cuda" else cpu_name()
            before = f"{where}|{device}|torch {torch.__version__}|{torch.get_num_threads()} threads"  # stop 67's
            fresh = CostAwareLookahead(per_position=True)
            assert fresh.restore(self.learned_something().learned(before), cost_aware._machine(state)) is taken

    @pytest.mark.parametrize("damage, message", [
        (lambda d: d.update(format=0), "format 0, expected 1"),
        (lambda d: d.update(max_k=4), "max_k = 4, this one has 8"),
        (lambda d: d["acceptance"].update(pool=[1.0, float("nan")]), "nan is not a finite number"),
        (lambda d: d["acceptance"].update(kept=[0.0]), "kept need 8 positions"),
        (lambda d: d["costs"]["fits"]["1"]["cells"].append([9, 1.0, 1.0, 1.0]), "k = 9 is outside 0..8"),
        (lambda d: d["costs"].pop("resume"), "KeyError: 'resume'"),
        (lambda d: d["costs"]["alternatives"]["1"]["cells"][0].__setitem__(1, "yes"), r"is not \[width, read"),
    ])
    def test_a_record_that_is_not_its_memory_is_refused_and_changes_nothing(self, damage, message):
        data = self.learned_something().learned("here")
        damage(data)
        fresh = CostAwareLookahead(per_position=True)
        before = fresh.learned("here")
        with pytest.raises(ValueError, match=message):
            fresh.restore(data, "here")
        assert fresh.learned("here") == before

    @pytest.mark.parametrize("value, message", [("", "memory must be the path of a JSON file"),
                                                (3, "option 'memory' must be str | None, got 3")])
    def test_a_memory_that_is_no_path_is_a_config_error(self, value, message):
        with pytest.raises(ConfigError, match=message):
            get_registry().create("policy", "cost-aware", {"memory": value})

    def test_a_folder_is_no_memory(self, tmp_path):
        with pytest.raises(ConfigError, match="memory must be a file, not the folder"):
            get_registry().create("policy", "cost-aware", {"memory": str(tmp_path)})

    def test_a_new_process_starts_where_the_last_one_ended_and_decodes_exactly(self, target, tmp_path):
        """Two decoders, as two calls of ``specdec generate``: the second's policy reads the file the
        first wrote after its request, so it does not explore again; both outputs are the target's."""
        memory = tmp_path / "policies" / "cost-aware.json"
        draft = perturbed_copy(target, 0.05)
        input_ids, mask = left_padded(PROMPTS)
        expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        policies = []
        for _ in range(2):
            clock = Ticks(lambda k: 1.0 + 0.05 * k)
            policy = CostAwareLookahead(clock=clock, memory=str(memory))
            clock.policy = policy
            decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft), policy=policy, verifier=GreedyVerifier())
            out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
            assert torch.equal(out.sequences, expected)
            assert memory.is_file() and not list(memory.parent.glob(".*"))  # renamed into place, no scratch left
            policies.append(policy)
        first, second = policies
        assert second._pool != [0.0, 0.0] and second._pool != first._pool  # read, then counted on
        assert second._fits[bucket_of(4)].changes > first._fits[bucket_of(4)].changes  # its timings went on from the first's

    def test_the_first_request_of_a_fresh_policy_explores_and_a_remembered_one_does_not(self, target, tmp_path):
        memory = tmp_path / "cost-aware.json"
        draft = perturbed_copy(target, 0.05)
        input_ids, mask = left_padded(PROMPTS)
        choices = []
        for _ in range(2):
            clock = Ticks(lambda k: 1.0 + 0.05 * k)
            policy = CostAwareLookahead(clock=clock, memory=str(memory), probe_rate=0.0)
            clock.policy = policy
            seen = []
            original = policy.choose

            def choose(*args, _original=original, _seen=seen, **kwargs):
                _seen.append(_original(*args, **kwargs))
                return _seen[-1]

            policy.choose = choose
            SpeculativeDecoder(target=target, drafter=ModelDrafter(draft), policy=policy).generate(
                input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
            choices.append(seen)
        assert choices[0][0].probing and choices[0][0].costs is None  # nothing known: explore
        assert not choices[1][0].probing and choices[1][0].costs is not None

    def test_a_policy_built_anew_from_its_file_for_every_request_decides_as_one_kept_across_them(self, target, tmp_path):
        """What ``specdec generate`` does call by call, against a server that keeps its decoder: with
        the same (fake) costs, every lookahead of every request is the same."""
        draft = perturbed_copy(target, 0.08)
        requests = [left_padded(PROMPTS), left_padded(PROMPTS[:1]), left_padded(PROMPTS[1:3]), left_padded(PROMPTS[2:])]

        def widths_of(policy, input_ids, mask):
            recorder = Recorder()
            SpeculativeDecoder(target=target, drafter=ModelDrafter(draft), policy=policy, observers=[recorder]).generate(
                input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
            return [step.draft.width for step in recorder.steps]

        def cost(k):
            return 1.0 + 0.3 * k

        kept_clock = Ticks(cost)
        kept = CostAwareLookahead(clock=kept_clock, probe_rate=0.2)
        kept_clock.policy = kept
        memory = tmp_path / "cost-aware.json"
        for input_ids, mask in requests:
            clock = Ticks(cost)
            built = CostAwareLookahead(clock=clock, probe_rate=0.2, memory=str(memory))
            clock.policy = built
            assert widths_of(built, input_ids, mask) == widths_of(kept, input_ids, mask)
        assert kept._probes > 0  # the probes' schedule carried across the calls too

    def test_a_damaged_file_is_warned_of_then_replaced(self, target, tmp_path):
        import json

        from specdec.errors import PolicyMemoryWarning

        memory = tmp_path / "cost-aware.json"
        memory.write_text("{not json")
        policy = CostAwareLookahead(memory=str(memory))
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(perturbed_copy(target, 0.05)), policy=policy)
        input_ids, mask = left_padded(PROMPTS)
        with pytest.warns(PolicyMemoryWarning, match=r"ignoring its memory .*cost-aware.json.*starting from nothing"):
            decoder.generate(input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        assert json.loads(memory.read_text())["format"] == 1

    def test_a_memory_that_cannot_be_written_is_warned_of_and_the_request_returns(self, target, tmp_path):
        from specdec.errors import PolicyMemoryWarning

        blocker = tmp_path / "a-file"
        blocker.write_text("")
        policy = CostAwareLookahead(memory=str(blocker / "cost-aware.json"))  # its folder would be a file
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(perturbed_copy(target, 0.05)), policy=policy)
        input_ids, mask = left_padded(PROMPTS)
        with pytest.warns(PolicyMemoryWarning, match="cannot write its memory"):
            out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        assert out.sequences.shape[0] == len(PROMPTS)
