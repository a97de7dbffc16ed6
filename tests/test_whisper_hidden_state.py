"""The ``hidden-state`` drafter on Whisper (training/whisper_hidden_state.py, ``specdec drafter
train-whisper``): an EAGLE-style head whose one decoder layer reads the target's last decoder
states and cross-attends to the target's encoder output, through the very keys and values the
target computed. Trained on a tiny Whisper, it drafts exactly (greedy, batched, long-form, with
alternatives), shares the target's cross-attention, and a head for another target is refused."""

from __future__ import annotations

import pytest
import torch
import transformers

from specdec import IncompatibleModelsError, SpeculativeDecoder
from specdec.drafters import HiddenStateDrafter
from specdec.drafters.hidden_state_head import HiddenStateHead
from specdec.policies import ConstantLookahead
from specdec.training.whisper_hidden_state import build_whisper_head, train_whisper_hidden_state_head
from specdec.whisper import WhisperSpeculativeDecoder

from .tiny_whisper import features, long_form_batch, processor, tiny_whisper, tone_utterances, train_command

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def target():
    # Two decoder layers, float64 as every exactness test; the head starts from the last.
    return tiny_whisper(seed=0, decoder_layers=2)


@pytest.fixture(scope="module")
def audio_dir(tmp_path_factory):
    return tone_utterances(tmp_path_factory.mktemp("speech"))


@pytest.fixture(scope="module")
def trained(target, audio_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("head") / "head.safetensors"
    report = train_whisper_hidden_state_head(target, processor(), audio_dir, out, vocab=300, epochs=6, batch_size=3,
                                             lr=3e-3, holdout=0.2, unroll=2, cache=out.parent / "teacher.pt")
    return report, out


def speculative(target, head, k=3, **options):
    drafter = HiddenStateDrafter(head=str(head), **options)
    return WhisperSpeculativeDecoder(SpeculativeDecoder(target=target, drafter=drafter, policy=ConstantLookahead(k=k)))


class TestTraining:
    def test_the_loss_goes_down_and_each_drafted_position_is_measured(self, trained):
        report, out = trained
        assert report.losses[-1] < 0.5 * report.losses[0]
        assert len(report.heldout_top1_per_step) == 2 and all(0.0 <= t <= 1.0 for t in report.heldout_top1_per_step)
        assert report.path == out and out.is_file()

    def test_the_head_starts_as_the_targets_last_layer(self, target):
        head = build_whisper_head(target, torch.arange(300))
        ours, theirs = head.decoder.layers[0].state_dict(), target.model.decoder.layers[-1].state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)

    def test_the_saved_head_shares_the_targets_cross_attention(self, target, trained):
        """Its key and value projections stay the target's last layer's, so the loop lends it the
        target's keys and values instead of computing its own."""
        _, out = trained
        drafter = HiddenStateDrafter(head=str(out))
        SpeculativeDecoder(target=target, drafter=drafter)
        assert drafter._shared_cross == [(0, 1)]
        loaded = drafter.head.decoder.layers[0].encoder_attn
        assert torch.equal(loaded.k_proj.weight, target.model.decoder.layers[1].encoder_attn.k_proj.weight)
        assert loaded.k_proj.weight.dtype == torch.float64

    def test_the_trained_layer_moved(self, target, trained):
        report, _ = trained
        assert not torch.equal(report.head.decoder.layers[0].fc1.weight, target.model.decoder.layers[1].fc1.weight)


