"""The ``hidden_state`` drafter (an EAGLE-style head on the target's hidden states): exact on several
architectures, trainable, saved and loaded, and refused clearly where it cannot work."""

from __future__ import annotations

import functools

import pytest
import torch

from specdec import ConfigError, IncompatibleModelsError, InputError, SpeculativeDecoder
from specdec.drafters import HiddenStateDrafter, HiddenStateHead
from specdec.drafters.hidden_state import head_config
from specdec.policies import ConstantLookahead, HeuristicLookahead
from specdec.training.hidden_state import train_hidden_state_head
from specdec.verifiers import RejectionVerifier

from .architectures import tiny_family_model
from .conftest import greedy_reference, left_padded_prompts, tiny_model


@functools.cache
def trained_head(arch: str) -> HiddenStateHead:
    """A head fitted for a few steps to the target's own greedy continuations (so drafts get accepted)."""
    target = target_for(arch)
    ids, mask = left_padded_prompts([6] * 8, seed=3, vocab=target.config.vocab_size)
    texts = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40).tolist()
    report = train_hidden_state_head(target, texts, vocab=24, length=16, epochs=6, batch_size=4, lr=3e-3, seed=0)
    return report.head


def target_for(arch: str):
    return tiny_family_model(arch) if arch in ("sliding", "ssm2") else tiny_model(arch)


class TestExactness:
    @pytest.mark.parametrize("arch", ["llama", "gpt2", "sliding"])
    @pytest.mark.parametrize("policy", ["constant", "heuristic"])
    @pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
    def test_matches_target_generate_on_a_ragged_batch(self, arch, policy, static):
        target = target_for(arch)
        vocab = target.config.vocab_size
        ids, mask = left_padded_prompts([9, 3, 14, 6], vocab=vocab)
        expected = greedy_reference(target, ids, mask, 20)
        decoder = SpeculativeDecoder(target=target, drafter=HiddenStateDrafter(trained_head(arch)),
                                     policy=ConstantLookahead(k=3) if policy == "constant" else HeuristicLookahead(),
                                     static_cache=static)
        out = decoder.generate(ids, attention_mask=mask, max_new_tokens=20)
        assert torch.equal(out.sequences, expected)
        assert out.stats.drafted > 0  # it drafted after the first (plain) step

    def test_the_trained_head_gets_drafts_accepted(self):
        target = target_for("llama")
        ids, mask = left_padded_prompts([6, 6], seed=3, vocab=target.config.vocab_size)
        # A constant k: this is about the head's drafts, not whether drafting pays on a tiny model.
        out = SpeculativeDecoder(target=target, drafter=HiddenStateDrafter(trained_head("llama")),
                                 policy=ConstantLookahead()).generate(ids, attention_mask=mask, max_new_tokens=30)
        assert out.stats.accepted > 0

    def test_sampling_drafts_only_tokens_of_the_map(self):
        target = target_for("llama")
        head = trained_head("llama")
        ids, mask = left_padded_prompts([5, 8], vocab=target.config.vocab_size)
        seen = []

        class Spy(HiddenStateDrafter):
            def propose(self, state, max_tokens, keep_drafting):
                draft = super().propose(state, max_tokens, keep_drafting)
                if draft.probs is not None:
                    outside = torch.ones(draft.probs.shape[-1], dtype=torch.bool)
                    outside[head.token_map] = False
                    seen.append(float(draft.probs[..., outside].sum()))
                return draft

        out = SpeculativeDecoder(target=target, drafter=Spy(head), policy=ConstantLookahead(),
                                 verifier=RejectionVerifier()).generate(
            ids, attention_mask=mask, max_new_tokens=16, do_sample=True, generator=torch.Generator().manual_seed(0))
        assert out.stats.drafted >= 4 and len(seen) >= 2  # rows may sample eos early: enough drafts to judge
        assert max(seen) == 0.0


