"""The distilled reduced-head shared-encoder draft (drafters/shared_encoder_draft.py,
training/whisper_draft.py, ``specdec drafter distill-whisper``) on a tiny Whisper: distillation
lowers its loss, the saved draft comes back the same and drafts exactly, and a draft for another
target is refused with the file and the mismatch named. The shipped draft for the real
whisper-base is checked only where that model was fetched."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specdec import ConfigError, IncompatibleModelsError, SpeculativeDecoder
from specdec.core.model_cache import cached_model_dir
from specdec.drafters import SharedEncoderDrafter
from specdec.drafters.shared_encoder_draft import (
    FILE_NAME,
    WhisperDraftDecoder,
    build_draft,
    load_shared_encoder_draft,
    save_shared_encoder_draft,
)
from specdec.policies import ConstantLookahead
from specdec.training.whisper_draft import (
    cached_teacher_pass,
    choose_token_map,
    distill_whisper_draft,
    read_utterances,
    reference_ids,
    special_tokens,
    teacher_logits,
    teacher_pass,
    timestamp_ids,
    with_timestamps,
)
from specdec.errors import InputError
from specdec.whisper import WhisperSpeculativeDecoder

from .tiny_whisper import EOT, NO_TIMESTAMPS, SOT, TIMESTAMP_BEGIN, features, processor, tiny_whisper, tone_utterances, train_command

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "models" / "whisper-base-draft"


@pytest.fixture(scope="module")
def target():
    # Two decoder layers, so a one-layer draft is a real reduction; float64 as every exactness test.
    return tiny_whisper(seed=0, decoder_layers=2)


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory):
    return tone_utterances(tmp_path_factory.mktemp("speech"))


@pytest.fixture(scope="module")
def distilled(target, audio_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft")
    report = distill_whisper_draft(target, processor(), audio_dir, out, layers=[1], vocab=300, epochs=6,
                                   batch_size=3, lr=3e-3, holdout=0.0, cache=out / "teacher.pt")
    return report, out


class TestDistillation:
    """distill_whisper_draft: the teacher pass, the map, the loss going down, the saved file."""

    def test_the_loss_goes_down(self, distilled):
        report, _ = distilled
        assert report.steps == 12 and len(report.losses) == 12
        assert np.mean(report.losses[-3:]) < 0.8 * np.mean(report.losses[:3]), report.losses

    def test_the_map_holds_the_specials_and_the_targets_tokens(self, target, distilled):
        report, _ = distilled
        token_map = report.draft.token_map
        assert token_map.numel() == 300
        assert torch.isin(torch.tensor(special_tokens(target)), token_map).all()
        assert {EOT, SOT, NO_TIMESTAMPS} <= set(token_map.tolist())
        assert report.map_coverage == 1.0  # 300 tokens hold every token of six short pseudo-labels

    def test_the_teacher_pass_is_cached(self, target, audio_dir, distilled):
        """A second run reads the cache file: the target's encoder does not run again."""
        _, out = distilled
        calls = []
        hook = target.model.encoder.register_forward_hook(lambda *args: calls.append(1))
        try:
            distill_whisper_draft(target, processor(), audio_dir, None, layers=[0], vocab=300, epochs=1,
                                  batch_size=3, holdout=0.0, cache=out / "teacher.pt")
        finally:
            hook.remove()
        assert calls == []

    def test_the_cache_serves_a_subset_and_computes_only_new_utterances(self, target, audio_dir, tmp_path):
        """Rows are cached per utterance: a subset of a cached set runs no encoder, a superset runs it
        on its new utterances only, and every row equals a fresh teacher pass's."""
        every = read_utterances(audio_dir)
        cache = tmp_path / "teacher.pt"
        calls = []
        hook = target.model.encoder.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
        try:
            first = cached_teacher_pass(target, processor(), every[:4], cache, batch_size=3)
            assert sum(calls) == 4
            calls.clear()
            subset = cached_teacher_pass(target, processor(), every[1:3], cache, batch_size=3)
            assert calls == []
            superset = cached_teacher_pass(target, processor(), every, cache, batch_size=3)
            assert sum(calls) == 2  # the two new utterances only
        finally:
            hook.remove()
        fresh = teacher_pass(target, processor(), every, batch_size=2)
        assert subset.labels == first.labels[1:3] and torch.equal(subset.encoder_states, first.encoder_states[1:3])
        assert superset.labels == fresh.labels
        assert torch.allclose(superset.encoder_states.float(), fresh.encoder_states.float(), atol=1e-3)

    def test_the_saved_draft_is_small_and_holds_no_embeddings(self, distilled):
        _, out = distilled
        with safe_open(str(out / FILE_NAME), framework="pt") as handle:
            names = list(handle.keys())
            assert handle.get_tensor("proj_out.weight").dtype == torch.float16
            assert json.loads(handle.metadata()["init_layers"]) == [1]
        assert "token_map" in names and not any("embed_" in name for name in names)
        assert all(name.startswith(("model.decoder.layers.0.", "model.decoder.layer_norm", "proj_out", "token_map"))
                   for name in names)

    def test_round_trip_and_exact_greedy_decoding(self, target, distilled):
        report, out = distilled
        loaded = load_shared_encoder_draft(out, target)
        assert isinstance(loaded, WhisperDraftDecoder) and loaded.dtype == target.dtype
        assert torch.equal(loaded.token_map, report.draft.token_map)
        # The file stores float16: the loaded weights are the trained ones rounded to it.
        trained = report.draft.state_dict()
        for name, value in loaded.state_dict().items():
            if name != "token_map" and ".embed_" not in name:  # the embeddings are the target's
                assert torch.equal(value, trained[name].to(torch.float16).to(value.dtype)), name
        assert loaded.model.decoder.embed_tokens is target.model.decoder.embed_tokens  # shared, not copied
        x = features(2, seed=7)
        decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=str(out)),
                                     policy=ConstantLookahead(k=3))
        whisper = WhisperSpeculativeDecoder(decoder)
        assert torch.equal(whisper.generate(x, language="en", max_new_tokens=20),
                           target.generate(x, language="en", max_new_tokens=20))