class TestExactness:
    @pytest.mark.parametrize("k,batch", [(1, 1), (3, 1), (2, 3), (4, 2)])
    def test_greedy_is_the_targets(self, target, trained, k, batch):
        _, out = trained
        x = features(batch, seed=7 + batch)
        whisper = speculative(target, out, k=k)
        reference = target.generate(x, language="en", max_new_tokens=25)
        assert torch.equal(whisper.generate(x, language="en", max_new_tokens=25), reference)
        assert whisper.stats.decode.drafted > 0

    def test_on_packed_weights(self, target, trained, monkeypatch):
        """In float32 with every step on oneDNN-packed weights (as on a CPU where they are faster),
        the head's one-token steps included: still the target's tokens (its logits' margins are far
        wider than float32's rounding)."""
        import copy

        from specdec.core.packed_linear import packed_layers

        from .conftest import pin_packing

        pin_packing(monkeypatch, start=2, smallest=0, one_row=True)
        _, out = trained
        target32 = copy.deepcopy(target).float()
        x = features(2, seed=13).float()
        whisper = speculative(target32, out, k=3)
        assert torch.equal(whisper.generate(x, language="en", max_new_tokens=25),
                           target32.generate(x, language="en", max_new_tokens=25))
        assert packed_layers(whisper.decoder.drafter.head)

    def test_a_two_layer_head(self, target, audio_dir, tmp_path):
        """Layers started from the target's first and last (the Distil-Whisper choice): the file says
        how many, each shares its source layer's keys and values, and the output is the target's."""
        out = tmp_path / "two.safetensors"
        train_whisper_hidden_state_head(target, processor(), audio_dir, out, layers=[0, 1], vocab=300, epochs=2,
                                        batch_size=3, lr=3e-3, holdout=0.0, cache=tmp_path / "teacher.pt")
        whisper = speculative(target, out, k=3)
        assert len(whisper.decoder.drafter.head.decoder.layers) == 2
        assert whisper.decoder.drafter._shared_cross == [(0, 0), (1, 1)]
        x = features(3, seed=17)
        assert torch.equal(whisper.generate(x, language="en", max_new_tokens=25),
                           target.generate(x, language="en", max_new_tokens=25))

    def test_with_alternatives(self, target, trained):
        _, out = trained
        x = features(2, seed=11)
        whisper = speculative(target, out, k=3, alternatives=2)
        assert torch.equal(whisper.generate(x, language="en", max_new_tokens=25),
                           target.generate(x, language="en", max_new_tokens=25))

    def test_long_form(self, target, trained):
        """45 s and 70 s of audio: 30-second windows seeking by timestamps, rows leaving the batch."""
        _, out = trained
        x, kwargs = long_form_batch()
        reference = target.generate(x, **kwargs)
        whisper = speculative(target, out)
        assert torch.equal(whisper.generate(x, **kwargs)["sequences"], reference["sequences"])
        assert whisper.stats.windows > 2


class TestBadHeads:
    def test_a_head_for_a_narrower_whisper(self, trained):
        _, out = trained
        other = tiny_whisper(seed=2, d_model=16, ffn=32)
        with pytest.raises(IncompatibleModelsError, match=f"{out} was trained for a whisper target of hidden size 32"):
            SpeculativeDecoder(target=other, drafter=HiddenStateDrafter(head=str(out)))

    @pytest.mark.parametrize("layers", ["0", "9", "two"])
    def test_a_file_that_names_no_sensible_layer_count(self, target, trained, tmp_path, layers):
        from safetensors import safe_open
        from safetensors.torch import save_file

        _, out = trained
        with safe_open(str(out), framework="pt") as handle:
            info, tensors = dict(handle.metadata()), {name: handle.get_tensor(name) for name in handle.keys()}
        save_file(tensors, str(tmp_path / "bad.safetensors"), metadata={**info, "layers": layers})
        with pytest.raises(IncompatibleModelsError, match=f"names '{layers}' layers; a head has 1 to 8"):
            HiddenStateHead.load(tmp_path / "bad.safetensors", target)

    def test_a_whisper_head_for_a_decoder_only_target(self, trained):
        from .conftest import tiny_model

        _, out = trained
        with pytest.raises(IncompatibleModelsError, match="trained for a whisper target"):
            SpeculativeDecoder(target=tiny_model("llama"), drafter=HiddenStateDrafter(head=str(out)))

    def test_a_layer_the_target_does_not_have(self, target, audio_dir, tmp_path):
        from specdec import InputError

        with pytest.raises(InputError, match=r"1 to 8 indices of the target's 2 decoder layers, got \[0, 2\]"):
            train_whisper_hidden_state_head(target, processor(), audio_dir, tmp_path / "h.safetensors", layers=[0, 2])
        assert not (tmp_path / "h.safetensors").exists()


