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
from ..errors import IncompatibleModelsError
from .model import ModelDrafter


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


@attrs.define(eq=False)
class SharedEncoderDrafter(ModelDrafter):
    """Draft with a small decoder that cross-attends to the target's encoder output (audio encoded once).

    ``model``: the draft decoder (a ``WhisperForCausalLM``), or a path to load it from: a draft
    distilled by ``specdec drafter distill-whisper`` (a folder with ``draft.safetensors``, whose
    embeddings are the target's; shared_encoder_draft.py), else with ``AutoModelForCausalLM`` (a
    Distil-Whisper checkpoint loads its decoder only). ``token_map``: see the ``model`` drafter.
    """

    name = "shared-encoder"
    _shared_cross: list = attrs.field(factory=list, init=False, repr=False)  # (draft layer, target layer)

    def check_target(self, target) -> None:
        from transformers import AutoModelForCausalLM, PreTrainedModel

        from ..core.models import CausalLMRunner, encoder_hidden_size, load_pretrained

        who = f"drafter '{self.name}'"
        if not target.config.is_encoder_decoder:
            raise IncompatibleModelsError(
                f"{who}: the target {type(target).__name__} has no encoder to share; use drafter 'model' or 'ngram'"
            )
        if not isinstance(self.model, PreTrainedModel):
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

    def propose(self, state, max_tokens, keep_drafting):
        lend_cross_attention(self._cached, state, self._shared_cross)
        draft = super().propose(state, max_tokens, keep_drafting)
        lend_cross_attention(self._cached, state, self._shared_cross)
        return draft

    def _start_runner(self, state):
        from ..core.models import CausalLMRunner

        runner = CausalLMRunner(self.model)
        runner.begin(encoder_outputs=state.encoder_outputs)  # the target's, all rows of the request
        return runner


@hookimpl
def specdec_register(registry):
    registry.register_drafter("shared-encoder", SharedEncoderDrafter)
