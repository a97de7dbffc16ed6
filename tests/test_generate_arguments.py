"""Every argument ``generate`` takes is honoured like ``model.generate`` or refused with a clear error."""

from __future__ import annotations

import pytest
import torch

from specdec import ConfigError, Draft, SpeculativeDecoder
from specdec.drafters import Drafter, ModelDrafter, NGramDrafter
from specdec.policies import HeuristicLookahead
from specdec.verifiers import GreedyVerifier, RejectionVerifier

from .conftest import VOCAB, greedy_reference, left_padded_prompts, tiny_model


def row_rules(batch_id: int, input_ids: torch.Tensor) -> list[int]:
    """A constraint that differs per row: row b may only use tokens congruent to b mod 3 (and eos)."""
    return [2] + [token for token in range(3, VOCAB) if token % 3 == batch_id % 3]


class TestRowAwareProcessors:
    @pytest.mark.parametrize("drafter", ["model", "ngram"])
    def test_prefix_allowed_tokens_fn_sees_each_rows_own_index(self, llama, llama_draft, drafter):
        """Rows accept different numbers of drafts; the function must still be called with each row's index."""
        input_ids, mask = left_padded_prompts([9, 3, 14, 6])
        expected = greedy_reference(llama, input_ids, mask, 20, prefix_allowed_tokens_fn=row_rules)
        decoder = SpeculativeDecoder(
            target=llama, drafter=ModelDrafter(llama_draft) if drafter == "model" else NGramDrafter(),
            policy=HeuristicLookahead(),
        )
        got = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=20, prefix_allowed_tokens_fn=row_rules)
        assert torch.equal(got.sequences, expected)
        for row in range(4):
            new = got.sequences[row, input_ids.shape[1]:].tolist()
            assert all(token in row_rules(row, None) or token == 0 for token in new)

    def test_a_prefix_function_that_is_not_callable_is_refused(self, llama, llama_draft):
        decoder = SpeculativeDecoder(target=llama, drafter=ModelDrafter(llama_draft))
        input_ids, mask = left_padded_prompts([4])
        with pytest.raises(Exception, match="prefix_allowed_tokens_fn must be a callable"):
            decoder.generate(input_ids, attention_mask=mask, max_new_tokens=4, prefix_allowed_tokens_fn=[1, 2])


class TestReturnedOutputs:
    @pytest.mark.parametrize("option", ["output_scores", "output_logits", "output_attentions", "output_hidden_states"])
    def test_outputs_specdec_does_not_return_are_refused(self, llama, llama_draft, option):
        decoder = SpeculativeDecoder(target=llama, drafter=ModelDrafter(llama_draft))
        input_ids, mask = left_padded_prompts([4])
        with pytest.raises(ConfigError, match=option):
            decoder.generate(input_ids, attention_mask=mask, max_new_tokens=4, return_dict_in_generate=True, **{option: True})

    def test_num_return_sequences_samples_each_row_that_many_times(self, llama, llama_draft):
        decoder = SpeculativeDecoder(target=llama, drafter=ModelDrafter(llama_draft), verifier=RejectionVerifier())
        input_ids, mask = left_padded_prompts([5, 9])
        out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=True,
                               num_return_sequences=3, generator=torch.Generator().manual_seed(0))
        assert out.sequences.shape[0] == 6
        for row in range(6):  # copies of row r are rows 3r .. 3r + 2, each with row r's prompt
            assert torch.equal(out.sequences[row, : input_ids.shape[1]], input_ids[row // 3])
        assert len({tuple(out.sequences[row].tolist()) for row in range(3)}) > 1  # sampled, not copied

    def test_num_return_sequences_without_sampling_is_refused(self, llama, llama_draft):
        decoder = SpeculativeDecoder(target=llama, drafter=ModelDrafter(llama_draft))
        input_ids, mask = left_padded_prompts([5])
        with pytest.raises(ConfigError, match="num_return_sequences"):
            decoder.generate(input_ids, attention_mask=mask, max_new_tokens=4, num_return_sequences=2)


class MinusOnePadding(Drafter):
    """Drafts the target's own greedy continuation but leaves -1 in every padding column."""

    name = "minus-one"

    def __init__(self, target):
        self.target = target

    def propose(self, state, max_tokens, keep_drafting):
        width = int(max_tokens.max())
        tokens = torch.full((state.active, width), -1, dtype=torch.long)
        lengths = (max_tokens // 2).clamp(min=1)  # rows draft different lengths
        for b, row in enumerate(state.rows.tolist()):
            ids = state.sequences[row : row + 1, : int(state.lengths[row])]
            mask = state.token_mask[row : row + 1, : ids.shape[1]]
            greedy = self.target.generate(ids, attention_mask=mask, max_new_tokens=int(lengths[b]), do_sample=False)
            drafted = greedy[0, ids.shape[1] :]
            tokens[b, : drafted.shape[0]] = drafted
        return Draft(tokens=tokens, lengths=lengths)


class TestDraftPadding:
    @pytest.mark.parametrize("verifier", [GreedyVerifier, RejectionVerifier])
    def test_verifiers_and_the_target_never_read_padding_columns(self, verifier):
        target = tiny_model("llama")
        input_ids, mask = left_padded_prompts([6, 2, 9])
        expected = greedy_reference(target, input_ids, mask, 10)
        decoder = SpeculativeDecoder(target=target, drafter=MinusOnePadding(target), policy=HeuristicLookahead(),
                                     verifier=verifier())
        got = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=10)
        assert torch.equal(got.sequences, expected)


def _described(processors) -> list:
    """Each processor's type and its scalar settings (temperature, top_k, top_p, ...)."""
    return [(type(p).__name__, {k: v for k, v in vars(p).items() if isinstance(v, (bool, int, float))})
            for p in processors]


class TestGenerationDefaults:
    """Options a user leaves unset resolve as in ``model.generate``: the request's config, then the
    target's ``generation_config``, then transformers' global defaults (top_k = 50 among them)."""

    @pytest.mark.parametrize("options", [
        dict(do_sample=True),
        dict(do_sample=True, temperature=0.7, top_p=0.9),
        dict(do_sample=True, top_k=0, temperature=1.3),
        dict(do_sample=False, repetition_penalty=1.2),
    ], ids=["sampling", "temperature and top-p", "top-k off", "greedy"])
    @pytest.mark.parametrize("model_default", [None, 7], ids=["no model default", "model top_k 7"])
    def test_the_processors_are_generates(self, llama, llama_draft, monkeypatch, options, model_default):
        monkeypatch.setattr(llama.generation_config, "top_k", model_default)
        input_ids, mask = left_padded_prompts([5, 3])
        built = []
        original = llama._get_logits_processor

        def spy(*args, **kwargs):
            built.append(original(*args, **kwargs))
            return built[-1]

        monkeypatch.setattr(llama, "_get_logits_processor", spy)
        llama.generate(input_ids, attention_mask=mask, max_new_tokens=1, **options)
        decoder = SpeculativeDecoder(target=llama, drafter=ModelDrafter(llama_draft), verifier=RejectionVerifier())
        state = decoder.prepare(input_ids, mask, 1, **options)
        assert _described(state.processors) == _described(built[0])
        if options.get("do_sample") and "top_k" not in options:
            assert ("TopKLogitsWarper", {"top_k": model_default or 50, "filter_value": -float("inf"),
                                         "min_tokens_to_keep": 1}) in _described(state.processors)