class TestTrainWhisperCommand:
    """``specdec drafter train-whisper`` trains with progress bars and says how to use the head."""

    def test_trains_and_saves(self, target, audio_dir, tmp_path):
        out = tmp_path / "head.safetensors"
        result = train_command("train-whisper", target, audio_dir, out, tmp_path)
        assert result.exit_code == 0, result.output
        assert isinstance(HiddenStateHead.load(out, target), HiddenStateHead)
        assert "held-out top-1" in result.stdout and 'use = "hidden-state"' in result.stdout

    def test_a_half_precision_file(self, target, audio_dir, tmp_path):
        """float16 halves the file; loaded, the head is in the target's dtype again."""
        from safetensors import safe_open

        out = tmp_path / "half.safetensors"
        result = train_command("train-whisper", target, audio_dir, out, tmp_path, "--save-dtype", "float16")
        assert result.exit_code == 0, result.output
        with safe_open(str(out), framework="pt") as handle:
            assert handle.get_tensor("fc.weight").dtype == torch.float16
            assert handle.get_tensor("token_map").dtype == torch.long
        assert HiddenStateHead.load(out, target).fc.weight.dtype == torch.float64
        refused = train_command("train-whisper", target, audio_dir, out, tmp_path, "--save-dtype", "int8")
        assert refused.exit_code == 2 and "--save-dtype must be float32, float16 or bfloat16, got 'int8'" in refused.output

    def test_bad_options_are_refused_before_the_target_loads(self, tmp_path):
        """A misspelt option is named at once, not after minutes of loading (here: no target at all)."""
        from typer.testing import CliRunner

        from specdec.cli.app import app

        base = ["drafter", "train-whisper", "--target", str(tmp_path / "missing"), "--audio-dir", str(tmp_path),
                "--out", str(tmp_path / "head.safetensors")]
        for option, value, message in (("--save-dtype", "int8", "--save-dtype must be float32, float16 or bfloat16"),
                                       ("--layers", "last", "--layers must be comma-separated integers")):
            result = CliRunner().invoke(app, [*base, option, value])
            assert result.exit_code == 2 and message in result.output and "missing" not in result.output
        result = CliRunner().invoke(app, ["drafter", "distill-whisper", "--target", str(tmp_path / "missing"),
                                          "--audio-dir", str(tmp_path), "--out", str(tmp_path), "--layers", "0;5"])
        assert result.exit_code == 2 and "--layers must be comma-separated integers" in result.output


class TestTranscribe:
    """``specdec transcribe`` with a config that names the head by a path relative to the TOML file."""

    def test_prints_the_targets_transcripts(self, target, trained, audio_dir, tmp_path):
        import json
        import shutil

        from typer.testing import CliRunner

        from specdec.audio import read_audio
        from specdec.cli.app import app

        _, head = trained
        target.save_pretrained(tmp_path / "target")
        processor().save_pretrained(tmp_path / "target")
        shutil.copy(head, tmp_path / "head.safetensors")
        config = tmp_path / "whisper.toml"
        config.write_text('[target]\nmodel = "target"\ndtype = "float64"\n\n[drafter]\nuse = "hidden-state"\n'
                          'head = "head.safetensors"\n\n[policy]\nuse = "constant"\nk = 3\n\n'
                          '[sampling]\nmax_new_tokens = 20\n')
        files = [str(audio_dir / f"u{i}.wav") for i in (0, 3)]
        result = CliRunner().invoke(app, ["transcribe", *files, "--config", str(config), "--language", "en", "--json"])
        assert result.exit_code == 0, result.output
        proc = processor()
        inputs = proc.feature_extractor([read_audio(f).samples for f in files], sampling_rate=16_000, return_tensors="pt")
        ids = target.generate(inputs.input_features.double(), language="en", task="transcribe", max_new_tokens=20)
        expected = [proc.tokenizer.decode(row, skip_special_tokens=True).strip() for row in ids]
        output = json.loads(result.stdout)
        assert [entry["text"] for entry in output["files"]] == expected and all(expected)
        assert output["stats"]["drafted"] > 0, output["stats"]
