"""Tiny Whisper models, built offline from configs, with a Whisper-shaped vocabulary.

Token ids follow Whisper's layout on a byte-level vocabulary: 256 byte tokens, then
<|endoftext|>, <|startoftranscript|>, three languages, <|translate|>, <|transcribe|>,
<|startoflm|>, <|startofprev|>, <|nospeech|>, <|notimestamps|> and the 1501 timestamp tokens
<|0.00|> .. <|30.00|>. Audio windows are real 30-second ones (3000 mel frames, 1500 encoder
positions), so long-form transcription runs exactly as it does for a real checkpoint.
"""

from __future__ import annotations

import copy

import torch
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForCausalLM,
    WhisperForConditionalGeneration,
    WhisperProcessor,
    WhisperTokenizer,
)

N_BYTES = 256
EOT = 256
SOT = 257
LANGUAGES = {"<|en|>": 258, "<|de|>": 259, "<|fr|>": 260}
TRANSLATE, TRANSCRIBE, START_OF_LM, START_OF_PREV, NO_SPEECH, NO_TIMESTAMPS = 261, 262, 263, 264, 265, 266
TIMESTAMP_BEGIN = 267
VOCAB = TIMESTAMP_BEGIN + 1501
SPACE = 32  # the byte-level token of " "
SPECIAL_TOKENS = [
    "<|startoftranscript|>", *LANGUAGES, "<|translate|>", "<|transcribe|>", "<|startoflm|>",
    "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>",
]


def generation_config() -> GenerationConfig:
    """The generation config a Whisper checkpoint ships, for this vocabulary."""
    return GenerationConfig(
        decoder_start_token_id=SOT,
        bos_token_id=EOT,
        eos_token_id=EOT,
        pad_token_id=EOT,
        max_length=448,
        begin_suppress_tokens=[SPACE, EOT],
        suppress_tokens=[1, 2, 7, 8, 9, 10, 14, 25, 26, 27, 28, 29, 31, 58, 59, 60, 61, 62, 63, 90, 91, 92, 93,
                         START_OF_LM, START_OF_PREV, NO_SPEECH],
        no_timestamps_token_id=NO_TIMESTAMPS,
        prev_sot_token_id=START_OF_PREV,
        lang_to_id=dict(LANGUAGES),
        task_to_id={"translate": TRANSLATE, "transcribe": TRANSCRIBE},
        is_multilingual=True,
        max_initial_timestamp_index=50,
        return_timestamps=False,
    )


def whisper_config(d_model=32, encoder_layers=1, decoder_layers=1, heads=2, ffn=64, **overrides) -> WhisperConfig:
    options = dict(
        vocab_size=VOCAB,
        num_mel_bins=80,
        d_model=d_model,
        encoder_layers=encoder_layers,
        decoder_layers=decoder_layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn,
        max_source_positions=1500,
        max_target_positions=448,
        pad_token_id=EOT,
        bos_token_id=EOT,
        eos_token_id=EOT,
        decoder_start_token_id=SOT,
        begin_suppress_tokens=[SPACE, EOT],
        suppress_tokens=None,
    )
    options.update(overrides)
    return WhisperConfig(**options)


def _sharpen(model, seed: int, scale: float):
    # Random weights give near-uniform logits; larger ones give a model that commits to tokens and
    # sometimes ends (eos), so rows of a batch finish at different steps.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * scale)
    return model


def _shape_vocabulary(embeddings: torch.Tensor) -> None:
    # Output embeddings are tied to these: quieter timestamps and a louder eos make segments of a
    # few tokens and rows that end at different steps, as a trained model's would.
    with torch.no_grad():
        embeddings[TIMESTAMP_BEGIN:] *= 0.3
        embeddings[EOT] *= 2.0


def tiny_whisper(seed=0, scale=0.5, **config) -> WhisperForConditionalGeneration:
    """A float64 WhisperForConditionalGeneration with random weights and Whisper's generation config."""
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(whisper_config(**config)).to(torch.float64)
    _sharpen(model, seed, scale)
    _shape_vocabulary(model.model.decoder.embed_tokens.weight)
    model.generation_config = generation_config()
    return model.eval()


