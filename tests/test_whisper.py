"""Encoder-decoder targets, the shared_encoder drafter and speculative Whisper transcription.

Every exactness test compares token ids with the target's own ``generate`` on tiny float64
Whisper models (tests/tiny_whisper.py), so numeric ties cannot hide a wrong cache or mask.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import GenerationMixin, GPT2Config, GPT2LMHeadModel

from specdec import ConfigError, IncompatibleModelsError, InputError, SpeculativeDecoder
from specdec.core.models import Seq2SeqRunner, runner_for
from specdec.drafters import ModelDrafter, NGramDrafter, SharedEncoderDrafter
from specdec.plugins import get_registry
from specdec.policies import ConstantLookahead
from specdec.whisper import WhisperSpeculativeDecoder, speculative_whisper_generate

from .conftest import finished_requests
from .tiny_whisper import (
    EOT,
    NO_TIMESTAMPS,
    SOT,
    START_OF_PREV,
    TRANSCRIBE,
    decoder_of,
    features,
    long_form_batch,
    tiny_distil_decoder,
    tiny_whisper,
)

transformers.logging.set_verbosity_error()

MAX_NEW = 20


@pytest.fixture(scope="module")
def target():
    return tiny_whisper(seed=0)


# Drafters by name, built fresh per test (a drafter belongs to one decoder).
DRAFTERS = {
    "ngram": lambda target: NGramDrafter(),
    # A random small decoder: acceptance is near zero, the output must still be the target's.
    "shared_encoder-random": lambda target: SharedEncoderDrafter(model=tiny_distil_decoder(seed=1)),
    # The target's own decoder reading the target's encoder output: every draft is accepted.
    "shared_encoder-copy": lambda target: SharedEncoderDrafter(model=decoder_of(target)),
    # A tiny encoder-decoder draft with its own encoder (the whisper-tiny-for-large case).
    "model-seq2seq": lambda target: ModelDrafter(model=tiny_whisper(seed=5, d_model=16, ffn=32)),
}


def decoder_for(target, drafter: str, k: int = 3) -> SpeculativeDecoder:
    return SpeculativeDecoder(target=target, drafter=DRAFTERS[drafter](target), policy=ConstantLookahead(k=k))


def assert_same(reference, output):
    assert reference.shape == output.shape, (reference.tolist(), output.tolist())
    assert torch.equal(reference, output), (reference.tolist(), output.tolist())


def tiny_moonshine():
    """Another speech encoder-decoder (RoPE decoder, encoder mask in its output), random float64
    weights scaled up so its greedy choices are clear; seeds the global generator (callers draw
    their audio after it, as the tests were written)."""
    config = transformers.MoonshineConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, encoder_num_hidden_layers=1,
        decoder_num_hidden_layers=1, encoder_num_attention_heads=2, decoder_num_attention_heads=2,
        max_position_embeddings=128, decoder_start_token_id=1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    moonshine = transformers.MoonshineForConditionalGeneration(config).to(torch.float64).eval()
    with torch.no_grad():
        for parameter in moonshine.parameters():
            parameter.mul_(3)
    return moonshine


class TestSeq2SeqRunner:
    """The runner that verifies drafts against an encoder-decoder target."""

    def test_holes_give_the_logits_of_the_compact_sequence(self, target):
        """Whisper with holes in its self-attention cache, decoder_attention_mask and decoder_position_ids
        gives the logits of the sequence without them (transformers 5.23)."""
        runner = Seq2SeqRunner(target)
        x = features(2, seed=3)
        encoder_outputs = runner.begin(input_features=x)
        slots = runner.new_cache(2)
        prompt = torch.tensor([[SOT, 258, TRANSCRIBE, NO_TIMESTAMPS], [EOT, SOT, 259, TRANSCRIBE]])
        valid = torch.tensor([[True, True, True, True], [False, True, True, True]])  # row 1 left-padded
        runner.forward(slots, prompt, valid, logits_to_keep=1)
        # Verify three drafts; row 0 keeps one, row 1 none: the rest become holes.
        runner.forward(slots, torch.tensor([[40, 41, 42], [50, 51, 52]]), torch.ones(2, 3, dtype=torch.bool), 3)
        slots.drop_tail(3, keep_columns=torch.tensor([1, 0]))
        logits = runner.forward(slots, torch.tensor([[60, 61], [70, 71]]), torch.ones(2, 2, dtype=torch.bool), 2)
        compact = [[SOT, 258, TRANSCRIBE, NO_TIMESTAMPS, 40, 60, 61], [SOT, 259, TRANSCRIBE, 70, 71]]
        for row, tokens in enumerate(compact):
            reference = target(
                encoder_outputs=(encoder_outputs.last_hidden_state[row : row + 1],),
                decoder_input_ids=torch.tensor([tokens]),
            ).logits[0, -2:]
            torch.testing.assert_close(logits[row], reference, rtol=0, atol=1e-12)

    def test_encodes_once_and_drops_finished_rows(self, target):
        """begin() runs the encoder once; select_rows keeps only the active rows' encoder output."""
        calls = []
        hook = target.model.encoder.register_forward_hook(lambda *args: calls.append(1))
        try:
            runner = Seq2SeqRunner(target)
            hidden = runner.begin(input_features=features(3)).last_hidden_state
            runner.select_rows(torch.tensor([0, 2]))
        finally:
            hook.remove()
        assert len(calls) == 1
        assert torch.equal(runner.encoder_outputs.last_hidden_state, hidden[[0, 2]])

    def test_runner_for_picks_by_architecture(self, target):
        """Encoder-decoder models get a Seq2SeqRunner, causal LMs the CausalLMRunner."""
        assert isinstance(runner_for(target), Seq2SeqRunner)
        assert not isinstance(runner_for(tiny_distil_decoder()), Seq2SeqRunner)


