"""Policies ``constant`` (its batch-size cap), ``draft-confidence`` and ``target-confidence``: their
decisions on hand-made inputs, the rule they enforce inside the loop, and greedy exactness with them."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from specdec import ConfigError, SpeculativeDecoder, Step, Verdict
from specdec.core.types import Draft
from specdec.drafters import ModelDrafter
from specdec.plugins import get_registry
from specdec.policies import ConstantLookahead, DraftConfidenceLookahead, TargetConfidenceLookahead
from specdec.policies.cost_aware import CostFit, bucket_of
from specdec.policies.draft_confidence import CostStop
from specdec.verifiers import GreedyVerifier

from .conftest import Recorder, drafts_and_budgets, left_padded, perturbed_copy, tiny_llama

VOCAB = 32
PROMPTS = [[1, 2, 3, 1, 2], [4, 5], [6, 7, 8, 9, 10, 11, 6, 7], [12]]  # left-padded into one batch
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def target():
    return tiny_llama(20, vocab=VOCAB, layers=2, dtype=torch.float64, init=0.3)


@pytest.fixture(scope="module")
def draft_model(target):
    return perturbed_copy(target, 0.1)  # accepts some drafts, rejects more



def run(target, draft_model, policy):
    """Greedy specdec and the target's own greedy output on the same left-padded batch."""
    recorder = Recorder()
    decoder = SpeculativeDecoder(
        target=target, drafter=ModelDrafter(draft_model), policy=policy, verifier=GreedyVerifier(), observers=[recorder]
    )
    input_ids, mask = left_padded(PROMPTS)
    out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert 0 < out.stats.accepted < out.stats.drafted  # exactness is tested across kept and rejected drafts
    return out, expected, recorder.steps


def make_step(rows, target_probs) -> Step:
    """A Step carrying only what confidence policies read (rows and the target's probabilities)."""
    batch = len(rows)
    zeros = torch.zeros(batch, dtype=torch.long)
    probs = torch.tensor(target_probs, dtype=torch.float32)
    return Step(
        iteration=0,
        rows_host=torch.tensor(rows),
        draft=Draft.empty(batch, torch.device("cpu")),
        verdict=Verdict(accepted=zeros, next_token=zeros, target_probs=probs),
        drafted_host=zeros,
        accepted_host=zeros,
        appended_host=zeros + 1,
        finished_host=torch.zeros(batch, dtype=torch.bool),
        appended_tokens=zeros[:, None],
        target_probs_host=probs,
    )


def stop_state(batch: int):
    """What ``CostStop`` reads of a DecodeState."""
    return SimpleNamespace(batch_size=batch, active=batch, rows_host=torch.arange(batch), iteration=1, row_cuts=0,
                           device=torch.device("cpu"), progress_host=lambda: ([0] * batch, [100] * batch))


class WidthClock:
    """A fake clock for ``CostStop``'s planner, read once per lookahead: the iteration that just
    ended lasted ``cost(width)`` for the width it drafted."""

    def __init__(self, policy, cost):
        self.policy, self.cost, self.now = policy, cost, 0.0

    def __call__(self) -> float:
        pending = self.policy._stop.planner._pending
        self.now += self.cost(pending[2] if pending is not None else 0)
        return self.now


def fed_stop(times: dict[int, float], batch: int = 1) -> CostStop:
    """A ``CostStop`` (up to 6 drafts) whose planner has seen iterations of these widths take these
    seconds at ``batch`` rows."""
    stop = CostStop(6, clock=lambda: 0.0)
    stop.begin(stop_state(batch), None)
    fit = stop.planner._fits.setdefault(bucket_of(batch), CostFit(log_batch=math.log2(batch)))
    for _ in range(3):
        for width, seconds in times.items():
            fit.add(width, seconds, 1.0)
    return stop


def step_with_width(rows, width: int) -> Step:
    """A Step whose draft is ``width`` columns wide, every row's draft rejected at once."""
    batch = len(rows)
    zeros = torch.zeros(batch, dtype=torch.long)
    return Step(
        iteration=1,
        rows_host=torch.tensor(rows),
        draft=Draft(tokens=torch.zeros(batch, width, dtype=torch.long), lengths=zeros + width),
        verdict=Verdict(accepted=zeros, next_token=zeros),
        drafted_host=zeros + width,
        accepted_host=zeros,
        appended_host=zeros + 1,
        finished_host=torch.zeros(batch, dtype=torch.bool),
        appended_tokens=zeros[:, None],
    )