class TestTraining:
    def test_loss_goes_down(self):
        target = tiny_model("llama")
        ids, mask = left_padded_prompts([6] * 8, seed=5)
        texts = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40).tolist()
        report = train_hidden_state_head(target, texts, vocab=20, length=16, epochs=30, batch_size=4, lr=1e-2)
        first, last = sum(report.losses[:3]) / 3, sum(report.losses[-3:]) / 3
        assert last < 0.8 * first
        assert report.head.token_map.numel() == 20 and 0 < report.map_coverage <= 1

    def test_too_little_text_is_refused(self):
        with pytest.raises(InputError, match="fewer than two rows"):
            train_hidden_state_head(tiny_model("llama"), [[3, 4, 5]], length=16)


class TestFiles:
    def test_saved_and_loaded_by_path_through_the_plugin(self, tmp_path):
        target = tiny_model("llama")
        path = trained_head("llama").save(tmp_path / "head.safetensors")
        ids, mask = left_padded_prompts([7, 4])
        decoder = SpeculativeDecoder(target=target, drafter=HiddenStateDrafter(str(path)))
        assert torch.equal(decoder.generate(ids, attention_mask=mask, max_new_tokens=12).sequences,
                           greedy_reference(target, ids, mask, 12))

    def test_a_head_path_in_plugins_toml_is_relative_to_the_file(self, tmp_path):
        from specdec.config import SpecdecConfig

        (tmp_path / "heads").mkdir()
        trained_head("llama").save(tmp_path / "heads" / "head.safetensors")
        config = tmp_path / "plugins.toml"
        config.write_text('[target]\nmodel = "t"\n\n[drafter]\nuse = "hidden-state"\nhead = "heads/head.safetensors"\n')
        drafter = SpecdecConfig.from_toml(config).drafter
        assert drafter.options["head"] == str(tmp_path / "heads" / "head.safetensors")

    def test_a_head_for_another_target_is_refused(self, tmp_path):
        path = trained_head("llama").save(tmp_path / "head.safetensors")
        with pytest.raises(IncompatibleModelsError, match="trained for a llama target"):
            SpeculativeDecoder(target=tiny_model("gpt2"), drafter=HiddenStateDrafter(str(path)))

    def test_a_token_map_outside_the_vocabulary_is_refused(self, tmp_path):
        target = tiny_model("llama")
        head = HiddenStateHead(head_config(target.config), torch.tensor([1, 2, 500]))
        path = head.save(tmp_path / "bad.safetensors")
        with pytest.raises(IncompatibleModelsError, match="outside the target's vocabulary"):
            SpeculativeDecoder(target=target, drafter=HiddenStateDrafter(str(path)))

    def test_missing_file_and_other_formats_are_config_errors(self, tmp_path):
        with pytest.raises(ConfigError, match="does not exist"):
            SpeculativeDecoder(target=tiny_model("llama"), drafter=HiddenStateDrafter(str(tmp_path / "none")))
        other = tmp_path / "other.safetensors"
        other.write_bytes(b"not safetensors at all")
        with pytest.raises(ConfigError, match="not a safetensors file"):
            SpeculativeDecoder(target=tiny_model("llama"), drafter=HiddenStateDrafter(str(other)))

    def test_a_target_whose_cache_cannot_hold_holes_is_refused(self):
        """Its head would be the same architecture, which is re-read from token ids, never from embeddings."""
        target = tiny_family_model("local")
        head = HiddenStateHead(head_config(target.config), torch.tensor([3, 4, 5]))
        with pytest.raises(IncompatibleModelsError, match=r"one-layer gpt_neo, which cannot keep a cache with holes \(.*slot"):
            SpeculativeDecoder(target=target, drafter=HiddenStateDrafter(head))

    def test_an_encoder_decoder_target_other_than_whisper_is_refused(self):
        from .test_whisper import tiny_moonshine

        with pytest.raises(IncompatibleModelsError, match="encoder-decoder; the hidden-state head drafts for "
                                                          "decoder-only targets and Whisper"):
            SpeculativeDecoder(target=tiny_moonshine(), drafter=HiddenStateDrafter(trained_head("llama")))

    def test_a_head_for_another_architecture_is_refused(self):
        from .tiny_whisper import tiny_whisper

        with pytest.raises(IncompatibleModelsError, match="the head is a llama head; this target is a whisper"):
            SpeculativeDecoder(target=tiny_whisper(), drafter=HiddenStateDrafter(trained_head("llama")))


