"""First-position alternatives (``Draft.alternatives``, a token tree of one level): under greedy
decoding the verify also reads the draft's next best candidates for the first position, each seeing
only the committed tokens, and commits one of them, and the target's token after it, where the first
draft is rejected and it is the target's token. Exact on every family that reads them, ignored (and
exact) where the cache cannot, under sampling and with static shapes."""

from __future__ import annotations

import pytest
import torch

from specdec import ConfigError, SpeculativeDecoder
from specdec.core.drafting import MAX_ALTERNATIVES
from specdec.drafters import FallbackDrafter, HiddenStateDrafter, ModelDrafter, NGramDrafter
from specdec.plugins.manager import get_registry
from specdec.policies import ConstantLookahead, HeuristicLookahead
from specdec.verifiers import RejectionVerifier

from .architectures import FAMILIES, ragged_batch, reference_generate, tiny_family_model
from .conftest import Recorder, left_padded_prompts, tiny_model

NEW_TOKENS = 24
# Families whose target reads siblings: attention caches with holes, positions from position_ids.
READS = ["full", "sliding", "mixed_sliding", "per_layer_shapes", "kv_shared", "chunked", "evicted_window", "mla", "moe"]
# Families that fall back to the chain: recurrent states, ALiBi, re-read models, an indexer's keys.
FALLS_BACK = ["ssm", "hybrid_ssm", "gated_delta", "short_conv", "alibi", "local", "sparse_indexed"]


def alternatives_taken(recorder: Recorder) -> int:
    """Rows that committed an alternative and the target's token after it: two tokens with no draft kept."""
    return sum(int(((step.appended_host == 2) & (step.accepted_host == 0)).sum()) for step in recorder.steps)


def _inputs(case: str):
    ids, mask = ragged_batch()
    if case == "batch":
        return ids, mask
    keep = mask[2].bool()
    return ids[2, keep][None], mask[2, keep][None]


def _decode(target, drafter, ids, mask, policy=None, **kwargs):
    recorder = Recorder()
    decoder = SpeculativeDecoder(target=target, drafter=drafter, policy=policy or ConstantLookahead(k=3),
                                 observers=[recorder], **kwargs)
    return decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), recorder


class TestExactness:
    @pytest.mark.parametrize("family", READS)
    @pytest.mark.parametrize("k", [1, 3])
    def test_families_that_read_them_take_them_and_stay_exact(self, family, k):
        target, draft = tiny_family_model(family), tiny_family_model(family, draft=True)
        taken = 0
        for case in ("batch", "row"):
            ids, mask = _inputs(case)
            out, recorder = _decode(target, ModelDrafter(draft, alternatives=3), ids, mask, ConstantLookahead(k=k))
            assert torch.equal(out.sequences, reference_generate(target, ids, mask, max_new_tokens=NEW_TOKENS))
            taken += alternatives_taken(recorder)
        assert taken > 0  # the perturbed draft's second or third choice was the target's token somewhere

    @pytest.mark.parametrize("family", FALLS_BACK)
    def test_families_that_cannot_read_them_decode_the_chain_exactly(self, family):
        target, draft = tiny_family_model(family), tiny_family_model(family, draft=True)
        ids, mask = _inputs("batch")
        out, recorder = _decode(target, ModelDrafter(draft, alternatives=3), ids, mask)
        assert torch.equal(out.sequences, reference_generate(target, ids, mask, max_new_tokens=NEW_TOKENS))
        assert alternatives_taken(recorder) == 0

    def test_a_heuristic_policy_and_a_ragged_batch_of_longer_prompts(self):
        target, draft = tiny_family_model("full"), tiny_family_model("full", draft=True)
        ids, mask = ragged_batch(lengths=(5, 31, 17, 2), seed=4)
        out, recorder = _decode(target, ModelDrafter(draft, alternatives=MAX_ALTERNATIVES), ids, mask, HeuristicLookahead())
        assert torch.equal(out.sequences, reference_generate(target, ids, mask, max_new_tokens=NEW_TOKENS))
        assert alternatives_taken(recorder) > 0

    def test_they_cut_the_target_calls(self):
        target, draft = tiny_family_model("full"), tiny_family_model("full", draft=True)
        ids, mask = _inputs("row")
        chain, _ = _decode(target, ModelDrafter(draft), ids, mask, ConstantLookahead(k=1))
        tree, recorder = _decode(target, ModelDrafter(draft, alternatives=3), ids, mask, ConstantLookahead(k=1))
        assert torch.equal(tree.sequences, chain.sequences)
        assert alternatives_taken(recorder) > 0 and tree.stats.iterations < chain.stats.iterations


