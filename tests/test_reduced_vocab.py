"""Reduced-vocabulary drafting (core/reduced_vocab.py): a draft head over a subset of the target's
tokens, expanded to the full vocabulary with -inf elsewhere, for the ``model``, ``shared-encoder``
and ``hidden-state`` drafters. Exact by construction: greedy output equals ``generate`` (float64),
no token outside the map is ever drafted, and under sampling q is zero outside the map while the
continuations still follow the target's distribution."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from specdec import IncompatibleModelsError, SpeculativeDecoder
from specdec.core.reduced_vocab import TokenMap, read_token_map
from specdec.drafters import ModelDrafter, SharedEncoderDrafter
from specdec.drafters.shared_encoder_draft import build_draft
from specdec.policies import ConstantLookahead
from specdec.verifiers import RejectionVerifier
from specdec.whisper import WhisperSpeculativeDecoder

from .conftest import EOS, Recorder, greedy_reference, left_padded_prompts, perturbed_copy, tiny_llama, tiny_model
from .test_rejection import PASS_P, chi_square, exact_continuations, sample_continuations
from .tiny_whisper import EOT, LANGUAGES, NO_TIMESTAMPS, SOT, TRANSCRIBE, TRANSLATE, features, tiny_whisper


def reduced_head_copy(model, token_map: torch.Tensor):
    """``model`` with its LM head cut to the rows of ``token_map``: a draft that agrees with ``model``
    whenever ``model``'s token is in the map."""
    draft = copy.deepcopy(model)
    head = draft.get_output_embeddings()
    reduced = torch.nn.Linear(head.weight.shape[1], token_map.numel(), bias=False, dtype=head.weight.dtype)
    with torch.no_grad():
        reduced.weight.copy_(head.weight[token_map])
    draft.set_output_embeddings(reduced)
    return draft


def drafted_tokens(recorder: Recorder) -> torch.Tensor:
    """Every token any row drafted (within its draft length)."""
    out = []
    for step in recorder.steps:
        for row, length in enumerate(step.draft.lengths.tolist()):
            out.append(step.draft.tokens[row, :length])
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


class TestTokenMap:
    """The map itself: expansion and the checks that name what does not fit."""

    def test_expand_puts_minus_infinity_outside_the_map(self):
        """Reduced logits land on their full ids; every other id is -inf; float32 out."""
        token_map = TokenMap.checked([4, 1, 7], 10, "test")
        full = token_map.expand(torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64))
        assert full.dtype == torch.float32 and full.shape == (1, 10)
        assert full[0, [4, 1, 7]].tolist() == [1.0, 2.0, 3.0]
        outside = torch.ones(10, dtype=torch.bool)
        outside[[4, 1, 7]] = False
        assert torch.isneginf(full[0, outside]).all()

    @pytest.mark.parametrize("ids,message", [
        ([1, 2, 10], "token id 10, outside the target's vocabulary of 10"),
        ([-1, 2], "token id -1"),
        ([1, 1, 2], "twice"),
        ([[1, 2]], "1-D"),
        ([], "non-empty"),
    ])
    def test_bad_maps_are_refused(self, ids, message):
        with pytest.raises(IncompatibleModelsError, match=message):
            TokenMap.checked(torch.tensor(ids, dtype=torch.long), 10, "drafter 'model'", "map.json")

    def test_a_head_of_another_width_is_refused(self):
        with pytest.raises(IncompatibleModelsError, match="scores 4 tokens but its token map holds 3"):
            TokenMap.checked([0, 1, 2], 10, "test").expand(torch.zeros(1, 4))

    def test_read_from_json_and_safetensors(self, tmp_path):
        from safetensors.torch import save_file

        (tmp_path / "map.json").write_text(json.dumps({"token_map": [3, 5, 8]}))
        save_file({"token_map": torch.tensor([3, 5, 8])}, str(tmp_path / "map.safetensors"))
        for name in ("map.json", "map.safetensors"):
            assert read_token_map(tmp_path / name, "test").tolist() == [3, 5, 8]


# --- decoder-only: the ``model`` drafter ------------------------------------------------------------

MAP = torch.tensor(sorted({EOS, *range(3, 40, 2)}))  # about half of the tiny vocabulary, eos included


