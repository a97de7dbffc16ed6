"""Thin runners that call a transformers model on a block of tokens with a `SlotCache`.

The loop and the model drafter speak to models only through these, so a decoder-only LM and an
encoder-decoder model look the same to them: tokens in, logits out, holes allowed.
``runner_for(model)`` picks the runner; ``begin(**model_inputs)`` takes a request's inputs other
than tokens (an encoder-decoder runner encodes here, once per request).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers import (AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq, Cache, DynamicCache, EncoderDecoderCache,
                          PreTrainedModel)
from transformers.modeling_outputs import BaseModelOutput
from transformers.utils import ModelOutput

from ..errors import ConfigError, InputError, RereadWarning
from .cache import SlotCache, full_tensor, static_cache
from .masks import FULL, AttentionLayout
from .gqa_attention import gqa_steps
from .packed_linear import TRIAL_ROWS, packed_steps
from .screened_head import screened_head
from .recurrent import config_cache


_POSITIONS_FROM_CACHE = (
    "it derives its position ids from the cache length (past_key_values_length) instead of taking "
    "position_ids, so the holes that rejected drafts leave in a cache would shift every later position"
)
# Architectures whose cache cannot hold the holes of rejected drafts, and why. runner_for gives
# them a RereadingRunner: each row's whole sequence as generate prepares it, read with no cache or
# over a cache per row (exact, and slow: see docs/design.md).
REREAD_ARCHITECTURES = {
    "gpt_neo": "its local-attention layers apply their window through a fixed buffer indexed by cache slot "
               "(GPTNeoSelfAttention.bias), which the holes of rejected drafts shift",
    "git": "with a cache it widens the attention mask by its image tokens (even without an image), so the mask "
           "no longer lines up with the cache's slots and the holes of rejected drafts show",
    "cpmant": "it is fed the whole sequence at every step and cuts the cached prefix off by the cache length, and "
              "counts its padding from the pad ids of the whole sequence, so holes would misalign both",
    "roformer": _POSITIONS_FROM_CACHE,
    "trocr": _POSITIONS_FROM_CACHE,
    "openai-gpt": "it has no KV cache",
    # From transformers 5.24 generate hands it a cache it misuses (tests/architectures.py, GENERATE_KWARGS):
    # specdec computes what generate(use_cache=False) does, the model's own output.
    "xlm": "it keeps no cache in generate and reads each next token from a mask token appended to the sequence",
    "rwkv": "it keeps its recurrent state in a state tuple outside transformers' cache classes",
    "recurrent_gemma": "it keeps its recurrent and attention states inside its layers, not in a transformers Cache",
    "minimax": "its lightning-attention state lives in a cache class of its own that refuses DynamicCache",
    "deepseek_v4": "its compressed-attention cache layers keep per-slot compression state that cannot hold holes",
    "inkling_text": "its relative position bias and log scaling count cache slots (InklingAttention: arange over "
                    "the cache's mask sizes), not position ids, so holes would shift them",
}
# Architectures that cannot be decoded exactly at all, and why (docs/architectures.md has the sweep).
REFUSED_ARCHITECTURES: dict[str, str] = {}
# Requests on which transformers' own generate gives a row another output than the same row alone,
# so there is no one output to match (tests/test_architectures.py proves each): model type -> (the
# request refused, why).
_GENERATE_DIFFERS = {
    "rwkv": ("batched", "its one-token steps add a [B, H] state to [B, 1, H] hidden states "
             "(RwkvSelfAttention.extract_key_value), which broadcasts every row against every other once B > 1"),
}


# Models whose tokens attend to later tokens of the same forward, so that generate's output depends on
# what it reads together (the prompt at once, then each token alone): the runner replays exactly
# that, row by row, with a cache it crops back to the kept tokens. Model type -> why.
_REPLAY_STEPS = {
    "cpmant": "its attention is bidirectional within a forward (CpmAntModel._prepare_attention_mask sets "
              "context = 1 for every token)",
    "git": "once it has a cache it widens the attention mask by its image tokens, even without an image "
           "(GitModel.forward), which unmasks the prompt's padding for every token read after the prompt",
}
# Models whose cache can be cropped but cannot hold holes, and whose forward of a block equals its
# tokens read one by one: each row keeps a cache of its own too, but reads each new block at once.
_ROW_BLOCKS = {"gpt_neo", "roformer", "trocr"}


def _last_columns(logits: torch.Tensor, n: int) -> torch.Tensor:
    """``logits[:, -n:]``, without the slice (a tensor op: 5-10 us on a CPU) when the model already
    returned only those (``logits_to_keep``)."""
    return logits if logits.shape[1] == n else logits[:, -n:]


def _text_model_type(model: PreTrainedModel) -> str:
    return model.config.get_text_config(decoder=True).model_type


def check_architecture(model: PreTrainedModel) -> None:
    """Refuse, before decoding, a model specdec cannot decode exactly, naming it and the reason."""
    model_type = _text_model_type(model)
    reason = REFUSED_ARCHITECTURES.get(model_type) or REFUSED_ARCHITECTURES.get(model.config.model_type)
    if reason:
        raise ConfigError(f"{type(model).__name__} ({model_type}) cannot be decoded exactly by specdec: {reason}")


def check_generate_agrees(model: PreTrainedModel, batch_size: int, padded: bool) -> None:
    """Refuse, as a target, a request on which transformers' own generate gives a row another output
    than the same row alone (``_GENERATE_DIFFERS``): there is no one output to match. A draft model
    is never refused for it: its drafts only change the speed."""
    model_type = _text_model_type(model)
    kind, why = _GENERATE_DIFFERS.get(model_type, (None, None))
    request = {"padded": "left-padded prompts" if padded else None,
               "batched": "a batch of more than one row" if batch_size > 1 else None}.get(kind)
    if request:
        raise InputError(
            f"{type(model).__name__} ({model_type}) cannot be decoded exactly by specdec on {request}: {why}, "
            "so there is no one output to match; decode its rows one at a time"
        )


def reread_reason(model: PreTrainedModel) -> str | None:
    """Why ``model``'s cache cannot hold holes (it is then re-read every forward), or None."""
    return REREAD_ARCHITECTURES.get(_text_model_type(model)) or REREAD_ARCHITECTURES.get(model.config.model_type)


