"""The ``fallback`` drafter: prompt lookup where it finds a match, a model everywhere else; exact, routed
per row, and written in plugins.toml as two tables."""

from __future__ import annotations

import attrs
import pytest
import torch

from specdec import ConfigError, SpeculativeDecoder
from specdec.config import SpecdecConfig
from specdec.drafters import FallbackDrafter, HiddenStateDrafter, ModelDrafter, NGramDrafter
from specdec.policies import ConstantLookahead, CostAwareLookahead, HeuristicLookahead
from specdec.verifiers import RejectionVerifier

from .conftest import greedy_reference, left_padded, left_padded_prompts, perturbed_copy, tiny_model


@attrs.define(eq=False)
class WatchedLookup(NGramDrafter):
    """Prompt lookup that records the widest draft of each call."""

    widths: list = attrs.field(factory=list, init=False)

    def propose(self, state, max_tokens, keep_drafting):
        draft = super().propose(state, max_tokens, keep_drafting)
        self.widths.append(int(draft.lengths_host.max()))
        return draft


@attrs.define(eq=False)
class Counting(ModelDrafter):
    """A model drafter that records the budgets it was asked to fill."""

    asked: list = attrs.field(factory=list, init=False)

    def propose(self, state, max_tokens, keep_drafting):
        self.asked.append(max_tokens.clone())
        return super().propose(state, max_tokens, keep_drafting)


def repetitive_prompts(vocab: int):
    """Rows whose prompts repeat a phrase, so prompt lookup finds matches, next to random ones."""
    phrase = [5, 9, 13, 7, 11]
    ids, mask = left_padded([phrase * 3, [3, 4, 17, 21, 8, 30, 6], phrase * 2 + [5, 9], [25, 26]])
    return ids.clamp(max=vocab - 1), mask


@pytest.mark.parametrize("policy", [ConstantLookahead(k=4), HeuristicLookahead()], ids=["constant", "heuristic"])
def test_exact_on_a_ragged_batch_and_both_drafters_draft(policy):
    target = tiny_model("llama")
    model = Counting(perturbed_copy(target, 0.1))
    ids, mask = repetitive_prompts(target.config.vocab_size)
    expected = greedy_reference(target, ids, mask, 24)
    decoder = SpeculativeDecoder(target=target, drafter=FallbackDrafter(NGramDrafter(min_ngram=2), model), policy=policy)
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=24)
    assert torch.equal(out.sequences, expected)
    assert model.asked, "the model never drafted"
    # The model was asked only for some rows some of the time: lookup covered the others.
    assert any(bool((asked == 0).any()) and bool((asked > 0).any()) for asked in model.asked)


def test_the_model_is_not_called_when_lookup_covers_every_row():
    target = tiny_model("llama")
    model = Counting(perturbed_copy(target, 0.1))
    phrase = [5, 9, 13, 7, 11]
    ids, mask = left_padded([phrase * 4])

    lookup = WatchedLookup()
    decoder = SpeculativeDecoder(target=target, drafter=FallbackDrafter(lookup, model), policy=ConstantLookahead(k=3))
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=12)
    assert torch.equal(out.sequences, greedy_reference(target, ids, mask, 12))
    hits = sum(1 for length in lookup.widths if length > 0)
    assert hits > 0
    assert len(model.asked) == len(lookup.widths) - hits  # once per iteration the lookup missed


def test_a_hidden_state_head_after_lookup_gets_the_target_hidden_states():
    from .test_hidden_state import target_for, trained_head

    target = target_for("llama")
    ids, mask = left_padded_prompts([9, 3, 14, 6], vocab=target.config.vocab_size)
    drafter = FallbackDrafter(NGramDrafter(), HiddenStateDrafter(trained_head("llama")))
    assert drafter.wants_hidden_states
    out = SpeculativeDecoder(target=target, drafter=drafter, policy=ConstantLookahead(k=3)).generate(
        ids, attention_mask=mask, max_new_tokens=20)
    assert torch.equal(out.sequences, greedy_reference(target, ids, mask, 20))


def test_sampling_mixes_one_hot_and_model_distributions():
    target = tiny_model("llama")
    seen = []

    class Spy(FallbackDrafter):
        def propose(self, state, max_tokens, keep_drafting):
            draft = super().propose(state, max_tokens, keep_drafting)
            if draft.probs is not None:
                seen.append(draft)
            return draft

    ids, mask = repetitive_prompts(target.config.vocab_size)
    drafter = Spy(NGramDrafter(min_ngram=2), ModelDrafter(perturbed_copy(target, 0.1)))
    out = SpeculativeDecoder(target=target, drafter=drafter, verifier=RejectionVerifier(), policy=ConstantLookahead(k=3)).generate(
        ids, attention_mask=mask, max_new_tokens=16, do_sample=True, generator=torch.Generator().manual_seed(0))
    assert out.sequences.shape == (4, ids.shape[1] + 16)
    assert seen
    for draft in seen:
        inside = draft.in_draft()
        sums = draft.probs.sum(-1)[inside]
        assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5)
        # every drafted token has its own q; one-hot rows (lookup) have q = 1 exactly
        q = draft.probs.gather(-1, draft.tokens[..., None])[..., 0]
        assert torch.allclose(q[inside], draft.token_probs[inside])


