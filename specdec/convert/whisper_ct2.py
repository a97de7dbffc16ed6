"""Convert a CTranslate2 Whisper checkpoint (faster-whisper's format) into a Transformers folder.

A CTranslate2 Whisper folder holds ``model.bin`` (the weights, see ``ct2_binary``), ``config.json``
(``suppress_ids``, ``suppress_ids_begin``, ``lang_ids``, ``alignment_heads``), the vocabulary
(``vocabulary.json`` or ``vocabulary.txt``: one token per id, timestamps included) and usually the
original ``tokenizer.json``. ``convert_whisper_ct2`` writes a folder that
``WhisperForConditionalGeneration.from_pretrained`` and ``AutoProcessor.from_pretrained`` load:
``model.safetensors`` + ``config.json``, ``generation_config.json`` (language and task tokens,
suppress lists, timestamps, alignment heads: what ``generate(language=..., task=...)`` needs) and
the processor (feature extractor and tokenizer).

Weights come out in float32. CTranslate2 stores them in float16 (what faster-whisper ships), int8 or
int16 (with per-row scales), bfloat16 or float32; float16 and bfloat16 widen exactly, int8/int16 are
dequantised (``weight / scale``), which is the value CTranslate2 approximates, not the original.

How CTranslate2 lays Whisper out (``WhisperSpec``, revisions 1-3), against Transformers' names:

    encoder/conv{1,2}/{weight,bias}                 model.encoder.conv{1,2}
    encoder/position_encodings/encodings            model.encoder.embed_positions.weight
    encoder/layer_N/self_attention/linear_0         q, k, v stacked on the rows ([3d, d])
    encoder/layer_N/self_attention/linear_1         out_proj
    */layer_N/self_attention/layer_norm/{gamma,beta} self_attn_layer_norm
    */layer_N/ffn/linear_0, linear_1, layer_norm    fc1, fc2, final_layer_norm
    decoder/layer_N/attention/linear_0              encoder_attn.q_proj
    decoder/layer_N/attention/linear_1              encoder_attn k, v stacked ([2d, d])
    decoder/layer_N/attention/linear_2              encoder_attn.out_proj
    decoder/layer_N/attention/layer_norm            encoder_attn_layer_norm
    decoder/embeddings/weight                       model.decoder.embed_tokens (proj_out, tied)
    decoder/projection/weight                       proj_out (usually an alias of the embeddings)

Transformers' ``k_proj`` has no bias; CTranslate2 stores zeros there. A non-zero key bias adds
``q . b`` to every score of a query alike, which softmax ignores, so it is dropped either way.

Nothing is written half-way: the folder is assembled under a temporary name next to ``out_dir``
and renamed into place at the end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import attrs
import torch

from ..errors import ConfigError
from .ct2_binary import CT2Checkpoint, read_model_bin

Progress = Callable[[str, float], None]  # (what is happening, fraction done 0..1)

#: Whisper's decoding defaults, as openai/whisper and the generation configs Transformers ships use them.
MAX_TARGET_POSITIONS = 448
MAX_INITIAL_TIMESTAMP_INDEX = 50  # 1.0 s at 0.02 s per timestamp token
MEDIAN_FILTER_WIDTH = 7
GELU = 3  # CTranslate2's Activation enum value for exact GELU (spec revision 3)


@attrs.frozen
class CT2WhisperFiles:
    """The files of one CTranslate2 Whisper checkpoint. ``model_bin`` may be split into parts
    (concatenated in order); ``tokenizer`` (the original ``tokenizer.json``) is optional when the
    vocabulary alone is enough (then the BPE merges are missing and the tokenizer cannot encode)."""

    model_bin: tuple[Path, ...] = attrs.field(converter=lambda paths: tuple(Path(p) for p in paths))
    config: Path = attrs.field(converter=Path)
    vocabulary: Path = attrs.field(converter=Path)
    tokenizer: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))

    @classmethod
    def from_folder(cls, folder: str | Path) -> "CT2WhisperFiles":
        """The files of a CTranslate2 model folder: ``model.bin`` (or ``model.bin.part1``, ``.part2``, ...),
        ``config.json``, ``vocabulary.json``/``.txt`` and ``tokenizer.json``."""
        folder = Path(folder)
        if not folder.is_dir():
            raise ConfigError(f"{folder}: not a folder (expected a CTranslate2 Whisper model folder)")
        model_bin = folder / "model.bin"
        parts = [model_bin] if model_bin.is_file() else _parts(folder)
        if not parts:
            raise ConfigError(
                f"{folder} is not a CTranslate2 model folder: it has no model.bin (nor model.bin.part1, ...)"
            )
        vocabulary = next((folder / n for n in ("vocabulary.json", "vocabulary.txt") if (folder / n).is_file()), None)
        if vocabulary is None:
            raise ConfigError(f"{folder}: no vocabulary.json or vocabulary.txt next to {parts[0].name}")
        tokenizer = folder / "tokenizer.json"
        return cls(model_bin=parts, config=folder / "config.json", vocabulary=vocabulary,
                   tokenizer=tokenizer if tokenizer.is_file() else None)


def _parts(folder: Path) -> list[Path]:
    found = {}
    for path in folder.glob("model.bin.part*"):
        match = re.fullmatch(r"model\.bin\.part(\d+)", path.name)
        if match:
            found[int(match.group(1))] = path
    if found and sorted(found) != list(range(1, len(found) + 1)):
        raise ConfigError(f"{folder}: model.bin parts {sorted(found)} are not numbered 1..{len(found)}")
    return [found[i] for i in sorted(found)]


# --- reading the pieces -------------------------------------------------------------------------


def read_ct2_config(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: missing; a CTranslate2 Whisper checkpoint needs its config.json (suppress_ids, lang_ids, ...)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(config).__name__}")
    for key in ("suppress_ids", "suppress_ids_begin"):
        value = config.get(key)
        if not isinstance(value, list) or not all(isinstance(i, int) for i in value):
            raise ConfigError(f"{path}: '{key}' must be a list of token ids (is this a CTranslate2 Whisper config?), got {value!r}")
    heads = config.get("alignment_heads")
    if heads is not None and not all(isinstance(h, list) and len(h) == 2 for h in heads):
        raise ConfigError(f"{path}: 'alignment_heads' must be a list of [layer, head] pairs, got {heads!r}")
    return config


def read_vocabulary(path: Path) -> list[str]:
    if not path.is_file():
        raise ConfigError(f"{path}: missing vocabulary")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            tokens = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise ConfigError(f"{path}: expected a JSON list of token strings")
        return tokens
    tokens = text.split("\n")
    if tokens and tokens[-1] == "":
        tokens.pop()  # the trailing newline
    return tokens


# --- weights ------------------------------------------------------------------------------------


def _layer_count(checkpoint: CT2Checkpoint, side: str) -> int:
    layers = {int(m.group(1)) for name in checkpoint.variables if (m := re.match(rf"{side}/layer_(\d+)/", name))}
    if not layers:
        raise ConfigError(f"{checkpoint.path}: no {side} layers ({side}/layer_0/...) in the file")
    if layers != set(range(len(layers))):
        raise ConfigError(f"{checkpoint.path}: {side} layers {sorted(layers)} are not numbered 0..{len(layers) - 1}")
    return len(layers)


class _Weights:
    """Takes variables out of a checkpoint by name, remembering which were used."""

    def __init__(self, checkpoint: CT2Checkpoint):
        self.checkpoint, self.used = checkpoint, set()

    def __call__(self, name: str, shape: Sequence[int] | None = None) -> torch.Tensor:
        checkpoint = self.checkpoint
        value = checkpoint.float32(name)
        if value is None:
            raise ConfigError(f"{checkpoint.path}: variable {name} is missing (not a complete CTranslate2 Whisper model)")
        self.used.update({name, checkpoint.aliases.get(name, name), name + "_scale"})
        if shape is not None and tuple(value.shape) != tuple(shape):
            raise ConfigError(f"{checkpoint.path}: variable {name} has shape {list(value.shape)}, expected {list(shape)}")
        return value

    def optional(self, name: str, shape: Sequence[int]) -> torch.Tensor | None:
        if self.checkpoint.get(name) is None:
            return None
        return self(name, shape)

    def unused(self) -> list[str]:
        return sorted(n for n, v in self.checkpoint.variables.items() if v.dim() > 0 and n not in self.used)


def _whisper_shape(checkpoint: CT2Checkpoint) -> dict:
    """The WhisperConfig fields the weights imply."""
    path = checkpoint.path

    def need(name):
        value = checkpoint.get(name)
        if value is None:
            raise ConfigError(f"{path}: variable {name} is missing (not a complete CTranslate2 Whisper model)")
        return value

    conv1 = need("encoder/conv1/weight")
    if conv1.dim() != 3:
        raise ConfigError(f"{path}: encoder/conv1/weight has shape {list(conv1.shape)}, expected [d_model, mel bins, 3]")
    d_model, mel_bins = conv1.shape[0], conv1.shape[1]
    embeddings = need("decoder/embeddings/weight")
    ffn = lambda side: need(f"{side}/layer_0/ffn/linear_0/weight").shape[0]  # noqa: E731
    heads = {side: checkpoint.scalar(f"{side}/num_heads") for side in ("encoder", "decoder")}
    for side, count in heads.items():
        if not count or d_model % count:
            raise ConfigError(f"{path}: {side}/num_heads is {count}, which does not divide d_model {d_model}")
    return dict(
        vocab_size=embeddings.shape[0],
        num_mel_bins=mel_bins,
        d_model=d_model,
        encoder_layers=_layer_count(checkpoint, "encoder"),
        decoder_layers=_layer_count(checkpoint, "decoder"),
        encoder_attention_heads=heads["encoder"],
        decoder_attention_heads=heads["decoder"],
        encoder_ffn_dim=ffn("encoder"),
        decoder_ffn_dim=ffn("decoder"),
        max_source_positions=need("encoder/position_encodings/encodings").shape[0],
        max_target_positions=need("decoder/position_encodings/encodings").shape[0],
    )


def whisper_state_dict(checkpoint: CT2Checkpoint, shape: dict) -> tuple[dict[str, torch.Tensor], bool]:
    """Transformers' state dict (float32) for a CTranslate2 WhisperSpec, and whether proj_out is tied."""
    take = _Weights(checkpoint)
    d, state = shape["d_model"], {}

    def linear(ours: str, theirs: str, rows: int, cols: int, bias: bool = True):
        state[f"{ours}.weight"] = take(f"{theirs}/weight", (rows, cols))
        if bias:
            state[f"{ours}.bias"] = take(f"{theirs}/bias", (rows,))

    def stacked(ours: Sequence[str], theirs: str):
        # q/k/v (or k/v) stacked on the rows; Transformers' k_proj has no bias (see the module docstring).
        weight = take(f"{theirs}/weight", (len(ours) * d, d))
        bias = take(f"{theirs}/bias", (len(ours) * d,))
        for index, name in enumerate(ours):
            state[f"{name}.weight"] = weight[index * d : (index + 1) * d].clone()
            if not name.endswith("k_proj"):
                state[f"{name}.bias"] = bias[index * d : (index + 1) * d].clone()

    def norm(ours: str, theirs: str):
        state[f"{ours}.weight"] = take(f"{theirs}/gamma", (d,))
        state[f"{ours}.bias"] = take(f"{theirs}/beta", (d,))

    def ffn(ours: str, theirs: str, width: int):
        linear(f"{ours}.fc1", f"{theirs}/ffn/linear_0", width, d)
        linear(f"{ours}.fc2", f"{theirs}/ffn/linear_1", d, width)
        norm(f"{ours}.final_layer_norm", f"{theirs}/ffn/layer_norm")

    mel = shape["num_mel_bins"]
    state["model.encoder.conv1.weight"] = take("encoder/conv1/weight", (d, mel, 3))
    state["model.encoder.conv1.bias"] = take("encoder/conv1/bias", (d,))
    state["model.encoder.conv2.weight"] = take("encoder/conv2/weight", (d, d, 3))
    state["model.encoder.conv2.bias"] = take("encoder/conv2/bias", (d,))
    state["model.encoder.embed_positions.weight"] = take("encoder/position_encodings/encodings", (shape["max_source_positions"], d))
    for i in range(shape["encoder_layers"]):
        ours, theirs = f"model.encoder.layers.{i}", f"encoder/layer_{i}"
        stacked([f"{ours}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")], f"{theirs}/self_attention/linear_0")
        linear(f"{ours}.self_attn.out_proj", f"{theirs}/self_attention/linear_1", d, d)
        norm(f"{ours}.self_attn_layer_norm", f"{theirs}/self_attention/layer_norm")
        ffn(ours, theirs, shape["encoder_ffn_dim"])
    norm("model.encoder.layer_norm", "encoder/layer_norm")

    vocab = shape["vocab_size"]
    state["model.decoder.embed_tokens.weight"] = take("decoder/embeddings/weight", (vocab, d))
    state["model.decoder.embed_positions.weight"] = take("decoder/position_encodings/encodings", (shape["max_target_positions"], d))
    for i in range(shape["decoder_layers"]):
        ours, theirs = f"model.decoder.layers.{i}", f"decoder/layer_{i}"
        stacked([f"{ours}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")], f"{theirs}/self_attention/linear_0")
        linear(f"{ours}.self_attn.out_proj", f"{theirs}/self_attention/linear_1", d, d)
        norm(f"{ours}.self_attn_layer_norm", f"{theirs}/self_attention/layer_norm")
        linear(f"{ours}.encoder_attn.q_proj", f"{theirs}/attention/linear_0", d, d)
        stacked([f"{ours}.encoder_attn.{p}" for p in ("k_proj", "v_proj")], f"{theirs}/attention/linear_1")
        linear(f"{ours}.encoder_attn.out_proj", f"{theirs}/attention/linear_2", d, d)
        norm(f"{ours}.encoder_attn_layer_norm", f"{theirs}/attention/layer_norm")
        ffn(ours, theirs, shape["decoder_ffn_dim"])
    norm("model.decoder.layer_norm", "decoder/layer_norm")

    tied = checkpoint.aliases.get("decoder/projection/weight") == "decoder/embeddings/weight"
    projection = take.optional("decoder/projection/weight", (vocab, d))
    if projection is not None and not tied:
        tied = torch.equal(projection, state["model.decoder.embed_tokens.weight"])
        if not tied:
            state["proj_out.weight"] = projection
    projection_bias = take.optional("decoder/projection/bias", (vocab,))
    if projection_bias is not None and projection_bias.any():
        raise ConfigError(f"{checkpoint.path}: decoder/projection/bias is not zero; Whisper's output projection has no bias")

    unused = take.unused()
    if unused:
        raise ConfigError(
            f"{checkpoint.path}: variables this converter does not know how to place: {', '.join(unused[:8])}"
            + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
        )
    return state, tied