def _accepts(model: PreTrainedModel, argument: str) -> bool:
    return argument in inspect.signature(model.forward).parameters


# transformers 5.24 renamed the cache argument and output field to ``cache``; before it they were
# ``past_key_values`` (``cache_params`` for Mamba-style models). Passing the old name to 5.24 still
# works but logs a deprecation warning, and detecting the old name alone sends no cache at all.
_CACHE_NAMES = ("cache", "past_key_values", "cache_params")


def cache_argument(model) -> str:
    """The keyword ``model``'s forward takes its cache under (see ``_CACHE_NAMES``). Drafters call
    it at every draft step, so the answer is kept per forward function (reading a signature costs
    ~16 us)."""
    forward = model.forward
    return _cache_argument_of(getattr(forward, "__func__", forward))


@functools.lru_cache(maxsize=256)
def _cache_argument_of(forward) -> str:
    parameters = inspect.signature(forward).parameters
    return next((name for name in _CACHE_NAMES if name in parameters), "past_key_values")


def returned_cache(output: ModelOutput):
    """The cache a forward returned, under whichever name this transformers gives it."""
    # A ModelOutput's keys are its non-None fields. Its own ``in`` maps the old names to ``cache`` on
    # transformers >= 5.24 and logs a deprecation warning for asking; the plain keys do not.
    keys = output.keys()
    return next((output[name] for name in _CACHE_NAMES if name in keys), None)


def with_cache(output_class: type[ModelOutput], cache, **fields) -> ModelOutput:
    """``output_class(**fields)`` with ``cache`` under the field name this transformers declares.
    Drafts' forwards call it, compiled ones too: the class's field table is read as a dict, which
    dynamo traces (``dataclasses.fields`` of a class breaks its graph)."""
    declared = output_class.__dataclass_fields__
    return output_class(**fields, **{next(name for name in _CACHE_NAMES if name in declared): cache})


def vocab_size(model: PreTrainedModel) -> int:
    """The width of the model's logits, which is what a draft and a target must agree on."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None) if head is not None else None
    if callable(weight):  # a dynamically quantised Linear (torch.ao) gives its weight by a call
        weight = weight()
    if weight is not None:
        return int(weight.shape[0])
    if isinstance(getattr(head, "out_features", None), int):  # a layer kept only in int8 (packed_linear.Int8Linear)
        return head.out_features
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


# The accelerator's path on a CPU: runners prepare their 4D masks there too. For tests and the
# benchmarks that check what a GPU runs (check_architectures.py, profile_loop.py --accelerator-path).
PREPARE_MASKS_ON_CPU = False


def _prepares_masks(runner, device: torch.device) -> bool:
    """Whether ``runner`` hands this forward a 4D mask it built. Off the CPU, transformers' sdpa mask
    creation from a 2D mask syncs the device (it asks whether the mask is all ones, in Python, for
    one-token steps and prefills); a prepared 4D mask is used as it is. On the CPU a sync is free
    and the 2D path is transformers' own."""
    return (device.type != "cpu" or PREPARE_MASKS_ON_CPU) and runner.prepares_masks_off_cpu