class TestConstantBatchCap:
    """``constant`` with ``max_batch``: plain target steps while more rows than that are decoding."""

    def test_decisions(self):
        policy = ConstantLookahead(k=3, max_batch=2)
        assert policy.lookahead(SimpleNamespace(active=3)).tolist() == [0, 0, 0]
        assert policy.lookahead(SimpleNamespace(active=2)).tolist() == [3, 3]
        assert ConstantLookahead(k=3).lookahead(SimpleNamespace(active=64)).tolist() == [3] * 64

    @pytest.mark.parametrize("value", [0, -1, "two", True, 1.5])
    def test_invalid_caps_name_the_field(self, value):
        with pytest.raises(ConfigError, match="max_batch"):
            get_registry().create("policy", "constant", {"max_batch": value})

    def test_in_the_loop_the_batch_drafts_once_rows_have_left_and_output_is_greedy(self, target, draft_model):
        input_ids, mask = left_padded(PROMPTS)
        plain = target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        # An eos that the first row says early and the others later or never: rows leave one by one.
        first_new = plain[0, input_ids.shape[1]:].tolist()
        eos = next(t for t in first_new[2:] if all(t not in row[input_ids.shape[1]:][:6].tolist() for row in plain[1:]))
        expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                   eos_token_id=eos, pad_token_id=0)
        recorder = Recorder()
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft_model),
                                     policy=ConstantLookahead(k=3, max_batch=3), verifier=GreedyVerifier(),
                                     observers=[recorder])
        out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                               eos_token_id=eos, pad_token_id=0)
        assert torch.equal(out.sequences, expected)
        sizes = [(len(step.rows_host), int(step.drafted_host.sum())) for step in recorder.steps]
        assert any(rows > 3 for rows, _ in sizes) and all(drafted == 0 for rows, drafted in sizes if rows > 3)
        assert any(drafted > 0 for rows, drafted in sizes if rows <= 3), sizes


class TestDraftConfidence:
    """``draft-confidence``: stop a row after a draft token below ``threshold``."""

    def test_decisions(self):
        policy = DraftConfidenceLookahead(threshold=0.4, max_tokens=7)
        state = SimpleNamespace(active=4)
        assert policy.lookahead(state).tolist() == [7, 7, 7, 7]
        keep = policy.continue_drafting(state, 0, torch.zeros(4), torch.tensor([0.9, 0.39, 0.4, 0.0]), None)
        assert keep.tolist() == [True, False, True, False]
        assert policy.continue_drafting(state, 0, torch.zeros(4), None, None) is None

    @pytest.mark.parametrize("options,field", [({"threshold": 1.5}, "threshold"), ({"max_tokens": 0}, "max_tokens"), ({"threshold": "high"}, "threshold")])
    def test_invalid_options_name_the_field(self, options, field):
        with pytest.raises(ConfigError, match=field):
            get_registry().create("policy", "draft-confidence", options)

    def test_in_the_loop_rows_stop_after_an_unsure_token_and_output_is_greedy(self, target, draft_model):
        threshold, max_tokens = 0.3, 6
        out, expected, steps = run(target, draft_model, DraftConfidenceLookahead(threshold=threshold, max_tokens=max_tokens))
        assert torch.equal(out.sequences, expected)
        stopped_early = 0
        for step, b, allowed in drafts_and_budgets(steps, max_tokens, NEW_TOKENS):
            probs = step.draft.token_probs[b, : int(step.drafted_host[b])]
            assert bool((probs[:-1] >= threshold).all()), "a row kept drafting after an unsure token"
            if len(probs) < allowed:
                stopped_early += 1
                assert float(probs[-1]) < threshold, "a row stopped after a confident token"
        assert stopped_early > 0


