"""``shared_encoder``: a small decoder that reads the target's encoder output (Distil-Whisper style).

The audio is encoded once, by the target; the draft is only a decoder (``WhisperForCausalLM``, one
or two layers, loaded from a Distil-Whisper checkpoint or any Whisper checkpoint whose decoder
should draft) whose cross-attention reads that same encoder output. It needs the target's
vocabulary and the target's encoder width (its cross-attention projections take the encoder
output as it is).

Everything else is the ``model`` drafter's: its own self-attention cache with holes, catching up on
the target's committed tokens at the start of each draft, one token per forward. Its
cross-attention keys are computed on its first forward and kept in its ``EncoderDecoderCache``,
except for layers whose cross-attention projections are a target layer's own (a draft distilled
with them frozen, as ``specdec drafter distill-whisper`` does by default): those read the same
keys and values, so the two caches share them, computed once by whichever model reads first. On
whisper-base at batch 16 on a CPU, computing the two-layer draft's cross-attention keys took about
0.5 s per request, as long as five plain decoder steps.
"""

from __future__ import annotations

import attrs

from ..core.hookspecs import hookimpl
from ..errors import ConfigError, IncompatibleModelsError
from .model import ModelDrafter

ENCODER_FRAMES = ("audio", "all")
# Frames read past the last one that holds audio (2 s of Whisper's encoder output): with none, the
# shipped whisper-base draft's teacher-forced top-1 on the eval sentences fell from 77.6% to 71.2%;
# with 50, to 76.0%; with 100, 77.1% (its acceptance in the loop unchanged; docs/benchmarks.md, stop 60).
AUDIO_MARGIN_FRAMES = 100


