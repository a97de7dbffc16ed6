"""Thin runners that call a transformers model on a block of tokens with a `SlotCache`.

The loop and the model drafter speak to models only through these, so a decoder-only LM and an
encoder-decoder model look the same to them: tokens in, logits out, holes allowed.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel

from .cache import SlotCache


def _accepts(model: PreTrainedModel, argument: str) -> bool:
    return argument in inspect.signature(model.forward).parameters


def vocab_size(model: PreTrainedModel) -> int:
    """The width of the model's logits, which is what a draft and a target must agree on."""
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.get_text_config(decoder=True).vocab_size)


def context_length(model: PreTrainedModel) -> int | None:
    config = model.config.get_text_config(decoder=True)
    for name in ("max_position_embeddings", "n_positions", "max_target_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class CausalLMRunner:
    """Runs a decoder-only ``*ForCausalLM`` on ragged blocks over a cache with holes."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self._logits_to_keep = _accepts(model, "logits_to_keep")

    @property
    def device(self) -> torch.device:
        return self.model.device

    def new_cache(self, batch_size: int) -> SlotCache:
        return SlotCache(DynamicCache(), batch_size, self.device)

    def begin(self, **model_inputs) -> None:
        """Per-request inputs other than tokens (an encoder-decoder runner encodes here)."""

    def select_rows(self, index: torch.Tensor) -> None:
        """Finished rows leave the batch (an encoder-decoder runner drops their encoder output)."""

    @torch.no_grad()
    def forward(
        self,
        slots: SlotCache,
        input_ids: torch.Tensor,  # [B, n]
        valid: torch.Tensor,  # [B, n] bool
        logits_to_keep: int,
    ) -> torch.Tensor:  # [B, logits_to_keep, V]
        attention_mask, position_ids = slots.extend(valid)
        kwargs = {}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=slots.cache,
            use_cache=True,
            **kwargs,
        )
        return out.logits[:, -logits_to_keep:]