class TestEncoderDecoderGenerate:
    """SpeculativeDecoder.generate with encoder inputs equals the plain greedy loop of transformers."""

    @pytest.mark.parametrize("drafter", sorted(DRAFTERS))
    def test_equals_greedy_generate(self, target, drafter):
        """Decoder prompt as input_ids, audio features as input_features, every drafter."""
        x = features(3, seed=11)
        prompt = torch.tensor([[SOT, 258, TRANSCRIBE, NO_TIMESTAMPS]] * 3)
        reference = GenerationMixin.generate(target, x, decoder_input_ids=prompt, max_new_tokens=MAX_NEW)
        out = decoder_for(target, drafter).generate(prompt, input_features=x, max_new_tokens=MAX_NEW)
        assert_same(reference, out.sequences)
        if drafter == "shared_encoder-copy":
            assert out.stats.acceptance_rate == 1.0

    @pytest.mark.parametrize("drafter", sorted(DRAFTERS))
    @pytest.mark.parametrize("cache", ["dynamic", "static"])
    def test_equals_greedy_generate_on_the_accelerator_path(self, target, drafter, cache, monkeypatch):
        """What a GPU runs, on the CPU: a 4D decoder mask specdec builds at every forward (off the
        CPU transformers' own mask creation from the 2D mask syncs) and drafts to full width."""
        from specdec.core.masks import AttentionLayout

        monkeypatch.setattr("specdec.core.models.PREPARE_MASKS_ON_CPU", True)
        built = []
        masks = AttentionLayout.masks

        def checked(self, slot_mask, *args, **kwargs):
            mask = masks(self, slot_mask, *args, **kwargs)
            # Only slots in use are seen (a hole of the block sees itself): a wrong own slot would show
            # an empty one of a static cache, which the tokens of a random model may not reveal.
            if reading:  # the target's (a shared-encoder draft reads through CausalLMRunner)
                assert not mask[..., reading[-1].length:].any()
                built.append(1)
            return mask

        reading, forward = [], Seq2SeqRunner.forward

        def target_forward(self, slots, *args, **kwargs):
            reading.append(slots)
            try:
                return forward(self, slots, *args, **kwargs)
            finally:
                reading.pop()

        monkeypatch.setattr(Seq2SeqRunner, "forward", target_forward)
        monkeypatch.setattr(AttentionLayout, "masks", checked)
        x = features(3, seed=11)
        prompt = torch.tensor([[SOT, 258, TRANSCRIBE, NO_TIMESTAMPS]] * 3)
        reference = GenerationMixin.generate(target, x, decoder_input_ids=prompt, max_new_tokens=MAX_NEW)
        decoder = SpeculativeDecoder(target=target, drafter=DRAFTERS[drafter](target), policy=ConstantLookahead(k=3),
                                     draft_early_exit=False, static_cache=cache == "static")
        out = decoder.generate(prompt, input_features=x, max_new_tokens=MAX_NEW)
        assert_same(reference, out.sequences)
        assert runner_for(target).prepares_masks_off_cpu and built

    def test_default_prompt_is_the_decoder_start_token(self, target):
        """Without input_ids the decoder starts from decoder_start_token_id, as transformers does."""
        x = features(2, seed=12)
        reference = GenerationMixin.generate(target, x, max_new_tokens=8)
        out = decoder_for(target, "ngram").generate(input_features=x, max_new_tokens=8)
        assert_same(reference, out.sequences)

    def test_precomputed_encoder_outputs(self, target):
        """encoder_outputs= skips the encoder and decodes the same."""
        x = features(2, seed=13)
        encoder_outputs = target.model.encoder(x)
        prompt = torch.tensor([[SOT, 259, TRANSCRIBE, NO_TIMESTAMPS]] * 2)
        reference = GenerationMixin.generate(target, x, decoder_input_ids=prompt, max_new_tokens=10)
        out = decoder_for(target, "shared_encoder-copy").generate(prompt, encoder_outputs=encoder_outputs, max_new_tokens=10)
        assert_same(reference, out.sequences)

    def test_not_whisper_only(self):
        """Another speech encoder-decoder (Moonshine, RoPE decoder, encoder mask in its output) is exact too."""
        moonshine = tiny_moonshine()
        audio = torch.randn(3, 4000, dtype=torch.float64)
        reference = GenerationMixin.generate(moonshine, audio, max_new_tokens=12)
        for drafter in (NGramDrafter(), ModelDrafter(model=moonshine)):
            decoder = SpeculativeDecoder(target=moonshine, drafter=drafter, policy=ConstantLookahead(k=3))
            assert_same(reference, decoder.generate(input_values=audio, max_new_tokens=12).sequences)

    def test_finished_rows_stay_and_leave_exactly_in_another_family(self, monkeypatch):
        """Rows of a Moonshine batch with padded audio end at different steps (2 and 8 of 40), stay
        in the model's batch a while, then the batch is cut: still generate's output."""
        finished = finished_requests(monkeypatch)
        moonshine = tiny_moonshine()
        audio = torch.randn(6, 4000, dtype=torch.float64)
        mask = torch.ones(6, 4000, dtype=torch.long)
        mask[1, 3000:] = 0
        mask[4, 2000:] = 0
        free = GenerationMixin.generate(moonshine, audio, attention_mask=mask, max_new_tokens=40, eos_token_id=None)
        new = free[:, -40:]

        def first_positions(token):
            return {int((row == token).nonzero()[0]) for row in new if bool((row == token).any())}

        eos = max(new.unique().tolist(), key=lambda token: len(first_positions(token)))
        assert len(first_positions(eos)) >= 2, "rows must end at different steps for this test to mean anything"
        reference = GenerationMixin.generate(moonshine, audio, attention_mask=mask, max_new_tokens=40, eos_token_id=eos)
        decoder = SpeculativeDecoder(target=moonshine, drafter=ModelDrafter(model=moonshine), policy=ConstantLookahead(k=3))
        out = decoder.generate(input_values=audio, encoder_attention_mask=mask, max_new_tokens=40, eos_token_id=eos)
        assert_same(reference, out.sequences)
        slots = finished["target"].slots
        assert slots.row_cuts == 1 and slots.physical_batch == 4

    def test_models_without_decoder_positions_are_refused(self):
        """BART cannot take decoder_position_ids, so holes cannot be hidden: a ConfigError says so."""
        bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
            vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)).eval()
        with pytest.raises(ConfigError, match="decoder_position_ids"):
            SpeculativeDecoder(target=bart, drafter=NGramDrafter())

    def test_missing_encoder_input(self, target):
        """An encoder-decoder target without its encoder input is an InputError naming the input."""
        with pytest.raises(InputError, match="input_features"):
            decoder_for(target, "ngram").generate(torch.tensor([[SOT]]), max_new_tokens=4)

    def test_encoder_rows_must_match_prompt_rows(self, target):
        """Two prompts for three audios is an InputError."""
        with pytest.raises(InputError, match="3 rows"):
            decoder_for(target, "ngram").generate(torch.tensor([[SOT], [SOT]]), input_features=features(3), max_new_tokens=4)

    def test_model_drafter_with_own_encoder_needs_the_features(self, target):
        """An encoder-decoder draft cannot run on the target's encoder_outputs alone."""
        decoder = decoder_for(target, "model-seq2seq")
        with pytest.raises(Exception, match="own encoder"):
            decoder.generate(torch.tensor([[SOT]]), encoder_outputs=target.model.encoder(features(1)), max_new_tokens=4)


