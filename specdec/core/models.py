"""Thin runners that call a transformers model on a block of tokens with a `SlotCache`.

The loop and the model drafter speak to models only through these, so a decoder-only LM and an
encoder-decoder model look the same to them: tokens in, logits out, holes allowed.
``runner_for(model)`` picks the runner; ``begin(**model_inputs)`` takes a request's inputs other
than tokens (an encoder-decoder runner encodes here, once per request).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from transformers import AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq, DynamicCache, EncoderDecoderCache, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput
from transformers.utils import ModelOutput

from ..errors import ConfigError, InputError
from .cache import SlotCache
from .masks import AttentionLayout
from .recurrent import config_cache


_POSITIONS_FROM_CACHE = (
    "it derives its position ids from the cache length (past_key_values_length) instead of taking "
    "position_ids, so the holes that rejected drafts leave in the cache would shift every later position"
)
_NOT_ISOLATED = (
    "its output differs from generate after rejected drafts (benchmarks/check_architectures.py) and the "
    "cause is not isolated yet"
)
# Architectures that cannot be decoded exactly, and why (docs/architectures.md has the sweep).
REFUSED_ARCHITECTURES = {
    "gpt_neo": "its local-attention layers apply their window through a fixed buffer indexed by cache slot "
               "(GPTNeoSelfAttention.bias), which the holes of rejected drafts shift",
    "git": _POSITIONS_FROM_CACHE,
    "cpmant": _POSITIONS_FROM_CACHE,
    "roformer": _POSITIONS_FROM_CACHE,
    "trocr": _POSITIONS_FROM_CACHE,
    "openai-gpt": "it has no KV cache, so there is no cache to keep the accepted prefix in",
    "xlm": "it keeps its keys and values in a cache dict of its own, not a transformers Cache",
    "rwkv": "it keeps its recurrent state in a state tuple outside transformers' cache classes, which "
            "specdec cannot checkpoint and rewind",
    "recurrent_gemma": "it keeps its recurrent and attention states inside its layers, not in a transformers "
                       "Cache that specdec can checkpoint and rewind",
    "minimax": "its lightning-attention state lives in a cache class of its own that refuses DynamicCache",
    "deepseek_v4": "its compressed-attention cache layers keep per-slot compression state that cannot hold holes",
    "moshi": "its attention applies the sliding window only through generate's sliding-window cache, which "
             "evicts old slots (the prompt is read with full attention, every later token through the window), "
             "while its mask is full; specdec's cache keeps every slot",
    "inkling_text": _NOT_ISOLATED,
}


def check_architecture(model: PreTrainedModel) -> None:
    """Refuse, before decoding, a model specdec cannot decode exactly, naming it and the reason."""
    model_type = model.config.get_text_config(decoder=True).model_type
    reason = REFUSED_ARCHITECTURES.get(model_type) or REFUSED_ARCHITECTURES.get(model.config.model_type)
    if reason:
        raise ConfigError(f"{type(model).__name__} ({model_type}) cannot be decoded exactly by specdec: {reason}")


def _accepts(model: PreTrainedModel, argument: str) -> bool:
    return argument in inspect.signature(model.forward).parameters


def vocab_size(model: PreTrainedModel) -> int:
    """The width of the model's logits, which is what a draft and a target must agree on."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None) if head is not None else None
    if callable(weight):  # a dynamically quantised Linear (torch.ao) gives its weight by a call
        weight = weight()
    if weight is not None:
        return int(weight.shape[0])
    return int(model.config.get_text_config(decoder=True).vocab_size)