def spoken_texts(root, texts):
    """A copy of ``root``'s utterances.json (absolute paths) whose rows say ``texts``: the references."""
    rows = json.loads((root / "utterances.json").read_text())
    for row, text in zip(rows, texts):
        row["file"] = str(root / row["file"])
        row["text"] = text
    listing = root.parent / f"{root.name}-texts"
    listing.mkdir(exist_ok=True)
    (listing / "utterances.json").write_text(json.dumps(rows))
    return listing


TEXTS = ["hello there", "a b c", "the cat sat", "yes", "one two three four", "ok then"]


class TestReferenceLabels:
    """``labels="reference"``: the draft is trained along utterances.json's texts, with the target's
    choice after each prefix as its cross-entropy target, and no ``generate`` in the teacher pass."""

    def test_the_choices_along_the_targets_own_transcript_are_its_transcript(self, target, audio_dir):
        """The teacher-forced choice (suppressed tokens left out) is what ``generate`` said: the two
        label sources teach the same thing, the target's own next token."""
        data = teacher_pass(target, processor(), read_utterances(audio_dir), batch_size=3)
        token_map = torch.arange(target.config.vocab_size)
        for label, scores in zip(data.labels, teacher_logits(target, data, token_map, batch_size=3)):
            # The last label is eot, the target's own unless the transcript ran into the length limit.
            after_prompt = slice(data.prompt_length - 1, -1)
            assert scores.choice[after_prompt].tolist() == label[1:][after_prompt]
            assert scores.top_ids.shape == (len(label) - 1, 64) and scores.top_logits.dtype == torch.float16
            assert (scores.top_ids[:, 0] == scores.choice).all()  # the map is the whole vocabulary here

    def test_the_choice_and_the_top_logits_leave_out_suppressed_tokens(self, target, audio_dir):
        """A token the generation config suppresses is never the choice nor among the top logits,
        as ``generate`` never says it: the choice falls to the next best token."""
        import copy

        free = copy.deepcopy(target)
        free.generation_config.suppress_tokens, free.generation_config.begin_suppress_tokens = [], []
        data = teacher_pass(free, processor(), read_utterances(audio_dir), batch_size=3)
        token_map = torch.arange(target.config.vocab_size)
        plain = teacher_logits(free, data, token_map, batch_size=3)
        after = slice(data.prompt_length - 1, None)
        favourite = int(torch.cat([p.choice[after] for p in plain]).mode().values)
        strict = copy.deepcopy(free)
        strict.generation_config.suppress_tokens = [favourite]
        moved_somewhere = 0
        for loose, scores in zip(plain, teacher_logits(strict, data, token_map, batch_size=3)):
            assert favourite not in scores.choice.tolist() and favourite not in scores.top_ids.flatten().tolist()
            moved = loose.choice == favourite
            moved_somewhere += int(moved.sum())
            assert torch.equal(scores.choice[moved], loose.top_ids[moved][:, 1])  # the runner-up takes its place
            assert torch.equal(scores.choice[~moved], loose.choice[~moved])
        assert moved_somewhere > 0

    def test_the_teacher_pass_reads_the_texts_and_runs_no_generate(self, target, audio_dir, monkeypatch):
        listing = spoken_texts(audio_dir, TEXTS)
        utterances = read_utterances(listing)
        plain = teacher_pass(target, processor(), utterances, batch_size=3)
        monkeypatch.setattr(type(target), "generate", lambda *a, **k: pytest.fail("generate ran"))
        data = teacher_pass(target, processor(), utterances, batch_size=3, labels="reference")
        prompt = plain.labels[0][: data.prompt_length]
        for label, text in zip(data.labels, TEXTS):
            assert label == prompt + reference_ids(processor(), text) + [EOT]
        assert torch.equal(data.encoder_states, plain.encoder_states)

    def test_a_cache_keeps_the_two_label_sources_apart(self, target, audio_dir, tmp_path):
        utterances = read_utterances(spoken_texts(audio_dir, TEXTS))
        cache = tmp_path / "teacher.pt"
        plain = cached_teacher_pass(target, processor(), utterances, cache, batch_size=3)
        reference = cached_teacher_pass(target, processor(), utterances, cache, batch_size=3, labels="reference")
        assert reference.labels != plain.labels
        assert cached_teacher_pass(target, processor(), utterances, cache, batch_size=3).labels == plain.labels

    def test_distills_and_measures_against_the_targets_choices(self, target, audio_dir, tmp_path):
        report = distill_whisper_draft(target, processor(), spoken_texts(audio_dir, TEXTS), tmp_path / "d",
                                       layers=[1], vocab=300, epochs=6, batch_size=3, lr=3e-3, holdout=0.34,
                                       labels="reference")
        assert np.mean(report.losses[-2:]) < 0.8 * np.mean(report.losses[:2]), report.losses
        assert 0.0 <= report.heldout_top1 <= 1.0
        with safe_open(str(tmp_path / "d" / FILE_NAME), framework="pt") as handle:
            assert handle.metadata()["labels"] == "reference"

    def test_an_utterance_without_a_text_is_named(self, target, audio_dir, tmp_path):
        listing = spoken_texts(audio_dir, ["hello", "", "a", "b", "c", "d"])
        with pytest.raises(InputError, match=r"needs a text .* u1\.wav"):
            distill_whisper_draft(target, processor(), listing, tmp_path / "d", layers=[1], vocab=300, epochs=1,
                                  batch_size=3, labels="reference", cache=tmp_path / "t.pt")
        assert not (tmp_path / "d").exists() and not (tmp_path / "t.pt").exists()

    def test_an_unknown_label_source_is_refused(self, target, audio_dir, tmp_path):
        with pytest.raises(InputError, match="labels must be one of generate, reference, got 'gold'"):
            teacher_pass(target, processor(), read_utterances(audio_dir), labels="gold")
        result = train_command("distill-whisper", target, audio_dir, tmp_path / "o", tmp_path, "--labels", "gold")
        assert result.exit_code == 2 and "--labels must be one of generate, reference" in result.output
        assert not (tmp_path / "o").exists()