def draft_hidden_size(model) -> int | None:
    """The width of the draft decoder, which its cross-attention expects the encoder output to have."""
    config = model.config.get_text_config(decoder=True)
    for name in ("d_model", "hidden_size"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def shared_cross_attention_layers(draft, target) -> list[tuple[int, int]]:
    """Pairs (draft layer, target layer) whose cross-attention key and value projections are equal:
    both read the target's encoder output, so their keys and values are the same."""
    import torch

    def projections(model):
        try:
            layers = model.get_decoder().layers
        except AttributeError:
            return []
        out = []
        for layer in layers:
            attention = getattr(layer, "encoder_attn", None)
            k, v = getattr(attention, "k_proj", None), getattr(attention, "v_proj", None)
            out.append(None if k is None or v is None else [k.weight, k.bias, v.weight, v.bias])
        return out

    def same(x, y) -> bool:
        if x is None or y is None:
            return x is None and y is None
        return x.shape == y.shape and x.dtype == y.dtype and x.device == y.device and bool(torch.equal(x, y))

    pairs = []
    target_layers = projections(target)
    for i, mine in enumerate(projections(draft)):
        for j, theirs in enumerate(target_layers):
            if mine is not None and theirs is not None and all(same(x, y) for x, y in zip(mine, theirs)):
                pairs.append((i, j))
                break
    return pairs


def lend_cross_attention(cached, state, pairs: list[tuple[int, int]]) -> None:
    """Share the cross-attention keys and values of ``pairs`` (draft layer, target layer) between a
    drafter's cache and the target's. Called before the draft reads (it takes the layers the target
    has computed) and after (the target reads after the draft in an iteration, and takes those the
    draft computed)."""
    from ..core.cache import share_cross_attention

    if pairs and state.target_slots is not None and cached.slots is not None:
        share_cross_attention(cached.slots, state.target_slots, pairs)


def audio_frames(input_features, encoder_frames: int, margin: int = AUDIO_MARGIN_FRAMES) -> int | None:
    """How many of the encoder's ``encoder_frames`` output frames a draft needs to read for log-mel
    ``input_features`` ([B, mel bins, T]) padded to a fixed length the way Whisper's feature extractor
    pads them: the frames up to the last one in any row that holds audio, plus ``margin``; None where
    that is all of them. The padding is silence, and Whisper's log-mel floors silence at the same
    value (the row's maximum less 8, normalised) in every bin, so a frame holds audio where any bin
    is above its row's minimum; trailing digital silence counts as padding, which is what it is."""
    import torch

    if not isinstance(input_features, torch.Tensor) or input_features.dim() != 3 or encoder_frames < 1:
        return None
    features = input_features.float()
    floor = features.amin(dim=(1, 2), keepdim=True)  # [B, 1, 1]
    heard = (features > floor).any(dim=1).any(dim=0)  # [T]: a frame of some row holds audio
    counted = torch.arange(1, heard.shape[0] + 1, device=heard.device)
    last = int(torch.where(heard, counted, 0).max())  # frames up to the last heard one; the request's one sync
    frames = -(-last * encoder_frames // features.shape[-1]) + margin  # mel frames -> encoder frames
    return frames if frames < encoder_frames else None


def _encoder_frames_option(instance, attribute, value) -> None:
    if value not in ENCODER_FRAMES:
        raise ConfigError(f"drafter '{instance.name}': option 'encoder_frames' must be one of "
                          f"{', '.join(repr(choice) for choice in ENCODER_FRAMES)}, got {value!r}")


@attrs.define(eq=False)
class SharedEncoderDrafter(ModelDrafter):
    """Draft with a small decoder that cross-attends to the target's encoder output (audio encoded once).

    ``model``: the draft decoder (a ``WhisperForCausalLM``), or a path to load it from: a draft
    distilled by ``specdec drafter distill-whisper`` (a folder with ``draft.safetensors``, whose
    embeddings are the target's; shared_encoder_draft.py), else with ``AutoModelForCausalLM`` (a
    Distil-Whisper checkpoint loads its decoder only). ``token_map``: see the ``model`` drafter.
    ``encoder_frames``: "audio" (the default) lets the draft's cross-attention read, after its first
    forward, only the encoder frames that hold the request's audio (``audio_frames``: Whisper-style
    log-mel input padded with silence); "all" reads every frame, as the target does. The output is
    the target's either way.
    """

    name = "shared-encoder"
    encoder_frames: str = attrs.field(default="audio", kw_only=True, validator=_encoder_frames_option)
    _shared_cross: list = attrs.field(factory=list, init=False, repr=False)  # (draft layer, target layer)
    _frames: int | None = attrs.field(default=None, init=False, repr=False)  # this request's; None: all

    def check_target(self, target) -> None:
        from transformers import AutoModelForCausalLM, PreTrainedModel

        from ..core.models import CausalLMRunner, encoder_hidden_size, load_pretrained

        who = f"drafter '{self.name}'"
        if not target.config.is_encoder_decoder:
            raise IncompatibleModelsError(
                f"{who}: the target {type(target).__name__} has no encoder to share; use drafter 'model' or 'ngram'"
            )
        loaded = not isinstance(self.model, PreTrainedModel)
        if loaded:
            from .shared_encoder_draft import draft_file, load_shared_encoder_draft

            if draft_file(self.model) is not None:  # a draft distilled by specdec (reduced head, target's embeddings)
                self.model = load_shared_encoder_draft(self.model, target, who)
            else:
                self.model = load_pretrained(AutoModelForCausalLM, self.model, dtype=target.dtype, who=who)
        if self.model.config.is_encoder_decoder:
            raise IncompatibleModelsError(
                f"{who}: the draft {type(self.model).__name__} has an encoder of its own; load its decoder "
                "(e.g. WhisperForCausalLM) or use drafter 'model' for an encoder-decoder draft"
            )
        if not CausalLMRunner(self.model).cross_attends:
            raise IncompatibleModelsError(
                f"{who}: the draft {type(self.model).__name__} has no cross-attention, so it cannot read the "
                "target's encoder output"
            )
        draft_width, encoder_width = draft_hidden_size(self.model), encoder_hidden_size(target)
        if draft_width != encoder_width:
            raise IncompatibleModelsError(
                f"{who}: the draft decoder's hidden size is {draft_width} but the target's encoder output has "
                f"hidden size {encoder_width}; a shared-encoder draft must be as wide as the target's encoder"
            )
        self._check_vocabulary(target)
        self._check_dtype(target)
        self._shared_cross = shared_cross_attention_layers(self.model, target)
        if loaded:
            self._keep_int8_only()

    def propose(self, state, max_tokens, keep_drafting):
        lend_cross_attention(self._cached, state, self._shared_cross)
        draft = super().propose(state, max_tokens, keep_drafting)
        lend_cross_attention(self._cached, state, self._shared_cross)  # every frame, before narrowing
        if self._frames is not None and self._cached.slots is not None:
            from ..core.cache import narrow_cross_attention

            narrow_cross_attention(self._cached.slots, self._frames)
        return draft

    def _start_runner(self, state):
        from ..core.models import CausalLMRunner

        runner = CausalLMRunner(self.model)
        encoded = runner.begin(encoder_outputs=state.encoder_outputs)  # the target's, all rows of the request
        self._frames = None
        if self.encoder_frames == "audio" and encoded is not None:
            self._frames = audio_frames(state.model_inputs.get("input_features"), encoded.last_hidden_state.shape[1])
        return runner


@hookimpl
def specdec_register(registry):
    registry.register_drafter("shared-encoder", SharedEncoderDrafter)