def context_length(model: PreTrainedModel) -> int | None:
    config = model.config.get_text_config(decoder=True)
    for name in ("max_position_embeddings", "n_positions", "max_target_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def encoder_hidden_size(model: PreTrainedModel) -> int | None:
    """The width of the encoder output an encoder-decoder model's decoder cross-attends to."""
    config = model.config
    encoder = getattr(config, "encoder", None)  # EncoderDecoderModel-style configs
    for source in (encoder, config):
        for name in ("d_model", "hidden_size"):
            value = getattr(source, name, None) if source is not None else None
            if isinstance(value, int) and value > 0:
                return value
    return None


def as_encoder_outputs(value) -> ModelOutput:
    """An encoder output as a ``ModelOutput`` holding only per-row tensors.

    The model's own output class is kept with its tensor fields (``last_hidden_state``, and the
    encoder attention mask some models such as Moonshine return); per-layer tuples are dropped.
    A tuple or a bare hidden-state tensor becomes a ``BaseModelOutput``.
    """
    if isinstance(value, ModelOutput):
        return type(value)(**{name: field for name, field in value.items() if isinstance(field, torch.Tensor)})
    if isinstance(value, torch.Tensor):
        return BaseModelOutput(last_hidden_state=value)
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return BaseModelOutput(last_hidden_state=value[0])
    raise InputError(
        f"encoder_outputs must be a BaseModelOutput, a tuple or a [batch, frames, hidden] tensor, got {type(value).__name__}"
    )


def select_encoder_rows(outputs: ModelOutput, index: torch.Tensor) -> ModelOutput:
    """The encoder output of the rows in ``index`` (finished rows leave the batch)."""
    return type(outputs)(**{name: field[index] for name, field in outputs.items()})


class CausalLMRunner:
    """Runs a decoder-only ``*ForCausalLM`` on ragged blocks over a cache with holes.

    A decoder-only LM that cross-attends to an encoder output it did not compute (a Distil-Whisper
    decoder loaded as ``WhisperForCausalLM`` reading the target's encoder) is given that output in
    ``begin(encoder_outputs=...)``; its cache then keeps the cross-attention keys apart, computed
    once, exactly as an encoder-decoder model's does.
    """

    def __init__(self, model: PreTrainedModel):
        check_architecture(model)
        self.model = model
        self._logits_to_keep = _accepts(model, "logits_to_keep")
        # WhisperForCausalLM takes encoder_outputs; BERT/GPT-2-style LMs take encoder_hidden_states,
        # but only have cross-attention layers when built with add_cross_attention.
        if _accepts(model, "encoder_outputs"):
            self._encoder_argument = "encoder_outputs"
        elif _accepts(model, "encoder_hidden_states") and getattr(model.config, "add_cross_attention", False):
            self._encoder_argument = "encoder_hidden_states"
        else:
            self._encoder_argument = None
        self.encoder_outputs: ModelOutput | None = None
        self.layout = AttentionLayout.of(model)
        self.layout.check(model)
        # Mamba-style models take their cache as cache_params.
        self._cache_argument = "past_key_values" if _accepts(model, "past_key_values") else "cache_params"

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def cross_attends(self) -> bool:
        """Whether the model can read an encoder output (``encoder_outputs`` / ``encoder_hidden_states``)."""
        return self._encoder_argument is not None

    def new_cache(self, batch_size: int) -> SlotCache:
        if self.encoder_outputs is not None:
            return SlotCache(EncoderDecoderCache(DynamicCache(), DynamicCache()), batch_size, self.device)
        return SlotCache(config_cache(self.model) or DynamicCache(), batch_size, self.device)

    def begin(self, encoder_outputs=None, **model_inputs) -> ModelOutput | None:
        """Per-request inputs other than tokens. A decoder-only LM reads none of the encoder's
        inputs; one that cross-attends takes the ``encoder_outputs`` (all rows) it should read."""
        self.encoder_outputs = None
        if encoder_outputs is not None:
            if not self.cross_attends:
                raise ConfigError(f"{type(self.model).__name__} has no cross-attention: it cannot read an encoder output")
            self.encoder_outputs = as_encoder_outputs(encoder_outputs)
        return self.encoder_outputs

    def select_rows(self, index: torch.Tensor) -> None:
        """Finished rows leave the batch (and their encoder output with them)."""
        if self.encoder_outputs is not None:
            self.encoder_outputs = select_encoder_rows(self.encoder_outputs, index)

    @torch.no_grad()
    def forward(
        self,
        slots: SlotCache,
        input_ids: torch.Tensor,  # [B, n]
        valid: torch.Tensor,  # [B, n] bool
        logits_to_keep: int,
        inputs_embeds: torch.Tensor | None = None,  # [B, n, D]: fed instead of the tokens' embeddings
        hidden: bool = False,
    ):  # logits [B, logits_to_keep, V], or (logits, last hidden states [B, n, H]) with ``hidden``
        states = slots.recurrent
        if states is None:
            return self._forward(slots, input_ids, valid, logits_to_keep, inputs_embeds, hidden)
        if not states.checkpoints:
            states.begin_round()
        if not states.started:  # the prompt, read at once as generate reads it
            out = self._forward(slots, input_ids, valid, logits_to_keep, inputs_embeds, hidden)
            states.record(input_ids.shape[1])
            return out
        # Recurrent layers continue from a state one token at a time: one forward per column, a hole
        # leaves its row's state as it was, and a checkpoint after every column for the rewind.
        outs = []
        for c in range(input_ids.shape[1]):
            before = states.checkpoints[-1]
            embeds = None if inputs_embeds is None else inputs_embeds[:, c : c + 1]
            outs.append(self._forward(slots, input_ids[:, c : c + 1], valid[:, c : c + 1], 1, embeds, hidden))
            states.keep_rows(before, valid[:, c])
            states.record(1)
        if not hidden:
            return torch.cat(outs, dim=1)[:, -logits_to_keep:]
        return torch.cat([o[0] for o in outs], dim=1)[:, -logits_to_keep:], torch.cat([o[1] for o in outs], dim=1)

    def _forward(self, slots: SlotCache, input_ids, valid, logits_to_keep: int, inputs_embeds=None, hidden=False):
        attention_mask, position_ids = slots.extend(valid)
        if self.layout.counts_positions:
            attention_mask = self.layout.masks(slots.slot_mask, slots.positions, position_ids, self.model.dtype)
        elif not slots.attends:
            attention_mask = valid.long()
        kwargs = {}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        if self.encoder_outputs is not None:
            encoded = self.encoder_outputs.last_hidden_state  # [B, S, D]
            kwargs[self._encoder_argument] = self.encoder_outputs if self._encoder_argument == "encoder_outputs" else encoded
        kwargs[self._cache_argument] = slots.cache
        if inputs_embeds is None:
            kwargs["input_ids"] = input_ids
        else:
            kwargs["inputs_embeds"] = inputs_embeds
        if hidden:
            kwargs["output_hidden_states"] = True
        out = self.model(attention_mask=attention_mask, position_ids=position_ids, use_cache=True, **kwargs)
        logits = out.logits[:, -logits_to_keep:]
        return (logits, out.hidden_states[-1][:, -input_ids.shape[1]:]) if hidden else logits


class Seq2SeqRunner:
    """Runs an encoder-decoder model (``WhisperForConditionalGeneration``, ...) on ragged decoder blocks.

    ``begin`` encodes the request once (or takes an ``encoder_outputs`` someone already computed);
    every ``forward`` reuses it, and the cross-attention keys the first forward computes stay in the
    ``EncoderDecoderCache`` (the ``SlotCache`` never puts holes in them). Holes in the decoder's
    self-attention are hidden by ``decoder_attention_mask``, and ``decoder_position_ids`` count only
    valid slots, so the model must accept both.
    """

    REQUIRED = ("encoder_outputs", "decoder_input_ids", "decoder_attention_mask", "decoder_position_ids")

    def __init__(self, model: PreTrainedModel):
        missing = [name for name in self.REQUIRED if not _accepts(model, name)]
        if missing:
            raise ConfigError(
                f"{type(model).__name__}.forward does not take {', '.join(missing)}: specdec needs them to "
                "verify a ragged batch of drafts against an encoder-decoder target"
            )
        self.model = model
        self.encoder_outputs: ModelOutput | None = None
        self._encoder_mask: torch.Tensor | None = None  # [B, S] or None

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def main_input_name(self) -> str:
        return self.model.get_encoder().main_input_name

    def new_cache(self, batch_size: int) -> SlotCache:
        return SlotCache(EncoderDecoderCache(DynamicCache(), DynamicCache()), batch_size, self.device)

    @torch.no_grad()
    def begin(self, encoder_outputs=None, attention_mask=None, **encoder_inputs) -> ModelOutput:
        """Encode the request once; return the encoder output for every row.

        ``attention_mask`` is the encoder's (over the input frames or tokens), passed to every
        forward; ``encoder_outputs``, when given, is used instead of running the encoder.
        """
        self._encoder_mask = None if attention_mask is None else attention_mask.to(self.device)
        if encoder_outputs is None:
            if not encoder_inputs:
                raise InputError(
                    f"{type(self.model).__name__} is an encoder-decoder model: pass its encoder input "
                    f"({self.main_input_name}=...) or encoder_outputs=..."
                )
            encoder = self.model.get_encoder()
            kwargs = {name: value.to(self.device) if isinstance(value, torch.Tensor) else value
                      for name, value in encoder_inputs.items()}
            if self._encoder_mask is not None and "attention_mask" in inspect.signature(encoder.forward).parameters:
                kwargs["attention_mask"] = self._encoder_mask
            encoder_outputs = encoder(**kwargs, return_dict=True)
        self.encoder_outputs = as_encoder_outputs(encoder_outputs)
        return self.encoder_outputs

    def select_rows(self, index: torch.Tensor) -> None:
        """Finished rows leave the batch: drop their encoder output (the cache drops their keys)."""
        self.encoder_outputs = select_encoder_rows(self.encoder_outputs, index)
        if self._encoder_mask is not None:
            self._encoder_mask = self._encoder_mask[index]

    @torch.no_grad()
    def forward(
        self,
        slots: SlotCache,
        input_ids: torch.Tensor,  # [B, n] decoder tokens
        valid: torch.Tensor,  # [B, n] bool
        logits_to_keep: int,
        inputs_embeds: torch.Tensor | None = None,  # [B, n, D] decoder input embeddings
        hidden: bool = False,
    ):  # logits [B, logits_to_keep, V], or (logits, last decoder hidden states [B, n, H]) with ``hidden``
        attention_mask, position_ids = slots.extend(valid)  # [B, L + n], [B, n]
        tokens = {"decoder_input_ids": input_ids} if inputs_embeds is None else {"decoder_inputs_embeds": inputs_embeds}
        out = self.model(
            encoder_outputs=self.encoder_outputs,
            attention_mask=self._encoder_mask,
            decoder_attention_mask=attention_mask,
            decoder_position_ids=position_ids,
            past_key_values=slots.cache,
            use_cache=True,
            output_hidden_states=hidden,
            **tokens,
        )
        logits = out.logits[:, -logits_to_keep:]
        return (logits, out.decoder_hidden_states[-1][:, -input_ids.shape[1]:]) if hidden else logits


def load_pretrained(auto_class, model: str | Path, *, dtype: torch.dtype | str | None, who: str):
    """Load a model from a local path (or a hub id, when the network allows), naming ``who`` wants it."""
    from .model_cache import cached_model_dir, missing_model_hint

    path = Path(model).expanduser()
    if not path.exists() and cached_model_dir(str(model)) is not None:
        path = cached_model_dir(str(model))  # a name `specdec models fetch` converted
    if not path.exists() and (str(model).startswith((".", "/", "~")) or path.suffix or len(path.parts) != 2):
        raise ConfigError(f"{who}: model {str(model)!r} {missing_model_hint(str(model))}")
    try:
        return auto_class.from_pretrained(str(path if path.exists() else model), dtype=dtype).eval()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{who}: cannot load model {str(model)!r}: {exc}") from exc


def load_seq2seq(model: str | Path, *, dtype, who: str):
    """Load an encoder-decoder model: a speech one (Whisper) first, then a text one (T5, BART)."""
    try:
        return load_pretrained(AutoModelForSpeechSeq2Seq, model, dtype=dtype, who=who)
    except ConfigError as speech_error:
        try:
            return load_pretrained(AutoModelForSeq2SeqLM, model, dtype=dtype, who=who)
        except ConfigError:
            raise speech_error from None


def runner_for(model: PreTrainedModel) -> CausalLMRunner | Seq2SeqRunner:
    """The runner that calls ``model``: encoder-decoder models get a ``Seq2SeqRunner``."""
    if model.config.is_encoder_decoder:
        return Seq2SeqRunner(model)
    return CausalLMRunner(model)