def compiled_forward(model: PreTrainedModel):
    """``model.forward`` through ``torch.compile(dynamic=False)``, compiled once per model and process
    (CUDA graphs too on CUDA: ``mode="reduce-overhead"``). Only static-shape steps call it: their
    shapes are a handful (batch bucket x block width), each compiled once. The prefill stays eager,
    as transformers advises (its width changes with every request)."""
    compiled = model.__dict__.get("_specdec_compiled_forward")
    if compiled is None:
        # A batch that shrinks through its power-of-two buckets meets more shapes than dynamo's
        # default of 8 recompilations per function, after which it would silently run eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        mode = "reduce-overhead" if model.device.type == "cuda" else None
        compiled = torch.compile(model.forward, dynamic=False, mode=mode)
        model.__dict__["_specdec_compiled_forward"] = compiled
    return compiled


class CausalLMRunner:
    """Runs a decoder-only ``*ForCausalLM`` on ragged blocks over a cache with holes.

    A decoder-only LM that cross-attends to an encoder output it did not compute (a Distil-Whisper
    decoder loaded as ``WhisperForCausalLM`` reading the target's encoder) is given that output in
    ``begin(encoder_outputs=...)``; its cache then keeps the cross-attention keys apart, computed
    once, exactly as an encoder-decoder model's does.
    """

    rereads = False  # reads only what its cache has not seen (see RereadingRunner)

    def __init__(self, model: PreTrainedModel):
        check_architecture(model)
        if reason := reread_reason(model):
            raise ConfigError(f"{type(model).__name__} ({_text_model_type(model)}) cannot keep a cache with holes: "
                              f"{reason}; runner_for(model) gives it a RereadingRunner")
        self.model = model
        self._logits_to_keep = _accepts(model, "logits_to_keep")
        self._takes_positions = _accepts(model, "position_ids")
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
        self._cache_argument = cache_argument(model)
        self._last_static: tuple[tuple[int, int], Cache] | None = None  # (batch, capacity), its attention cache

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def cross_attends(self) -> bool:
        """Whether the model can read an encoder output (``encoder_outputs`` / ``encoder_hidden_states``)."""
        return self._encoder_argument is not None

    def new_cache(self, batch_size: int, capacity: int | None = None) -> SlotCache:
        """An empty cache for ``batch_size`` rows; with ``capacity``, preallocated (static shapes)."""
        if capacity is not None:
            self.check_static()
            self_attention = self._reused_static(batch_size, capacity) or static_cache(_decoder_layers(self.model), capacity, self.device)
            self._last_static = ((batch_size, capacity), self_attention)
            if self.encoder_outputs is not None:
                self_attention = EncoderDecoderCache(self_attention, DynamicCache())
            return SlotCache(self_attention, batch_size, self.device, capacity)
        if self.encoder_outputs is not None:
            return SlotCache(EncoderDecoderCache(DynamicCache(), DynamicCache()), batch_size, self.device)
        return SlotCache(config_cache(self.model) or DynamicCache(), batch_size, self.device)

    def _reused_static(self, batch_size: int, capacity: int) -> Cache | None:
        """The last request's static cache, zeroed, if it was of this shape and still is: its
        tensors keep their addresses, so compiled steps replay the CUDA graphs they captured for it
        instead of re-recording each one per request, and a drafter's cache, made inside the loop,
        does not initialise (a blocking copy each layer) again. A batch cut to smaller buckets read
        views of the same tensors, which it gets back whole. One is kept, as transformers keeps
        ``generate``'s static cache; one that grew its capacity (``SlotCache.regrowths``) is of
        another shape, and a new one is made."""
        last, self._last_static = self._last_static, None
        if last is None or last[0] != (batch_size, capacity):
            return None
        cache = last[1]
        whole = [(full_tensor(layer.keys), full_tensor(layer.values)) if getattr(layer, "is_initialized", False)
                 else None for layer in cache.layers]
        for layer, tensors in zip(cache.layers, whole):
            if layer.max_cache_len != capacity or tensors is not None and (
                    tensors[0].shape[0] != batch_size or tensors[0].shape[2] != capacity
                    or tensors[0].device != self.device or tensors[0].dtype != self.model.dtype):
                return None
        for layer, tensors in zip(cache.layers, whole):
            if tensors is not None:  # a batch cut to a smaller bucket read views of them
                layer.keys, layer.values = tensors
        cache.reset()
        return cache

    def check_static(self) -> None:
        """Refuse, before decoding, a model whose state a preallocated cache cannot hold."""
        who = f"static_cache: {type(self.model).__name__}"
        if config_cache(self.model) is not None or self.layout.others:
            raise ConfigError(
                f"{who} keeps state besides attention keys and values (recurrent or conv states, sparse-attention "
                "indexer keys), which specdec's static cache does not preallocate; decode it with static_cache=False"
            )
        if not self.layout.takes_prepared_masks:
            raise ConfigError(
                f"{who} uses attn_implementation={self.layout.implementation!r}; the static cache hands the model "
                "prepared 4D masks over its full capacity, which only 'sdpa' and 'eager' take"
            )

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

    def end(self) -> None:
        """The request is over: let go of the encoder output it read."""
        self.encoder_outputs = None

    @torch.no_grad()
    def forward(
        self,
        slots: SlotCache,
        input_ids: torch.Tensor,  # [B, n]
        valid: torch.Tensor,  # [B, n] bool
        logits_to_keep: int,
        inputs_embeds: torch.Tensor | None = None,  # [B, n, D]: fed instead of the tokens' embeddings
        hidden: bool = False,
        dense: bool = False,  # every column of ``valid`` is True, as the caller knows on the host
        siblings: tuple[int, int] | None = None,  # (first, count): see ``reads_siblings``
    ):  # logits [B, logits_to_keep, V], or (logits, last hidden states [B, n, H]) with ``hidden``
        states = slots.recurrent
        if states is None:
            return self._forward(slots, input_ids, valid, logits_to_keep, inputs_embeds, hidden, dense, siblings)
        if not states.checkpoints:
            states.begin_round()
        if not states.started:  # the prompt, read at once as generate reads it
            out = self._forward(slots, input_ids, valid, logits_to_keep, inputs_embeds, hidden, dense)
            states.record(input_ids.shape[1])
            return out
        # Recurrent layers continue from a state one token at a time: one forward per column, a hole
        # leaves its row's state as it was, and a checkpoint after every column for the rewind.
        outs = []
        for c in range(input_ids.shape[1]):
            before = states.checkpoints[-1]
            embeds = None if inputs_embeds is None else inputs_embeds[:, c : c + 1]
            outs.append(self._forward(slots, input_ids[:, c : c + 1], valid[:, c : c + 1], 1, embeds, hidden, dense))
            states.keep_rows(before, valid[:, c])
            states.record(1)
        if not hidden:
            return torch.cat(outs, dim=1)[:, -logits_to_keep:]
        return torch.cat([o[0] for o in outs], dim=1)[:, -logits_to_keep:], torch.cat([o[1] for o in outs], dim=1)

    compiled_steps = False  # set per request (CachedModel.begin): call a compiled forward after the prefill
    packed_steps = False  # set per request (CachedModel.begin): steps after the prefill on packed weights
    weight_copies = True  # set per request (CachedModel.begin): packed copies; else copy-free routes
    packed_one_row = False  # set per request (CachedModel.begin): one-token steps too (a drafter's)
    matmul_precision = "highest"  # set per request (CachedModel.begin): a drafter's bfloat16 weights
    grouped_steps = False  # set per request (CachedModel.begin): multi-token steps' attention by gqa_steps
    screened_steps = False  # set per request (CachedModel.begin): multi-row steps' LM head by screened_head
    screen_suppressed = ()  # set per request (CachedModel.begin): the tokens its argmax is taken without
    screen_exact_from = None  # set per request (CachedModel.begin): the tokens from which it is float32 throughout

    @property
    def prepares_masks_off_cpu(self) -> bool:
        """Whether, off the CPU, every forward gets a 4D mask specdec built: where it can build every
        layer's (``AttentionLayout.builds_every_mask``) and the model reads positions from
        ``position_ids``. An ALiBi model (Bloom) derives its biases from the 2D mask, and a 4D one
        breaks it; such models get the 2D slot mask and transformers' own masks, and a sync."""
        return self.layout.builds_every_mask and self._takes_positions

    def reads_siblings(self, slots: SlotCache | None) -> bool:
        """Whether a block may end in siblings of one of its columns (a token tree's first level: the
        same position, each seeing the block's columns before that one and itself only): a cache
        with holes of attention layers only, an attention implementation that takes the 4D mask
        specdec builds, and positions read from ``position_ids`` (ALiBi models such as Bloom derive
        theirs from the 2D mask). Recurrent states read a block column by column, and a static
        cache's steps are compiled for chain blocks."""
        return (slots is not None and slots.recurrent is None and not slots.static and slots.attends
                and self.layout.takes_prepared_masks and not self.layout.others and self._takes_positions)

    def _forward(self, slots: SlotCache, input_ids, valid, logits_to_keep: int, inputs_embeds=None, hidden=False,
                 dense=False, siblings: tuple[int, int] | None = None):
        # A static cache's physical batch may hold finished rows: they read holes.
        physical = slots.to_physical(valid, False)  # [P, n]
        dense = dense and physical is valid  # finished rows in the batch read holes
        input_ids, valid = slots.to_physical(input_ids), physical
        if inputs_embeds is not None:
            inputs_embeds = slots.to_physical(inputs_embeds)
        position_ids = slots.extend(valid, dense, siblings)
        one_token = input_ids.shape[1] == 1
        branches = None if siblings is None else tree_branches(input_ids.shape[1], siblings, input_ids.device)
        if self.layout.counts_positions or branches is not None or slots.attends and (
                slots.static and self.prepares_masks_off_cpu or _prepares_masks(self, input_ids.device)):
            attention_mask = self.layout.masks(slots.slot_mask, slots.positions, position_ids, self.model.dtype,
                                               first_query_slot=slots.length - input_ids.shape[1],
                                               prompt_lengths=slots.prompt_lengths, branches=branches)
        elif not slots.attends:
            attention_mask = valid.long()
        elif one_token and not slots.static and (
                not slots.holes or input_ids.device.type == "cpu" and bool(slots.slot_mask.all())):
            # A plain step over a cache without holes attends to every slot: no mask, as generate
            # passes none without padding (transformers would check the 2D mask and drop it anyway).
            attention_mask = None
        else:
            attention_mask = slots.slot_mask.long()
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
        call = self.model
        step = slots.length > input_ids.shape[1]  # not the prefill
        if self.compiled_steps and slots.static and step:
            call = compiled_forward(self.model)
        # A drafter reads a short prompt (Whisper's four prompt tokens) as it reads its steps: its
        # numbers never reach the output, and the cross-attention keys a shared-encoder draft
        # computes there and lends the target stay on torch's path (packed_linear._candidates).
        packed = self.packed_steps and (step or self.packed_one_row and input_ids.numel() <= TRIAL_ROWS[-1])
        with (packed_steps(self.model, input_ids.numel(), self.packed_one_row, self.matmul_precision,
                           self.weight_copies) if packed else nullcontext()), \
                (gqa_steps(self.model) if self.grouped_steps and step and not one_token else nullcontext()), \
                (screened_head(self.model, self.screen_suppressed, self.screen_exact_from) if self.screened_steps and step
                 else nullcontext()):
            out = call(attention_mask=attention_mask, position_ids=position_ids, use_cache=True, **kwargs)
        logits = slots.to_active(_last_columns(out.logits, logits_to_keep))
        return (logits, slots.to_active(out.hidden_states[-1][:, -input_ids.shape[1]:])) if hidden else logits