def _check_spec(checkpoint: CT2Checkpoint) -> None:
    if checkpoint.spec != "WhisperSpec":
        what = f"a CTranslate2 {checkpoint.spec!r} model" if checkpoint.spec else "a CTranslate2 model without a spec name"
        raise ConfigError(f"{checkpoint.path} is {what}, not Whisper (expected spec 'WhisperSpec')")
    if checkpoint.revision > 3:
        raise ConfigError(f"{checkpoint.path}: WhisperSpec revision {checkpoint.revision} is newer than this converter knows (1-3)")
    activation = checkpoint.scalar("decoder/activation")
    if checkpoint.revision >= 3 and activation is not None and activation != GELU:
        raise ConfigError(f"{checkpoint.path}: decoder/activation is {activation}, expected {GELU} (GELU) for Whisper")
    if checkpoint.scalar("decoder/pre_norm", 1) != 1:
        raise ConfigError(f"{checkpoint.path}: decoder/pre_norm is off; Whisper is a pre-norm transformer")


# --- config, generation config, processor ------------------------------------------------------


def _token_ids(vocabulary: list[str], path: Path) -> dict[str, int]:
    ids = {token: index for index, token in enumerate(vocabulary)}
    for token in ("<|endoftext|>", "<|startoftranscript|>", "<|translate|>", "<|transcribe|>", "<|notimestamps|>"):
        if token not in ids:
            raise ConfigError(f"{path}: no {token} token; this is not a Whisper vocabulary")
    return ids