class TestDrafters:
    def test_the_hidden_state_drafter_hands_over_the_taken_alternatives_hidden_state(self):
        from .test_hidden_state import target_for, trained_head

        target = target_for("llama")
        ids, mask = left_padded_prompts([9, 3, 14, 6], vocab=target.config.vocab_size)
        expected = reference_generate(target, ids, mask, max_new_tokens=NEW_TOKENS)
        out, recorder = _decode(target, HiddenStateDrafter(trained_head("llama"), alternatives=2), ids, mask)
        assert torch.equal(out.sequences, expected)
        assert alternatives_taken(recorder) > 0

    def test_the_fallback_drafter_keeps_its_model_drafters_alternatives(self):
        target, draft = tiny_family_model("full"), tiny_family_model("full", draft=True)
        ids, mask = _inputs("batch")
        drafter = FallbackDrafter(NGramDrafter(max_ngram=3), ModelDrafter(draft, alternatives=2))
        out, recorder = _decode(target, drafter, ids, mask)
        assert torch.equal(out.sequences, reference_generate(target, ids, mask, max_new_tokens=NEW_TOKENS))
        assert alternatives_taken(recorder) > 0

    def test_none_when_sampling(self):
        target = tiny_model("llama")
        draft = tiny_model("llama", seed=1)
        ids, mask = left_padded_prompts([5, 8], vocab=target.config.vocab_size)
        proposed = []

        class Spy(ModelDrafter):
            def propose(self, state, max_tokens, keep_drafting):
                draft = super().propose(state, max_tokens, keep_drafting)
                proposed.append(draft.alternatives)
                return draft

        SpeculativeDecoder(target=target, drafter=Spy(draft, alternatives=2), verifier=RejectionVerifier()).generate(
            ids, attention_mask=mask, max_new_tokens=12, do_sample=True, generator=torch.Generator().manual_seed(0))
        assert proposed and all(a is None for a in proposed)

    def test_static_shapes_read_the_chain_only(self):
        target, draft = tiny_family_model("full"), tiny_family_model("full", draft=True)
        ids, mask = _inputs("batch")
        out, recorder = _decode(target, ModelDrafter(draft, alternatives=3), ids, mask, static_cache=True)
        assert torch.equal(out.sequences, reference_generate(target, ids, mask, max_new_tokens=NEW_TOKENS))
        assert alternatives_taken(recorder) == 0


class TestBadInput:
    @pytest.mark.parametrize("value", [-1, MAX_ALTERNATIVES + 1, 1.5, True, "two"])
    def test_out_of_range_or_not_an_integer(self, value):
        with pytest.raises(ConfigError, match=r"drafter 'model': option 'alternatives' must be an integer from 0 to 8"):
            ModelDrafter(tiny_model("llama"), alternatives=value)

    def test_from_a_plugins_toml_table(self):
        with pytest.raises(ConfigError, match=r"'alternatives'"):
            get_registry().create("drafter", "hidden-state", {"head": "head.safetensors", "alternatives": "two"})


class Flipping(ConstantLookahead):
    """A constant k that, like ``cost-aware`` pricing them, lets the verify read the alternatives in
    some iterations and not in others (``state.verify_alternatives``), at random."""

    def __init__(self, k: int, seed: int):
        super().__init__(k=k)
        self.coin = torch.Generator().manual_seed(seed)

    def lookahead(self, state):
        state.verify_alternatives = bool(torch.rand((), generator=self.coin) < 0.5)
        return super().lookahead(state)