class RereadingRunner:
    """Runs a decoder-only LM whose cache cannot hold holes (``REREAD_ARCHITECTURES``) as generate does.

    Every read gets whole sequences: ``CachedModel`` hands it each row's committed tokens
    (the prompt's left padding and attention mask exactly as ``generate`` saw them) followed by the
    round's speculative tokens, rows of one length at a time, so there is no padding but the
    prompt's own. The model's inputs are built by its own ``prepare_inputs_for_generation`` with
    ``use_cache=False``, and position ids, where the model takes them, exactly as ``generate``
    makes them from the attention mask. Every token then has the position and the context it has
    in ``generate``, whatever the model derives positions from. A model whose generate appends a
    token to read the next one (XLM's mask token) gets one forward per scored position. A model
    whose forward depends on what is read together (``_REPLAY_STEPS``: CPM-Ant, GIT) is replayed
    as generate reads it, row by row: the prompt at once, then one token per forward, over a cache
    of the row's own that is cropped back to its kept tokens. A model whose cache can be cropped
    but not hold holes (``_ROW_BLOCKS``: GPT-Neo, RoFormer, TrOCR) keeps such a cache per row too,
    and reads each row's new tokens in one forward: only what is new, not the whole sequence.

    Exact, and costly: read whole, each verification (and each draft step of a draft model)
    re-reads the whole sequence, so speculation pays only for short sequences; with a cache per
    row, a read is one forward per row (docs/design.md).
    """

    rereads = True

    def __init__(self, model: PreTrainedModel):
        check_architecture(model)
        self.model = model
        self.reason = reread_reason(model) or "it was asked to re-read"
        self._positions = _accepts(model, "position_ids")
        self._logits_to_keep = _accepts(model, "logits_to_keep")
        probe = torch.ones(1, 1, dtype=torch.long, device=model.device)
        prepared = model.prepare_inputs_for_generation(probe, attention_mask=probe, use_cache=False)
        # XLM-style: the next token is read from a token the model appends (its mask token), so
        # each scored position needs a forward of its own.
        self._appends = prepared["input_ids"].shape[1] > probe.shape[1]
        model_type = _text_model_type(model)
        self._one_token = model_type in _REPLAY_STEPS
        self._replays = self._one_token or model_type in _ROW_BLOCKS  # a cache per row
        self._caches: dict[int, tuple[DynamicCache, int]] = {}  # row id -> its cache, tokens read
        self._encoder_argument = "encoder_hidden_states" if (
            _accepts(model, "encoder_hidden_states") and getattr(model.config, "add_cross_attention", False)) else None
        self.encoder_outputs: ModelOutput | None = None
        warnings.warn(
            f"{type(model).__name__} ({_text_model_type(model)}) cannot keep rejected drafts as holes in a cache "
            f"({self.reason}): specdec re-reads every row's whole sequence at each forward. The output is "
            "exact; speculation pays only for short sequences.", RereadWarning, stacklevel=2,
        )

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def cross_attends(self) -> bool:
        return self._encoder_argument is not None

    def new_cache(self, batch_size: int, capacity: int | None = None) -> None:
        if capacity is not None:
            raise ConfigError(
                f"static_cache: {type(self.model).__name__} ({_text_model_type(self.model)}) is re-read without a "
                f"cache ({self.reason}), so there is no cache to preallocate; decode it with static_cache=False"
            )
        return None

    def begin(self, encoder_outputs=None, **model_inputs) -> ModelOutput | None:
        self.encoder_outputs = None
        self._caches = {}
        if encoder_outputs is not None:
            if not self.cross_attends:
                raise ConfigError(f"{type(self.model).__name__} has no cross-attention: it cannot read an encoder output")
            if self._replays:
                raise ConfigError(f"{type(self.model).__name__} is replayed row by row: it reads no encoder output")
            self.encoder_outputs = as_encoder_outputs(encoder_outputs)
        return self.encoder_outputs

    def select_rows(self, index: torch.Tensor) -> None:
        if self.encoder_outputs is not None:
            self.encoder_outputs = select_encoder_rows(self.encoder_outputs, index)

    def keep_caches(self, row_ids: list[int]) -> None:
        """Only the rows ``row_ids`` (original ids) go on: free the caches of the others."""
        self._caches = {row: self._caches[row] for row in row_ids if row in self._caches}

    def end(self) -> None:
        """The request is over: let go of its rows' caches and the encoder output it read."""
        self.encoder_outputs = None
        self._caches = {}

    @torch.no_grad()
    def read_sequences(
        self,
        input_ids: torch.Tensor,  # [g, T]: whole sequences of one length
        attention_mask: torch.Tensor,  # [g, T] long
        logits_to_keep: int,
        rows: torch.Tensor | None = None,  # [g] the active rows these are (for the encoder output)
        replay: tuple | None = None,  # (original row ids, tokens each row's cache may keep, prompt width), host
    ) -> torch.Tensor:  # [g, logits_to_keep, V]: the logits of the last columns
        if self._replays:
            row_ids, kept, prompt_width = replay
            return torch.cat([self._replay(input_ids[i:i + 1], attention_mask[i:i + 1], logits_to_keep,
                                           row_ids[i], kept[i], prompt_width) for i in range(len(row_ids))], dim=0)
        if self._appends:
            length = input_ids.shape[1]
            parts = [self._forward(input_ids[:, :end], attention_mask[:, :end], 1, rows).logits[:, -1:]
                     for end in range(length - logits_to_keep + 1, length + 1)]
            return torch.cat(parts, dim=1)
        return self._forward(input_ids, attention_mask, logits_to_keep, rows).logits[:, -logits_to_keep:]

    def _replay(self, input_ids, attention_mask, logits_to_keep: int, row: int, kept: int, prompt_width: int):
        """One row as generate reads it, over a cache of its own cropped back to the ``kept`` tokens it
        read before and that still stand: the prompt in one forward, then what is new one token per
        forward (``_REPLAY_STEPS``) or in one forward (``_ROW_BLOCKS``)."""
        cache, read = self._caches.get(row, (None, 0))
        parts = []
        if cache is None or kept < prompt_width:
            cache = DynamicCache(config=self.model.config)
            parts.append(self._step(input_ids[:, :prompt_width], attention_mask[:, :prompt_width], cache, None))
            kept = prompt_width
        elif read > kept:  # counted from the end: a model may cache more than it read (CPM-Ant: its own prompt)
            cache.crop(kept - read)  # a negative count: drop the last read - kept tokens
        length = input_ids.shape[1]
        ends = range(kept + 1, length + 1) if self._one_token else [length] if length > kept else []
        for end in ends:
            parts.append(self._step(input_ids[:, :end], attention_mask[:, :end], cache, end - kept))
            kept = end
        self._caches[row] = (cache, length)
        logits = torch.cat(parts, dim=1)[:, -logits_to_keep:]
        if logits.shape[1] < logits_to_keep:  # columns before what was read now are holes: any logits do
            logits = torch.cat([logits[:, :1].expand(-1, logits_to_keep - logits.shape[1], -1), logits], dim=1)
        return logits

    def _step(self, input_ids, attention_mask, cache, new: int | None):
        """generate's forward of the ``new`` last tokens over ``cache`` (None: the prompt, all of them)."""
        first = new is None
        kwargs = {"attention_mask": attention_mask, "use_cache": True, cache_argument(self.model): cache}
        if self._positions:
            kwargs["position_ids"] = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        # generate's decoding steps ask for the new tokens only (a model that needs more, as CPM-Ant
        # does, overrides prepare_inputs_for_generation to ignore it)
        inputs = self.model.prepare_inputs_for_generation(input_ids, is_first_iteration=first,
                                                          next_sequence_length=new, **kwargs)
        logits = self.model(**inputs).logits
        return logits if first else logits[:, -new:]

    def _forward(self, input_ids, attention_mask, logits_to_keep, rows):
        kwargs = {"attention_mask": attention_mask, "use_cache": False}
        if self._positions:  # as generate makes them (_prepare_position_ids_for_generation)
            kwargs["position_ids"] = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        inputs = self.model.prepare_inputs_for_generation(input_ids, is_first_iteration=True, **kwargs)
        if self._logits_to_keep and not self._appends:
            inputs["logits_to_keep"] = logits_to_keep
        if self.encoder_outputs is not None:
            encoded = self.encoder_outputs.last_hidden_state
            inputs[self._encoder_argument] = encoded if rows is None else encoded[rows]
        return self.model(**inputs)