SENTENCES = ["hello there. a b c", "the cat sat! yes? ok", "one two", "ok then. fine", "a. b. c", "yes no"]


class TestTimestampLabels:
    """``timestamps``: a share of the reference labels written as long-form transcription writes a
    window, and every timestamp token in the draft's map, so that it drafts timestamps."""

    def test_labels_are_written_as_long_form_windows(self, target, audio_dir):
        utterances = read_utterances(spoken_texts(audio_dir, SENTENCES))
        data = teacher_pass(target, processor(), utterances, batch_size=3, labels="reference")
        stamped = with_timestamps(target, processor(), data, utterances, 0.5)
        changed = [i for i in range(len(utterances)) if stamped.labels[i] != data.labels[i]]
        assert len(changed) == 3 and stamped.prompt_length == data.prompt_length
        for i in range(len(utterances)):
            if i not in changed:
                assert stamped.prompt_of(i) == data.prompt_length
                continue
            prompt = data.labels[i][: data.prompt_length - 1]  # sot, language, task: no notimestamps
            label = stamped.labels[i]
            assert stamped.prompt_of(i) == len(prompt) and label[: len(prompt)] == prompt
            assert label[len(prompt)] == timestamp_ids(target, 0.0) == TIMESTAMP_BEGIN and label[-1] == EOT
            sentences = [part.strip() for part in SENTENCES[i].replace("!", ".").replace("?", ".").split(".") if part.strip()]
            times = [t for t in label if t >= TIMESTAMP_BEGIN]
            # <|0.00|>, then each sentence's end, twice but for the last: the time it opens the next segment at
            assert len(times) == 2 * len(sentences)
            assert times[1:-1:2] == times[2:-1:2] and times == sorted(times)
            assert times[-1] == timestamp_ids(target, utterances[i].seconds)
            assert NO_TIMESTAMPS not in label
        assert with_timestamps(target, processor(), data, utterances, 0.0) is data
        with pytest.raises(InputError, match=r"timestamps must be a share of the utterances, in \[0, 1\], got 1.5"):
            with_timestamps(target, processor(), data, utterances, 1.5)

    def test_the_map_holds_every_timestamp_and_the_draft_drafts_them_exactly(self, target, audio_dir, tmp_path):
        listing = spoken_texts(audio_dir, SENTENCES)
        report = distill_whisper_draft(target, processor(), listing, tmp_path / "d", layers=[1], vocab=1700,
                                       epochs=6, batch_size=3, lr=3e-3, holdout=0.0, labels="reference",
                                       timestamps=1.0)
        assert np.mean(report.losses[-2:]) < 0.8 * np.mean(report.losses[:2]), report.losses
        token_map = report.draft.token_map.tolist()
        assert set(range(TIMESTAMP_BEGIN, target.config.vocab_size)) <= set(token_map) and len(token_map) == 1700
        with safe_open(str(tmp_path / "d" / FILE_NAME), framework="pt") as handle:
            assert handle.metadata()["timestamps"] == "1.0"
        # Long-form transcription's grammar (return_timestamps) with the timestamped draft: the
        # target's own tokens, and drafts that reach timestamps.
        decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=str(tmp_path / "d")),
                                     policy=ConstantLookahead(k=3))
        whisper = WhisperSpeculativeDecoder(decoder)
        drafted = []
        original = decoder.drafter.propose

        def watched(*args, **kwargs):
            draft = original(*args, **kwargs)
            drafted.extend(draft.tokens.flatten().tolist())
            return draft

        decoder.drafter.propose = watched
        x = features(2, seed=5)
        reference = target.generate(x, language="en", task="transcribe", return_timestamps=True)
        assert torch.equal(whisper.generate(x, language="en", task="transcribe", return_timestamps=True), reference)
        assert any(t >= TIMESTAMP_BEGIN for t in drafted)

    def test_timestamps_need_reference_labels(self, target, audio_dir, tmp_path):
        with pytest.raises(InputError, match="timestamps are written into reference labels"):
            distill_whisper_draft(target, processor(), audio_dir, tmp_path / "d", layers=[1], vocab=1700, epochs=1,
                                  timestamps=0.5)
        result = train_command("distill-whisper", target, audio_dir, tmp_path / "o", tmp_path, "--timestamps", "0.5")
        assert result.exit_code == 2 and "--timestamps must be a share in [0, 1] and needs --labels reference" in result.output
        assert not (tmp_path / "o").exists() and not (tmp_path / "d").exists()
        with pytest.raises(InputError, match=r"timestamps must be a share of the utterances, in \[0, 1\], got 2"):
            distill_whisper_draft(target, processor(), spoken_texts(audio_dir, SENTENCES), tmp_path / "d", layers=[1],
                                  vocab=1700, epochs=1, labels="reference", timestamps=2, cache=tmp_path / "t.pt")
        assert not (tmp_path / "d").exists() and not (tmp_path / "t.pt").exists()  # refused before the teacher pass


