"""A request, checked and prepared for the loop: prompts, encoder inputs, the generation config and its
logits processors become one ``DecodeState``. Every mistake a user can make is an ``InputError`` or
``ConfigError`` raised here, before anything is decoded."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel

from ..core.models import as_encoder_outputs, check_generate_agrees, context_length, vocab_size
from ..core.state import DecodeState
from ..core.types import token_id_list
from ..errors import ConfigError, InputError

# generate options that ask for something specdec does not return, and why.
_UNSUPPORTED = {
    "num_beams": "beam search is not speculative decoding: num_beams must be 1",
    "output_scores": "output_scores: specdec returns token ids and stats, not per-step scores",
    "output_logits": "output_logits: specdec returns token ids and stats, not per-step logits",
    "output_attentions": "output_attentions: specdec returns token ids and stats, not attentions",
    "output_hidden_states": "output_hidden_states: specdec returns token ids and stats, not hidden states",
}


def split_encoder_inputs(target: PreTrainedModel, main_input_name: str | None, options: dict) -> dict:
    """Take the encoder's inputs out of ``generate``'s keyword arguments (encoder-decoder targets)."""
    if not target.config.is_encoder_decoder:
        return {}
    names = {main_input_name, "encoder_outputs"}
    model_inputs = {name: options.pop(name) for name in list(options) if name in names}
    if "encoder_attention_mask" in options:
        model_inputs["attention_mask"] = options.pop("encoder_attention_mask")
    return model_inputs


def prepare_request(
    target: PreTrainedModel,
    verifier,
    main_input_name: str | None,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    max_new_tokens: int | None,
    generation_config: GenerationConfig | None,
    generator: torch.Generator | None,
    options: dict,
    model_inputs: dict | None = None,
    processors: LogitsProcessorList | None = None,
    custom_processors=None,
    prefix_allowed_tokens_fn=None,
) -> DecodeState:
    """The ``DecodeState`` of one ``generate`` call, or a clear error about what is wrong with it.

    ``processors``, when given, are used as they are (``model.generate`` built them, for the
    ``custom_generate`` path); otherwise they are built from the generation config, plus
    ``custom_processors``, exactly as ``model.generate`` builds them.
    """
    model_inputs = dict(model_inputs or {})
    encoder_outputs = model_inputs.pop("encoder_outputs", None)
    if encoder_outputs is not None:
        encoder_outputs = as_encoder_outputs(encoder_outputs)
    encoder_input = _check_encoder_inputs(target, main_input_name, model_inputs, encoder_outputs)
    if input_ids is None and target.config.is_encoder_decoder:
        input_ids = _decoder_start(target, generation_config, encoder_input, encoder_outputs)
    input_ids, mask, real = _check_prompt(target, input_ids, attention_mask)
    _check_encoder_rows(encoder_input, encoder_outputs, model_inputs, input_ids.shape[0])
    config = _generation_config(target, generation_config, options, max_new_tokens, input_ids.shape[1], int(real.max()))
    verifier.check_generation_config(config)
    copies = config.num_return_sequences or 1
    if copies > 1 and processors is None:  # model.generate expands its rows itself
        input_ids, mask, real, encoder_input, encoder_outputs, model_inputs = _repeat_rows(
            copies, input_ids, mask, real, encoder_input, encoder_outputs, model_inputs)
    if not target.config.is_encoder_decoder:
        check_generate_agrees(target, input_ids.shape[0], padded=bool((~mask).any()))
    if processors is None:  # a direct call; model.generate (custom_generate) checks its own outputs
        for name, reason in _UNSUPPORTED.items():
            if name != "num_beams" and getattr(config, name, False):
                raise ConfigError(reason)
        processors = _logits_processors(
            target, config, input_ids, mask, encoder_input, custom_processors, prefix_allowed_tokens_fn
        )
    return _new_state(target, config, processors, input_ids, mask, real, generator, model_inputs, encoder_outputs)


def _repeat_rows(copies, input_ids, mask, real, encoder_input, encoder_outputs, model_inputs):
    """``num_return_sequences``: each row ``copies`` times in a row, as ``model.generate`` expands them
    (the generation config's own validation has refused it without sampling)."""

    def repeat(value):
        return value.repeat_interleave(copies, dim=0) if isinstance(value, torch.Tensor) else value

    model_inputs = {name: repeat(value) for name, value in model_inputs.items()}
    if encoder_outputs is not None:
        encoder_outputs = type(encoder_outputs)(**{name: repeat(field) for name, field in encoder_outputs.items()})
    return repeat(input_ids), repeat(mask), repeat(real), repeat(encoder_input), encoder_outputs, model_inputs


def _check_encoder_inputs(target, main_input_name, model_inputs: dict, encoder_outputs) -> torch.Tensor | None:
    """Check the encoder's inputs against the target; return its main input (or None)."""
    if not target.config.is_encoder_decoder:
        if model_inputs or encoder_outputs is not None:
            raise InputError(f"{type(target).__name__} is decoder-only: it takes no encoder inputs")
        return None
    encoder_input = model_inputs.get(main_input_name)
    if encoder_input is None and encoder_outputs is None:
        raise InputError(
            f"{type(target).__name__} is an encoder-decoder model: pass its encoder input ({main_input_name}=...) "
            "or encoder_outputs=..."
        )
    if encoder_input is not None and not isinstance(encoder_input, torch.Tensor):
        raise InputError(f"{main_input_name} must be a torch.Tensor, got {type(encoder_input).__name__}")
    if encoder_input is not None and encoder_input.dim() < 2:
        raise InputError(f"{main_input_name} must have a batch dimension, got shape {tuple(encoder_input.shape)}")
    return encoder_input


def _decoder_start(target, generation_config, encoder_input, encoder_outputs) -> torch.Tensor:
    """The default decoder prompt of an encoder-decoder target: its decoder start token, per row."""
    start = (generation_config or target.generation_config).decoder_start_token_id
    start = start if start is not None else target.config.decoder_start_token_id
    if start is None:
        raise InputError("no decoder prompt: pass input_ids (the target has no decoder_start_token_id)")
    batch = (encoder_input if encoder_input is not None else encoder_outputs.last_hidden_state).shape[0]
    return torch.full((batch, 1), int(start), dtype=torch.long, device=target.device)


def _check_prompt(target, input_ids, attention_mask):
    """``(input_ids, mask, real)`` on the target's device: the left-padded prompt, its mask (bool) and
    each row's real length (CPU)."""
    if input_ids is None:
        raise InputError("input_ids is required: the prompt token ids [batch, length]")
    if not isinstance(input_ids, torch.Tensor):
        raise InputError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dim() != 2:
        raise InputError(f"input_ids must be 2-D [batch, length], got shape {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.long, torch.int, torch.int32, torch.int64, torch.int16):
        raise InputError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    batch_size, width = input_ids.shape
    if batch_size == 0:
        raise InputError("input_ids holds no rows")
    if width == 0:
        raise InputError("empty prompt: input_ids has no tokens; give every row at least one token")
    device = target.device
    input_ids = input_ids.to(device=device, dtype=torch.long)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        hint = (" (for an encoder-decoder target it is the decoder prompt's; the encoder's mask is "
                "encoder_attention_mask=)") if target.config.is_encoder_decoder else ""
        raise InputError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {shape}{hint}")
    mask = attention_mask.to(device=device).bool()
    mask_host = mask.cpu()
    real = mask_host.sum(1)
    if bool((real == 0).any()):
        rows = (real == 0).nonzero().flatten().tolist()
        raise InputError(f"empty prompt: row(s) {rows} have no tokens (attention_mask is all zeros)")
    # Left padding only: once a row's real tokens start, they run to the end.
    if bool((mask_host.long().diff(dim=1) < 0).any()):
        raise InputError(
            "right padding is not supported for decoder-only models or decoder prompts: pad on the left "
            "(tokenizer.padding_side = 'left')"
        )
    vocab = vocab_size(target)
    lowest, highest = int(input_ids[mask].min()), int(input_ids[mask].max())
    if lowest < 0 or highest >= vocab:
        raise InputError(f"input_ids hold token id {highest if highest >= vocab else lowest}, outside the target's vocabulary of {vocab}")
    return input_ids, mask, real


def _check_encoder_rows(encoder_input, encoder_outputs, model_inputs: dict, batch_size: int) -> None:
    encoder_rows = encoder_input if encoder_input is not None else (
        None if encoder_outputs is None else encoder_outputs.last_hidden_state)
    if encoder_rows is not None and encoder_rows.shape[0] != batch_size:
        raise InputError(
            f"the encoder input holds {encoder_rows.shape[0]} rows but input_ids (the decoder prompt) holds {batch_size}"
        )
    encoder_mask = model_inputs.get("attention_mask")
    if encoder_mask is not None and (not isinstance(encoder_mask, torch.Tensor) or encoder_mask.shape[0] != batch_size):
        raise InputError(f"encoder_attention_mask must be a tensor with one row per prompt ({batch_size})")


def _generation_config(target, generation_config, options: dict, max_new_tokens, width: int, longest: int):
    """The request's generation config, resolved as ``model.generate`` resolves it: the given one (or a
    blank one), its unset fields filled from the target's ``generation_config`` and then from
    transformers' global defaults (``top_k = 50`` among them: without it, sampling would draw from
    another distribution than ``generate``'s), then ``options``."""
    try:
        config, _ = target._prepare_generation_config(generation_config)
        unused = config.update(**options)
    except ValueError as exc:  # transformers validates the combination, e.g. num_return_sequences without sampling
        raise ConfigError(f"generation options: {exc}") from None
    if unused:
        raise InputError(f"unknown generation option(s): {', '.join(sorted(unused))}")
    if max_new_tokens is not None:
        config.max_new_tokens = max_new_tokens
    if config.max_new_tokens is None:
        config.max_new_tokens = (config.max_length or 20) - width
    max_new = config.max_new_tokens
    if not isinstance(max_new, int) or max_new < 1:
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new!r}")
    context = context_length(target)
    if context is not None and longest > context:
        raise InputError(f"prompt of {longest} tokens is longer than the target's context of {context} tokens")
    if context is not None and longest + max_new > context:
        raise InputError(
            f"prompt of {longest} tokens plus max_new_tokens={max_new} exceeds the target's context of "
            f"{context} tokens; shorten the prompt or lower max_new_tokens"
        )
    if getattr(config, "num_beams", 1) not in (None, 1):
        raise ConfigError(_UNSUPPORTED["num_beams"])
    config.num_beams = 1  # as generate resolves it; processors such as prefix_allowed_tokens_fn read it
    if config.guidance_scale not in (None, 1, 1.0):
        raise ConfigError(
            f"guidance_scale={config.guidance_scale}: classifier-free guidance runs a second, unconditional "
            "pass of the target that specdec does not batch; decode without it"
        )
    config.max_length = width + max_new  # as generate sets it; length-aware processors read it
    return config


def _logits_processors(target, config, input_ids, mask, encoder_input, custom, prefix_allowed_tokens_fn):
    """The processors ``model.generate`` would build for this config, plus the user's own."""
    # As generate does first: the eos/pad tensors that processors such as min_new_tokens need.
    target._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=input_ids.device)
    custom = LogitsProcessorList(custom or [])
    if not all(callable(processor) for processor in custom):
        raise InputError("logits_processor must be a list of transformers LogitsProcessor objects")
    if prefix_allowed_tokens_fn is not None and not callable(prefix_allowed_tokens_fn):
        raise InputError("prefix_allowed_tokens_fn must be a callable (batch_id, input_ids) -> allowed token ids")
    try:
        return target._get_logits_processor(
            generation_config=config,
            input_ids_seq_length=input_ids.shape[1],
            encoder_input_ids=encoder_input if encoder_input is not None else input_ids,
            prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
            logits_processor=custom,
            device=input_ids.device,
            model_kwargs={"attention_mask": mask.long()},
        )
    except ValueError as exc:  # an invalid option value, e.g. repetition_penalty=-1
        raise ConfigError(f"logits processors: {exc}") from None


