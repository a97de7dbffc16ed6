"""The hot path: stopped rows masked on the device instead of a host sync per draft position, exact
on the CPU, and (on a GPU) one device sync per iteration in all."""

from __future__ import annotations

import pytest
import torch

from specdec import ConfigError, SpeculativeDecoder
from specdec.decoding.ops import syncs_outside_commit
from specdec.drafters import ModelDrafter
from specdec.observers import PhaseTimes
from specdec.plugins import get_registry
from specdec.policies import CostAwareLookahead, DraftConfidenceLookahead
from specdec.verifiers import GreedyVerifier

from .conftest import Recorder, drafts_and_budgets, left_padded, perturbed_copy, tiny_llama

VOCAB = 32
PROMPTS = [[1, 2, 3, 1, 2], [4, 5], [6, 7, 8, 9, 10, 11, 6, 7], [12]]  # ragged, left-padded
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def target():
    return tiny_llama(20, vocab=VOCAB, layers=2, dtype=torch.float64, init=0.3)


@pytest.fixture(scope="module")
def draft_model(target):
    return perturbed_copy(target, 0.1)


def decode(target, draft_model, policy, early_exit, device="cpu"):
    recorder = Recorder()
    decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft_model), policy=policy,
                                 verifier=GreedyVerifier(), observers=[recorder], draft_early_exit=early_exit)
    input_ids, mask = left_padded(PROMPTS)
    out = decoder.generate(input_ids.to(device), attention_mask=mask.to(device), max_new_tokens=NEW_TOKENS)
    return out, recorder.steps


class TestDraftMask:
    """Rows a policy stops are masked on the device; the loop need not end early to be exact."""

    @pytest.mark.parametrize("threshold", [0.3, "auto"])
    def test_masked_rows_stay_exact_on_a_ragged_batch(self, target, draft_model, threshold):
        max_tokens = 6
        input_ids, mask = left_padded(PROMPTS)
        expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        out, steps = decode(target, draft_model, DraftConfidenceLookahead(threshold=threshold, max_tokens=max_tokens), False)
        assert torch.equal(out.sequences, expected)
        assert 0 < out.stats.accepted < out.stats.drafted
        stopped = sum(int(step.drafted_host[b]) < allowed for step, b, allowed in drafts_and_budgets(steps, max_tokens, NEW_TOKENS))
        assert stopped > 0, "no row was stopped by the policy: the mask path was not exercised"
        # The loop ran past the point where every row had stopped: the draft is wider than any row's
        # draft (with an early exit the width would equal the longest).
        assert any(step.draft.width > int(step.drafted_host.max()) for step in steps)

    def test_early_exit_ends_the_draft_at_the_longest_row(self, target, draft_model):
        policy = DraftConfidenceLookahead(threshold=0.3, max_tokens=6)
        masked, _ = decode(target, draft_model, policy, False)
        out, steps = decode(target, draft_model, DraftConfidenceLookahead(threshold=0.3, max_tokens=6), True)
        assert torch.equal(out.sequences, masked.sequences)
        assert all(step.draft.width == int(step.drafted_host.max()) for step in steps if step.draft.width)
        assert out.stats.draft_calls < masked.stats.draft_calls

    def test_early_exit_is_decided_by_device_by_default(self, target, draft_model):
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft_model))
        input_ids, mask = left_padded(PROMPTS)
        state = decoder.prepare(input_ids, mask, max_new_tokens=2)
        decoder.decode(state)
        assert state.draft_early_exit is True  # a CPU: the sync is free

    def test_a_bad_value_is_a_config_error(self, target, draft_model):
        with pytest.raises(ConfigError, match="draft_early_exit"):
            SpeculativeDecoder(target=target, drafter=ModelDrafter(draft_model), draft_early_exit="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.set_sync_debug_mode)")
class TestOneSyncPerIteration:
    """On a GPU every phase but the commit runs without a device sync (sync debug mode 'error')."""

    @pytest.mark.parametrize("choice", ["draft-confidence", "cost-aware with alternatives"])
    def test_an_iteration_syncs_only_in_the_commit(self, target, draft_model, choice):
        device = torch.device("cuda")
        gpu_target = tiny_llama(20, vocab=VOCAB, layers=2, dtype=torch.float32, init=0.3).to(device)
        gpu_draft = perturbed_copy(tiny_llama(20, vocab=VOCAB, layers=2, dtype=torch.float32, init=0.3), 0.1).to(device)
        if choice == "draft-confidence":
            drafter, policy = ModelDrafter(gpu_draft), DraftConfidenceLookahead(threshold=0.3, max_tokens=6)
        else:  # the alternatives' hits are counted on the device and read a step later, with no sync
            drafter, policy = ModelDrafter(gpu_draft, alternatives=3), CostAwareLookahead()
        decoder = SpeculativeDecoder(target=gpu_target, drafter=drafter, policy=policy, verifier=GreedyVerifier())
        input_ids, mask = left_padded(PROMPTS)
        input_ids, mask = input_ids.to(device), mask.to(device)
        decoder.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)  # warm-up (lazy inits)

        state = decoder.prepare(input_ids, mask, max_new_tokens=NEW_TOKENS)  # checks the request: syncs allowed
        torch.cuda.synchronize()
        with syncs_outside_commit("error") as commits:
            out = decoder.decode(state)
        assert state.draft_early_exit is False
        assert len(commits) == out.stats.iterations
        if choice != "draft-confidence":
            assert out.stats.alternatives_read > 0
        expected = gpu_target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(out.sequences, expected)