class TestChooseTokenMap:
    def test_frequent_label_tokens_first_then_low_ids(self):
        labels = [[SOT, 258, 262, NO_TIMESTAMPS, 100, 100, 90, EOT], [SOT, 258, 262, NO_TIMESTAMPS, 100, 80, EOT]]
        ids, coverage = choose_token_map(labels, 1768, 6, always=[EOT, SOT], skip=4)
        assert set(ids.tolist()) == {EOT, SOT, 100, 90, 80, 0}
        assert coverage == 1.0
        ids, coverage = choose_token_map(labels, 1768, 3, always=[EOT, SOT], skip=4)
        assert set(ids.tolist()) == {EOT, SOT, 100} and coverage == pytest.approx(5 / 7)


class TestBadDrafts:
    """A draft for another target is refused before anything is built, naming the file and the mismatch."""

    @pytest.fixture
    def saved(self, target, tmp_path):
        draft = build_draft(target, torch.arange(0, 300), init_layers=[0])
        return save_shared_encoder_draft(draft, tmp_path / "draft")

    def rewrite(self, path: Path, tensors=None, **metadata):
        with safe_open(str(path), framework="pt") as handle:
            info = dict(handle.metadata())
            data = {name: handle.get_tensor(name) for name in handle.keys()}
        info.update(metadata)
        data.update(tensors or {})
        save_file(data, str(path), metadata=info)

    def test_another_vocabulary(self, target, saved):
        self.rewrite(saved, target_vocab_size="51865")
        with pytest.raises(IncompatibleModelsError, match=f"{saved}.*vocabulary of 51865 tokens; this target has 1768"):
            load_shared_encoder_draft(saved, target)

    def test_another_encoder_width(self, target, saved):
        self.rewrite(saved, encoder_width="512")
        with pytest.raises(IncompatibleModelsError, match="encoder output of width 512; this target's encoder output has width 32"):
            SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=str(saved.parent)))

    def test_a_token_map_out_of_range(self, target, saved):
        self.rewrite(saved, tensors={"token_map": torch.arange(1700, 2000, dtype=torch.int32)})
        with pytest.raises(IncompatibleModelsError, match="token map holds token id 1999, outside the target's vocabulary of 1768"):
            load_shared_encoder_draft(saved, target)

    def test_a_head_that_does_not_fit_the_map(self, target, saved):
        self.rewrite(saved, tensors={"proj_out.weight": torch.zeros(200, 32, dtype=torch.float16)})
        with pytest.raises(IncompatibleModelsError, match=r"head is \(200, 32\), but its token map holds 300"):
            load_shared_encoder_draft(saved, target)

    def test_a_target_that_is_not_whisper(self, saved):
        from .conftest import tiny_model

        with pytest.raises(IncompatibleModelsError, match="not a Whisper model|no encoder to share"):
            SpeculativeDecoder(target=tiny_model("llama"), drafter=SharedEncoderDrafter(model=str(saved.parent)))

    def test_another_file(self, target, tmp_path):
        save_file({"x": torch.zeros(1)}, str(tmp_path / "draft.safetensors"), metadata={"format": "other"})
        with pytest.raises(ConfigError, match="is not a shared-encoder draft"):
            load_shared_encoder_draft(tmp_path, target)
        with pytest.raises(ConfigError, match="does not exist"):
            load_shared_encoder_draft(tmp_path / "none", target)