def tree_branches(n: int, siblings: tuple[int, int], device) -> torch.Tensor:
    """``AttentionLayout.masks``' branches of an n-column block whose last ``count`` columns are
    siblings of column ``first``: the catch-up before it is the trunk (-1), the chain branch 0, each
    sibling its own branch."""
    first, count = siblings
    return torch.cat([torch.full((first,), -1), torch.zeros(n - first - count, dtype=torch.long),
                      torch.arange(1, count + 1)]).to(device, non_blocking=True)


class Seq2SeqRunner:
    """Runs an encoder-decoder model (``WhisperForConditionalGeneration``, ...) on ragged decoder blocks.

    ``begin`` encodes the request once (or takes an ``encoder_outputs`` someone already computed);
    every ``forward`` reuses it, and the cross-attention keys the first forward computes stay in the
    ``EncoderDecoderCache`` (the ``SlotCache`` never puts holes in them). Holes in the decoder's
    self-attention are hidden by ``decoder_attention_mask``, and ``decoder_position_ids`` count only
    valid slots, so the model must accept both.
    """

    rereads = False
    REQUIRED = ("encoder_outputs", "decoder_input_ids", "decoder_attention_mask", "decoder_position_ids")
    compiled_steps = False  # set per request (CachedModel.begin): decoder steps after the first compiled
    packed_steps = False  # set per request (CachedModel.begin): decoder steps after the first on packed weights
    weight_copies = True  # set per request (CachedModel.begin): packed copies; else copy-free routes
    packed_one_row = False  # set per request (CachedModel.begin): one-token steps too (a drafter's)
    matmul_precision = "highest"  # set per request (CachedModel.begin): a drafter's bfloat16 weights
    screened_steps = False  # set per request (CachedModel.begin): multi-row steps' LM head by screened_head
    screen_suppressed = ()  # set per request (CachedModel.begin): the tokens its argmax is taken without
    screen_exact_from = None  # set per request (CachedModel.begin): the tokens from which it is float32 throughout

    def __init__(self, model: PreTrainedModel):
        missing = [name for name in self.REQUIRED if not _accepts(model, name)]
        if missing:
            raise ConfigError(
                f"{type(model).__name__}.forward does not take {', '.join(missing)}: specdec needs them to "
                "verify a ragged batch of drafts against an encoder-decoder target"
            )
        self.model = model
        self._cache_argument = cache_argument(model)
        self.encoder_outputs: ModelOutput | None = None
        self._encoder_mask: torch.Tensor | None = None  # [B, S] or None
        self.layout = AttentionLayout.of(model)  # the decoder's self-attention: full, causal

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def main_input_name(self) -> str:
        return self.model.get_encoder().main_input_name

    def new_cache(self, batch_size: int, capacity: int | None = None) -> SlotCache:
        """An empty cache for ``batch_size`` rows; with ``capacity``, the decoder's self-attention is
        preallocated (static shapes; the cross-attention keys are computed once anyway)."""
        if capacity is None:
            return SlotCache(EncoderDecoderCache(DynamicCache(), DynamicCache()), batch_size, self.device)
        cache = EncoderDecoderCache(static_cache(_decoder_layers(self.model), capacity, self.device), DynamicCache())
        return SlotCache(cache, batch_size, self.device, capacity)

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

    @property
    def prepares_masks_off_cpu(self) -> bool:
        """Whether, off the CPU, every decoder forward gets a 4D mask specdec built (positions are
        always ``decoder_position_ids`` here: models without them are refused)."""
        return self.layout.builds_every_mask

    def reads_siblings(self, slots: SlotCache | None) -> bool:
        """Token-tree siblings (``CausalLMRunner.reads_siblings``): through a 4D decoder mask, where
        the decoder's attention takes one and its positions are ``decoder_position_ids``."""
        return slots is not None and not slots.static and self.layout.takes_prepared_masks and \
            self.layout.kinds == (FULL,)

    def select_rows(self, index: torch.Tensor) -> None:
        """Finished rows leave the batch: drop their encoder output (the cache drops their keys)."""
        self.encoder_outputs = select_encoder_rows(self.encoder_outputs, index)
        if self._encoder_mask is not None:
            self._encoder_mask = self._encoder_mask[index]

    def end(self) -> None:
        """The request is over: let go of its encoder output (whisper-base: 3 MiB a row)."""
        self.encoder_outputs = self._encoder_mask = None

    @torch.no_grad()
    def forward(
        self,
        slots: SlotCache,
        input_ids: torch.Tensor,  # [B, n] decoder tokens
        valid: torch.Tensor,  # [B, n] bool
        logits_to_keep: int,
        inputs_embeds: torch.Tensor | None = None,  # [B, n, D] decoder input embeddings
        hidden: bool = False,
        dense: bool = False,  # every column of ``valid`` is True, as the caller knows on the host
        siblings: tuple[int, int] | None = None,  # (first, count): see ``reads_siblings``
    ):  # logits [B, logits_to_keep, V], or (logits, last decoder hidden states [B, n, H]) with ``hidden``
        physical = slots.to_physical(valid, False)  # static: [P, n]
        dense = dense and physical is valid  # finished rows in the batch read holes
        input_ids, valid = slots.to_physical(input_ids), physical
        if inputs_embeds is not None:
            inputs_embeds = slots.to_physical(inputs_embeds)
        position_ids = slots.extend(valid, dense, siblings)  # [B, n]
        if siblings is None and not _prepares_masks(self, input_ids.device):
            attention_mask = slots.slot_mask.long()  # [B, L + n] (static: [P, capacity])
        else:  # a token tree's siblings (a 4D mask keeps them apart), or off the CPU
            branches = None if siblings is None else tree_branches(input_ids.shape[1], siblings, input_ids.device)
            attention_mask = self.layout.masks(slots.slot_mask, slots.positions, position_ids, self.model.dtype,
                                               first_query_slot=slots.length - input_ids.shape[1], branches=branches)
        tokens = {"decoder_input_ids": input_ids} if inputs_embeds is None else {"decoder_inputs_embeds": inputs_embeds}
        # The first read computes the cross-attention keys, on torch's path as generate's (packed layers
        # leave them out: packed_linear._candidates). A target's first read that verifies drafts runs packed
        # as its verifies do; one that scores a single position (a plain first step) stays generate's own,
        # and an encoder-decoder drafter's first read stays as before. Its LM head is screened either way
        # (the argmax stays float32's): on whisper-base a first read of 4 prompt tokens and 3 drafts took
        # 13.5 ms in the head alone on torch's path (docs/benchmarks.md, stop 60), its other layers 4 ms
        # more than packed (stop 62).
        step = slots.length > input_ids.shape[1]
        packed = self.packed_steps and (step or logits_to_keep > 1 and not self.packed_one_row)
        call = compiled_forward(self.model) if self.compiled_steps and slots.static and step else self.model
        with (packed_steps(self.model, input_ids.numel(), self.packed_one_row, self.matmul_precision,
                           self.weight_copies) if packed else nullcontext()), \
                (screened_head(self.model, self.screen_suppressed, self.screen_exact_from) if self.screened_steps
                 else nullcontext()):
            out = call(
                encoder_outputs=self.encoder_outputs,
                attention_mask=self._encoder_mask,
                decoder_attention_mask=attention_mask,
                decoder_position_ids=position_ids,
                use_cache=True,
                output_hidden_states=hidden,
                **{self._cache_argument: slots.cache},
                **tokens,
            )
        logits = slots.to_active(_last_columns(out.logits, logits_to_keep))
        return (logits, slots.to_active(out.decoder_hidden_states[-1][:, -input_ids.shape[1]:])) if hidden else logits


def _decoder_layers(model: PreTrainedModel) -> int:
    """How many self-attention layers a (decoder-only or encoder-decoder) model's decoder has."""
    config = model.config
    for name in ("decoder_layers", "num_decoder_layers"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return int(config.get_text_config(decoder=True).num_hidden_layers)


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


def runner_for(model: PreTrainedModel) -> CausalLMRunner | RereadingRunner | Seq2SeqRunner:
    """The runner that calls ``model``: encoder-decoder models get a ``Seq2SeqRunner``, decoder-only
    models whose cache cannot hold holes a ``RereadingRunner``, the others a ``CausalLMRunner``."""
    if model.config.is_encoder_decoder:
        return Seq2SeqRunner(model)
    check_architecture(model)
    if reread_reason(model):
        return RereadingRunner(model)
    return CausalLMRunner(model)