class TestSyncsOutsideCommit:
    """The wrapper the GPU test and ``benchmarks/sync_sites.py`` share, checked where CI runs (a CPU):
    it sees every commit and puts the commit back, also when the decode fails."""

    def test_counts_each_commit_and_restores_it(self, target, draft_model):
        from specdec.core.state import DecodeState

        commit = DecodeState.commit
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft_model), verifier=GreedyVerifier())
        input_ids, mask = left_padded(PROMPTS)
        state = decoder.prepare(input_ids, mask, max_new_tokens=NEW_TOKENS)
        with syncs_outside_commit("error") as commits:
            out = decoder.decode(state)
        assert len(commits) == out.stats.iterations > 0
        assert DecodeState.commit is commit
        with pytest.raises(RuntimeError, match="inside"), syncs_outside_commit("error"):
            raise RuntimeError("inside")
        assert DecodeState.commit is commit


class TestPhaseTimes:
    """The ``phases`` observer: the loop marks its five phases, once per iteration, only when asked."""

    def test_every_iteration_marks_every_phase(self, target, draft_model):
        timer = PhaseTimes()
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft_model), observers=[timer])
        input_ids, mask = left_padded(PROMPTS)
        out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
        assert timer.iterations == out.stats.iterations > 0
        assert set(timer.seconds) == {"lookahead", "draft", "verify", "commit", "bookkeeping"}
        per_iteration = timer.per_iteration_ms()
        assert all(value >= 0 for value in per_iteration.values())
        assert per_iteration["total"] == pytest.approx(sum(v for k, v in per_iteration.items() if k != "total"))
        # The phases partition the loop's time: together no longer than the call.
        assert sum(timer.seconds.values()) <= out.stats.wall_time_s
        timer.reset()
        assert timer.iterations == 0 and sum(timer.seconds.values()) == 0

    def test_is_a_registered_observer_and_costs_nothing_when_absent(self, target, draft_model):
        assert isinstance(get_registry().create("observer", "phases", {"sync": True}), PhaseTimes)
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft_model))
        assert decoder._timers is None


class TestIterationOps:
    """An iteration outside the models' forwards: a handful of tensor ops (a plain step: near ``generate``'s).

    On a CPU each op costs 5-10 us, so on a small target they decide whether specdec's plain steps,
    the floor of every policy that falls back to them, keep up with ``generate``: 112 ops per plain
    greedy iteration (164 sampled) ran 0.90-0.95x of ``generate`` on the bundled pair's 16 ms step,
    and 50 (81) ran 0.99x (docs/benchmarks.md, stop 30). A drafted iteration pays the same per draft
    forward: 218 ops at k = 5 (499 sampled) on the bundled pair before stop 31, 140 (321) after.
    Counted with a dispatch mode, not timed."""

    @staticmethod
    def ops_per_iteration(target, draft_model, sampled: bool, batch: int, k: int = 0, accelerator: bool = False) -> float:
        from specdec.decoding.ops import iteration_ops
        from specdec.policies import ConstantLookahead
        from specdec.verifiers import RejectionVerifier

        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft_model), policy=ConstantLookahead(k=k),
                                     verifier=RejectionVerifier(), draft_early_exit=False if accelerator else None)
        input_ids, mask = left_padded(PROMPTS[:batch])
        options = dict(do_sample=True, temperature=0.7, top_p=0.9, generator=torch.Generator().manual_seed(0)) if sampled else {}
        with iteration_ops([target, draft_model]) as count:
            out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, **options)
        if not k:
            assert out.stats.iterations == NEW_TOKENS
        else:
            assert out.stats.draft_calls > out.stats.iterations  # mostly drafted iterations, several tokens each
        assert count.total > 10 * out.stats.iterations  # the count sees the loop's ops (a commit alone takes more)
        return count.total / out.stats.iterations

    @pytest.mark.parametrize("sampled, batch, budget", [(False, 1, 60), (False, 4, 60), (True, 1, 95), (True, 4, 95)])
    def test_a_plain_step_takes_few_ops(self, target, draft_model, sampled, batch, budget):
        assert self.ops_per_iteration(target, draft_model, sampled, batch) <= budget

    # k = 3 on the tiny pair: 126 and 153 ops greedy at batch 1 and 4, 243 and 276 sampled (stop 30's
    # loop: 189, 208, 364, 392).
    @pytest.mark.parametrize("sampled, batch, budget", [(False, 1, 165), (False, 4, 165), (True, 1, 300), (True, 4, 300)])
    def test_a_drafted_iteration_takes_few_ops(self, target, draft_model, sampled, batch, budget):
        assert self.ops_per_iteration(target, draft_model, sampled, batch, k=3) <= budget

    # What a GPU runs (prepared 4D masks at every forward, drafts to full width), counted on the CPU.
    # k = 3 on the tiny pair: 173 and 188 greedy at batch 1 and 4 before stop 34's one-token masks,
    # 153 and 170 after.
    @pytest.mark.parametrize("batch, budget", [(1, 160), (4, 178)])
    def test_on_the_accelerator_path_a_drafted_iteration_takes_few_ops(self, target, draft_model, batch, budget,
                                                                       monkeypatch):
        monkeypatch.setattr("specdec.core.models.PREPARE_MASKS_ON_CPU", True)
        assert self.ops_per_iteration(target, draft_model, False, batch, k=3, accelerator=True) <= budget
