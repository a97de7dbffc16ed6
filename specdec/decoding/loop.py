"""The speculative loop: lookahead, draft, verify, commit, observe. No strategy lives here."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import attrs
import pluggy
import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel

from ..config import SpecdecConfig
from ..core import hookspecs, screened_head
from ..core.cache import bucket
from ..core.cached_model import CachedModel
from ..core.components import Drafter, LookaheadPolicy, Observer, Verifier
from ..core.models import runner_for
from ..core.state import DecodeState
from ..core.types import DecodeOutput, Draft, Step
from ..errors import ConfigError
from ..observers.phases import PhaseTimes
from ..observers.stats import StatsObserver
from ..policies.cost_aware import CostAwareLookahead
from ..verifiers.greedy import GreedyVerifier
from . import custom_generate
from .request import prepare_request, split_encoder_inputs


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


def _optional_bool(instance, attribute, value):
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"{attribute.name} must be True, False or None (decide by device), got {value!r}")


def _bool(instance, attribute, value):
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name} must be True or False, got {value!r}")


COMPILE_CHOICES = {"none": frozenset(), "draft": frozenset({"draft"}), "all": frozenset({"draft", "target"})}


def _compile_choice(instance, attribute, value):
    if value not in COMPILE_CHOICES:
        raise ConfigError(f"compile must be one of {', '.join(map(repr, COMPILE_CHOICES))}, got {value!r}")
    if value != "none" and not instance.static_cache:
        raise ConfigError(f"compile={value!r} needs static_cache=True: with a growing cache every step has a new shape "
                          "and would be compiled again")


def _target_model(instance, attribute, value):
    if not isinstance(value, PreTrainedModel) or not hasattr(value, "generate"):
        raise ConfigError(f"target must be a transformers generative model, got {type(value).__name__}")
    # An encoder-decoder target must take the decoder mask and positions holes need (runner_for checks).
    runner_for(value)


@attrs.define(eq=False)
class SpeculativeDecoder:
    """Decode with a target model, a drafter, a lookahead policy and a verifier.

    ``generate`` returns what ``target.generate`` would (greedy: token for token) plus stats; only
    the time changes. The components are plugged into a pluggy manager of their own, with any
    ``observers``, so a third-party component is called exactly like a built-in one.
    """

    target: PreTrainedModel = attrs.field(validator=_target_model)
    drafter: Drafter = attrs.field(validator=_is_a(Drafter, "drafter"))
    # cost-aware by default: it measures what drafting costs here and takes plain target steps where
    # it does not pay, so turning specdec on never makes decoding much slower; a constant k = 5 ran
    # 0.61-0.99x of the target in four of the bundled pair's sampled cells (docs/benchmarks.md, stop 58).
    policy: LookaheadPolicy = attrs.field(factory=CostAwareLookahead, validator=_is_a(LookaheadPolicy, "lookahead policy"))
    verifier: Verifier = attrs.field(factory=GreedyVerifier, validator=_is_a(Verifier, "verifier"))
    observers: list[Observer] = attrs.field(factory=list, converter=list, validator=_observers)
    # End a draft loop once the policy has stopped every row: one host sync per draft position. None
    # decides by device: yes on a CPU, where a sync costs nothing and the skipped forwards are saved;
    # no on an accelerator, where stopped rows are masked and the loop runs to its width.
    draft_early_exit: bool | None = attrs.field(default=None, validator=_optional_bool)
    # Static shapes: every model's KV cache preallocated (prompt + max_new_tokens + headroom), verify
    # blocks padded to power-of-two widths, finished rows kept in the models' batch until it fits a
    # smaller power of two; what torch.compile and CUDA graphs need (core/cache.py).
    static_cache: bool = attrs.field(default=False, validator=_bool)
    # torch.compile(dynamic=False) of the models' steps on the static path: "draft" (every draft
    # model), "all" (the target too) or "none"; CUDA graphs on CUDA (docs/benchmarks.md has the CPU numbers).
    compile: str = attrs.field(default="none", validator=_compile_choice)
    # Multi-token steps (verify blocks, batched draft steps) of float32 models on a CPU read their
    # linear layers' weights prepacked for oneDNN, whose cost hardly grows with the tokens read
    # where torch's own path (MKL) costs 1.5-3x a plain step from 2-4 tokens on, depending on the
    # CPU; from how many rows each weight shape packs is timed once per process
    # (core/packed_linear.py). Each packed layer keeps a second copy of its weight. Other dtypes and devices are never packed.
    # False: no packed copy; multi-token steps read the weights as loaded, by the copy-free route
    # (transposed sgemm or oneDNN) measured faster for each shape and width, most of packing's gain
    # at no memory (whisper-base: 84 MiB fewer, the same decoder speed; docs/benchmarks.md, stop 65).
    packed_weights: bool = attrs.field(default=True, validator=_bool)
    # Greedy verifies read the target's LM head in bfloat16 where this CPU runs it faster (timed once
    # per machine), and recompute in float32 only the logits that could be the argmax, so the output
    # stays the target's (core/screened_head.py). Plain steps at batch 1 keep generate's own head.
    # Its bfloat16 copy costs half the head's float32 bytes (whisper-base: 51 MiB), with or without
    # packed_weights.
    screened_head: bool = attrs.field(default=True, validator=_bool)
    _hooks: Any = attrs.field(init=False, repr=False)
    _stats: StatsObserver = attrs.field(init=False, repr=False)
    _target: CachedModel = attrs.field(init=False, repr=False)
    _timers: list[PhaseTimes] | None = attrs.field(default=None, init=False, repr=False)
    _judges_positions: bool = attrs.field(default=True, init=False, repr=False)

    def __attrs_post_init__(self):
        self.drafter.check_target(self.target)
        self.target.eval()
        self._target = CachedModel(runner_for(self.target), role="target")
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
        self._judges_positions = _judges_positions(manager.hook.specdec_continue_drafting)
        # Phase timers get the loop's marks; without one the loop calls nothing extra.
        timers = [observer for observer in self.observers if isinstance(observer, PhaseTimes)]
        self._timers = timers or None

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
        return cls(target=target, drafter=drafter, policy=policy, verifier=verifier, observers=observers,
                   static_cache=config.static_cache, compile=config.compile, packed_weights=config.packed_weights,
                   screened_head=config.screened_head)

    @property
    def main_input_name(self) -> str | None:
        """The name of an encoder-decoder target's encoder input (``input_features`` for Whisper)."""
        runner = self._target.runner
        return getattr(runner, "main_input_name", None) if self.target.config.is_encoder_decoder else None

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
        prefix_allowed_tokens_fn: Callable | None = None,
        **kwargs,
    ) -> DecodeOutput:
        """Generate up to ``max_new_tokens`` for every row of a left-padded batch.

        Takes the arguments of ``model.generate`` (other generation options as keyword
        arguments, or a ``generation_config``); ``generator`` makes sampling reproducible;
        ``logits_processor`` adds your own processors after those the config asks for, as
        ``model.generate`` does (they see each row's ``input_ids`` at every draft position), and
        ``prefix_allowed_tokens_fn(batch_id, input_ids)`` constrains each row as it does there.
        For an encoder-decoder target, ``input_ids``/``attention_mask`` are the decoder prompt
        (default: the decoder start token) and the encoder's input goes by its name
        (``input_features=...`` for Whisper, or a precomputed ``encoder_outputs=...``, with
        ``encoder_attention_mask=...`` where the encoder takes one); it is encoded once.
        """
        model_inputs = split_encoder_inputs(self.target, self.main_input_name, kwargs)
        state = self.prepare(
            input_ids, attention_mask, max_new_tokens, generation_config, generator, model_inputs=model_inputs,
            custom_processors=logits_processor, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, **kwargs,
        )
        return self.decode(state)

    def prepare(self, input_ids, attention_mask=None, max_new_tokens=None, generation_config=None, generator=None,
                *, model_inputs=None, processors=None, custom_processors=None, prefix_allowed_tokens_fn=None,
                **options) -> DecodeState:
        """The ``DecodeState`` ``generate`` would decode, checked (``decoding/request.py``); a drafter's
        tests can call ``propose`` on it directly."""
        return prepare_request(
            self.target, self.verifier, self.main_input_name, input_ids, attention_mask, max_new_tokens,
            generation_config, generator, options, model_inputs=model_inputs, processors=processors,
            custom_processors=custom_processors, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        )

    def decoding_method(self, on_output: Callable[[DecodeOutput], None] | None = None) -> Callable:
        """This decoder as a transformers decoding method: ``model.generate(..., custom_generate=it)``
        (see ``decoding/custom_generate.py``). ``on_output`` receives each call's ``DecodeOutput``."""
        return custom_generate.decoding_method(self, on_output)

    # --- the loop --------------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, state: DecodeState) -> DecodeOutput:
        """Run the loop over a prepared request until every row has finished."""
        hooks = self._hooks
        early_exit = self.draft_early_exit
        state.draft_early_exit = state.device.type == "cpu" if early_exit is None else early_exit
        state.static_shapes = self.static_cache
        state.compile = COMPILE_CHOICES[self.compile]
        state.packed_weights = self.packed_weights
        state.screen_suppressed = (screened_head.suppression_masks(state.processors, self.target)
                                   if self.screened_head and self.verifier.argmax_only
                                   and screened_head.applies_to(self.target) else None)
        state.screen_exact_from = (screened_head.exact_from(state.processors) if state.screen_suppressed is not None
                                   else None)
        # The encoder runs once per request; drafters that share it read state.encoder_outputs.
        state.encoder_outputs = self._target.runner.begin(encoder_outputs=state.encoder_outputs, **state.model_inputs)
        self._target.begin(state)
        state.target_slots = self._target.slots
        try:
            hooks.specdec_begin(state=state, target=self.target)
            while state.active:
                self._iterate(state)
            new_tokens = int(state.lengths_host.max()) - state.prompt_width
            output = DecodeOutput(sequences=state.sequences[:, : state.prompt_width + new_tokens].clone(),
                                  stats=self._stats.stats)
            hooks.specdec_on_finish(state=state, output=output)  # a drafter lets go of its cache there
        finally:
            self._target.end(state)
        return output

    def _iterate(self, state: DecodeState) -> None:
        hooks, target, rows_host, timers = self._hooks, self._target, state.rows_host, self._timers
        if timers:
            for timer in timers:
                timer.start()

        # 1. lookahead: the policy's wish, capped so no row drafts past its token budget.
        wish = hooks.specdec_lookahead(state=state)  # [B] CPU
        if wish.shape != (state.active,):
            raise ConfigError(f"{self.policy.plugin_label} returned a lookahead of shape {tuple(wish.shape)}, expected ({state.active},)")
        wishes = wish.tolist()  # capped on the host: Python's integers are cheaper than tensor ops
        drafting = max(wishes, default=0) > 0
        if drafting:
            caps = [max(min(want, left - 1), 0) for want, left in zip(wishes, state.progress_host()[1])]
            drafting = max(caps) > 0
            max_tokens = torch.tensor(caps)
        if timers:
            _mark(timers, "lookahead")

        # 2. draft
        if drafting:
            draft = hooks.specdec_propose(state=state, max_tokens=max_tokens, keep_drafting=self._keep_drafting(state))
            draft = draft.with_padding(state.pad_token_id)
        else:
            draft = Draft.empty(state.active, state.device)
        if state.static_shapes:  # a verify block of a power-of-two width: few shapes to compile
            draft = draft.padded_to(bucket(draft.width))
        if timers:
            _mark(timers, "draft")

        # 3. verify: ONE target forward over [unread committed tokens, d1 .. dK] for every row (and,
        #    under greedy decoding, the draft's alternatives to d1: siblings that see what d1 sees).
        wants_hidden = self.drafter.wants_hidden_states
        alternatives = draft.alternatives if draft.alternatives is not None and self._reads_alternatives(state) else None
        siblings = 0 if alternatives is None else alternatives.shape[1]
        tokens = draft.tokens if draft.width else None  # None: a plain step
        valid = None if tokens is None or draft.full else draft.in_draft()  # None: no hole in the block
        if siblings:
            tokens = torch.cat([tokens, alternatives.clamp(min=0)], dim=1)  # [B, K + A]
            valid = torch.cat([draft.in_draft() if valid is None else valid, alternatives >= 0], dim=1)
        read = target.read(state, tokens, valid, logits_to_keep=draft.width + 1 + siblings, hidden=wants_hidden,
                           siblings=siblings)
        logits, hidden = read if wants_hidden else (read, None)  # [B, K + 1 (+ A), V], [B, W + K (+ A), H]
        state.target_calls += 1
        if siblings:
            logits, sibling_logits = logits[:, : draft.width + 1], logits[:, draft.width + 1 :]
        scores = state.process(logits.float(), draft.tokens)  # fp32, as model.generate's scores
        verdict = hooks.specdec_verify(state=state, draft=draft, scores=scores)
        if timers:
            _mark(timers, "verify")

        # 4. commit: accepted drafts, then the verifier's token, with the iteration's one device sync
        #    (the target's confidence is copied to the host before it, so the sync completes it too).
        if draft.width:
            appended = torch.cat([draft.tokens, verdict.next_token[:, None]], dim=1)  # [B, K + 1]
            appended.scatter_(1, verdict.accepted[:, None], verdict.next_token[:, None])
        else:
            appended = verdict.next_token[:, None]
        commit_accepted, alternative_hits = verdict.accepted, None
        if siblings:
            commit_accepted, alternative_hits = _take_alternative(state, verdict, alternatives, sibling_logits, appended)
        target_probs = None if verdict.target_probs is None else verdict.target_probs.to("cpu", non_blocking=True)
        committed = state.commit(appended, commit_accepted, draft.lengths, kept=verdict.accepted)
        hidden_positions = None if hidden is None else target.read_positions(state)
        if hidden_positions is not None and siblings:
            hidden_positions = _tree_hidden_positions(hidden_positions, draft.width, alternative_hits)
        target.keep(state, rows_host, verdict.accepted, committed.kept)
        if timers:
            _mark(timers, "commit")

        # 5. observe
        hooks.specdec_on_step(state=state, step=Step(
            iteration=state.iteration, rows_host=rows_host, draft=draft, verdict=verdict,
            drafted_host=committed.drafted, accepted_host=committed.kept, appended_host=committed.appended,
            finished_host=committed.finished, appended_tokens=appended, target_probs_host=target_probs,
            hidden_states=hidden, hidden_positions=hidden_positions, siblings=siblings,
        ))
        state.iteration += 1

        # 6. retire: finished rows leave the batch.
        kept = state.retire(committed.finished)
        if kept is not None and state.active:
            target.select_rows(state, kept[0])
            hooks.specdec_select_rows(state=state, keep=kept[0], keep_host=kept[1])
        if timers:
            _mark(timers, "bookkeeping")

    def _reads_alternatives(self, state) -> bool:
        """Whether this iteration verifies a draft's first-position alternatives: greedy decoding (a
        sampled token is drawn from one distribution per position), a target whose cache reads siblings
        (``CachedModel.reads_siblings``), dynamic shapes, and the policy's leave
        (``state.verify_alternatives``)."""
        return (state.verify_alternatives and not state.do_sample and not state.static_shapes
                and self._target.reads_siblings)

    def _keep_drafting(self, state) -> KeepDrafting:
        return KeepDrafting(self._hooks.specdec_continue_drafting, state, self._judges_positions)