def _new_state(target, config, processors, input_ids, mask, real, generator, model_inputs, encoder_outputs):
    batch_size, width = input_ids.shape
    device = input_ids.device
    eos = token_id_list(config.eos_token_id)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    total = width + config.max_new_tokens
    sequences = torch.full((batch_size, total + 1), pad, dtype=torch.long, device=device)
    sequences[:, :width] = input_ids
    token_mask = torch.ones(batch_size, total + 1, dtype=torch.bool, device=device)
    token_mask[:, :width] = mask
    return DecodeState(
        generation_config=config,
        processors=processors,
        sequences=sequences,
        token_mask=token_mask,
        lengths=torch.full((batch_size,), width, dtype=torch.long, device=device),
        lengths_host=torch.full((batch_size,), width, dtype=torch.long),
        sequences_host=sequences.to("cpu", copy=True),  # a copy even on CPU: never an alias
        padding_host=width - real,
        prompt_width=width,
        max_new_tokens=config.max_new_tokens,
        eos_token_ids=torch.tensor(eos, dtype=torch.long, device=device),
        eos_token_set=frozenset(eos),
        pad_token_id=pad,
        rows=torch.arange(batch_size, device=device),
        rows_host=torch.arange(batch_size),
        generator=generator,
        do_sample=bool(config.do_sample),
        model_inputs=model_inputs,
        encoder_outputs=encoder_outputs,
    )