class TestWhisperExact:
    """speculative_whisper_generate returns target.generate's token ids for every Whisper option."""

    OPTIONS = {
        "transcribe-en": dict(language="en"),
        "translate-fr": dict(language="fr", task="translate"),
        "timestamps": dict(return_timestamps=True),
        "detect-language": dict(),
        "timestamps-de": dict(language="de", return_timestamps=True),
    }

    @pytest.mark.parametrize("drafter", sorted(DRAFTERS))
    @pytest.mark.parametrize("option", sorted(OPTIONS))
    def test_each_option_each_drafter(self, target, drafter, option):
        """Batch 3: forced language and task tokens, detection, suppression, the timestamp grammar."""
        x = features(3, seed=21)
        kwargs = dict(self.OPTIONS[option], max_new_tokens=MAX_NEW)
        reference = target.generate(x, **kwargs)
        whisper = WhisperSpeculativeDecoder(decoder_for(target, drafter))
        assert_same(reference, whisper.generate(x, **kwargs))
        if drafter == "shared_encoder-copy":
            assert whisper.stats.decode.acceptance_rate == 1.0
            assert whisper.stats.tokens_per_target_call > 1.5

    @pytest.mark.parametrize("batch", [1, 2, 3, 4])
    def test_batch_sizes(self, target, batch):
        """Batch 1 to 4 with timestamps, where rows end at different steps."""
        x = features(batch, seed=30 + batch)
        reference = target.generate(x, return_timestamps=True, max_new_tokens=MAX_NEW)
        out = speculative_whisper_generate(decoder_for(target, "shared_encoder-random"), x, return_timestamps=True,
                                           max_new_tokens=MAX_NEW)
        assert_same(reference, out)

    @pytest.mark.parametrize("drafter", ["ngram", "shared_encoder-copy", "model-seq2seq"])
    def test_long_form(self, target, drafter):
        """Two audios of 45 s and 70 s: 30-second windows, seeking by timestamps, rows leaving the batch."""
        x, kwargs = long_form_batch()
        reference = target.generate(x, **kwargs)
        whisper = WhisperSpeculativeDecoder(decoder_for(target, drafter))
        out = whisper.generate(x, **kwargs)
        assert_same(reference["sequences"], out["sequences"])
        assert [[(float(s["start"]), float(s["end"])) for s in row] for row in out["segments"]] == [
            [(float(s["start"]), float(s["end"])) for s in row] for row in reference["segments"]
        ]
        assert whisper.stats.windows > 2
        assert whisper.stats.audio_seconds == pytest.approx(115.0)
        assert whisper.stats.rtfx > 0

    def test_previous_text_and_prompt(self, target):
        """condition_on_prev_tokens and prompt_ids give left-padded decoder prompts; still exact."""
        x = features(2, seed=50, frames=6500)
        prompt_ids = torch.tensor([START_OF_PREV, 65, 66, 67])
        for kwargs in (dict(condition_on_prev_tokens=True), dict(prompt_ids=prompt_ids)):
            kwargs.update(attention_mask=torch.ones(2, 6500, dtype=torch.long), return_timestamps=True, max_new_tokens=15)
            reference = target.generate(x, **kwargs)
            assert_same(reference, speculative_whisper_generate(decoder_for(target, "ngram"), x, **kwargs))


