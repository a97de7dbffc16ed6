"""Write a CTranslate2 Whisper checkpoint from a Transformers Whisper, for the converter's tests.

A small independent writer of the format ``specdec.convert.ct2_binary`` reads (header, named
variables with dtype and shape, aliases), laid out the way CTranslate2's own converter lays out
Whisper (``WhisperSpec`` revision 3: fused q/k/v with a zero key bias, ``gamma``/``beta`` norms,
the projection an alias of the embeddings). It saves the tests from depending on the ctranslate2
wheel (a 30+ MB native library); ``test_convert_whisper.py`` also cross-checks against
ctranslate2's own converter when that package is installed.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

DTYPE_IDS = {torch.float32: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.float16: 4, torch.bfloat16: 5}


def ct2_variables(model, dtype=torch.float32, quantize_int8=False) -> dict[str, torch.Tensor]:
    """CTranslate2's variables (names, layout, scalars) for a WhisperForConditionalGeneration."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    config = model.config
    out: dict[str, torch.Tensor] = {}

    def put(name, value):
        value = value.to(dtype)
        if quantize_int8 and "/linear_" in name and name.endswith("/weight"):
            # CTranslate2's int8: one scale per output row, value = round(w * 127 / amax(row)).
            w = value.to(torch.float32)
            amax = w.abs().amax(dim=1).clamp(min=1e-30)
            scale = 127.0 / amax
            out[name] = torch.round(w * scale[:, None]).to(torch.int8)
            out[name + "_scale"] = scale.to(torch.float32)
        else:
            out[name] = value

    def linear(theirs, ours, bias=True):
        put(f"{theirs}/weight", sd[f"{ours}.weight"])
        if bias:
            put(f"{theirs}/bias", sd[f"{ours}.bias"])

    def fused(theirs, ours_list):
        put(f"{theirs}/weight", torch.cat([sd[f"{o}.weight"] for o in ours_list]))
        biases = [sd.get(f"{o}.bias", torch.zeros(sd[f"{o}.weight"].shape[0], dtype=sd[f"{o}.weight"].dtype)) for o in ours_list]
        put(f"{theirs}/bias", torch.cat(biases))

    def norm(theirs, ours):
        put(f"{theirs}/gamma", sd[f"{ours}.weight"])
        put(f"{theirs}/beta", sd[f"{ours}.bias"])

    def ffn(theirs, ours):
        linear(f"{theirs}/ffn/linear_0", f"{ours}.fc1")
        linear(f"{theirs}/ffn/linear_1", f"{ours}.fc2")
        norm(f"{theirs}/ffn/layer_norm", f"{ours}.final_layer_norm")

    out["decoder/activation"] = torch.tensor(3, dtype=torch.int8)
    out["decoder/alibi"] = torch.tensor(0, dtype=torch.int8)
    out["decoder/num_heads"] = torch.tensor(config.decoder_attention_heads, dtype=torch.int16)
    out["decoder/pre_norm"] = torch.tensor(1, dtype=torch.int8)
    out["decoder/scale_embeddings"] = torch.tensor(0, dtype=torch.int8)
    put("decoder/embeddings/weight", sd["model.decoder.embed_tokens.weight"])
    put("decoder/position_encodings/encodings", sd["model.decoder.embed_positions.weight"])
    for i in range(config.decoder_layers):
        theirs, ours = f"decoder/layer_{i}", f"model.decoder.layers.{i}"
        fused(f"{theirs}/self_attention/linear_0", [f"{ours}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")])
        linear(f"{theirs}/self_attention/linear_1", f"{ours}.self_attn.out_proj")
        norm(f"{theirs}/self_attention/layer_norm", f"{ours}.self_attn_layer_norm")
        linear(f"{theirs}/attention/linear_0", f"{ours}.encoder_attn.q_proj")
        fused(f"{theirs}/attention/linear_1", [f"{ours}.encoder_attn.{p}" for p in ("k_proj", "v_proj")])
        linear(f"{theirs}/attention/linear_2", f"{ours}.encoder_attn.out_proj")
        norm(f"{theirs}/attention/layer_norm", f"{ours}.encoder_attn_layer_norm")
        ffn(theirs, ours)
    norm("decoder/layer_norm", "model.decoder.layer_norm")
    for n in (1, 2):
        put(f"encoder/conv{n}/weight", sd[f"model.encoder.conv{n}.weight"])
        put(f"encoder/conv{n}/bias", sd[f"model.encoder.conv{n}.bias"])
    for i in range(config.encoder_layers):
        theirs, ours = f"encoder/layer_{i}", f"model.encoder.layers.{i}"
        fused(f"{theirs}/self_attention/linear_0", [f"{ours}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")])
        linear(f"{theirs}/self_attention/linear_1", f"{ours}.self_attn.out_proj")
        norm(f"{theirs}/self_attention/layer_norm", f"{ours}.self_attn_layer_norm")
        ffn(theirs, ours)
    norm("encoder/layer_norm", "model.encoder.layer_norm")
    out["encoder/num_heads"] = torch.tensor(config.encoder_attention_heads, dtype=torch.int16)
    put("encoder/position_encodings/encodings", sd["model.encoder.embed_positions.weight"])
    return dict(sorted(out.items()))


def _string(text: str) -> bytes:
    raw = text.encode("utf-8") + b"\0"
    return struct.pack("<H", len(raw)) + raw


def model_bin_bytes(variables: dict[str, torch.Tensor], aliases: dict[str, str], spec="WhisperSpec", revision=3) -> bytes:
    chunks = [struct.pack("<I", 6), _string(spec), struct.pack("<I", revision), struct.pack("<I", len(variables))]
    for name, value in variables.items():
        value = value.contiguous()
        payload = value.view(torch.uint8).numpy().tobytes() if value.dim() else value.reshape(1).view(torch.uint8).numpy().tobytes()
        chunks += [_string(name), struct.pack("<B", value.dim()), *(struct.pack("<I", d) for d in value.shape),
                   struct.pack("<B", DTYPE_IDS[value.dtype]), struct.pack("<I", len(payload)), payload]
    chunks.append(struct.pack("<I", len(aliases)))
    for alias, target in aliases.items():
        chunks += [_string(alias), _string(target)]
    return b"".join(chunks)


def write_ct2_whisper(model, tokenizer, folder: Path, dtype=torch.float32, quantize_int8=False) -> Path:
    """A CTranslate2 Whisper folder (model.bin, config.json, vocabulary.json, tokenizer.json) for ``model``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    variables = ct2_variables(model, dtype=dtype, quantize_int8=quantize_int8)
    (folder / "model.bin").write_bytes(model_bin_bytes(variables, {"decoder/projection/weight": "decoder/embeddings/weight"}))
    generation = model.generation_config
    config = {
        "suppress_ids": list(generation.suppress_tokens),
        "suppress_ids_begin": list(generation.begin_suppress_tokens),
        "lang_ids": sorted(generation.lang_to_id.values()),
        "alignment_heads": [[0, 0], [0, 1]],
    }
    (folder / "config.json").write_text(json.dumps(config))
    vocabulary = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    (folder / "vocabulary.json").write_text(json.dumps(vocabulary))
    tokenizer.save_pretrained(folder / "_tok")
    (folder / "_tok" / "tokenizer.json").rename(folder / "tokenizer.json")
    for leftover in (folder / "_tok").iterdir():
        leftover.unlink()
    (folder / "_tok").rmdir()
    return folder
