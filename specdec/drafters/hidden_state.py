"""``hidden_state``: an EAGLE-style head that drafts from the target's own last hidden states.

No second model with the target's tokenizer is needed. The head is one decoder layer of the
target's architecture. At position p it reads the embedding of token p (the target's own
embedding) side by side with the hidden state at p - 1, and predicts the hidden state at p, which
it reads out through the rows of the target's frozen LM head for a reduced vocabulary (the most
frequent tokens of the target's own outputs, ``token_map``). After the prompt, the target's
verify forward hands over its hidden states (``Drafter.wants_hidden_states``); for the tokens it
drafts, the head continues on its own predicted hidden states (Li et al. 2024, EAGLE; EAGLE-3 and
FR-Spec draft over a reduced vocabulary the same way).

The head keeps a KV cache like every other draft model (a ``CachedModel``, holes and all). Its
speculative entries are built on predicted hidden states, so after each verification it keeps only
the committed tokens it read with the target's real ones, and reads the accepted drafts again,
with the target's hidden states, at the start of its next draft. Verification is the target's, so
the output is exact whatever the head predicts; tokens outside ``token_map`` are never drafted.

A head is fitted to a target by ``specdec.training.hidden_state.train_hidden_state_head`` (and
``specdec drafter train``) and saved as safetensors: its own layer, the token map and the target's
shape; the embeddings and the LM head are the target's, taken at load time.
"""

from __future__ import annotations

import copy
from pathlib import Path

from typing import TYPE_CHECKING

import attrs
import torch

from ..core.components import Drafter
from ..core.deferred import no_grad
from ..core.hookspecs import hookimpl
from ..core.drafting import TokenByToken, alternatives_option, matmul_precision_option
from ..core.types import Draft
from ..errors import ConfigError, IncompatibleModelsError
from .shared_encoder import lend_cross_attention, shared_cross_attention_layers

if TYPE_CHECKING:  # transformers is imported when the drafter is used, not when plugins are listed
    from transformers import PreTrainedModel

    from ..core.cached_model import CachedModel
    from ..core.reduced_vocab import TokenMap
    from .hidden_state_head import HiddenStateHead

FORMAT = "specdec-hidden-state-head"
FORMAT_VERSION = "1"


def target_parts(target: PreTrainedModel, who: str = "drafter 'hidden-state'"):
    """``(embedding, lm_head weight [V, H], hidden size)`` of a decoder-only or Whisper target (its
    decoder's), or a clear refusal."""
    if target.config.is_encoder_decoder and target.config.model_type != "whisper":
        raise IncompatibleModelsError(f"{who}: the target {type(target).__name__} is encoder-decoder; the "
                                      "hidden-state head drafts for decoder-only targets and Whisper")
    embedding, head = target.get_input_embeddings(), target.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if embedding is None or weight is None or getattr(head, "bias", None) is not None:
        raise IncompatibleModelsError(
            f"{who}: {type(target).__name__} does not expose an input embedding and a bias-free linear LM "
            "head (get_input_embeddings / get_output_embeddings), which the head reads its tokens through"
        )
    if weight.shape[1] != embedding.weight.shape[1]:
        raise IncompatibleModelsError(f"{who}: {type(target).__name__}'s LM head does not read its hidden size")
    return embedding, weight, int(weight.shape[1])


def head_config(target_config, layers: int = 1):
    """The target's text config cut to ``layers`` full-attention decoder layers (one by default) with
    no vocabulary of its own (Whisper's: decoder layers, which cross-attend to the encoder output)."""
    if target_config.is_encoder_decoder:  # Whisper's get_text_config(decoder=True) drops the head counts
        config = copy.deepcopy(target_config)
        config.decoder_layers = layers
        config.is_encoder_decoder = False  # a decoder that reads an encoder output, as WhisperForCausalLM's config says
    else:
        config = copy.deepcopy(target_config.get_text_config(decoder=True))
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * layers
    for name in ("sliding_window", "attention_chunk_size"):
        if hasattr(config, name):
            setattr(config, name, None)
    config.vocab_size = 1  # inputs are embeddings; the LM head is the target's
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if hasattr(config, name):
            setattr(config, name, None)
    config.tie_word_embeddings = False
    return config


def _head(instance, attribute, value):
    from .hidden_state_head import HiddenStateHead

    if not isinstance(value, (HiddenStateHead, str, Path)):
        raise ConfigError(f"drafter 'hidden-state': 'head' must be a HiddenStateHead or a path, got {type(value).__name__}")