class TestDistillCommand:
    """``specdec drafter distill-whisper`` trains from scratch with a progress bar and says how to use the draft."""

    def test_trains_and_saves(self, target, audio_dir, tmp_path):
        out = tmp_path / "out"
        result = train_command("distill-whisper", target, audio_dir, out, tmp_path)
        assert result.exit_code == 0, result.output
        assert (out / FILE_NAME).is_file()
        assert "held-out top-1" in result.stdout and 'use = "shared-encoder"' in result.stdout

    def test_a_missing_cache_name_says_how_to_fetch(self, audio_dir, tmp_path, monkeypatch):
        from typer.testing import CliRunner

        from specdec.cli.app import app

        monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
        result = CliRunner().invoke(app, ["drafter", "distill-whisper", "--target", "whisper-base", "--audio-dir",
                                          str(audio_dir), "--out", str(tmp_path / "o")])
        assert result.exit_code == 2
        assert "specdec models fetch whisper-base" in result.output


@pytest.mark.skipif(cached_model_dir("whisper-base") is None or not (SHIPPED / FILE_NAME).is_file(),
                    reason="needs whisper-base fetched (specdec models fetch whisper-base) and the shipped draft")
class TestShippedDraft:
    """models/whisper-base-draft on the real whisper-base."""

    def test_loads_on_whisper_base_and_is_small(self):
        from transformers import WhisperForConditionalGeneration

        target = WhisperForConditionalGeneration.from_pretrained(cached_model_dir("whisper-base")).eval()
        draft = load_shared_encoder_draft(SHIPPED, target)
        # two layers and a 9,728-token head (8,227 tokens and the 1,501 timestamps) in float16: 26.8 MB
        # (25.6 MiB); the budget is about 27 MB
        assert (SHIPPED / FILE_NAME).stat().st_size < 27 * 2**20
        assert draft.config.decoder_layers == 2
        assert draft.token_map.numel() == draft.proj_out.weight.shape[0]
        # every timestamp, so that it drafts them in long-form transcription (distill-whisper --timestamps)
        first = target.generation_config.no_timestamps_token_id + 1
        assert set(range(first, target.config.vocab_size)) <= set(draft.token_map.tolist())
        x = torch.zeros(1, 80, 3000)
        decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=draft), policy=ConstantLookahead(k=4))
        assert torch.equal(WhisperSpeculativeDecoder(decoder).generate(x, language="en"), target.generate(x, language="en"))

    def test_the_shipped_config_is_cost_aware_and_exact(self):
        """whisper.toml as `specdec transcribe` reads it: one decoder over several calls, so the
        policy measures across them; every call gives base's tokens."""
        from specdec.config import SpecdecConfig
        from specdec.policies import CostAwareLookahead

        config = SpecdecConfig.from_toml(SHIPPED / "whisper.toml")
        target, _ = config.load_target()
        decoder = SpeculativeDecoder.from_config(config, target=target)
        assert isinstance(decoder.policy, CostAwareLookahead)
        assert (decoder.drafter.matmul_precision, decoder.drafter.encoder_frames) == ("int8", "audio")
        assert not decoder.packed_weights and not decoder.screened_head  # no copy of base's weights (stop 65)
        whisper = WhisperSpeculativeDecoder(decoder)
        generator = torch.Generator().manual_seed(0)
        for batch in (1, 2, 1):
            x = torch.randn(batch, 80, 3000, generator=generator) * 0.5
            assert torch.equal(whisper.generate(x, language="en"), target.generate(x, language="en"))
        from specdec.core import packed_linear

        copies = (packed_linear._PACKED, packed_linear._PACKED_BF16, packed_linear._PACKED_INT8)
        assert not any(p in made for p in target.parameters() for made in copies)