class TestReadSometimes:
    """Read in some iterations and not in others, the output stays generate's: the caches, the
    hidden states handed to a drafter and the alternatives' bookkeeping follow each iteration's read."""

    @pytest.mark.parametrize("family", ["full", "sliding", "mla"])
    def test_model_drafter(self, family):
        target, draft = tiny_family_model(family), tiny_family_model(family, draft=True)
        ids, mask = _inputs("batch")
        read = []
        for seed in range(3):
            out, recorder = _decode(target, ModelDrafter(draft, alternatives=3), ids, mask, Flipping(k=3, seed=seed))
            assert torch.equal(out.sequences, reference_generate(target, ids, mask, max_new_tokens=NEW_TOKENS))
            read += [step.siblings > 0 for step in recorder.steps if step.draft.alternatives is not None]
        assert any(read) and not all(read)

    def test_hidden_state_drafter(self):
        from .test_hidden_state import target_for, trained_head

        target = target_for("llama")
        ids, mask = left_padded_prompts([9, 3, 14, 6], vocab=target.config.vocab_size)
        expected = reference_generate(target, ids, mask, max_new_tokens=NEW_TOKENS)
        for seed in range(3):
            out, recorder = _decode(target, HiddenStateDrafter(trained_head("llama"), alternatives=2), ids, mask,
                                    Flipping(k=2, seed=seed))
            assert torch.equal(out.sequences, expected)
        assert {step.siblings for step in recorder.steps} == {0, 2}

    def test_whisper(self):
        from specdec.drafters import SharedEncoderDrafter
        from specdec.whisper import WhisperSpeculativeDecoder

        from .conftest import perturbed_copy
        from .tiny_whisper import decoder_of, features, tiny_whisper

        target = tiny_whisper(seed=0)
        draft = perturbed_copy(decoder_of(target), 0.3, seed=2)
        x = features(3, seed=21)
        reference = target.generate(x, max_new_tokens=20, language="en")
        read = []
        for seed in range(2):
            recorder = Recorder()
            decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=draft, alternatives=3),
                                         policy=Flipping(k=2, seed=seed), observers=[recorder])
            out = WhisperSpeculativeDecoder(decoder).generate(x, max_new_tokens=20, language="en")
            assert torch.equal(out, reference), (out.tolist(), reference.tolist())
            read += [step.siblings > 0 for step in recorder.steps if step.draft.alternatives is not None]
        assert any(read) and not all(read)


def test_every_family_is_sorted_into_one_list():
    assert set(READS) | set(FALLS_BACK) <= set(FAMILIES)


class TestWhisper:
    """An encoder-decoder target reads them through a 4D decoder mask, with Whisper's processors
    (forced tokens, suppression, the timestamp grammar) applied to each alternative's own column."""

    @pytest.mark.parametrize("options", [dict(language="en"), dict(return_timestamps=True)], ids=["en", "timestamps"])
    def test_equals_generate_with_a_shared_encoder_draft(self, options):
        from specdec.drafters import SharedEncoderDrafter
        from specdec.whisper import WhisperSpeculativeDecoder

        from .conftest import perturbed_copy
        from .tiny_whisper import decoder_of, features, tiny_whisper

        target = tiny_whisper(seed=0)
        draft = perturbed_copy(decoder_of(target), 0.3, seed=2)  # right often, not always
        x = features(3, seed=21)
        reference = target.generate(x, max_new_tokens=20, **options)
        recorder = Recorder()
        decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=draft, alternatives=3),
                                     policy=ConstantLookahead(k=2), observers=[recorder])
        out = WhisperSpeculativeDecoder(decoder).generate(x, max_new_tokens=20, **options)
        assert torch.equal(out, reference), (out.tolist(), reference.tolist())
        assert alternatives_taken(recorder) > 0
