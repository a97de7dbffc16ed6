"""``model``: a small causal LM with the target's vocabulary drafts token by token.

The draft keeps its own KV cache across iterations under the same rules as the target's (rejected
drafts become holes), so it never re-reads the prefix: each draft starts by reading the tokens the
target committed that the draft has not seen (the correction or bonus token, and the last accepted
draft), together in one ragged block, then drafts one token per forward.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from ..core.models import CausalLMRunner, vocab_size
from ..core.sampling import sample
from ..core.types import Draft
from ..errors import ConfigError, IncompatibleModelsError
from ..plugins.hookspecs import hookimpl
from .base import Drafter


def load_pretrained(auto_class, model: str | Path, *, dtype: torch.dtype | str | None, who: str):
    """Load a model from a local path (or a hub id, when the network allows), naming ``who`` wants it."""
    path = Path(model).expanduser()
    if not path.exists() and (str(model).startswith((".", "/", "~")) or path.suffix or len(path.parts) != 2):
        raise ConfigError(f"{who}: model path {str(model)!r} does not exist")
    try:
        return auto_class.from_pretrained(str(path if path.exists() else model), dtype=dtype).eval()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{who}: cannot load model {str(model)!r}: {exc}") from exc


def _model_or_path(instance, attribute, value):
    if not isinstance(value, (PreTrainedModel, str, Path)):
        raise ConfigError(
            f"drafter 'model': 'model' must be a transformers PreTrainedModel or a path, got {type(value).__name__}"
        )


@attrs.define(eq=False)
class ModelDrafter(Drafter):
    """Draft with a small causal LM that shares the target's tokenizer.

    ``model``: the draft model, or a path to load it from (in the target's dtype, on its device).
    """

    name = "model"

    model: PreTrainedModel | str = attrs.field(validator=_model_or_path)
    _runner: CausalLMRunner | None = attrs.field(default=None, init=False, repr=False)
    _slots = attrs.field(default=None, init=False, repr=False)
    _fed_host: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)
    _catch_up_width: int = attrs.field(default=0, init=False, repr=False)
    _drafts_fed: int = attrs.field(default=0, init=False, repr=False)

    def check_target(self, target) -> None:
        if not isinstance(self.model, PreTrainedModel):
            self.model = load_pretrained(AutoModelForCausalLM, self.model, dtype=target.dtype, who="drafter 'model'")
        draft_vocab, target_vocab = vocab_size(self.model), vocab_size(target)
        if draft_vocab != target_vocab:
            raise IncompatibleModelsError(
                f"drafter 'model': the draft model's vocabulary has {draft_vocab} tokens but the "
                f"target's has {target_vocab}; a draft model must share the target's tokenizer"
            )
        if self.model.config.is_encoder_decoder != target.config.is_encoder_decoder:
            raise IncompatibleModelsError(
                "drafter 'model': the draft and the target must both be decoder-only or both encoder-decoder"
            )

    def begin(self, state, target) -> None:
        if self.model.device != target.device:
            self.model.to(target.device)
        self._runner = CausalLMRunner(self.model)
        self._runner.begin(**state.model_inputs)
        self._slots = self._runner.new_cache(state.batch_size)
        self._fed_host = torch.zeros(state.batch_size, dtype=torch.long)

    @torch.no_grad()
    def propose(self, state, max_tokens, keep_drafting) -> Draft:
        width = int(max_tokens.max())
        device = state.device
        limit = max_tokens.to(device, non_blocking=True)  # [B]
        batch = state.active
        tokens = torch.zeros(batch, width, dtype=torch.long, device=device)  # [B, K]
        token_probs = torch.zeros(batch, width, dtype=torch.float32, device=device)  # [B, K]
        probs = None
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        drafting = limit > 0  # [B]

        input_ids, valid = state.committed_since(self._fed_host[state.rows_host])  # [B, W]
        self._catch_up_width = input_ids.shape[1]
        drafted = 0
        for j in range(width):
            logits = self._runner.forward(self._slots, input_ids, valid, logits_to_keep=1)[:, -1]  # [B, V]
            state.draft_calls += 1
            scores = state.process(logits.float()[:, None], tokens[:, :j])[:, 0]  # [B, V]
            q = torch.softmax(scores, dim=-1)  # [B, V] fp32
            if state.do_sample:
                # q (the target's warpers applied to the draft's scores) is exactly what the token is
                # drawn from and what the rejection verifier divides by.
                token = sample(q, state.generator)
                if probs is None:
                    probs = torch.zeros(batch, width, q.shape[-1], dtype=torch.float32, device=device)
                probs[:, j] = q
            else:
                token = scores.argmax(-1)
            tokens[:, j] = token
            token_probs[:, j] = q.gather(1, token[:, None])[:, 0]
            lengths += drafting
            drafted = j + 1
            if drafted == width:
                break
            drafting = drafting & (limit > drafted)
            keep = keep_drafting(j, token, token_probs[:, j], q)
            if keep is not None:
                drafting = drafting & keep
                if not bool(drafting.any()):
                    break
            input_ids, valid = token[:, None], torch.ones(batch, 1, dtype=torch.bool, device=device)
        self._drafts_fed = drafted - 1
        return Draft(
            tokens=tokens[:, :drafted],
            lengths=lengths,
            probs=None if probs is None else probs[:, :drafted],
            token_probs=token_probs[:, :drafted],
        )

    def on_step(self, state, step) -> None:
        if step.draft.width == 0:
            return  # the draft was not asked this iteration and read nothing
        fed = self._drafts_fed
        kept_drafts = step.accepted_host.clamp(max=fed)
        self._slots.drop_tail(
            self._catch_up_width + fed,
            keep_columns=self._catch_up_width + step.verdict.accepted.clamp(max=fed),
        )
        # Everything committed before this step is now in the cache, plus the accepted drafts it
        # read while drafting.
        before = state.lengths_host[step.rows_host] - step.appended_host
        self._fed_host[step.rows_host] = before + kept_drafts
        real = self._fed_host[step.rows_host] - state.padding_host[step.rows_host]
        self._slots.maybe_compact(int(real.max()))

    def select_rows(self, state, keep, keep_host) -> None:
        self._slots.select_rows(keep, widest=int((self._fed_host - state.padding_host)[state.rows_host].max()))
        self._runner.select_rows(keep)


@hookimpl
def specdec_register(registry):
    registry.register_drafter("model", ModelDrafter)