class TestModelDrafterReduced:
    """A decoder-only draft with a reduced head, through the ``model`` drafter's ``token_map`` option."""

    @pytest.mark.parametrize("lengths", [[6], [3, 9, 5, 1]], ids=["batch 1", "ragged batch"])
    def test_greedy_equals_generate_and_drafts_stay_in_the_map(self, lengths):
        target = tiny_model("llama")
        draft = reduced_head_copy(target, MAP)  # agrees with the target whenever its token is in the map
        ids, mask = left_padded_prompts(lengths, seed=3)
        recorder = Recorder()
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft, token_map=MAP),
                                     policy=ConstantLookahead(k=4), observers=[recorder])
        out = decoder.generate(ids, attention_mask=mask, max_new_tokens=24)
        assert torch.equal(out.sequences, greedy_reference(target, ids, mask, 24))
        drafted = drafted_tokens(recorder)
        assert drafted.numel() > 0 and torch.isin(drafted, MAP).all()
        # The target sometimes says a token outside the map, so drafts are rejected there, and accepted elsewhere.
        new = out.sequences[:, ids.shape[1]:]
        assert not torch.isin(new, MAP).all()
        assert 0 < out.stats.accepted < out.stats.drafted

    def test_a_map_that_does_not_fit_the_head_is_refused(self):
        target = tiny_model("llama")
        draft = reduced_head_copy(target, MAP)
        with pytest.raises(IncompatibleModelsError, match=f"head scores {MAP.numel()} tokens but its token_map option maps"):
            SpeculativeDecoder(target=target, drafter=ModelDrafter(draft, token_map=MAP[:-1]))

    def test_a_reduced_head_without_a_map_is_refused(self):
        target = tiny_model("llama")
        with pytest.raises(IncompatibleModelsError, match="vocabulary has"):
            SpeculativeDecoder(target=target, drafter=ModelDrafter(reduced_head_copy(target, MAP)))


class TestSamplingReduced:
    """Rejection sampling with a reduced-head draft: q is zero outside the map, the output is the target's."""

    VOCAB_MAP = torch.tensor([0, 1, 2, 5, 6])  # of the 8 tokens

    def test_q_is_zero_outside_the_map_and_the_distribution_is_the_targets(self):
        target = tiny_llama(0, vocab=8, dtype=torch.float64)
        draft = reduced_head_copy(perturbed_copy(target, 0.15), self.VOCAB_MAP)
        recorder = Recorder()
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft, token_map=self.VOCAB_MAP),
                                     policy=ConstantLookahead(k=3), verifier=RejectionVerifier(), observers=[recorder])
        sampling = dict(temperature=1.0, top_k=0)
        samples, stats = sample_continuations(decoder, [[1, 2, 3, 4]], 2000, sampling)
        outside = torch.ones(8, dtype=torch.bool)
        outside[self.VOCAB_MAP] = False
        checked = [step.draft.probs for step in recorder.steps if step.draft.tokens.shape[1]]
        assert checked and all(probs is not None and (probs[..., outside] == 0).all() for probs in checked)
        assert torch.isin(drafted_tokens(recorder), self.VOCAB_MAP).all()
        assert 0.2 < stats.acceptance_rate < 0.95
        # Tokens outside the map still come out, from the target's corrections and bonus tokens.
        assert not torch.isin(samples[0], self.VOCAB_MAP).all()
        expected = [exact_continuations(target, [1, 2, 3, 4], 3, sampling)]
        assert chi_square(samples, expected) > PASS_P


# --- Whisper: the ``shared-encoder`` drafter with a distilled-style draft -------------------------------

# Text bytes, Whisper's prompt tokens and eos; no timestamps (so a forced timestamp has nothing to draft).
WHISPER_MAP = torch.tensor(sorted({*range(32, 127), EOT, SOT, *LANGUAGES.values(), TRANSLATE, TRANSCRIBE, NO_TIMESTAMPS}))


@pytest.fixture(scope="module")
def target():
    return tiny_whisper(seed=0)