def test_plugins_toml_tables_and_their_errors(tmp_path):
    (tmp_path / "draft").mkdir()
    good = tmp_path / "plugins.toml"
    good.write_text(
        '[target]\nmodel = "target"\n[drafter]\nuse = "fallback"\n'
        '[drafter.first]\nuse = "ngram"\nmin_ngram = 2\n[drafter.then]\nuse = "model"\nmodel = "draft"\n'
    )
    drafter, *_ = SpecdecConfig.from_toml(good).build_components()
    assert isinstance(drafter, FallbackDrafter)
    assert isinstance(drafter.first, NGramDrafter) and drafter.first.min_ngram == 2
    assert isinstance(drafter.then, ModelDrafter) and drafter.then.model == str(tmp_path / "draft")

    missing_use = tmp_path / "missing.toml"
    missing_use.write_text('[target]\nmodel = "t"\n[drafter]\nuse = "fallback"\n[drafter.first]\nmin_ngram = 2\n'
                           '[drafter.then]\nuse = "ngram"\n')
    with pytest.raises(ConfigError, match=r"fallback.*'first'.*use ="):
        SpecdecConfig.from_toml(missing_use).build_components()

    bad_inner = tmp_path / "bad.toml"
    bad_inner.write_text('[target]\nmodel = "t"\n[drafter]\nuse = "fallback"\n[drafter.first]\nuse = "ngram"\n'
                         'min_ngram = "two"\n[drafter.then]\nuse = "ngram"\n')
    with pytest.raises(ConfigError, match=r"drafter 'ngram'.*'min_ngram' must be int"):
        SpecdecConfig.from_toml(bad_inner).build_components()

    with pytest.raises(ConfigError, match="missing required option 'then'"):
        SpecdecConfig.from_dict({"target": {"model": "t"}, "drafter": {"use": "fallback", "first": {"use": "ngram"}}}).build_components()


def test_the_same_drafter_twice_is_refused():
    ngram = NGramDrafter()
    with pytest.raises(ConfigError, match="same object"):
        FallbackDrafter(ngram, ngram)
    with pytest.raises(ConfigError, match="'then' must be a drafter"):
        FallbackDrafter(ngram, "ngram")


def test_then_max_tokens_caps_only_the_second_drafter():
    target = tiny_model("llama")
    model = Counting(perturbed_copy(target, 0.1))

    ids, mask = repetitive_prompts(target.config.vocab_size)
    lookup = WatchedLookup(min_ngram=2)
    drafter = FallbackDrafter(lookup, model, then_max_tokens=1)
    out = SpeculativeDecoder(target=target, drafter=drafter, policy=ConstantLookahead(k=5)).generate(
        ids, attention_mask=mask, max_new_tokens=24)
    assert torch.equal(out.sequences, greedy_reference(target, ids, mask, 24))
    assert model.asked and max(int(asked.max()) for asked in model.asked) == 1
    assert max(lookup.widths) > 1  # the lookup still drafts up to the policy's k
    with pytest.raises(ConfigError, match="'then_max_tokens' must be an integer of at least 1"):
        FallbackDrafter(NGramDrafter(), model, then_max_tokens=0)


def test_the_shipped_smollm2_config_builds_lookup_then_head(tmp_path):
    from pathlib import Path

    config = Path(__file__).resolve().parent.parent / "models/smollm2-135m-instruct-head/plugins.toml"
    drafter, policy, *_ = SpecdecConfig.from_toml(config).build_components()
    assert isinstance(drafter, FallbackDrafter) and drafter.then_max_tokens == 2
    assert isinstance(drafter.first, NGramDrafter)
    assert isinstance(drafter.then, HiddenStateDrafter) and Path(drafter.then.head).is_file()
    # The head's alternatives, read where cost-aware measures that they pay (they lose on some CPUs).
    assert drafter.then.alternatives == 3
    assert isinstance(policy, CostAwareLookahead) and policy.alternatives == "auto"
    # An option in the TOML table of the fallback's second drafter reaches that drafter.
    head = Path(drafter.then.head)
    text = config.read_text().replace('head = "head.safetensors"', f'head = "{head}"').replace(
        "alternatives = 3", "alternatives = 2")
    (tmp_path / "plugins.toml").write_text(text)
    drafter, *_ = SpecdecConfig.from_toml(tmp_path / "plugins.toml").build_components()
    assert drafter.then.alternatives == 2