class TestHiddenStateAPI:
    """What a third-party drafter that sets ``wants_hidden_states`` receives in ``on_step``."""

    def test_every_committed_position_arrives_once_with_the_targets_own_hidden_state(self):
        from .test_exactness import NonsenseDrafter

        target = tiny_model("llama")
        ids, mask = left_padded_prompts([9, 3, 14])
        seen: dict[tuple[int, int], torch.Tensor] = {}

        class Recording(NonsenseDrafter):
            wants_hidden_states = True

            def on_step(self, state, step):
                assert step.hidden_states.shape[:2] == step.hidden_positions.shape
                for b, row in enumerate(step.rows_host.tolist()):
                    for j, position in enumerate(step.hidden_positions[b].tolist()):
                        if position >= 0:
                            assert (row, position) not in seen  # once
                            seen[(row, position)] = step.hidden_states[b, j]

        out = SpeculativeDecoder(target=target, drafter=Recording(target.config.vocab_size),
                                 policy=ConstantLookahead(k=3)).generate(ids, attention_mask=mask, max_new_tokens=12)
        sequences = out.sequences
        assert not (sequences[:, ids.shape[1]:] == 2).any()  # no row ended early: every position was read
        full = torch.cat([mask, torch.ones(3, sequences.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        reference = target(sequences, attention_mask=full, position_ids=(full.cumsum(1) - 1).clamp(min=0),
                           output_hidden_states=True).hidden_states[-1]
        for row in range(3):
            real = range(int((mask[row] == 0).sum()), sequences.shape[1] - 1)  # all but the last token
            assert {p for r, p in seen if r == row} == set(real)
            for position in real:
                torch.testing.assert_close(seen[(row, position)], reference[row, position], rtol=0, atol=1e-6)

    def test_drafters_that_do_not_ask_get_none(self, llama, llama_draft):
        from specdec.drafters import ModelDrafter

        got = []

        class Spy(ModelDrafter):
            def on_step(self, state, step):
                got.append(step.hidden_states)
                super().on_step(state, step)

        ids, mask = left_padded_prompts([5])
        SpeculativeDecoder(target=llama, drafter=Spy(llama_draft)).generate(ids, attention_mask=mask, max_new_tokens=6)
        assert got and all(h is None for h in got)


class TestTrainingOptions:
    def test_features_are_cached_and_reused(self, tmp_path, monkeypatch):
        """A second run on the same rows reads the target's hidden states from the cache file."""
        from specdec.training import hidden_state as training

        target = tiny_model("llama")
        ids, mask = left_padded_prompts([6] * 4, seed=5)
        texts = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=30).tolist()
        cache = tmp_path / "features.pt"
        first = train_hidden_state_head(target, texts, vocab=20, length=16, epochs=2, batch_size=4,
                                        feature_cache=cache, schedule="cosine")
        assert cache.is_file()
        calls = []
        real = training.target_features
        monkeypatch.setattr(training, "target_features", lambda *a, **k: calls.append(1) or real(*a, **k))
        second = train_hidden_state_head(target, texts, vocab=20, length=16, epochs=2, batch_size=4,
                                         feature_cache=cache, schedule="cosine")
        assert len(calls) == 1  # the held-out check only: the training rows came from the cache
        assert torch.equal(first.head.token_map, second.head.token_map)

    @pytest.mark.parametrize("arch", ["llama", "gpt2"])
    def test_unrolled_steps_see_what_a_draft_sees(self, arch):
        """Step s of unrolled training at index j equals the head drafting its (s + 1)-th token after
        reading positions 0..j with real hidden states: token by token through a cache, its own
        predictions fed back (float64)."""
        from transformers import DynamicCache

        from specdec.training.hidden_state import unrolled_predictions

        target = target_for(arch).to(torch.float64)
        head = HiddenStateHead(head_config(target.config), torch.arange(24)).to(torch.float64).eval()
        head.attach(target.get_output_embeddings().weight)
        embedding = target.get_input_embeddings()
        tokens = torch.randint(0, target.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
        features = torch.randn(2, 12, target.config.hidden_size, dtype=torch.float64,
                               generator=torch.Generator().manual_seed(2))
        steps = 3
        unrolled = unrolled_predictions(head, embedding, tokens, features, steps)
        length = 12 - steps
        assert [tuple(p.shape) for p in unrolled] == [(2, length, target.config.hidden_size)] * steps
        for j in (0, 4, length - 1):
            cache = DynamicCache(config=head.config)
            inputs = torch.cat([embedding(tokens[:, 1 : j + 2]), features[:, : j + 1]], dim=-1)
            out = head(inputs_embeds=inputs, position_ids=torch.arange(j + 1)[None].expand(2, -1),
                       past_key_values=cache, use_cache=True)
            predicted = out.hidden_states[-1][:, -1]
            torch.testing.assert_close(predicted, unrolled[0][:, j], rtol=1e-9, atol=1e-9)
            for step in range(1, steps):
                inputs = torch.cat([embedding(tokens[:, j + 1 + step : j + 2 + step]), predicted[:, None]], dim=-1)
                out = head(inputs_embeds=inputs, position_ids=torch.full((2, 1), j + step),
                           past_key_values=cache, use_cache=True)
                predicted = out.hidden_states[-1][:, -1]
                torch.testing.assert_close(predicted, unrolled[step][:, j], rtol=1e-9, atol=1e-9)

    def test_unrolled_training_reports_every_step(self, tmp_path):
        target = tiny_model("llama")
        ids, mask = left_padded_prompts([6] * 8, seed=5)
        texts = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40).tolist()
        report = train_hidden_state_head(target, texts, tmp_path / "head.safetensors", vocab=20, length=16,
                                         epochs=20, batch_size=4, lr=1e-2, unroll=3, holdout=0.2)
        first, last = sum(report.losses[:3]) / 3, sum(report.losses[-3:]) / 3
        assert last < 0.8 * first
        assert len(report.heldout_top1_per_step) == 3 and report.heldout_top1 == report.heldout_top1_per_step[0]
        assert all(0.0 <= top1 <= 1.0 for top1 in report.heldout_top1_per_step)
        assert "step 2:" in report.summary() and "step 3:" in report.summary()
        assert HiddenStateHead.load(report.path, target).token_map.numel() == 20
        assert all(p.grad is None for p in target.parameters())  # the target is read, never trained

    def test_training_continues_from_a_given_head(self, tmp_path):
        """``init``: the head starts from the given one (its token map kept, the given head untouched),
        so its first loss is the trained head's, far below a fresh head's."""
        target = tiny_model("llama")
        ids, mask = left_padded_prompts([6] * 8, seed=5)
        texts = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=40).tolist()
        first = train_hidden_state_head(target, texts, tmp_path / "first.safetensors", vocab=20, length=16,
                                        epochs=20, batch_size=4, lr=1e-2)
        before = {name: value.clone() for name, value in first.head.state_dict().items()}
        again = train_hidden_state_head(target, texts, vocab=12, length=16, epochs=1, batch_size=4, lr=1e-3,
                                        unroll=2, init=first.path)
        assert torch.equal(again.head.token_map, first.head.token_map)  # vocab=12 is not applied
        assert again.losses[0] < 0.5 * first.losses[0]
        continued = train_hidden_state_head(target, texts, vocab=20, length=16, epochs=1, batch_size=4, lr=1e-3,
                                            init=first.head)
        assert continued.head is not first.head
        assert all(torch.equal(value, first.head.state_dict()[name]) for name, value in before.items())

    @pytest.mark.parametrize("unroll", [0, 9])
    def test_an_unroll_that_does_not_fit_the_rows_is_refused(self, unroll):
        with pytest.raises(InputError, match="unroll must be between 1 and half the row length \\(8\\)"):
            train_hidden_state_head(tiny_model("llama"), [[3, 4, 5] * 20], length=16, unroll=unroll)

    def test_text_rows_begin_with_a_text_and_pad_the_rest(self):
        from specdec.training.hidden_state import text_rows

        rows, real = text_rows([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11, 12], [13]], None, 5, pad=0)
        # [1 2 3] and [4 5] fill a row; the long text fills a row of its own and its tail starts the
        # next, which [13] joins; the rest is padding.
        assert rows.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 0, 0]]
        assert real.tolist() == [[True] * 5, [True] * 5, [True, True, True, False, False]]
        rows, real = text_rows([[1, 2, 3], [4, 5, 6]], None, 4, pad=9)
        assert rows.tolist() == [[1, 2, 3, 9], [4, 5, 6, 9]]  # [4 5 6] does not fit after [1 2 3]: not split
        with pytest.raises(InputError, match="fewer than two"):
            text_rows([[1, 2]], None, 4)

    def test_padding_is_left_out_of_the_loss(self):
        """What stands in the padding (tokens, the target's hidden states there) does not move the loss."""
        from specdec.training.hidden_state import _loss

        target = tiny_model("llama")
        head = HiddenStateHead(head_config(target.config), torch.arange(24)).float()  # training runs in float32
        head.attach(target.get_output_embeddings().weight.float())
        embedding = target.get_input_embeddings()
        generator = torch.Generator().manual_seed(4)
        tokens = torch.randint(0, 24, (2, 10), generator=generator)
        features = torch.randn(2, 10, target.config.hidden_size, generator=generator)
        real = torch.ones(2, 10, dtype=torch.bool)
        real[1, 6:] = False
        other_tokens, other_features = tokens.clone(), features.clone()
        other_tokens[1, 6:] = 3
        other_features[1, 6:] = 100.0
        for unroll in (1, 3):
            loss = _loss(head, embedding, tokens, features, 1.0, 0.0, unroll, real)
            assert torch.allclose(loss, _loss(head, embedding, other_tokens, other_features, 1.0, 0.0, unroll, real))
            assert not torch.allclose(loss, _loss(head, embedding, other_tokens, other_features, 1.0, 0.0, unroll))

    def test_the_token_map_counts_only_text_positions(self):
        """Padding positions do not vote for the token map (counted in chunks, across their edges)."""
        from specdec.training.hidden_state import _greedy_counts

        generator = torch.Generator().manual_seed(6)
        features, weight = torch.randn(2, 5, 8, generator=generator), torch.randn(11, 8, generator=generator)
        real = torch.tensor([[True] * 5, [True, True, False, False, False]])
        counts = _greedy_counts(features, weight, chunk=3, real=real)
        assert torch.equal(counts, torch.bincount((features[real] @ weight.T).argmax(-1), minlength=11))
        assert int(counts.sum()) == 7 and int(_greedy_counts(features, weight, chunk=3).sum()) == 10

    def test_trains_on_text_rows(self):
        target = tiny_model("llama")
        ids, mask = left_padded_prompts([6] * 8, seed=5)
        texts = [row[row != 0].tolist() for row in target.generate(ids, attention_mask=mask, do_sample=False,
                                                                   max_new_tokens=20)]
        report = train_hidden_state_head(target, texts, vocab=20, length=32, epochs=20, batch_size=2, lr=1e-2,
                                         rows="texts", holdout=0.0)
        assert report.tokens == sum(len(t) for t in texts)  # positions of text, not of padding
        first, last = sum(report.losses[:3]) / 3, sum(report.losses[-3:]) / 3
        assert last < 0.8 * first
        with pytest.raises(InputError, match="rows must be 'stream' or 'texts'"):
            train_hidden_state_head(target, texts, length=32, rows="documents")

    def test_an_unknown_schedule_is_refused(self):
        with pytest.raises(InputError, match="schedule"):
            train_hidden_state_head(tiny_model("llama"), [[3, 4, 5] * 20], length=16, schedule="linear")
