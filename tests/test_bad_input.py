"""Mistakes a user can make: each gives a clear error naming the problem and changes nothing."""

from __future__ import annotations

import copy

import pytest
import torch

from specdec import ConfigError, IncompatibleModelsError, InputError, PluginError, SpeculativeDecoder
from specdec.drafters import ModelDrafter, NGramDrafter, SharedEncoderDrafter
from specdec.config import SpecdecConfig
from specdec.errors import DraftDtypeWarning
from specdec.policies import ConstantLookahead, LookaheadPolicy

from .conftest import greedy_reference, left_padded_prompts, tiny_model
from .tiny_whisper import tiny_distil_decoder, tiny_whisper


def config(**sections):
    data = {"target": {"model": "unused"}, "drafter": {"use": "ngram"}}
    data.update(sections)
    return SpecdecConfig.from_dict(data)


class TestModelsAndPlugins:
    """Construction-time errors."""

    def test_vocabularies_that_differ_name_both_sizes(self, llama):
        other = tiny_model("llama", layers=1, seed=3, vocab=80)
        with pytest.raises(IncompatibleModelsError, match=r"80 tokens.*61"):
            SpeculativeDecoder(target=llama, drafter=ModelDrafter(other))

    def test_a_half_precision_draft_beside_a_wider_target_on_a_cpu_is_warned_of(self, llama, recwarn):
        # transformers 5 loads a checkpoint saved in float16 as float16 unless told otherwise; on a
        # CPU that draft runs several times slower than in the target's dtype.
        half = copy.deepcopy(tiny_model("llama", layers=1, seed=1)).to(torch.float16)
        with pytest.warns(DraftDtypeWarning, match=r"drafter 'model': the draft model is float16 and the target float64.*dtype=torch.float64"):
            decoder = SpeculativeDecoder(target=llama, drafter=ModelDrafter(half))
        ids, mask = left_padded_prompts([5, 3])
        assert torch.equal(decoder.generate(ids, attention_mask=mask, max_new_tokens=6).sequences,
                           greedy_reference(llama, ids, mask, 6))
        recwarn.clear()
        SpeculativeDecoder(target=llama, drafter=ModelDrafter(tiny_model("llama", layers=1, seed=1)))
        assert not [w for w in recwarn if issubclass(w.category, DraftDtypeWarning)]

    def test_a_half_precision_shared_encoder_draft_is_warned_of_too(self):
        target, draft = tiny_whisper(seed=0), tiny_distil_decoder(seed=1).to(torch.float16)
        with pytest.warns(DraftDtypeWarning, match=r"drafter 'shared-encoder': the draft model is float16 and the target float64"):
            SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=draft))

    def test_unknown_plugin_name_lists_the_known_ones(self):
        with pytest.raises(ConfigError, match=r"unknown drafter 'ngrma'; known drafters: .*model.*ngram"):
            config(drafter={"use": "ngrma"}).build_components()
        with pytest.raises(ConfigError, match=r"unknown policy 'fast'; known policies: .*constant.*heuristic"):
            config(policy={"use": "fast"}).build_components()

    def test_invalid_option_names_the_field_and_the_value(self):
        with pytest.raises(ConfigError, match=r"'k' = -2.*'k' must be >= 0"):
            config(policy={"use": "constant", "k": -2}).build_components()
        with pytest.raises(ConfigError, match=r"'max_ngram' must be int, got 'three'"):
            config(drafter={"use": "ngram", "max_ngram": "three"}).build_components()
        with pytest.raises(ConfigError, match=r"unknown option\(s\) window; its options are: max_ngram, min_ngram"):
            config(drafter={"use": "ngram", "window": 3}).build_components()

    def test_invalid_option_in_python_names_the_field(self):
        with pytest.raises(ValueError, match="min_ngram"):
            NGramDrafter(max_ngram=2, min_ngram=3)

    def test_config_file_errors_name_the_file(self, tmp_path):
        with pytest.raises(ConfigError, match="does not exist"):
            SpecdecConfig.from_toml(tmp_path / "missing.toml")
        broken = tmp_path / "broken.toml"
        broken.write_text("[drafter\nuse = 'ngram'\n")
        with pytest.raises(ConfigError, match=r"broken.toml: not valid TOML.*line 1"):
            SpecdecConfig.from_toml(broken)
        no_target = tmp_path / "no_target.toml"
        no_target.write_text("[drafter]\nuse = 'ngram'\n")
        with pytest.raises(ConfigError, match=r"no_target.toml: \[target\] needs a 'model' key"):
            SpecdecConfig.from_toml(no_target)

    def test_missing_draft_model_path(self, llama, tmp_path):
        with pytest.raises(ConfigError, match="does not exist"):
            SpeculativeDecoder(target=llama, drafter=ModelDrafter(str(tmp_path / "no-such-model")))

    def test_wrong_component_types(self, llama):
        with pytest.raises(ConfigError, match="drafter must be a drafter"):
            SpeculativeDecoder(target=llama, drafter=ConstantLookahead())  # type: ignore[arg-type]