class TestSharedEncoderReduced:
    """``build_draft``'s reduced-head decoder on the target's encoder output, through Whisper's generate."""

    @pytest.mark.parametrize("batch", [1, 3])
    @pytest.mark.parametrize("options", [dict(language="en"), dict(return_timestamps=True)], ids=["en", "timestamps"])
    def test_greedy_equals_generate(self, target, batch, options):
        # The target's only decoder layer copied: the draft agrees wherever the target's token is in the map.
        draft = build_draft(target, WHISPER_MAP, init_layers=[0])
        recorder = Recorder()
        decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=draft),
                                     policy=ConstantLookahead(k=4), observers=[recorder])
        x = features(batch, seed=40 + batch)
        reference = target.generate(x, max_new_tokens=20, **options)
        whisper = WhisperSpeculativeDecoder(decoder)
        out = whisper.generate(x, max_new_tokens=20, **options)
        assert torch.equal(reference, out), (reference.tolist(), out.tolist())
        drafted = drafted_tokens(recorder)
        assert drafted.numel() > 0 and torch.isin(drafted, WHISPER_MAP).all()
        assert whisper.stats.decode.accepted > 0

    @staticmethod
    def biased_draft(target, token_map: torch.Tensor, rows: torch.Tensor, bias: float):
        """A draft over ``token_map`` whose head adds ``bias`` to the map's ``rows`` (a bool mask)."""
        draft = build_draft(target, token_map, init_layers=[0])
        head = torch.nn.Linear(draft.proj_out.in_features, draft.proj_out.out_features, dtype=draft.dtype)
        with torch.no_grad():
            head.weight.copy_(draft.proj_out.weight)
            head.bias.zero_()
            head.bias[rows] = bias
        draft.proj_out = head
        return draft

    @staticmethod
    def drafts_in_the_map_and_over_the_vocabulary(target, draft, x, options, monkeypatch) -> list:
        """Transcribes ``x`` twice, the draft picking its tokens among its own scores and then over the
        whole vocabulary (``suppression_in`` answering None): both are ``generate``'s output, only the
        first reads the map's scores, and every draft (tokens, q of each token) is the same. Returns
        the first run's steps."""
        from specdec.core import drafting
        from specdec.core.state import DecodeState

        reference = target.generate(x, **options)
        in_map = []
        original = drafting.TokenByToken._add_in_map
        monkeypatch.setattr(drafting.TokenByToken, "_add_in_map", lambda self, scores: in_map.append(1) or original(self, scores))
        runs = []
        for whole_vocabulary in (False, True):
            if whole_vocabulary:
                monkeypatch.setattr(DecodeState, "suppression_in", lambda self, token_map: None)
            recorder, count = Recorder(), len(in_map)
            decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=draft),
                                         policy=ConstantLookahead(k=3), observers=[recorder])
            assert torch.equal(WhisperSpeculativeDecoder(decoder).generate(x, **options), reference)
            assert (len(in_map) > count) is not whole_vocabulary
            runs.append(recorder.steps)
        assert len(runs[0]) == len(runs[1])
        for mine, theirs in zip(*runs):
            assert torch.equal(mine.draft.tokens, theirs.draft.tokens)
            if mine.draft.width:  # a plain step (the budget's last token) drafts nothing
                assert torch.allclose(mine.draft.token_probs, theirs.draft.token_probs, rtol=1e-5, atol=1e-7)
        return runs[0]

    @pytest.mark.parametrize("batch", [1, 3])
    @pytest.mark.parametrize("eot_bias", [0.0, 50.0], ids=["plain", "eot-favoured"])
    def test_in_the_map_it_drafts_what_the_whole_vocabulary_would(self, target, batch, eot_bias, monkeypatch):
        """Greedy, with Whisper's processors that only suppress tokens: the draft picks its token among
        its own scores (``TokenByToken.reads_reduced``), and every draft (tokens, q of each token) is
        the one scored over the whole vocabulary. With the draft's head favouring <|endoftext|>, which
        ``begin_suppress_tokens`` forbids at the first generated position only, the first draft
        position of the request takes the runner-up and later ones take <|endoftext|>."""
        draft = self.biased_draft(target, WHISPER_MAP, WHISPER_MAP == EOT, eot_bias)
        steps = self.drafts_in_the_map_and_over_the_vocabulary(target, draft, features(batch, seed=60 + batch),
                                                               dict(max_new_tokens=16, language="en"), monkeypatch)
        if eot_bias:
            first = steps[0].draft.tokens
            assert (first[:, 0] != EOT).all() and (first[:, 1:] == EOT).all()

    @pytest.mark.parametrize("batch", [1, 3])
    @pytest.mark.parametrize("timestamp_bias", [0.0, 4.0], ids=["plain", "timestamps-favoured"])
    def test_with_every_timestamp_in_the_map_the_grammar_runs_in_it(self, target, batch, timestamp_bias, monkeypatch):
        """Long-form transcription's timestamp grammar, with a map that holds every timestamp (a draft
        trained with ``--timestamps``): the draft applies the grammar over its own scores, and every
        draft (tokens, q of each token) is the one scored over the whole vocabulary; the output is
        generate's. A head that favours timestamps takes the grammar through its pairs."""
        from .tiny_whisper import TIMESTAMP_BEGIN, VOCAB

        token_map = torch.tensor(sorted({*WHISPER_MAP.tolist(), *range(TIMESTAMP_BEGIN, VOCAB)}))
        draft = self.biased_draft(target, token_map, token_map >= TIMESTAMP_BEGIN, timestamp_bias)
        steps = self.drafts_in_the_map_and_over_the_vocabulary(
            target, draft, features(batch, seed=80 + batch),
            dict(max_new_tokens=16, language="en", return_timestamps=True), monkeypatch)
        assert any(t >= TIMESTAMP_BEGIN for step in steps if step.draft.width for t in step.draft.tokens.flatten().tolist())

    def test_timestamps_score_the_whole_vocabulary(self, target, monkeypatch):
        """Whisper's timestamp processor reads the tokens so far: with a map that lacks timestamps the
        draft goes through the processors over the whole vocabulary."""
        from specdec.core import drafting

        in_map = []
        original = drafting.TokenByToken._add_in_map
        monkeypatch.setattr(drafting.TokenByToken, "_add_in_map", lambda self, scores: in_map.append(1) or original(self, scores))
        decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=build_draft(target, WHISPER_MAP, init_layers=[0])),
                                     policy=ConstantLookahead(k=3))
        x = features(1, seed=70)
        out = WhisperSpeculativeDecoder(decoder).generate(x, max_new_tokens=16, return_timestamps=True)
        assert torch.equal(out, target.generate(x, max_new_tokens=16, return_timestamps=True))
        assert not in_map