class TestWhisperRefusals:
    """What speculative transcription cannot do is refused with a clear error, never decoded wrong."""

    def test_scores_are_refused(self, target):
        """logprob_threshold needs per-token scores specdec does not return."""
        whisper = WhisperSpeculativeDecoder(decoder_for(target, "ngram"))
        with pytest.raises(ConfigError, match="output_scores"):
            whisper.generate(features(1), logprob_threshold=-1.0, max_new_tokens=4)

    def test_temperature_fallback_needs_a_sampling_verifier(self, target):
        """Sampling at fallback temperatures is refused by the greedy verifier."""
        whisper = WhisperSpeculativeDecoder(decoder_for(target, "ngram"))
        with pytest.raises(ConfigError, match="do_sample"):
            whisper.generate(features(1), temperature=0.4, max_new_tokens=4)

    def test_needs_a_whisper_target(self):
        """A decoder-only target is not a Whisper target."""
        gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)).eval()
        with pytest.raises(ConfigError, match="Whisper target"):
            WhisperSpeculativeDecoder(SpeculativeDecoder(target=gpt2, drafter=NGramDrafter()))

    def test_decoding_method_belongs_to_its_target(self, target):
        """The decoding method of one decoder is refused by another model's generate."""
        other = tiny_whisper(seed=3)
        method = decoder_for(target, "ngram").decoding_method()
        with pytest.raises(ConfigError, match="target"):
            other.generate(features(1), custom_generate=method, max_new_tokens=4)