class TestPrompts:
    """Request-time errors leave the decoder usable."""

    @pytest.fixture
    def decoder(self, llama):
        return SpeculativeDecoder(target=llama, drafter=NGramDrafter())

    def _still_works(self, decoder, llama):
        input_ids, mask = left_padded_prompts([3, 6], seed=8)
        out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=6)
        assert torch.equal(out.sequences, greedy_reference(llama, input_ids, mask, 6))

    def test_empty_prompt(self, decoder, llama):
        with pytest.raises(InputError, match="empty prompt"):
            decoder.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=4)
        ids, mask = left_padded_prompts([3, 2])
        mask[1] = 0
        with pytest.raises(InputError, match=r"empty prompt: row\(s\) \[1\]"):
            decoder.generate(ids, attention_mask=mask, max_new_tokens=4)
        self._still_works(decoder, llama)

    def test_prompt_longer_than_context(self, decoder, llama):
        ids = torch.randint(3, 61, (1, 130))
        with pytest.raises(InputError, match="130 tokens is longer than the target's context of 128"):
            decoder.generate(ids, max_new_tokens=4)
        with pytest.raises(InputError, match="exceeds the target's context of 128"):
            decoder.generate(ids[:, :100], max_new_tokens=40)
        self._still_works(decoder, llama)

    def test_other_bad_requests(self, decoder, llama):
        ids, mask = left_padded_prompts([3, 5])
        with pytest.raises(InputError, match="right padding"):
            decoder.generate(ids, attention_mask=mask.flip(1), max_new_tokens=4)
        with pytest.raises(InputError, match="outside the target's vocabulary of 61"):
            decoder.generate(ids + 100, attention_mask=mask, max_new_tokens=4)
        with pytest.raises(InputError, match="max_new_tokens must be a positive integer"):
            decoder.generate(ids, attention_mask=mask, max_new_tokens=0)
        with pytest.raises(InputError, match="unknown generation option"):
            decoder.generate(ids, attention_mask=mask, max_new_tokens=3, warp_speed=9)
        with pytest.raises(ConfigError, match="verifier 'greedy' cannot sample"):
            decoder.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=True)
        with pytest.raises(ConfigError, match="num_beams must be 1"):
            decoder.generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=2)
        with pytest.raises(ConfigError, match="guidance_scale=1.5: classifier-free guidance"):
            decoder.generate(ids, attention_mask=mask, max_new_tokens=3, guidance_scale=1.5)
        with pytest.raises(InputError, match="logits_processor must be a list of transformers LogitsProcessor"):
            decoder.generate(ids, attention_mask=mask, max_new_tokens=3, logits_processor=[42])
        with pytest.raises(ConfigError, match="logits processors: `penalty` has to be a strictly positive float"):
            decoder.generate(ids, attention_mask=mask, max_new_tokens=3, repetition_penalty=-1.0)
        self._still_works(decoder, llama)

    def test_a_plugin_that_raises_is_named_and_the_decoder_recovers(self, llama):
        class Flaky(LookaheadPolicy):
            name = "flaky"
            calls = 0

            def lookahead(self, state):
                Flaky.calls += 1
                if Flaky.calls == 2:
                    raise RuntimeError("lookahead table is corrupt")
                return torch.full((state.active,), 2)

        decoder = SpeculativeDecoder(target=llama, drafter=NGramDrafter(), policy=Flaky())
        ids, mask = left_padded_prompts([4, 7], seed=1)
        with pytest.raises(PluginError, match=r"policy 'flaky' .* failed in lookahead: RuntimeError: lookahead table is corrupt") as info:
            decoder.generate(ids, attention_mask=mask, max_new_tokens=8)
        assert info.value.plugin == "flaky" and info.value.hook == "lookahead"
        self._still_works(decoder, llama)