class TestTargetConfidence:
    """``target-confidence``: a plain target step where the target was unsure of its last token."""

    def test_decisions(self):
        policy = TargetConfidenceLookahead(threshold=0.5, k=3)
        state = SimpleNamespace(batch_size=4, rows_host=torch.arange(4), active=4)
        policy.begin(state, None)
        assert policy.lookahead(state).tolist() == [3, 3, 3, 3]  # nothing verified yet
        policy.on_step(state, make_step([0, 1, 2, 3], [0.9, 0.1, 0.5, 0.49]))
        assert policy.lookahead(state).tolist() == [3, 0, 3, 0]
        # Rows addressed by original id: row 2 finished, row 3 verified again.
        state.rows_host, state.active = torch.tensor([0, 1, 3]), 3
        policy.on_step(state, make_step([3], [0.8]))
        assert policy.lookahead(state).tolist() == [3, 0, 3]

    def test_draft_threshold_stops_drafting(self):
        state = SimpleNamespace(active=2)
        assert TargetConfidenceLookahead().continue_drafting(state, 0, None, torch.tensor([0.1, 0.9]), None) is None
        policy = TargetConfidenceLookahead(draft_threshold=0.5)
        assert policy.continue_drafting(state, 0, None, torch.tensor([0.1, 0.9]), None).tolist() == [False, True]

    @pytest.mark.parametrize("options,field", [({"threshold": -0.1}, "threshold"), ({"k": 0}, "k"), ({"draft_threshold": 2}, "draft_threshold")])
    def test_invalid_options_name_the_field(self, options, field):
        with pytest.raises(ConfigError, match=field):
            get_registry().create("policy", "target-confidence", options)

    @pytest.mark.parametrize("draft_threshold", [None, 0.3])
    def test_in_the_loop_unsure_rows_take_target_steps_and_output_is_greedy(self, target, draft_model, draft_threshold):
        threshold, k = 0.2, 4
        policy = TargetConfidenceLookahead(threshold=threshold, k=k, draft_threshold=draft_threshold)
        out, expected, steps = run(target, draft_model, policy)
        assert torch.equal(out.sequences, expected)
        last = {}  # original row -> target's p of its last committed token
        plain = drafting = 0
        for step in steps:
            for b, row in enumerate(step.rows_host.tolist()):
                drafted = int(step.drafted_host[b])
                if row in last and last[row] < threshold:
                    assert drafted == 0
                    plain += 1
                elif drafted:
                    drafting += 1
                last[row] = float(step.target_probs_host[b])
        assert plain > 0 and drafting > 0