@attrs.define(eq=False, slots=True)
class KeepDrafting:
    """The ``keep_drafting`` a drafter calls after each draft position: asks the
    ``continue_drafting`` hook which rows go on (None: every row does).

    ``listening`` is False when no component answers it with more than the base policy's None: a
    drafter may then skip what it would compute only for the question (the draft's probabilities
    at each position, ``core/drafting.py``)."""

    hook: Any
    state: DecodeState
    listening: bool

    def __call__(self, position, tokens, token_probs=None, probs=None):
        if not self.listening:
            return None
        return self.hook(state=self.state, position=position, tokens=tokens, token_probs=token_probs, probs=probs)


def _take_alternative(state, verdict, alternatives, sibling_logits, appended):
    """Where the first draft was rejected and one of its alternatives is the target's token there,
    commit that alternative and the target's token after it (read in the alternative's own column):
    ``appended`` [B, K + 1] is rewritten in place. Returns the tokens each row commits less one
    (``accepted`` plus one for such rows) and which alternative each row took ``[B, A]``."""
    count = alternatives.shape[1]
    # The target's token after each alternative, processed as generate would see it: after the
    # committed tokens and the alternative.
    after = torch.stack([state.process(sibling_logits[:, i : i + 1].float(), alternatives[:, i : i + 1].clamp(min=0))[:, 0]
                         .argmax(-1) for i in range(count)], dim=1)  # [B, A]
    hits = (verdict.accepted == 0)[:, None] & (alternatives == verdict.next_token[:, None])  # [B, A]; -1 is no token
    took = hits.any(1)  # [B]
    bonus = after.gather(1, hits.long().argmax(1, keepdim=True))[:, 0]
    appended[:, 1] = torch.where(took, bonus, appended[:, 1])  # appended[:, 0] is the alternative already
    return verdict.accepted + took.long(), hits


def _tree_hidden_positions(positions, width: int, hits) -> torch.Tensor:
    """``read_positions`` of a read that ended in alternatives ``[B, W + K + A]``: an alternative
    shares d1's position, so a row keeps the hidden state of the one it took (and none of its chain's
    from d1 on), or of none."""
    count = hits.shape[1]
    positions = positions.clone()
    chain = positions[:, -count - width : -count]
    positions[:, -count - width : -count] = torch.where(hits.any(1, keepdim=True), -1, chain)
    positions[:, -count:] = torch.where(hits, positions[:, -count:], -1)
    return positions


def _judges_positions(hook) -> bool:
    """Whether any implementation of ``specdec_continue_drafting`` is more than the base policy's."""
    for impl in hook.get_hookimpls():
        plugin = impl.plugin
        if not (isinstance(plugin, LookaheadPolicy)
                and type(plugin).continue_drafting is LookaheadPolicy.continue_drafting):
            return True
    return False


def _mark(timers: list[PhaseTimes], phase: str) -> None:
    for timer in timers:
        timer.mark(phase)