@attrs.define(eq=False)
class HiddenStateDrafter(Drafter):
    """Draft with a one-layer head that reads the target's last hidden states (EAGLE-style).

    ``head``: a ``HiddenStateHead`` or the path of one saved by ``specdec drafter train``.
    ``alternatives``: under greedy decoding, also hand the verify the head's next best candidates
    for the first position (``Draft.alternatives``), this many.
    ``matmul_precision``: "auto" (the default), "medium" or "highest", as the ``model`` drafter's:
    the head's linear layers (its readout included) on bfloat16 copies of their weights on a CPU.
    """

    name = "hidden-state"
    wants_hidden_states = True

    head: HiddenStateHead | str = attrs.field(validator=_head)
    alternatives: int = attrs.field(default=0, kw_only=True, validator=alternatives_option)
    matmul_precision: str = attrs.field(default="auto", kw_only=True, validator=matmul_precision_option)
    _cached: CachedModel | None = attrs.field(default=None, init=False, repr=False)
    _embedding = attrs.field(default=None, init=False, repr=False)
    _hidden: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)  # [R, T + 1, H]
    _started: bool = attrs.field(default=False, init=False, repr=False)
    _reduced: TokenMap | None = attrs.field(default=None, init=False, repr=False)
    _shared_cross: list = attrs.field(factory=list, init=False, repr=False)  # (head layer, target layer)

    def check_target(self, target) -> None:
        from ..core.models import reread_reason, vocab_size
        from ..core.reduced_vocab import TokenMap

        from .hidden_state_head import HiddenStateHead

        who = f"drafter '{self.name}'"
        embedding, weight, hidden = target_parts(target, who)
        if not isinstance(self.head, HiddenStateHead):
            self.head = HiddenStateHead.load(self.head, target, who)
        target_type = target.config.get_text_config(decoder=True).model_type
        if self.head.config.model_type != target_type:
            raise IncompatibleModelsError(f"{who}: the head is a {self.head.config.model_type} head; "
                                          f"this target is a {target_type}: train a head for it")
        if self.head.config.hidden_size != hidden:
            raise IncompatibleModelsError(
                f"{who}: the head reads hidden states of size {self.head.config.hidden_size}, the target's are {hidden}"
            )
        self._reduced = TokenMap.checked(self.head.token_map, vocab_size(target), who, "the head's token map")
        if reason := reread_reason(self.head):
            # Such models are re-read whole from token ids (core/models.py RereadingRunner); the head
            # reads embeddings built from the target's hidden states, so it needs a cache with holes.
            raise IncompatibleModelsError(
                f"{who}: the head is a one-layer {self.head.config.model_type}, which cannot keep a cache with "
                f"holes ({reason}); draft for this target with the 'model' or 'ngram' drafter"
            )
        self.head.to(device=target.device, dtype=target.dtype)
        self.head.attach(weight)
        self._embedding = embedding
        self._shared_cross = shared_cross_attention_layers(self.head, target)

    def begin(self, state, target) -> None:
        from ..core.cached_model import CachedModel
        from ..core.models import CausalLMRunner

        runner = CausalLMRunner(self.head)
        if state.encoder_outputs is not None:  # Whisper: the head's layer reads the target's encoder output
            runner.begin(encoder_outputs=state.encoder_outputs)
        self._cached = CachedModel(runner, matmul_precision=self.matmul_precision)
        self._cached.begin(state)
        # Token p is read with the hidden state at p - 1: the head's sequence starts at each row's
        # second real token.
        self._cached.fed_host = state.padding_host + 1
        total = state.sequences.shape[1]
        self._hidden = torch.zeros(state.batch_size, total, self.head.config.hidden_size,
                                   dtype=self.head.dtype, device=state.device)
        self._started = False

    def _inputs(self, state):
        """``embed(tokens, positions)`` for the cached head: [embedding of token p, hidden state at p - 1]."""
        rows = state.rows[:, None]

        def embed(tokens, positions):
            # A row near its token budget is still fed the batch's drafts: past the buffer, it reads and
            # writes the last column, which nobody uses.
            before = self._hidden[rows, (positions - 1).clamp(0, self._hidden.shape[1] - 1)]  # [B, n, H]
            return torch.cat([self._embedding(tokens).to(before.dtype), before], dim=-1)

        return embed

    @no_grad
    def propose(self, state, max_tokens, keep_drafting) -> Draft:
        if not self._started:  # the target has not read the prompt yet: a plain target step does
            return Draft.empty(state.active, state.device)
        lend_cross_attention(self._cached, state, self._shared_cross)
        draft = self._draft(state, max_tokens, keep_drafting)
        lend_cross_attention(self._cached, state, self._shared_cross)
        return draft

    def _draft(self, state, max_tokens, keep_drafting) -> Draft:
        draft = TokenByToken(state, max_tokens, keep_drafting, self.alternatives, reduced=True, token_map=self._reduced)
        fed, embed, last = None, self._inputs(state), self._hidden.shape[1] - 1
        while True:
            logits, predicted = self._cached.read(state, fed, embed=embed, hidden=True)  # [B, 1, V'], [B, n, H]
            state.draft_calls += 1
            # The predicted hidden state at the last position read feeds the next drafted token.
            self._hidden[state.rows, self._cached.positions[:, -1].clamp(max=last)] = predicted[:, -1]
            scores = logits[:, -1].float()  # [B, V']
            # [B, V] with -inf outside the map (so q is zero there), unless it drafts among the map's own
            token = draft.add(scores if draft.reads_reduced else self._reduced.expand(scores))
            if not draft.more():
                break
            fed = token[:, None]
        return draft.draft()

    def on_step(self, state, step) -> None:
        if step.hidden_states is not None:
            # Holes and rejected drafts (-1) go to the buffer's last column, which nobody reads: no
            # boolean indexing, so no device sync.
            trash = self._hidden.shape[1] - 1
            positions = torch.where(step.hidden_positions >= 0, step.hidden_positions, trash)  # [B, M]
            rows = step.rows_host.to(state.device, non_blocking=True)[:, None].expand_as(positions)
            self._hidden[rows, positions] = step.hidden_states.to(self._hidden.dtype)
            self._started = True
        # Only what was read with the target's own hidden states stays: the drafts, read on predicted
        # ones, are read again with the real ones at the next draft.
        nothing = torch.zeros(step.rows_host.shape[0], dtype=torch.long)
        self._cached.keep(state, step.rows_host, nothing.to(state.device, non_blocking=True), nothing)

    def select_rows(self, state, keep, keep_host) -> None:
        self._cached.select_rows(state, keep)

    def on_finish(self, state, output) -> None:
        self._cached.end(state)
        self._hidden = None


@hookimpl
def specdec_register(registry):
    registry.register_drafter("hidden-state", HiddenStateDrafter)