class TestSharedEncoderDrafter:
    """The shared_encoder drafter checks its decoder against the target when the decoder is built."""

    def test_registered(self):
        """It is a built-in drafter, registered by name (listed as shared-encoder; shared_encoder finds it too)."""
        assert "shared-encoder" in get_registry().names("drafter")
        assert get_registry().get("drafter", "shared_encoder").factory is SharedEncoderDrafter

    def test_hidden_size_mismatch_names_both_sizes(self, target):
        """A draft narrower than the target's encoder output is refused, naming both widths."""
        drafter = SharedEncoderDrafter(model=tiny_distil_decoder(d_model=48))
        with pytest.raises(IncompatibleModelsError, match=r"hidden size is 48.*hidden size 32"):
            SpeculativeDecoder(target=target, drafter=drafter)

    def test_vocabulary_mismatch_names_both_sizes(self, target):
        """A draft with another vocabulary is refused, naming both sizes."""
        drafter = SharedEncoderDrafter(model=tiny_distil_decoder(vocab_size=1800))
        with pytest.raises(IncompatibleModelsError, match=r"1800 tokens.*1768"):
            SpeculativeDecoder(target=target, drafter=drafter)

    def test_needs_an_encoder_decoder_target(self):
        """A decoder-only target has no encoder to share."""
        gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=1768)).eval()
        with pytest.raises(IncompatibleModelsError, match="no encoder to share"):
            SpeculativeDecoder(target=gpt2, drafter=SharedEncoderDrafter(model=tiny_distil_decoder()))

    def test_refuses_a_draft_without_cross_attention(self, target):
        """A plain causal LM of the right width and vocabulary cannot read an encoder output."""
        gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=1768)).to(torch.float64).eval()
        with pytest.raises(IncompatibleModelsError, match="no cross-attention"):
            SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=gpt2))

    def test_refuses_a_draft_with_its_own_encoder(self, target):
        """A full Whisper as draft belongs to drafter 'model'."""
        with pytest.raises(IncompatibleModelsError, match="drafter 'model'"):
            SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=tiny_whisper(seed=2)))

    def test_loads_a_saved_decoder_by_path(self, target, tmp_path):
        """From plugins.toml the draft is a path, loaded as a causal LM in the target's dtype."""
        tiny_distil_decoder().save_pretrained(tmp_path / "draft")
        drafter = get_registry().create("drafter", "shared_encoder", {"model": str(tmp_path / "draft")})
        SpeculativeDecoder(target=target, drafter=drafter)
        assert drafter.model.dtype == torch.float64
        assert type(drafter.model).__name__ == "WhisperForCausalLM"