def tiny_distil_decoder(seed=1, scale=0.5, **config) -> WhisperForCausalLM:
    """A float64 WhisperForCausalLM (a Distil-Whisper-style decoder) with random weights."""
    torch.manual_seed(seed)
    model = WhisperForCausalLM(whisper_config(**config)).to(torch.float64)
    _sharpen(model, seed, scale)
    _shape_vocabulary(model.model.decoder.embed_tokens.weight)
    model.generation_config = generation_config()
    return model.eval()


def decoder_of(target: WhisperForConditionalGeneration) -> WhisperForCausalLM:
    """A WhisperForCausalLM holding exactly the target's decoder: a draft the target always agrees with."""
    config = copy.deepcopy(target.config)
    draft = WhisperForCausalLM(config).to(target.dtype)
    draft.model.decoder.load_state_dict(target.model.decoder.state_dict())
    draft.proj_out.load_state_dict(target.proj_out.state_dict())
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.eval()


def tokenizer() -> WhisperTokenizer:
    """A byte-level Whisper tokenizer for this vocabulary, built without any download."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    vocab["<|endoftext|>"] = EOT
    tok = WhisperTokenizer(vocab=vocab, merges=[])
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tok.add_tokens([f"<|{i * 0.02:.2f}|>" for i in range(1501)])
    assert tok.convert_tokens_to_ids("<|notimestamps|>") == NO_TIMESTAMPS
    assert tok.convert_tokens_to_ids("<|30.00|>") == VOCAB - 1
    return tok


def processor() -> WhisperProcessor:
    return WhisperProcessor(feature_extractor=WhisperFeatureExtractor(), tokenizer=tokenizer())


def features(batch: int, seed=0, frames=3000) -> torch.Tensor:
    """[batch, 80, frames] float64 log-mel-like features: noise around a spectrum of each row's own,
    so rows decode differently."""
    generator = torch.Generator().manual_seed(seed)
    spectrum = torch.randn(batch, 80, 1, generator=generator, dtype=torch.float64) * 3
    return spectrum + torch.randn(batch, 80, frames, generator=generator, dtype=torch.float64)


def tone_utterances(root):
    """Six short 'utterances' (tones and noise) in ``root`` with a utterances.json like
    benchmarks/build_speech_eval.py's: training audio for the distillation tests."""
    import json

    import numpy as np
    import soundfile

    rng = np.random.default_rng(0)
    rows = []
    for i in range(6):
        seconds = 2.0 + i
        t = np.arange(int(16_000 * seconds)) / 16_000
        audio = 0.3 * np.sin(2 * np.pi * (200 + 90 * i) * t) + rng.normal(0, 0.05, t.shape)
        soundfile.write(root / f"u{i}.wav", audio.astype(np.float32), 16_000)
        rows.append({"id": f"u{i}", "file": f"u{i}.wav", "language": "en", "seconds": seconds, "text": "x"})
    (root / "utterances.json").write_text(json.dumps(rows))
    return root


def long_form_batch():
    """Two audios of 45 s and 70 s, as features with generate's arguments: 30-second windows seeking
    by timestamps, and rows that leave the batch at different windows."""
    x = features(2, seed=40, frames=7000)
    mask = torch.ones(2, 7000, dtype=torch.long)
    mask[0, 4500:] = 0
    x[0, :, 4500:] = 0
    return x, dict(attention_mask=mask, language="en", return_timestamps=True, return_segments=True, max_new_tokens=15)


def train_command(command: str, target, audio_dir, out, tmp_path, *options: str):
    """``specdec drafter COMMAND`` through typer's runner on ``target`` (saved with its processor
    under ``tmp_path``), with a tiny vocabulary and one epoch."""
    from typer.testing import CliRunner

    from specdec.cli.app import app

    folder = tmp_path / "target"
    target.save_pretrained(folder)
    processor().save_pretrained(folder)
    return CliRunner().invoke(app, ["drafter", command, "--target", str(folder), "--audio-dir", str(audio_dir),
                                    "--out", str(out), "--vocab", "300", "--epochs", "1", "--batch-size", "3",
                                    "--holdout", "0.2", *options])
