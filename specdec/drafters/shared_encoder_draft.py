"""A distilled ``shared-encoder`` draft for a Whisper target, with a reduced output head; its file format.

The draft (``WhisperDraftDecoder``) is a ``WhisperForCausalLM`` of one or two decoder layers that
reads the target's encoder output, built the Distil-Whisper way: its layers start as copies of the
target's (the first and the last for two), and its output head scores only the target's most
frequent tokens (``token_map``, core/reduced_vocab.py): on whisper-base the full 51865 x 512 head
costs more than a decoder layer, so a draft with it cannot pay. Its token and position embeddings
ARE the target's (the same modules, frozen), so it adds only its layers and its head.

A saved draft is one safetensors file (``draft.safetensors`` in a folder): its layers, its final
layer norm, the reduced head, the token map, and in the metadata the draft's config and the
target's vocabulary size and encoder width, which ``load_shared_encoder_draft`` checks before it
builds anything. ``specdec drafter distill-whisper`` (training/whisper_draft.py) trains one.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Sequence

import torch
from transformers import WhisperConfig, WhisperForCausalLM
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutputWithCrossAttentions

from ..core.models import cache_argument, returned_cache, with_cache
from ..core.reduced_vocab import TokenMap
from ..errors import ConfigError, IncompatibleModelsError

FORMAT = "specdec-shared-encoder-draft"
FORMAT_VERSION = "1"
FILE_NAME = "draft.safetensors"


class WhisperDraftDecoder(WhisperForCausalLM):
    """``WhisperForCausalLM`` with a reduced head (``proj_out``: [len(token_map), d_model]) and a
    ``token_map`` buffer; its forward scores only the last ``logits_to_keep`` positions (the draft
    reads a catch-up block of several tokens but needs one distribution)."""

    def forward(self, input_ids=None, attention_mask=None, encoder_outputs=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, logits_to_keep: int = 0, **kwargs):
        if isinstance(encoder_outputs, (BaseModelOutput, tuple, list)):
            encoder_outputs = encoder_outputs[0]
        # generate's own loop passes the cache as ``cache`` from transformers 5.24 on
        kwargs[cache_argument(self.model.decoder)] = kwargs.pop("cache", past_key_values)
        out = self.model.decoder(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=encoder_outputs,
                                 inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state  # [B, n, D]
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        return with_cache(CausalLMOutputWithCrossAttentions, returned_cache(out), logits=self.proj_out(kept),
                          hidden_states=out.hidden_states)


def _target_decoder(target, who: str):
    decoder = getattr(getattr(target, "model", None), "decoder", None)
    if not target.config.is_encoder_decoder or decoder is None or not hasattr(decoder, "embed_positions"):
        raise IncompatibleModelsError(f"{who}: the target {type(target).__name__} is not a Whisper model; a distilled "
                                      "shared-encoder draft reads a WhisperForConditionalGeneration's encoder output")
    return decoder


def draft_config(target_config: WhisperConfig, layers: int) -> WhisperConfig:
    """The target's config cut to ``layers`` decoder layers, its head not tied to the embeddings."""
    config = copy.deepcopy(target_config)
    config.decoder_layers = layers
    config.tie_word_embeddings = False
    config.architectures = ["WhisperForCausalLM"]
    return config


def build_draft(target, token_map: torch.Tensor, config: WhisperConfig | None = None,
                init_layers: Sequence[int] | None = None, who: str = "shared-encoder draft") -> WhisperDraftDecoder:
    """A ``WhisperDraftDecoder`` on ``target``: its embeddings are the target's modules; its layers are
    copies of the target's layers ``init_layers`` (or left for a state dict to fill); its head is
    the target's output rows of ``token_map``."""
    decoder = _target_decoder(target, who)
    token_map = TokenMap.checked(token_map, target.config.vocab_size, who).ids
    if config is None:
        config = draft_config(target.config, len(init_layers))
    with torch.device("meta"):  # the full-vocabulary embedding and head it allocates are replaced below
        draft = WhisperDraftDecoder(config)
    draft.model.decoder.embed_tokens = decoder.embed_tokens  # shared with the target, not copied
    draft.model.decoder.embed_positions = decoder.embed_positions
    draft.proj_out = torch.nn.Linear(config.d_model, token_map.numel(), bias=False)
    draft.model.decoder.layers.to_empty(device="cpu")
    draft.model.decoder.layer_norm.to_empty(device="cpu")
    with torch.no_grad():
        if init_layers is not None:
            for own, source in enumerate(init_layers):
                draft.model.decoder.layers[own].load_state_dict(decoder.layers[source].state_dict())
            draft.model.decoder.layer_norm.load_state_dict(decoder.layer_norm.state_dict())
        head = target.get_output_embeddings().weight
        draft.proj_out.weight.copy_(head.detach()[token_map.to(head.device)].cpu())
    draft.register_buffer("token_map", token_map.clone(), persistent=True)
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.to(device=target.device, dtype=target.dtype).eval()