def generation_settings(
    vocabulary: list[str],
    ct2_config: dict,
    vocabulary_path: Path,
    decoder_layers: int,
    decoder_heads: int,
    multilingual: bool | None = None,
) -> dict:
    """The generation config a Whisper checkpoint ships (as on the Hub for openai/whisper-*),
    built from the vocabulary and CTranslate2's config.

    ``multilingual=None`` follows openai/whisper: a vocabulary of 51865 tokens or more is
    multilingual (English-only ones have 51864 and hold language tokens too, unused).
    """
    ids = _token_ids(vocabulary, vocabulary_path)
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    translate, transcribe = ids["<|translate|>"], ids["<|transcribe|>"]
    # openai/whisper: multilingual vocabularies have 51865+ tokens; English-only ones 51864.
    if multilingual is None:
        multilingual = len(vocabulary) >= 51865
    settings = dict(
        decoder_start_token_id=sot,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        max_length=MAX_TARGET_POSITIONS,
        begin_suppress_tokens=list(ct2_config["suppress_ids_begin"]),
        suppress_tokens=list(ct2_config["suppress_ids"]),
        no_timestamps_token_id=ids["<|notimestamps|>"],
        max_initial_timestamp_index=MAX_INITIAL_TIMESTAMP_INDEX,
        return_timestamps=False,
        is_multilingual=multilingual,
        median_filter_width=MEDIAN_FILTER_WIDTH,
    )
    if "<|startofprev|>" in ids:
        settings["prev_sot_token_id"] = ids["<|startofprev|>"]
    heads = ct2_config.get("alignment_heads")
    if heads is None:  # CTranslate2's own default: every head of the second half of the decoder
        heads = [[layer, head] for layer in range(decoder_layers // 2, decoder_layers) for head in range(decoder_heads)]
    settings["alignment_heads"] = [list(h) for h in heads]
    if multilingual:
        # Language tokens sit between <|startoftranscript|> and <|translate|>.
        languages = {vocabulary[i]: i for i in range(sot + 1, translate)}
        if not languages or not all(re.fullmatch(r"<\|[a-z_]{2,8}\|>", t) for t in languages):
            raise ConfigError(f"{vocabulary_path}: the tokens between <|startoftranscript|> and <|translate|> are not language tokens")
        lang_ids = ct2_config.get("lang_ids")
        if lang_ids is not None and sorted(lang_ids) != sorted(languages.values()):
            raise ConfigError(
                f"config.json lists lang_ids {min(lang_ids)}..{max(lang_ids)} ({len(lang_ids)}) but {vocabulary_path} "
                f"has language tokens {sot + 1}..{translate - 1} ({len(languages)})"
            )
        settings["lang_to_id"] = languages
        settings["task_to_id"] = {"translate": translate, "transcribe": transcribe}
    return settings


def _tokenizer(files: CT2WhisperFiles, vocabulary: list[str]):
    """Transformers' Whisper tokenizer from the checkpoint's tokenizer.json, completed to the model's
    vocabulary (timestamp tokens) and with Whisper's special tokens registered as such."""
    from transformers import WhisperTokenizer

    if files.tokenizer is None:
        raise ConfigError(
            f"no tokenizer.json next to {files.vocabulary}: the vocabulary alone has no BPE merges, so text "
            "could not be encoded (prompts); copy the original tokenizer.json into the folder"
        )
    try:
        data = json.loads(files.tokenizer.read_text(encoding="utf-8"))
        specials = [t["content"] for t in data.get("added_tokens", []) if t.get("special")]
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, KeyError, TypeError) as exc:
        raise ConfigError(f"{files.tokenizer}: not a tokenizers JSON file ({exc})") from None
    tokenizer = WhisperTokenizer(
        tokenizer_file=str(files.tokenizer),
        additional_special_tokens=[t for t in specials if t != "<|endoftext|>"],
    )
    size = len(tokenizer)
    if size < len(vocabulary):  # older tokenizer.json files stop at <|notimestamps|>: add the timestamps
        missing = vocabulary[size:]
        if not all(re.fullmatch(r"<\|\d+\.\d\d\|>", t) for t in missing):
            raise ConfigError(f"{files.tokenizer} has {size} tokens; {files.vocabulary} has {len(vocabulary)} and the extra ones are not timestamps")
        tokenizer.add_tokens(missing)
    for index in (0, len(vocabulary) // 2, len(vocabulary) - 1, vocabulary.index("<|notimestamps|>")):
        if tokenizer.convert_ids_to_tokens(index) != vocabulary[index]:
            raise ConfigError(
                f"{files.tokenizer} and {files.vocabulary} disagree on token {index}: "
                f"{tokenizer.convert_ids_to_tokens(index)!r} vs {vocabulary[index]!r}"
            )
    if len(tokenizer) != len(vocabulary):
        raise ConfigError(f"{files.tokenizer} has {len(tokenizer)} tokens, {files.vocabulary} has {len(vocabulary)}")
    return tokenizer


def convert_whisper_ct2(
    source: str | Path | CT2WhisperFiles,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    multilingual: bool | None = None,
    on_progress: Progress | None = None,
) -> Path:
    """Convert a CTranslate2 Whisper checkpoint (a folder, or its files) into a Transformers folder.

    Returns ``out_dir``. Raises ``ConfigError`` naming the file for anything wrong with the
    input (not Whisper, truncated, missing config or vocabulary, shapes that do not fit); then
    nothing is written. An existing ``out_dir`` is replaced only with ``overwrite=True``.
    ``multilingual`` overrides openai/whisper's rule (51865+ tokens: multilingual), for
    checkpoints with unusual vocabularies; ``on_progress(message, fraction)`` follows the steps.
    """
    from transformers.utils import logging as hf_logging
    from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration, WhisperProcessor

    report = on_progress or (lambda message, fraction: None)
    files = source if isinstance(source, CT2WhisperFiles) else CT2WhisperFiles.from_folder(source)
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise ConfigError(f"{out_dir} already exists; pass overwrite=True to replace it")

    report("reading config and vocabulary", 0.0)
    ct2_config = read_ct2_config(files.config)
    vocabulary = read_vocabulary(files.vocabulary)
    report("reading model.bin", 0.05)
    checkpoint = read_model_bin(files.model_bin)
    _check_spec(checkpoint)
    shape = _whisper_shape(checkpoint)
    if shape["vocab_size"] != len(vocabulary):
        raise ConfigError(f"{files.vocabulary} has {len(vocabulary)} tokens but {checkpoint.path} embeds {shape['vocab_size']}")
    report("mapping weights", 0.4)
    state, tied = whisper_state_dict(checkpoint, shape)
    del checkpoint
    settings = generation_settings(
        vocabulary, ct2_config, files.vocabulary, shape["decoder_layers"], shape["decoder_attention_heads"], multilingual
    )
    tokenizer = _tokenizer(files, vocabulary)

    config = WhisperConfig(
        **shape,
        activation_function="gelu",
        scale_embedding=False,
        tie_word_embeddings=tied,
        pad_token_id=settings["pad_token_id"],
        bos_token_id=settings["bos_token_id"],
        eos_token_id=settings["eos_token_id"],
        decoder_start_token_id=settings["decoder_start_token_id"],
        begin_suppress_tokens=settings["begin_suppress_tokens"],
        suppress_tokens=settings["suppress_tokens"],
        median_filter_width=MEDIAN_FILTER_WIDTH,
    )
    config.architectures = ["WhisperForConditionalGeneration"]
    report("building the model", 0.5)
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [name for name in missing if not (tied and name == "proj_out.weight")]
    if missing or unexpected:  # a bug here, not in the input: every variable was placed and shaped above
        raise RuntimeError(f"state dict does not fit WhisperForConditionalGeneration: missing {missing}, unexpected {unexpected}")
    if tied:
        model.proj_out.weight = model.model.decoder.embed_tokens.weight
    model.generation_config = GenerationConfig(**settings)
    model.eval()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    try:
        report("writing model.safetensors", 0.6)
        bars_were_off = hf_logging.is_progress_bar_enabled() is False
        hf_logging.disable_progress_bar()  # the caller's on_progress reports progress
        try:
            model.save_pretrained(staging)
        finally:
            if not bars_were_off:
                hf_logging.enable_progress_bar()
        report("writing the processor", 0.9)
        processor = WhisperProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=shape["num_mel_bins"]), tokenizer=tokenizer)
        processor.save_pretrained(staging)
        for path in [staging, *staging.iterdir()]:  # mkdtemp makes it private; give it the usual modes
            path.chmod((0o777 if path.is_dir() else 0o666) & ~_umask())
        _replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    report("done", 1.0)
    return out_dir


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _replace(staging: Path, out_dir: Path) -> None:
    """Move the finished folder into place; an old one is removed only once the new one is there."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        out_dir.rename(old)
    try:
        staging.rename(out_dir)
    except BaseException:
        if old is not None:
            old.rename(out_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
