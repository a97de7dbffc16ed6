"""The speculative loop: lookahead, draft, verify, commit, observe. No strategy lives here."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import attrs
import pluggy
import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.generation import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from ..config import SpecdecConfig
from ..core import hookspecs
from ..core.components import Drafter, LookaheadPolicy, Observer, Verifier
from ..core.models import CausalLMRunner, Seq2SeqRunner, as_encoder_outputs, context_length, runner_for, vocab_size
from ..core.state import DecodeState
from ..core.types import DecodeOutput, Draft, Step
from ..errors import ConfigError, InputError
from ..observers.stats import StatsObserver
from ..policies.constant import ConstantLookahead
from ..verifiers.greedy import GreedyVerifier


def _is_a(kind: type, label: str):
    def check(instance, attribute, value):
        if not isinstance(value, kind):
            raise ConfigError(
                f"{attribute.name} must be a {label} (a subclass of specdec.{kind.__name__}), got {type(value).__name__}"
            )

    return check


def _observers(instance, attribute, value):
    for observer in value:
        if not isinstance(observer, Observer):
            raise ConfigError(f"observers must be specdec Observer instances, got {type(observer).__name__}")


def _target_model(instance, attribute, value):
    if not isinstance(value, PreTrainedModel) or not hasattr(value, "generate"):
        raise ConfigError(f"target must be a transformers generative model, got {type(value).__name__}")
    # An encoder-decoder target must take the decoder mask and positions holes need (runner_for checks).
    runner_for(value)


# Stopping criteria that ``model.generate`` builds and the loop honours itself (length budget, eos).
_LOOP_CRITERIA = (MaxLengthCriteria, EosTokenCriteria)
# What ``decoding_method`` is handed besides the encoder output and masks: the loop makes its own cache.
# (position ids transformers derives from the attention mask; the loop derives the same ones).
_IGNORED_MODEL_KWARGS = {"past_key_values", "use_cache", "logits_to_keep", "cache_position", "return_dict", "position_ids"}


@attrs.define(eq=False)
class SpeculativeDecoder:
    """Decode with a target model, a drafter, a lookahead policy and a verifier.

    ``generate`` returns what ``target.generate`` would (greedy: token for token) plus stats; only
    the time changes. The components are plugged into a pluggy manager of their own, with any
    ``observers``, so a third-party component is called exactly like a built-in one.
    """

    target: PreTrainedModel = attrs.field(validator=_target_model)
    drafter: Drafter = attrs.field(validator=_is_a(Drafter, "drafter"))
    policy: LookaheadPolicy = attrs.field(factory=ConstantLookahead, validator=_is_a(LookaheadPolicy, "lookahead policy"))
    verifier: Verifier = attrs.field(factory=GreedyVerifier, validator=_is_a(Verifier, "verifier"))
    observers: list[Observer] = attrs.field(factory=list, converter=list, validator=_observers)
    _hooks: Any = attrs.field(init=False, repr=False)
    _stats: StatsObserver = attrs.field(init=False, repr=False)
    _runner: CausalLMRunner | Seq2SeqRunner = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self):
        self.drafter.check_target(self.target)
        self.target.eval()
        self._runner = runner_for(self.target)
        self._stats = StatsObserver()
        manager = pluggy.PluginManager(hookspecs.PROJECT)
        manager.add_hookspecs(hookspecs)
        for component in [self.drafter, self.policy, self.verifier, self._stats, *self.observers]:
            if manager.is_registered(component):
                raise ConfigError(f"{component.plugin_label} is passed twice; give each role its own instance")
            manager.register(component)
        for hook, role in [
            ("specdec_propose", "drafter"),
            ("specdec_lookahead", "policy"),
            ("specdec_verify", "verifier"),
        ]:
            answering = getattr(manager.hook, hook).get_hookimpls()
            if len(answering) != 1:
                names = ", ".join(impl.plugin_name for impl in answering)
                raise ConfigError(f"exactly one component must answer {hook} (the {role}); got {len(answering)}: {names}")
        self._hooks = manager.hook

    @classmethod
    def from_config(cls, config: SpecdecConfig | str | Path, target: PreTrainedModel | None = None,
                    extra_observers=()) -> SpeculativeDecoder:
        """The decoder a plugins.toml (a path or a parsed ``SpecdecConfig``) describes; its target is
        loaded unless ``target`` is given."""
        if not isinstance(config, SpecdecConfig):
            config = SpecdecConfig.from_toml(config)
        drafter, policy, verifier, observers = config.build_components(extra_observers)
        if target is None:
            target, _ = config.load_target()
        return cls(target=target, drafter=drafter, policy=policy, verifier=verifier, observers=observers)

    # --- the request ---------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int | None = None,
        generation_config: GenerationConfig | None = None,
        generator: torch.Generator | None = None,
        logits_processor: LogitsProcessorList | list | None = None,
        **kwargs,
    ) -> DecodeOutput:
        """Generate up to ``max_new_tokens`` for every row of a left-padded batch.

        Takes the arguments of ``model.generate`` (other generation options as keyword
        arguments, or a ``generation_config``); ``generator`` makes sampling reproducible;
        ``logits_processor`` adds your own processors after those the config asks for, as
        ``model.generate`` does (they see each row's ``input_ids`` at every draft position).
        For an encoder-decoder target, ``input_ids``/``attention_mask`` are the decoder prompt
        (default: the decoder start token) and the encoder's input goes by its name
        (``input_features=...`` for Whisper, or a precomputed ``encoder_outputs=...``, with
        ``encoder_attention_mask=...`` where the encoder takes one); it is encoded once.
        """
        model_inputs = self._split_model_inputs(kwargs)
        state = self._prepare(
            input_ids, attention_mask, max_new_tokens, generation_config, generator, kwargs,
            model_inputs=model_inputs, custom_processors=logits_processor,
        )
        return self._decode(state)

    def decoding_method(self, on_output: Callable[[DecodeOutput], None] | None = None) -> Callable:
        """This decoder as a transformers decoding method: ``model.generate(..., custom_generate=it)``.

        ``model.generate`` then does everything but the decoding loop exactly as it always does (the
        decoder prompt, the encoder pass, its logits processors; for Whisper the forced language and
        task tokens, the timestamp rules and 30-second long-form windows) and hands this loop the
        prepared inputs. The loop honours the length and eos stopping criteria itself and refuses
        others. ``on_output`` receives each call's ``DecodeOutput`` (stats included).
        """

        def specdec_decoding_method(
            model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
            inputs_tensor=None, **model_kwargs,
        ):
            output = self._decode_prepared(
                model, input_ids, logits_processor, stopping_criteria, generation_config, inputs_tensor, model_kwargs
            )
            if on_output is not None:
                on_output(output)
            config = generation_config
            if config is not None and config.return_dict_in_generate:
                wanted = [name for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
                          if getattr(config, name, False)]
                if wanted:
                    raise ConfigError(
                        f"specdec returns token ids only; it cannot honour {', '.join(wanted)} (for Whisper: "
                        "no logprob_threshold, no_speech_threshold or return_token_timestamps)"
                    )
                kind = GenerateEncoderDecoderOutput if self.target.config.is_encoder_decoder else GenerateDecoderOnlyOutput
                return kind(sequences=output.sequences)
            return output.sequences

        return specdec_decoding_method

    def _decode_prepared(self, model, input_ids, processors, criteria, config, inputs_tensor, model_kwargs) -> DecodeOutput:
        if model is not self.target:
            raise ConfigError(
                f"this decoder's target is a {type(self.target).__name__}; call its own generate, not that of "
                f"another {type(model).__name__}"
            )
        for criterion in criteria or ():
            if not isinstance(criterion, _LOOP_CRITERIA):
                raise ConfigError(f"specdec cannot honour the stopping criterion {type(criterion).__name__}")
        model_kwargs = {name: value for name, value in model_kwargs.items()
                        if name not in _IGNORED_MODEL_KWARGS and value is not None}
        decoder_mask = model_kwargs.pop("decoder_attention_mask", None)
        model_inputs = {}
        if self.target.config.is_encoder_decoder:
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
                model_inputs[self._runner.main_input_name] = inputs_tensor
            attention_mask = decoder_mask
        else:
            attention_mask = model_kwargs.pop("attention_mask", None)
        if model_kwargs:
            raise InputError(f"specdec cannot pass these inputs to the target: {', '.join(sorted(model_kwargs))}")
        max_new_tokens = config.max_length - input_ids.shape[1]
        state = self._prepare(
            input_ids, attention_mask, max_new_tokens, config, None, {}, model_inputs=model_inputs, processors=processors
        )
        return self._decode(state)

    def _split_model_inputs(self, kwargs: dict) -> dict:
        """Take the encoder's inputs out of ``generate``'s keyword arguments."""
        if not self.target.config.is_encoder_decoder:
            return {}
        names = {self._runner.main_input_name, "encoder_outputs"}
        model_inputs = {name: kwargs.pop(name) for name in list(kwargs) if name in names}
        if "encoder_attention_mask" in kwargs:
            model_inputs["attention_mask"] = kwargs.pop("encoder_attention_mask")
        return model_inputs

    def _decode(self, state: DecodeState) -> DecodeOutput:
        hooks = self._hooks
        # The encoder runs once per request; drafters that share it read state.encoder_outputs.
        state.encoder_outputs = self._runner.begin(encoder_outputs=state.encoder_outputs, **state.model_inputs)
        hooks.specdec_begin(state=state, target=self.target)
        target_slots = self._runner.new_cache(state.batch_size)
        # Buffer positions of each row the target's cache covers (all committed tokens but the last).
        target_fed_host = torch.zeros(state.batch_size, dtype=torch.long)
        while state.active:
            self._iterate(state, target_slots, target_fed_host)
        new_tokens = int(state.lengths_host.max()) - state.prompt_width
        sequences = state.sequences[:, : state.prompt_width + new_tokens].clone()
        output = DecodeOutput(sequences=sequences, stats=self._stats.stats)
        hooks.specdec_on_finish(state=state, output=output)
        return output

    def _iterate(self, state: DecodeState, target_slots, target_fed_host: torch.Tensor) -> None:
        hooks, device = self._hooks, state.device
        batch = state.active

        # 1. lookahead: the policy's wish, capped so no row drafts past its token budget.
        wish = hooks.specdec_lookahead(state=state)
        if wish.shape != (batch,):
            raise ConfigError(f"{self.policy.plugin_label} returned a lookahead of shape {tuple(wish.shape)}, expected ({batch},)")
        max_tokens = torch.minimum(wish.clamp(min=0), state.remaining_host() - 1).clamp(min=0)  # [B] CPU

        # 2. draft
        if int(max_tokens.max()) > 0:
            draft = hooks.specdec_propose(state=state, max_tokens=max_tokens, keep_drafting=self._keep_drafting(state))
        else:
            draft = Draft.empty(batch, device)
        width = draft.width

        # 3. verify: ONE target forward over [unread committed tokens, d1 .. dK] for every row.
        catch_up, catch_up_valid = state.committed_since(target_fed_host[state.rows_host])  # [B, W]
        in_draft = torch.arange(width, device=device)[None, :] < draft.lengths[:, None]  # [B, K]
        block = torch.cat([catch_up, draft.tokens], dim=1)  # [B, W + K]
        valid = torch.cat([catch_up_valid, in_draft], dim=1)
        logits = self._runner.forward(target_slots, block, valid, logits_to_keep=width + 1)  # [B, K + 1, V]
        state.target_calls += 1
        scores = state.process(logits.float(), draft.tokens)  # fp32, as model.generate scores
        verdict = hooks.specdec_verify(state=state, draft=draft, scores=scores)

        # 4. commit: accepted drafts plus the verifier's token, cut at eos and at the length budget.
        accepted = verdict.accepted  # [B]
        appended = torch.cat([draft.tokens, verdict.next_token[:, None]], dim=1)  # [B, K + 1]
        appended.scatter_(1, accepted[:, None], verdict.next_token[:, None])
        position = torch.arange(width + 1, device=device)[None, :]
        count = accepted + 1
        is_eos = torch.isin(appended, state.eos_token_ids) & (position < count[:, None])
        count = torch.where(is_eos.any(1), is_eos.long().argmax(1) + 1, count)
        lengths = state.lengths[state.rows]
        remaining = state.prompt_width + state.max_new_tokens - lengths
        count = torch.minimum(count, remaining)
        finished = (count == remaining) | (is_eos & (position < count[:, None])).any(1)
        trash = state.sequences.shape[1] - 1
        write_at = torch.where(position < count[:, None], lengths[:, None] + position, trash)
        state.sequences[state.rows[:, None], write_at] = appended
        state.lengths[state.rows] = lengths + count

        # The iteration's one device sync, which also brings the appended tokens to the host
        # mirror and completes the copy of the target's confidence queued just before it (that
        # confidence-driven policies read on the host).
        target_probs = verdict.target_probs
        target_probs_host = None if target_probs is None else target_probs.to("cpu", non_blocking=True)
        counts = torch.stack([accepted, count, finished.long(), draft.lengths], dim=1)  # [B, 4]
        synced = torch.cat([counts, appended], dim=1).cpu()
        accepted_host, count_host, finished_host, drafted_host = synced[:, :4].unbind(1)
        finished_host = finished_host.bool()
        rows_host = state.rows_host
        position_host = torch.arange(width + 1)[None, :]
        write_at_host = torch.where(
            position_host < count_host[:, None], state.lengths_host[rows_host][:, None] + position_host, trash
        )
        state.sequences_host[rows_host[:, None], write_at_host] = synced[:, 4:]
        state.lengths_host[rows_host] += count_host
        target_fed_host[rows_host] = state.lengths_host[rows_host] - 1
        target_slots.drop_tail(
            block.shape[1],
            keep_columns=catch_up.shape[1] + accepted,
            widest=int((target_fed_host - state.padding_host)[rows_host].max()),
        )
        state.last_target_probs = verdict.target_probs

        # 5. observe
        step = Step(
            iteration=state.iteration,
            rows_host=rows_host,
            draft=draft,
            verdict=verdict,
            drafted_host=drafted_host,
            accepted_host=accepted_host,
            appended_host=count_host,
            finished_host=finished_host,
            appended_tokens=appended,
            target_probs_host=target_probs_host,
        )
        hooks.specdec_on_step(state=state, step=step)
        state.iteration += 1

        # Finished rows leave the batch.
        if bool(finished_host.any()):
            keep_host = (~finished_host).nonzero().flatten()
            keep = keep_host.to(device, non_blocking=True)
            state.rows = state.rows[keep]
            state.rows_host = rows_host[keep_host]
            if state.last_target_probs is not None:
                state.last_target_probs = state.last_target_probs[keep]
            if state.active:
                target_slots.select_rows(
                    keep, widest=int((target_fed_host - state.padding_host)[state.rows_host].max())
                )
                self._runner.select_rows(keep)
                hooks.specdec_select_rows(state=state, keep=keep, keep_host=keep_host)

    def _keep_drafting(self, state):
        hook = self._hooks.specdec_continue_drafting

        def keep_drafting(position, tokens, token_probs=None, probs=None):
            return hook(state=state, position=position, tokens=tokens, token_probs=token_probs, probs=probs)

        return keep_drafting

    # --- input checks ----------------------------------------------------------------------------

    def _prepare(
        self, input_ids, attention_mask, max_new_tokens, generation_config, generator, kwargs,
        model_inputs=None, processors=None, custom_processors=None,
    ) -> DecodeState:
        target = self.target
        device = target.device
        model_inputs = dict(model_inputs or {})
        encoder_outputs = model_inputs.pop("encoder_outputs", None)
        if encoder_outputs is not None:
            encoder_outputs = as_encoder_outputs(encoder_outputs)
        encoder_input = self._check_encoder_inputs(model_inputs, encoder_outputs, input_ids)
        if input_ids is None and target.config.is_encoder_decoder:
            start = (generation_config or target.generation_config).decoder_start_token_id
            start = start if start is not None else target.config.decoder_start_token_id
            if start is None:
                raise InputError("no decoder prompt: pass input_ids (the target has no decoder_start_token_id)")
            batch = (encoder_input if encoder_input is not None else encoder_outputs.last_hidden_state).shape[0]
            input_ids = torch.full((batch, 1), int(start), dtype=torch.long, device=device)
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
        encoder_rows = encoder_input if encoder_input is not None else (
            None if encoder_outputs is None else encoder_outputs.last_hidden_state)
        if encoder_rows is not None and encoder_rows.shape[0] != batch_size:
            raise InputError(
                f"the encoder input holds {encoder_rows.shape[0]} rows but input_ids (the decoder prompt) holds {batch_size}"
            )
        encoder_mask = model_inputs.get("attention_mask")
        if encoder_mask is not None and (not isinstance(encoder_mask, torch.Tensor) or encoder_mask.shape[0] != batch_size):
            raise InputError(f"encoder_attention_mask must be a tensor with one row per prompt ({batch_size})")
        vocab = vocab_size(target)
        lowest, highest = int(input_ids[mask].min()), int(input_ids[mask].max())
        if lowest < 0 or highest >= vocab:
            raise InputError(f"input_ids hold token id {highest if highest >= vocab else lowest}, outside the target's vocabulary of {vocab}")

        config = copy.deepcopy(generation_config if generation_config is not None else target.generation_config)
        unused = config.update(**kwargs)
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
        longest = int(real.max())
        if context is not None and longest > context:
            raise InputError(f"prompt of {longest} tokens is longer than the target's context of {context} tokens")
        if context is not None and longest + max_new > context:
            raise InputError(
                f"prompt of {longest} tokens plus max_new_tokens={max_new} exceeds the target's context of "
                f"{context} tokens; shorten the prompt or lower max_new_tokens"
            )
        if getattr(config, "num_beams", 1) not in (None, 1):
            raise ConfigError("beam search is not speculative decoding: num_beams must be 1")
        if config.guidance_scale not in (None, 1, 1.0):
            raise ConfigError(
                f"guidance_scale={config.guidance_scale}: classifier-free guidance runs a second, unconditional "
                "pass of the target that specdec does not batch; decode without it"
            )
        config.max_length = width + max_new  # as generate sets it; length-aware processors read it
        self.verifier.check_generation_config(config)

        eos = config.eos_token_id
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
        if processors is None:
            # As generate does first: the eos/pad tensors that processors such as min_new_tokens need.
            target._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=device)
            custom = LogitsProcessorList(custom_processors or [])
            if not all(callable(processor) for processor in custom):
                raise InputError("logits_processor must be a list of transformers LogitsProcessor objects")
            try:
                processors = target._get_logits_processor(
                    generation_config=config,
                    input_ids_seq_length=width,
                    encoder_input_ids=encoder_input if encoder_input is not None else input_ids,
                    prefix_allowed_tokens_fn=None,
                    logits_processor=custom,
                    device=device,
                    model_kwargs={"attention_mask": attention_mask},
                )
            except ValueError as exc:  # an invalid option value, e.g. repetition_penalty=-1
                raise ConfigError(f"logits processors: {exc}") from None

        total = width + max_new
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
            max_new_tokens=max_new,
            eos_token_ids=torch.tensor(eos, dtype=torch.long, device=device),
            pad_token_id=pad,
            rows=torch.arange(batch_size, device=device),
            rows_host=torch.arange(batch_size),
            generator=generator,
            do_sample=bool(config.do_sample),
            model_inputs=model_inputs,
            encoder_outputs=encoder_outputs,
        )

    def _check_encoder_inputs(self, model_inputs: dict, encoder_outputs, input_ids) -> torch.Tensor | None:
        """Check the encoder's inputs against the target; return its main input (or None)."""
        target = self.target
        if not target.config.is_encoder_decoder:
            if model_inputs or encoder_outputs is not None:
                raise InputError(f"{type(target).__name__} is decoder-only: it takes no encoder inputs")
            return None
        name = self._runner.main_input_name
        encoder_input = model_inputs.get(name)
        if encoder_input is None and encoder_outputs is None:
            raise InputError(
                f"{type(target).__name__} is an encoder-decoder model: pass its encoder input ({name}=...) "
                "or encoder_outputs=..."
            )
        if encoder_input is not None and not isinstance(encoder_input, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(encoder_input).__name__}")
        if encoder_input is not None and encoder_input.dim() < 2:
            raise InputError(f"{name} must have a batch dimension, got shape {tuple(encoder_input.shape)}")
        return encoder_input
