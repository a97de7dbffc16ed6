"""``shared_encoder``: a small decoder that reads the target's encoder output (Distil-Whisper style).

The audio is encoded once, by the target; the draft is only a decoder (``WhisperForCausalLM``, one
or two layers, loaded from a Distil-Whisper checkpoint or any Whisper checkpoint whose decoder
should draft) whose cross-attention reads that same encoder output. It needs the target's
vocabulary and the target's encoder width (its cross-attention projections take the encoder
output as it is).

Everything else is the ``model`` drafter's: its own self-attention cache with holes, catching up on
the target's committed tokens at the start of each draft, one token per forward. Its
cross-attention keys are computed on its first forward and kept in its ``EncoderDecoderCache``.
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


@attrs.define(eq=False)
class SharedEncoderDrafter(ModelDrafter):
    """Draft with a small decoder that cross-attends to the target's encoder output (audio encoded once).

    ``model``: the draft decoder (a ``WhisperForCausalLM``), or a path to load it from: a draft
    distilled by ``specdec drafter distill-whisper`` (a folder with ``draft.safetensors``, whose
    embeddings are the target's; shared_encoder_draft.py), else with ``AutoModelForCausalLM`` (a
    Distil-Whisper checkpoint loads its decoder only). ``token_map``: see the ``model`` drafter.
    """

    name = "shared-encoder"

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

    def _start_runner(self, state):
        from ..core.models import CausalLMRunner

        runner = CausalLMRunner(self.model)
        runner.begin(encoder_outputs=state.encoder_outputs)  # the target's, all rows of the request
        return runner


@hookimpl
def specdec_register(registry):
    registry.register_drafter("shared-encoder", SharedEncoderDrafter)