def own_state(draft: WhisperDraftDecoder) -> dict[str, torch.Tensor]:
    """What a saved draft holds: everything but the target's embeddings."""
    shared = ("model.decoder.embed_tokens.", "model.decoder.embed_positions.")
    return {name: value for name, value in draft.state_dict().items() if not name.startswith(shared)}


def save_shared_encoder_draft(draft: WhisperDraftDecoder, path: str | Path, *, dtype: torch.dtype = torch.float16,
                              metadata: dict[str, str] | None = None) -> Path:
    """Write ``draft`` (weights in ``dtype``, the token map as int32) to ``path`` (a folder gets
    ``draft.safetensors``); the file appears whole or not at all."""
    from ..core.weights_file import write_weights

    path = Path(path)
    if path.suffix != ".safetensors":
        path = path / FILE_NAME
    tensors = {}
    for name, value in own_state(draft).items():
        value = value.detach().cpu()
        tensors[name] = value.to(torch.int32) if name == "token_map" else value.to(dtype)
    info = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "config": draft.config.to_json_string(use_diff=False),
        "target_vocab_size": str(draft.config.vocab_size),
        "encoder_width": str(draft.config.d_model),
        **(metadata or {}),
    }
    return write_weights(path, tensors, info)


def draft_file(path: str | Path) -> Path | None:
    """``path`` or ``path/draft.safetensors`` when it is a saved shared-encoder draft, else None."""
    path = Path(path).expanduser()
    candidate = path / FILE_NAME if path.is_dir() else path
    if candidate.suffix != ".safetensors" or not candidate.is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(candidate), framework="pt") as handle:
            return candidate if (handle.metadata() or {}).get("format") == FORMAT else None
    except Exception:  # noqa: BLE001 - not ours
        return None


def load_shared_encoder_draft(path: str | Path, target, who: str = "drafter 'shared-encoder'") -> WhisperDraftDecoder:
    """A saved draft on ``target``, after checking that it was trained for a target of this shape:
    vocabulary size, encoder width, head and token map. Errors name the file and the mismatch."""
    from ..core.weights_file import read_weights

    path = Path(path).expanduser()
    file = path / FILE_NAME if path.is_dir() else path
    info, tensors = read_weights(file, FORMAT, "shared-encoder draft", who)
    _target_decoder(target, who)
    vocab, width = target.config.vocab_size, target.config.d_model
    if int(info.get("target_vocab_size", -1)) != vocab:
        raise IncompatibleModelsError(f"{who}: {file} was trained for a target with a vocabulary of "
                                      f"{info.get('target_vocab_size')} tokens; this target has {vocab}")
    if int(info.get("encoder_width", -1)) != width:
        raise IncompatibleModelsError(f"{who}: {file} reads an encoder output of width {info.get('encoder_width')}; "
                                      f"this target's encoder output has width {width}")
    if "token_map" not in tensors or "proj_out.weight" not in tensors:
        raise IncompatibleModelsError(f"{who}: {file} has no token map or no output head")
    token_map = TokenMap.checked(tensors.pop("token_map"), vocab, who, f"{file}'s token map").ids
    if tensors["proj_out.weight"].shape != (token_map.numel(), width):
        raise IncompatibleModelsError(f"{who}: {file}'s head is {tuple(tensors['proj_out.weight'].shape)}, but its "
                                      f"token map holds {token_map.numel()} tokens of width {width}")
    try:
        config = WhisperConfig(**json.loads(info["config"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{who}: {file} has no readable draft config: {exc}") from None
    if (config.vocab_size, config.d_model) != (vocab, width):
        raise IncompatibleModelsError(f"{who}: {file}'s config is for vocabulary {config.vocab_size} and width "
                                      f"{config.d_model}, this target's are {vocab} and {width}")
    draft = build_draft(target, token_map, config=config, who=who)
    expected = set(own_state(draft)) - {"token_map"}
    if set(tensors) != expected:
        raise IncompatibleModelsError(f"{who}: {file} does not fit a {config.decoder_layers}-layer draft (missing "
                                      f"{sorted(expected - set(tensors))[:3]}, unexpected {sorted(set(tensors) - expected)[:3]})")
    draft.load_state_dict({name: value.to(target.dtype) for name, value in tensors.items()}, strict=False)
    _share_frozen_cross_attention(draft, target)
    return draft.eval()


def _share_frozen_cross_attention(draft: WhisperDraftDecoder, target) -> None:
    """Make the draft's cross-attention key and value projections that equal a target layer's (a draft
    distilled with them frozen) that layer's own parameters, as its embeddings are: the same values,
    held once (4 MiB on whisper-base's two-layer draft)."""
    from .shared_encoder import shared_cross_attention_layers

    draft_layers, target_layers = draft.model.decoder.layers, target.model.decoder.layers
    for mine, theirs in shared_cross_attention_layers(draft, target):
        for name in ("k_proj", "v_proj"):
            own, shared = getattr(draft_layers[mine].encoder_attn, name), getattr(target_layers[theirs].encoder_attn, name)
            own.weight, own.bias = shared.weight, shared.bias