class TestSharedCrossAttention:
    """A draft layer whose cross-attention projections are a target layer's reads the target's keys."""

    @staticmethod
    def pair():
        target = tiny_whisper(seed=0, decoder_layers=2)
        draft = tiny_distil_decoder(seed=1, decoder_layers=2)
        mine, theirs = draft.model.decoder.layers[0].encoder_attn, target.model.decoder.layers[1].encoder_attn
        with torch.no_grad():
            for name in ("k_proj", "v_proj"):
                getattr(mine, name).load_state_dict(getattr(theirs, name).state_dict())
        return target, draft

    def test_equal_projections_are_found(self, target):
        from specdec.drafters.shared_encoder import shared_cross_attention_layers

        paired_target, paired_draft = self.pair()
        assert shared_cross_attention_layers(paired_draft, paired_target) == [(0, 1)]
        assert shared_cross_attention_layers(tiny_distil_decoder(seed=1), target) == []

    @pytest.mark.parametrize("plain_first", [False, True], ids=["draft-reads-first", "target-reads-first"])
    def test_keys_are_computed_once_and_output_is_exact(self, plain_first, monkeypatch):
        """Whichever model reads the encoder output first computes the shared layer's keys; the
        other never runs that projection. Transcripts equal generate's."""
        finished = finished_requests(monkeypatch)
        target, draft = self.pair()

        class PlainFirst(ConstantLookahead):
            def lookahead(self, state):
                k = super().lookahead(state)
                return k * 0 if plain_first and state.iteration == 0 else k

        x = features(3, seed=51)
        prompt = torch.tensor([[SOT, 258, TRANSCRIBE, NO_TIMESTAMPS]] * 3)
        reference = GenerationMixin.generate(target, x, decoder_input_ids=prompt, max_new_tokens=12)
        calls = {"draft": 0, "target": 0}
        hooks = [draft.model.decoder.layers[0].encoder_attn.k_proj.register_forward_hook(
                     lambda *a: calls.__setitem__("draft", calls["draft"] + 1)),
                 target.model.decoder.layers[1].encoder_attn.k_proj.register_forward_hook(
                     lambda *a: calls.__setitem__("target", calls["target"] + 1))]
        try:
            decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=draft), policy=PlainFirst(k=2))
            out = decoder.generate(prompt, input_features=x, max_new_tokens=12)
        finally:
            for hook in hooks:
                hook.remove()
        assert_same(reference, out.sequences)
        assert calls == ({"draft": 0, "target": 1} if plain_first else {"draft": 1, "target": 0})
        draft_layer = finished["draft"].slots.cache.cross_attention_cache.layers[0]
        target_layer = finished["target"].slots.cache.cross_attention_cache.layers[1]
        assert draft_layer.keys is target_layer.keys and draft_layer.values is target_layer.values


class TestModelDrafterEncoderDecoder:
    """The model drafter pairs an encoder-decoder draft with an encoder-decoder target."""

    def test_mel_bins_must_match(self, target):
        """A draft reading other features is refused, naming both."""
        drafter = ModelDrafter(model=tiny_whisper(seed=4, num_mel_bins=128))
        with pytest.raises(IncompatibleModelsError, match=r"num_mel_bins=128.*num_mel_bins=80"):
            SpeculativeDecoder(target=target, drafter=drafter)

    def test_decoder_only_draft_points_to_shared_encoder(self, target):
        """A decoder-only draft for an encoder-decoder target names the drafter that takes it."""
        with pytest.raises(IncompatibleModelsError, match="shared-encoder"):
            SpeculativeDecoder(target=target, drafter=ModelDrafter(model=tiny_distil_decoder()))


@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=128, eos_token_id=3,
                        bos_token_id=3, pad_token_id=0)
    return GPT2LMHeadModel(config).to(torch.float64).eval()