class TestAutoThresholds:
    """``threshold = "auto"``: decisions from online calibration and measured cost, output still greedy."""

    @pytest.mark.parametrize("make", [
        lambda: DraftConfidenceLookahead(threshold="auto", max_tokens=6),
        lambda: TargetConfidenceLookahead(threshold="auto", k=4),
    ])
    def test_in_the_loop_output_is_greedy_and_calibration_learns(self, target, draft_model, make):
        policy = make()
        # One request: on tiny models, real timings may (rightly) stop drafting altogether after it.
        out, expected, steps = run(target, draft_model, policy)
        assert torch.equal(out.sequences, expected)
        calibration = policy._stop.calibration if hasattr(policy, "_stop") and policy._stop else policy._calibration
        assert float(calibration.seen.sum()) > 0
        assert 0 < float(calibration.pooled()) < 1

    def test_auto_draft_confidence_stops_the_whole_batch_together(self, target, draft_model):
        policy = DraftConfidenceLookahead(threshold="auto", max_tokens=6)
        policy._stop = CostStop(6, clock=WidthClock(policy, lambda width: 10.0 + width))  # drafting pays
        run(target, draft_model, policy)
        out, expected, steps = run(target, draft_model, policy)
        for step in steps:  # every row drafts the same width unless capped by its budget
            drafted = step.drafted_host[step.drafted_host > 0]
            if drafted.numel() > 1 and int(step.draft.width) < 6:
                assert int(drafted.min()) >= 1

    def test_calibration_table(self):
        from specdec.policies.cost_aware import Calibration

        calibration = Calibration(edges=(0.5,), strength=0.0)
        calibration.to("cpu")
        predicted = torch.tensor([[0.1, 0.9, 0.9], [0.2, 0.8, 0.3]])
        accepted = torch.tensor([[True, True, False], [False, False, False]])
        seen = torch.tensor([[True, True, True], [True, False, False]])
        calibration.add(predicted, accepted, seen)
        assert calibration.estimate(torch.tensor([0.0, 0.99])).tolist() == pytest.approx([0.5, 0.5])
        calibration.add(torch.tensor([0.9]), torch.tensor([True]), torch.tensor([True]))
        assert calibration.estimate(torch.tensor([0.7])).tolist() == pytest.approx([2 / 3])

    def test_keep_drafting_rule(self):
        stop = fed_stop({0: 9.0, 1: 11.0, 2: 12.0, 3: 13.0})  # T = 10 + w when drafting
        state = stop_state(1)
        assert stop.lookahead(state).tolist() == [6]
        # Nothing calibrated: every q reads as the prior 0.5. One more column adds 0.5 * 0.5 tokens
        # for 1 s on top of 11 s holding 1.5 tokens: 1.75 / 12 >= 1.5 / 11.
        assert bool(stop.keep(state, 0, torch.tensor([0.05]))[0])
        # Calibrated: drafts at q < 0.1 are accepted 1 time in 20; 1.1 tokens in 11 s, 0.01 more
        # for 1 s more does not pay.
        stop.calibration.add(torch.full((20,), 0.05), torch.arange(20) == 0, torch.ones(20, dtype=torch.bool))
        stop.lookahead(state)
        assert not bool(stop.keep(state, 0, torch.tensor([0.05]))[0])

    def test_no_draft_at_all_where_plain_steps_pay_more(self):
        # A plain step takes 5 s, the cheapest draft 11 s: at the prior's acceptance of 0.5 no
        # width commits tokens faster than 1 per 5 s.
        stop = fed_stop({0: 5.0, 1: 11.0, 2: 12.0}, batch=4)
        assert stop.lookahead(stop_state(4)).tolist() == [0, 0, 0, 0]

    def test_iterations_are_timed_by_the_width_drafted(self):
        now = [0.0]
        stop = CostStop(6, clock=lambda: now[0])
        state = stop_state(1)
        stop.begin(state, None)
        # Each iteration asks for up to 6 and the confidence stops the draft at 2. The first one that
        # drafts after none did is not recorded (it also reads what the drafter sat out).
        for iteration, seconds in [(1, 0.0), (2, 3.0)]:
            now[0], state.iteration = seconds, iteration
            assert stop.lookahead(state).tolist() == [6]
            stop.on_step(state, step_with_width([0], 2), None)
        now[0], state.iteration = 7.0, 3
        stop.lookahead(state)
        assert stop.planner._fits[bucket_of(1)].mean == {2: 4.0}

    def test_in_the_loop_dear_drafts_become_plain_steps(self, target, draft_model):
        policy = DraftConfidenceLookahead(threshold="auto", max_tokens=6)
        policy._stop = CostStop(6, clock=WidthClock(policy, lambda width: 5.0 + width if width else 1.0))
        recorder = Recorder()
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft_model), policy=policy,
                                     verifier=GreedyVerifier(), observers=[recorder])
        input_ids, mask = left_padded(PROMPTS)
        out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(out.sequences, expected)
        plain = [step.draft.width == 0 for step in recorder.steps]
        assert any(not p for p in plain[:2]) and sum(plain) > len(plain) / 2

    @pytest.mark.parametrize("name", ["draft-confidence", "target-confidence"])
    def test_other_strings_are_config_errors(self, name):
        with pytest.raises(ConfigError, match="threshold"):
            get_registry().create("policy", name, {"threshold": "automatic"})


def test_the_batch_cap_is_read_from_a_plugins_toml(tmp_path):
    from specdec.config import SpecdecConfig

    toml = tmp_path / "plugins.toml"
    toml.write_text('[target]\nmodel = "unused"\n[drafter]\nuse = "ngram"\n[policy]\nuse = "constant"\nk = 4\nmax_batch = 4\n')
    _, policy, _, _ = SpecdecConfig.from_toml(toml).build_components()
    assert (policy.k, policy.max_batch) == (4, 4)
    toml.write_text('[target]\nmodel = "unused"\n[drafter]\nuse = "ngram"\n[policy]\nuse = "constant"\nmax_batch = 0\n')
    with pytest.raises(ConfigError, match=r"plugins.toml.*'max_batch' must be >= 1"):
        SpecdecConfig.from_toml(toml).build_components()


def test_the_default_policy_is_cost_aware_and_exact(target, draft_model, tmp_path):
    """Neither a decoder built in Python nor a config without [policy] names a policy: both get
    cost-aware, whose k follows timings; greedy output stays the target's whatever it chooses."""
    from specdec.config import SpecdecConfig
    from specdec.policies import CostAwareLookahead

    decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft_model))
    assert isinstance(decoder.policy, CostAwareLookahead)
    input_ids, mask = left_padded(PROMPTS)
    for _ in range(2):  # the second request starts from what the first measured
        out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(out.sequences, expected)
    config = tmp_path / "plugins.toml"
    config.write_text('[target]\nmodel = "target"\n\n[drafter]\nuse = "ngram"\n')
    spec = SpecdecConfig.from_toml(config)
    assert spec.policy.use == "cost-aware" and spec.policy.options == {}
    assert isinstance(spec.build_components()[1], CostAwareLookahead)