class TestModelNames:
    """``model = "whisper-base"`` in a plugins.toml names the folder ``specdec models fetch`` converted."""

    def test_a_fetched_name_resolves_to_the_cache(self, tmp_path, monkeypatch):
        from specdec.config import SpecdecConfig

        monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
        folder = tmp_path / "cache" / "models" / "whisper-base"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (tmp_path / "draft").mkdir()
        (tmp_path / "w.toml").write_text('[target]\nmodel = "whisper-base"\n[drafter]\nuse = "shared-encoder"\nmodel = "draft"\n')
        config = SpecdecConfig.from_toml(tmp_path / "w.toml")
        assert config.target["model"] == str(folder)
        assert config.drafter.options["model"] == str(tmp_path / "draft")

    def test_a_missing_name_says_how_to_fetch(self, tmp_path, monkeypatch):
        from specdec.config import SpecdecConfig

        monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
        (tmp_path / "w.toml").write_text('[target]\nmodel = "whisper-base"\n[drafter]\nuse = "ngram"\n')
        config = SpecdecConfig.from_toml(tmp_path / "w.toml")
        with pytest.raises(ConfigError, match=r"w.toml: \[target\] model 'whisper-base' is neither a folder nor in "
                                              r"specdec's model cache .*specdec models fetch whisper-base"):
            config.load_target()

    def test_the_shipped_config_points_at_the_cache_and_this_folder(self, tmp_path, monkeypatch):
        from specdec.config import SpecdecConfig

        monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
        folder = tmp_path / "cache" / "models" / "whisper-base"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        config = SpecdecConfig.from_toml(SHIPPED / "whisper.toml")
        assert config.target["model"] == str(folder)
        assert Path(config.drafter.options["model"]).resolve() == SHIPPED.resolve()
        assert config.drafter.use == "shared-encoder"
