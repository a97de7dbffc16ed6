"""``model``: a small model with the target's vocabulary drafts token by token.

The draft keeps its own KV cache across iterations under the same rules as the target's (rejected
drafts become holes), so it never re-reads the prefix: each draft starts by reading the tokens the
target committed that the draft has not seen (the correction or bonus token, and the last accepted
draft), together in one ragged block, then drafts one token per forward.

For an encoder-decoder target the draft is an encoder-decoder model too (whisper-tiny drafting
for a large Whisper): it encodes the request's input with its own encoder, once per request.
``shared_encoder`` (drafters/shared_encoder.py) reuses all of this with a decoder that reads the
target's encoder output instead.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from ..core.components import Drafter
from ..core.deferred import no_grad
from ..core.hookspecs import hookimpl
from ..core.drafting import TokenByToken, alternatives_option, matmul_precision_option
from ..core.types import Draft
from ..errors import ConfigError, DraftDtypeWarning, IncompatibleModelsError

if TYPE_CHECKING:  # transformers is imported when a drafter is used, not when plugins are listed
    from transformers import PreTrainedModel

    from ..core.cached_model import CachedModel
    from ..core.reduced_vocab import TokenMap


def _model_or_path(instance, attribute, value):
    from transformers import PreTrainedModel

    if not isinstance(value, (PreTrainedModel, str, Path)):
        raise ConfigError(
            f"drafter '{instance.name}': 'model' must be a transformers PreTrainedModel or a path, got {type(value).__name__}"
        )


@attrs.define(eq=False)
class ModelDrafter(Drafter):
    """Draft with a small model that shares the target's tokenizer (encoder-decoder for an encoder-decoder target).

    ``model``: the draft model, or a path to load it from (in the target's dtype, on its device).
    ``token_map``: for a draft whose output head scores only a subset of the target's tokens, the
    full id of each of its outputs (a list, a tensor, or a .json / .safetensors file); a draft
    model that carries a ``token_map`` buffer needs none (core/reduced_vocab.py).
    ``alternatives``: under greedy decoding, also hand the verify the draft's next best candidates
    for the first position (``Draft.alternatives``), this many.
    ``matmul_precision``: "auto" (the default: on a CPU with oneDNN, the draft's steps' linear layers
    read bfloat16 copies of their weights for the shapes this CPU runs faster so, timed once per
    machine; norms, attention and softmax stay float32), "medium" (bfloat16 for every shape) or
    "highest" (the draft's float32 as loaded) or "int8" (int8 weights through fbgemm, x86; a draft
    loaded from a path then keeps only those). The draft's numbers never reach the output, which
    stays the target's.
    """

    name = "model"

    model: PreTrainedModel | str = attrs.field(validator=_model_or_path)
    token_map: Any = attrs.field(default=None, kw_only=True)
    alternatives: int = attrs.field(default=0, kw_only=True, validator=alternatives_option)
    matmul_precision: str = attrs.field(default="auto", kw_only=True, validator=matmul_precision_option)
    _cached: CachedModel | None = attrs.field(default=None, init=False, repr=False)
    _reduced: TokenMap | None = attrs.field(default=None, init=False, repr=False)
    _drafts_fed: int = attrs.field(default=0, init=False, repr=False)

    def check_target(self, target) -> None:
        from transformers import AutoModelForCausalLM, PreTrainedModel

        from ..core.models import check_architecture, load_pretrained, load_seq2seq, runner_for

        who = f"drafter '{self.name}'"
        loaded = not isinstance(self.model, PreTrainedModel)
        if loaded:
            if target.config.is_encoder_decoder:
                self.model = load_seq2seq(self.model, dtype=target.dtype, who=who)
            else:
                self.model = load_pretrained(AutoModelForCausalLM, self.model, dtype=target.dtype, who=who)
        self._check_vocabulary(target)
        self._check_dtype(target)
        check_architecture(self.model)
        if self.model.config.is_encoder_decoder != target.config.is_encoder_decoder:
            raise IncompatibleModelsError(
                f"{who}: the draft and the target must both be decoder-only or both encoder-decoder "
                f"(draft {type(self.model).__name__}, target {type(target).__name__}); for a decoder that "
                "reads the target's encoder output use drafter 'shared-encoder'"
            )
        if target.config.is_encoder_decoder:
            runner_for(self.model)  # the draft must take decoder masks and positions too
            draft_input, target_input = _encoder_input_shape(self.model), _encoder_input_shape(target)
            if draft_input != target_input:
                raise IncompatibleModelsError(
                    f"{who}: the draft's encoder reads {draft_input[1]}={draft_input[0]} but the target's reads "
                    f"{target_input[1]}={target_input[0]}; both must read the same {target.main_input_name}"
                )
        if loaded:
            self._keep_int8_only()

    def _keep_int8_only(self) -> None:
        """Under matmul_precision "int8", a draft this drafter loaded itself keeps only its int8 weights
        (``packed_linear.keep_int8_only``): nothing else holds it, and once its steps read int8 no step
        reads its float32 ones. A draft model passed in is the caller's, and keeps them."""
        from ..core import packed_linear

        if self.matmul_precision == "int8" and packed_linear.applies_to(self.model):
            packed_linear.keep_int8_only(self.model)

    def _check_dtype(self, target) -> None:
        """Warn of a half-precision draft that a wider target on a CPU runs with: transformers 5 loads a
        checkpoint saved in float16 as float16 unless told otherwise, and most CPUs multiply in half
        precision several times slower than in float32. On a Zen 3 EPYC the bundled pair's draft read
        16 prompts in 0.35 s in float16 against 0.05 s in float32, and every draft step took about 3
        times as long, enough to make drafting lose where it pays (docs/benchmarks.md, stop 46)."""
        import torch

        half = (torch.float16, torch.bfloat16)
        if target.device.type == "cpu" and self.model.dtype in half and target.dtype not in half:
            warnings.warn(
                f"drafter '{self.name}': the draft model is {str(self.model.dtype).removeprefix('torch.')} and the "
                f"target {str(target.dtype).removeprefix('torch.')}, on a CPU, where half-precision steps run "
                "several times slower; the output is exact, but drafting may cost more than it saves. Load the "
                f"draft with dtype={target.dtype}, or give the drafter its path to load it in the target's dtype.",
                DraftDtypeWarning, stacklevel=2,
            )

    def _check_vocabulary(self, target) -> None:
        from ..core.models import vocab_size
        from ..core.reduced_vocab import TokenMap, model_token_map, read_token_map

        who = f"drafter '{self.name}'"
        draft_vocab, target_vocab = vocab_size(self.model), vocab_size(target)
        ids, source = self.token_map, "its token_map option"
        if isinstance(ids, (str, Path)):
            ids, source = read_token_map(ids, who), str(ids)
        elif ids is None:
            ids, source = model_token_map(self.model), "the draft model's token map"
        self._reduced = None
        if ids is not None:
            self._reduced = TokenMap.checked(ids, target_vocab, who, source)
            if self._reduced.size != draft_vocab:
                raise IncompatibleModelsError(
                    f"{who}: the draft's head scores {draft_vocab} tokens but {source} maps {self._reduced.size}"
                )
            return
        if draft_vocab != target_vocab:
            raise IncompatibleModelsError(
                f"drafter '{self.name}': the draft model's vocabulary has {draft_vocab} tokens but the "
                f"target's has {target_vocab}; a draft model must share the target's tokenizer"
            )

    def _start_runner(self, state):
        """The runner for this request, given what it reads besides tokens (encoder inputs)."""
        from ..core.models import Seq2SeqRunner, runner_for

        runner = runner_for(self.model)
        if isinstance(runner, Seq2SeqRunner) and runner.main_input_name not in state.model_inputs:
            raise ConfigError(
                f"drafter '{self.name}': the encoder-decoder draft encodes the input with its own encoder; "
                f"pass {runner.main_input_name}=..., not only the target's encoder_outputs"
            )
        runner.begin(**state.model_inputs)
        return runner

    def begin(self, state, target) -> None:
        from ..core.cached_model import CachedModel

        if self.model.device != target.device:
            self.model.to(target.device)
        self._cached = CachedModel(self._start_runner(state), matmul_precision=self.matmul_precision)
        self._cached.begin(state)

    @no_grad
    def propose(self, state, max_tokens, keep_drafting) -> Draft:
        draft = TokenByToken(state, max_tokens, keep_drafting, self.alternatives, reduced=self._reduced is not None,
                             token_map=self._reduced)
        fed = None  # the first read of a round catches up on the committed tokens by itself
        while True:
            logits = self._cached.read(state, fed)[:, -1].float()  # [B, V] (or [B, V'] from a reduced head)
            state.draft_calls += 1
            if self._reduced is not None and not draft.reads_reduced:
                logits = self._reduced.expand(logits)  # [B, V], -inf outside the map: q is zero there
            token = draft.add(logits)  # [B]
            if not draft.more():
                break
            fed = token[:, None]
        self._drafts_fed = draft.drafted - 1
        return draft.draft()

    def on_step(self, state, step) -> None:
        # Of the drafts it read (all but the last it drafted), the accepted ones stay in its cache.
        if not self._cached.reading:
            return  # a plain step: it drafted nothing
        fed = self._drafts_fed
        self._cached.keep(state, step.rows_host, step.verdict.accepted.clamp(max=fed), step.accepted_host.clamp(max=fed))

    def select_rows(self, state, keep, keep_host) -> None:
        self._cached.select_rows(state, keep)

    def on_finish(self, state, output) -> None:
        self._cached.end(state)


def _encoder_input_shape(model) -> tuple:
    """What an encoder-decoder model's encoder reads: (mel bins / channels, the config field), or (None, None)."""
    for name in ("num_mel_bins", "feature_size", "num_channels"):
        value = getattr(model.config, name, None)
        if isinstance(value, int):
            return value, name
    return None, None


@hookimpl
def specdec_register(registry):
    registry.register_drafter("model", ModelDrafter)
