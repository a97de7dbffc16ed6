"""The model of the ``hidden-state`` drafter (drafters/hidden_state.py): one decoder layer of the
target's architecture that predicts the target's next hidden state, read out through the target's
own LM head rows of a reduced vocabulary; saved and loaded as safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..core.reduced_vocab import TokenMap
from ..errors import IncompatibleModelsError
from .hidden_state import FORMAT, FORMAT_VERSION, head_config, target_parts

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class HiddenStateHead(torch.nn.Module):
    """``fc`` (2H -> H) then one decoder layer of the target's architecture; logits over ``token_map``.

    ``forward`` looks like a causal LM's to the runners: ``inputs_embeds`` are ``[embedding of token p,
    hidden state at p - 1]`` (2H wide); ``logits`` are over the reduced vocabulary and
    ``hidden_states[-1]`` is the predicted hidden state at p. For a Whisper target the layer is a
    Whisper decoder layer: it adds learned positions to its input and cross-attends to the
    ``encoder_outputs`` the forward is given (the target's).
    """

    def __init__(self, config, token_map: torch.Tensor):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        if config.model_type == "whisper":
            from transformers.models.whisper.modeling_whisper import WhisperDecoder

            self.decoder = WhisperDecoder(config)
        else:
            from transformers import AutoModel

            self.decoder = AutoModel.from_config(config)
        self.register_buffer("token_map", token_map.long().clone(), persistent=True)
        self.readout_layer: torch.nn.Linear | None = None  # [V', H]: the target's LM head rows, set by attach

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def attach(self, lm_head_weight: torch.Tensor) -> None:
        """Read out through these LM head rows (the target's, frozen; not saved with the head)."""
        rows = lm_head_weight.detach()[self.token_map.to(lm_head_weight.device)]
        # An nn.Linear, so that the drafter's steps run it on a packed weight where this CPU runs that
        # faster (core/packed_linear.py): on a Zen 4 a one-row 8192 x 576 readout takes 0.7x the time.
        self.readout_layer = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
        self.readout_layer.weight = torch.nn.Parameter(rows, requires_grad=False)

    def readout(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V']
        return self.readout_layer(hidden)

    def get_decoder(self):
        return self.decoder

    def forward(self, inputs_embeds=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, output_hidden_states=None, logits_to_keep: int = 0, encoder_outputs=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        from ..core.models import cache_argument, returned_cache, with_cache

        encoder = {}
        if encoder_outputs is not None:  # a ModelOutput or a tuple: its first field is the encoder's last state
            encoder["encoder_hidden_states"] = encoder_outputs if torch.is_tensor(encoder_outputs) else encoder_outputs[0]
        out = self.decoder(inputs_embeds=self.fc(inputs_embeds), attention_mask=attention_mask,
                           position_ids=position_ids, use_cache=use_cache, **encoder,
                           **{cache_argument(self.decoder): kwargs.pop("cache", past_key_values)})
        predicted = out.last_hidden_state  # [B, n, H]
        kept = predicted[:, -logits_to_keep:] if logits_to_keep else predicted
        return with_cache(CausalLMOutputWithPast, returned_cache(out), logits=self.readout(kept),
                          hidden_states=(predicted,))

    # --- files ---------------------------------------------------------------------------------

    def save(self, path: str | Path, metadata: dict[str, str] | None = None, dtype: torch.dtype | None = None) -> Path:
        """Write the head's own weights (not the target's readout rows) to ``path``, in ``dtype`` when
        given (the token map stays integer); ``load`` brings them to the target's dtype."""
        from ..core.weights_file import write_weights

        info = {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "config": json.dumps(self.config.to_dict()),
            "hidden_size": str(self.config.hidden_size),
            "model_type": str(self.config.model_type),
            "layers": str(len(self.decoder.layers)),
            **(metadata or {}),
        }
        own = {name: tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype)
               for name, tensor in self.state_dict().items() if not name.startswith("readout_layer.")}
        return write_weights(Path(path), own, info)

    @classmethod
    def load(cls, path: str | Path, target: PreTrainedModel, who: str = "drafter 'hidden-state'") -> HiddenStateHead:
        """A saved head, checked against ``target`` (architecture, hidden size, vocabulary)."""
        from ..core.weights_file import read_weights

        path = Path(path).expanduser()
        info, tensors = read_weights(path, FORMAT, "hidden-state head", who)
        _, weight, hidden = target_parts(target, who)
        target_type = target.config.get_text_config(decoder=True).model_type
        if info.get("model_type") != target_type or int(info.get("hidden_size", -1)) != hidden:
            raise IncompatibleModelsError(
                f"{who}: {path} was trained for a {info.get('model_type')} target of hidden size "
                f"{info.get('hidden_size')}; this target is a {target_type} of hidden size {hidden}"
            )
        token_map = TokenMap.checked(tensors["token_map"], weight.shape[0], who, f"{path}'s token map").ids
        try:
            layers = int(info.get("layers", "1"))  # heads saved before the key existed have one
        except ValueError:
            layers = 0
        if not 1 <= layers <= 8:
            raise IncompatibleModelsError(f"{who}: {path} names {info.get('layers')!r} layers; a head has 1 to 8")
        config = head_config(target.config, layers)
        head = cls(config, token_map).to(dtype=target.dtype)  # loaded at the target's precision, not rounded
        missing, unexpected = head.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise IncompatibleModelsError(
                f"{who}: {path} does not fit a {layers}-layer {target_type} head (missing {missing[:3]}, unexpected "
                f"{unexpected[:3]})"
            )
        return head.to(device=target.device, dtype=target.dtype).eval()
