"""The loop as a transformers decoding method: ``model.generate(..., custom_generate=decoder.decoding_method())``.

``model.generate`` then does everything but the decoding loop exactly as it always does (the decoder
prompt, the encoder pass, its logits processors; for Whisper the forced language and task tokens,
the timestamp rules and 30-second long-form windows) and hands the prepared inputs to this adapter,
which turns them into the loop's request.
"""

from __future__ import annotations

from typing import Callable

from transformers.generation import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from ..core.types import DecodeOutput
from ..errors import ConfigError, InputError

# Stopping criteria that ``model.generate`` builds and the loop honours itself (length budget, eos).
_LOOP_CRITERIA = (MaxLengthCriteria, EosTokenCriteria)
# What ``model.generate`` hands over besides the encoder output and masks: the loop makes its own
# cache, and derives the position ids transformers derives from the attention mask.
_IGNORED_MODEL_KWARGS = {"cache", "past_key_values", "cache_params", "use_cache", "logits_to_keep", "cache_position", "return_dict", "position_ids"}
_RETURNED_ONLY_AS_IDS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def decoding_method(decoder, on_output: Callable[[DecodeOutput], None] | None = None) -> Callable:
    """``decoder`` as a function ``model.generate`` calls in place of its own loop (see the module doc).

    The loop honours the length and eos stopping criteria itself and refuses others. ``on_output``
    receives each call's ``DecodeOutput`` (stats included).
    """

    def specdec_decoding_method(
        model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
        inputs_tensor=None, **model_kwargs,
    ):
        config = generation_config
        if config is not None and config.return_dict_in_generate:
            wanted = [name for name in _RETURNED_ONLY_AS_IDS if getattr(config, name, False)]
            if wanted:
                raise ConfigError(
                    f"specdec returns token ids only; it cannot honour {', '.join(wanted)} (for Whisper: "
                    "no logprob_threshold, no_speech_threshold or return_token_timestamps)"
                )
        output = _decode_prepared(
            decoder, model, input_ids, logits_processor, stopping_criteria, config, inputs_tensor, model_kwargs
        )
        if on_output is not None:
            on_output(output)
        if config is not None and config.return_dict_in_generate:
            kind = GenerateEncoderDecoderOutput if decoder.target.config.is_encoder_decoder else GenerateDecoderOnlyOutput
            return kind(sequences=output.sequences)
        return output.sequences

    return specdec_decoding_method


def _decode_prepared(decoder, model, input_ids, processors, criteria, config, inputs_tensor, model_kwargs) -> DecodeOutput:
    target = decoder.target
    if model is not target:
        raise ConfigError(
            f"this decoder's target is a {type(target).__name__}; call its own generate, not that of "
            f"another {type(model).__name__}"
        )
    for criterion in criteria or ():
        if not isinstance(criterion, _LOOP_CRITERIA):
            raise ConfigError(f"specdec cannot honour the stopping criterion {type(criterion).__name__}")
    model_kwargs = {name: value for name, value in model_kwargs.items()
                    if name not in _IGNORED_MODEL_KWARGS and value is not None}
    decoder_mask = model_kwargs.pop("decoder_attention_mask", None)
    model_inputs = {}
    if target.config.is_encoder_decoder:
        if "encoder_outputs" in model_kwargs:
            model_inputs["encoder_outputs"] = model_kwargs.pop("encoder_outputs")
        encoder_mask = model_kwargs.pop("attention_mask", None)
        # Whisper's long-form generate hands every window the mask of the whole audio batch;
        # that mask describes no input of this call (Whisper's decoder ignores it anyway).
        if encoder_mask is not None and (inputs_tensor is None or encoder_mask.shape[0] != inputs_tensor.shape[0]
                                         or encoder_mask.shape[-1] != inputs_tensor.shape[-1]):
            encoder_mask = None
        if encoder_mask is not None:
            model_inputs["attention_mask"] = encoder_mask
        if inputs_tensor is not None:  # the raw encoder input, for a draft with its own encoder
            model_inputs[decoder.main_input_name] = inputs_tensor
        attention_mask = decoder_mask
    else:
        attention_mask = model_kwargs.pop("attention_mask", None)
    if model_kwargs:
        raise InputError(f"specdec cannot pass these inputs to the target: {', '.join(sorted(model_kwargs))}")
    state = decoder.prepare(
        input_ids, attention_mask, config.max_length - input_ids.shape[1], generation_config=config,
        model_inputs=model_inputs, processors=processors,
    )
    return decoder.decode(state)