class TestDecoderOnlyUnchanged:
    """Decoder-only targets still decode exactly: the loop, runner and processor changes are shared."""

    @pytest.mark.parametrize("drafter", ["ngram", "model"])
    def test_left_padded_batch_with_processors(self, gpt2, drafter):
        """Left padding and history-dependent processors (no_repeat_ngram_size, repetition_penalty)."""
        torch.manual_seed(1)
        input_ids = torch.randint(4, 96, (3, 7))
        mask = torch.ones_like(input_ids)
        mask[1, :3] = 0
        mask[2, :5] = 0
        input_ids[mask == 0] = 0
        options = dict(max_new_tokens=16, no_repeat_ngram_size=2, repetition_penalty=1.3, do_sample=False)
        reference = gpt2.generate(input_ids, attention_mask=mask, **options)
        if drafter == "ngram":
            draft = NGramDrafter()
        else:
            draft = ModelDrafter(model=gpt2)  # the target drafting for itself: all accepted
        decoder = SpeculativeDecoder(target=gpt2, drafter=draft, policy=ConstantLookahead(k=4))
        out = decoder.generate(input_ids, attention_mask=mask, **options)
        assert_same(reference, out.sequences)
        if drafter == "model":
            assert out.stats.acceptance_rate == 1.0

    def test_as_transformers_decoding_method(self, gpt2):
        """gpt2.generate(custom_generate=decoder.decoding_method()) equals gpt2.generate."""
        input_ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
        mask = (input_ids != 0).long()
        reference = gpt2.generate(input_ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        decoder = SpeculativeDecoder(target=gpt2, drafter=NGramDrafter())
        out = gpt2.generate(input_ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                            custom_generate=decoder.decoding_method())
        assert_same(reference, out)

    def test_encoder_inputs_are_refused(self, gpt2):
        """A decoder-only target given input_features is an InputError, not a silent ignore."""
        decoder = SpeculativeDecoder(target=gpt2, drafter=NGramDrafter())
        with pytest.raises(InputError):
            decoder.generate(torch.tensor([[5, 6]]), input_features=features(1), max_new_tokens=2)


def spoken(seconds: list[float], seed=0) -> torch.Tensor:
    """Whisper's own log-mel features (float64) of noise bursts of these lengths, padded with silence
    to 30 s by the feature extractor, as every short utterance is."""
    from transformers import WhisperFeatureExtractor

    generator = torch.Generator().manual_seed(seed)
    audio = [(0.1 * torch.randn(int(16_000 * s), generator=generator)).numpy() for s in seconds]
    return WhisperFeatureExtractor()(audio, sampling_rate=16_000, return_tensors="pt").input_features.double()


class TestEncoderFrames:
    """``encoder_frames = "audio"``: after its first forward the draft's cross-attention reads only the
    encoder frames that hold the audio (and 2 s past it); the target reads all 1500."""

    def test_audio_frames_of_whisper_features(self):
        from specdec.drafters.shared_encoder import AUDIO_MARGIN_FRAMES, audio_frames

        five = audio_frames(spoken([5.0]), 1500)
        assert abs(five - (250 + AUDIO_MARGIN_FRAMES)) <= 2  # 50 encoder frames a second
        assert audio_frames(spoken([3.0, 8.0]), 1500) == audio_frames(spoken([8.0]), 1500)  # the longest row
        assert audio_frames(spoken([5.0]), 1500, margin=0) == five - AUDIO_MARGIN_FRAMES
        assert audio_frames(spoken([29.0]), 1500) is None  # audio and margin fill the window
        assert audio_frames(features(2, seed=3), 1500) is None  # no silence padding: every frame
        assert audio_frames(None, 1500) is None and audio_frames(torch.zeros(80, 3000), 1500) is None

    @pytest.mark.parametrize("batch", [1, 3])
    def test_narrowed_draft_is_exact(self, target, batch, monkeypatch):
        x = spoken([4.0, 2.5, 6.0][:batch], seed=batch)
        prompt = torch.tensor([[SOT, 258, TRANSCRIBE, NO_TIMESTAMPS]] * batch)
        reference = GenerationMixin.generate(target, x, decoder_input_ids=prompt, max_new_tokens=MAX_NEW)
        from specdec.drafters.shared_encoder import audio_frames

        frames = audio_frames(x, 1500)
        finished = finished_requests(monkeypatch)
        for drafter in (SharedEncoderDrafter(model=decoder_of(target)), SharedEncoderDrafter(model=tiny_distil_decoder(seed=1))):
            decoder = SpeculativeDecoder(target=target, drafter=drafter, policy=ConstantLookahead(k=3))
            out = decoder.generate(prompt, input_features=x, max_new_tokens=MAX_NEW)
            assert_same(reference, out.sequences)
            assert [layer.keys.shape[-2] for layer in finished["draft"].slots.cache.cross_attention_cache.layers] == [frames]
            assert [layer.keys.shape[-2] for layer in finished["target"].slots.cache.cross_attention_cache.layers] == [1500]

    def test_all_frames_keeps_every_frame(self, target, monkeypatch):
        x = spoken([4.0])
        finished = finished_requests(monkeypatch)
        drafter = SharedEncoderDrafter(model=decoder_of(target), encoder_frames="all")
        decoder = SpeculativeDecoder(target=target, drafter=drafter, policy=ConstantLookahead(k=3))
        decoder.generate(torch.tensor([[SOT, 258, TRANSCRIBE, NO_TIMESTAMPS]]), input_features=x, max_new_tokens=8)
        assert [layer.keys.shape[-2] for layer in finished["draft"].slots.cache.cross_attention_cache.layers] == [1500]

    def test_a_shared_layer_is_lent_whole_then_narrowed(self, monkeypatch):
        """The draft reads first and computes the shared layer's keys over every frame: the target
        takes them whole (it never computes them), the draft keeps a view of the audio's frames."""
        finished = finished_requests(monkeypatch)
        target, draft = TestSharedCrossAttention.pair()
        x = spoken([3.0, 5.0], seed=7)
        prompt = torch.tensor([[SOT, 258, TRANSCRIBE, NO_TIMESTAMPS]] * 2)
        reference = GenerationMixin.generate(target, x, decoder_input_ids=prompt, max_new_tokens=12)
        calls = []
        hook = target.model.decoder.layers[1].encoder_attn.k_proj.register_forward_hook(lambda *a: calls.append(1))
        try:
            drafter = SharedEncoderDrafter(model=draft)
            decoder = SpeculativeDecoder(target=target, drafter=drafter, policy=ConstantLookahead(k=2))
            out = decoder.generate(prompt, input_features=x, max_new_tokens=12)
        finally:
            hook.remove()
        assert_same(reference, out.sequences)
        assert calls == []
        mine = finished["draft"].slots.cache.cross_attention_cache.layers[0].keys
        theirs = finished["target"].slots.cache.cross_attention_cache.layers[1].keys
        assert theirs.shape[-2] == 1500 and mine.shape[-2] < 1500 and mine.data_ptr() == theirs.data_ptr()

    def test_bad_value_is_refused(self):
        with pytest.raises(ConfigError, match="drafter 'shared-encoder': option 'encoder_frames' must be one of 'audio', 'all', got 'some'"):
            get_registry().create("drafter", "shared-encoder", {"model": "x", "encoder_frames": "some"})


class TestBeginSuppression:
    """Whisper's ``begin_suppress_tokens`` act at the begin index only; past it, scoring a position
    builds no per-row ``input_ids`` for them (the host knows every row's length)."""

    def test_input_ids_are_built_only_at_the_begin_index(self, target, monkeypatch):
        from specdec.core.state import DecodeState

        built = []
        original = DecodeState._length_groups

        def counted(self):
            built.append(self.lengths_host[self.rows_host].tolist())
            return original(self)

        monkeypatch.setattr(DecodeState, "_length_groups", counted)
        x = features(2, seed=11)
        prompt = torch.tensor([[SOT, 258, TRANSCRIBE, NO_TIMESTAMPS]] * 2)
        reference = GenerationMixin.generate(target, x, decoder_input_ids=prompt, max_new_tokens=MAX_NEW)
        out = decoder_for(target, "shared_encoder-random").generate(prompt, input_features=x, max_new_tokens=MAX_NEW)
        assert_same(reference, out.sequences)
        assert built and all(lengths == [4, 4] for lengths in built)  # the prompt's 4 tokens: the begin index
