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
import json
from pathlib import Path

from typing import TYPE_CHECKING

import attrs
import torch

from ..core.components import Drafter
from ..core.hookspecs import hookimpl
from ..core.drafting import TokenByToken
from ..core.types import Draft
from ..errors import ConfigError, IncompatibleModelsError

if TYPE_CHECKING:  # transformers is imported when the drafter is used, not when plugins are listed
    from transformers import PreTrainedModel

    from ..core.cached_model import CachedModel

FORMAT = "specdec-hidden-state-head"
FORMAT_VERSION = "1"


def target_parts(target: PreTrainedModel, who: str = "drafter 'hidden-state'"):
    """``(embedding, lm_head weight [V, H], hidden size)`` of a decoder-only target, or a clear refusal."""
    if target.config.is_encoder_decoder:
        raise IncompatibleModelsError(f"{who}: the target {type(target).__name__} is encoder-decoder; the "
                                      "hidden-state head drafts for decoder-only targets")
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


def head_config(target_config):
    """The target's text config cut to one full-attention decoder layer with no vocabulary of its own."""
    config = copy.deepcopy(target_config.get_text_config(decoder=True))
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"]
    for name in ("sliding_window", "attention_chunk_size"):
        if hasattr(config, name):
            setattr(config, name, None)
    config.vocab_size = 1  # inputs are embeddings; the LM head is the target's
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if hasattr(config, name):
            setattr(config, name, None)
    config.tie_word_embeddings = False
    return config


class HiddenStateHead(torch.nn.Module):
    """``fc`` (2H -> H) then one decoder layer of the target's architecture; logits over ``token_map``.

    ``forward`` looks like a causal LM's to the runners: ``inputs_embeds`` are ``[embedding of token p,
    hidden state at p - 1]`` (2H wide); ``logits`` are over the reduced vocabulary and
    ``hidden_states[-1]`` is the predicted hidden state at p.
    """

    def __init__(self, config, token_map: torch.Tensor):
        from transformers import AutoModel

        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.decoder = AutoModel.from_config(config)
        self.register_buffer("token_map", token_map.long().clone(), persistent=True)
        self._readout: torch.Tensor | None = None  # [V', H]: the target's LM head rows, set by attach

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def attach(self, lm_head_weight: torch.Tensor) -> None:
        """Read out through these LM head rows (the target's, frozen)."""
        self._readout = lm_head_weight.detach()[self.token_map.to(lm_head_weight.device)]

    def readout(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V']
        return hidden @ self._readout.T

    def forward(self, inputs_embeds=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=None, output_hidden_states=None, logits_to_keep: int = 0, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        out = self.decoder(inputs_embeds=self.fc(inputs_embeds), attention_mask=attention_mask,
                           position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache)
        predicted = out.last_hidden_state  # [B, n, H]
        kept = predicted[:, -logits_to_keep:] if logits_to_keep else predicted
        return CausalLMOutputWithPast(logits=self.readout(kept), past_key_values=out.past_key_values,
                                      hidden_states=(predicted,))

    # --- files ---------------------------------------------------------------------------------

    def save(self, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {name: value.detach().contiguous().cpu() for name, value in self.state_dict().items()}
        info = {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "config": json.dumps(self.config.to_dict()),
            "hidden_size": str(self.config.hidden_size),
            "model_type": str(self.config.model_type),
            **(metadata or {}),
        }
        temporary = path.with_suffix(path.suffix + ".tmp")
        save_file(tensors, str(temporary), metadata=info)
        temporary.replace(path)  # nothing written half-way
        return path

    @classmethod
    def load(cls, path: str | Path, target: PreTrainedModel, who: str = "drafter 'hidden-state'") -> HiddenStateHead:
        """A saved head, checked against ``target`` (architecture, hidden size, vocabulary)."""
        from safetensors import safe_open

        path = Path(path).expanduser()
        if not path.is_file():
            raise ConfigError(f"{who}: head file {str(path)!r} does not exist")
        try:
            with safe_open(str(path), framework="pt") as handle:
                info = handle.metadata() or {}
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        except Exception as exc:  # noqa: BLE001 - safetensors raises several kinds
            raise ConfigError(f"{who}: {path} is not a safetensors file: {exc}") from None
        if info.get("format") != FORMAT:
            raise ConfigError(f"{who}: {path} is not a hidden-state head (format {info.get('format')!r})")
        _, weight, hidden = target_parts(target, who)
        target_type = target.config.get_text_config(decoder=True).model_type
        if info.get("model_type") != target_type or int(info.get("hidden_size", -1)) != hidden:
            raise IncompatibleModelsError(
                f"{who}: {path} was trained for a {info.get('model_type')} target of hidden size "
                f"{info.get('hidden_size')}; this target is a {target_type} of hidden size {hidden}"
            )
        token_map = tensors["token_map"]
        if int(token_map.max()) >= weight.shape[0] or int(token_map.min()) < 0:
            raise IncompatibleModelsError(
                f"{who}: {path}'s token map holds id {int(token_map.max())}, outside the target's vocabulary of "
                f"{weight.shape[0]}"
            )
        config = head_config(target.config)
        head = cls(config, token_map)
        missing, unexpected = head.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise IncompatibleModelsError(
                f"{who}: {path} does not fit a one-layer {target_type} head (missing {missing[:3]}, unexpected "
                f"{unexpected[:3]})"
            )
        return head.to(device=target.device, dtype=target.dtype).eval()


def _head(instance, attribute, value):
    if not isinstance(value, (HiddenStateHead, str, Path)):
        raise ConfigError(f"drafter 'hidden-state': 'head' must be a HiddenStateHead or a path, got {type(value).__name__}")


@attrs.define(eq=False)
class HiddenStateDrafter(Drafter):
    """Draft with a one-layer head that reads the target's last hidden states (EAGLE-style).

    ``head``: a ``HiddenStateHead`` or the path of one saved by ``specdec drafter train``.
    """

    name = "hidden-state"
    wants_hidden_states = True

    head: HiddenStateHead | str = attrs.field(validator=_head)
    _cached: CachedModel | None = attrs.field(default=None, init=False, repr=False)
    _embedding = attrs.field(default=None, init=False, repr=False)
    _hidden: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)  # [R, T + 1, H]
    _started: bool = attrs.field(default=False, init=False, repr=False)
    _vocab: int = attrs.field(default=0, init=False, repr=False)

    def check_target(self, target) -> None:
        from ..core.models import vocab_size

        who = f"drafter '{self.name}'"
        embedding, weight, hidden = target_parts(target, who)
        if not isinstance(self.head, HiddenStateHead):
            self.head = HiddenStateHead.load(self.head, target, who)
        if self.head.config.hidden_size != hidden:
            raise IncompatibleModelsError(
                f"{who}: the head reads hidden states of size {self.head.config.hidden_size}, the target's are {hidden}"
            )
        if int(self.head.token_map.max()) >= vocab_size(target):
            raise IncompatibleModelsError(f"{who}: the head's token map reaches past the target's vocabulary")
        self.head.to(device=target.device, dtype=target.dtype)
        self.head.attach(weight)
        self._embedding, self._vocab = embedding, int(weight.shape[0])

    def begin(self, state, target) -> None:
        from ..core.cached_model import CachedModel
        from ..core.models import CausalLMRunner

        self._cached = CachedModel(CausalLMRunner(self.head))
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

    @torch.no_grad()
    def propose(self, state, max_tokens, keep_drafting) -> Draft:
        if not self._started:  # the target has not read the prompt yet: a plain target step does
            return Draft.empty(state.active, state.device)
        draft, fed, embed, last = TokenByToken(state, max_tokens), None, self._inputs(state), self._hidden.shape[1] - 1
        while True:
            logits, predicted = self._cached.read(state, fed, embed=embed, hidden=True)  # [B, 1, V'], [B, n, H]
            state.draft_calls += 1
            # The predicted hidden state at the last position read feeds the next drafted token.
            self._hidden[state.rows, self._cached.positions[:, -1].clamp(max=last)] = predicted[:, -1]
            full = torch.full((state.active, 1, self._vocab), float("-inf"), device=state.device)  # [B, 1, V]
            full[:, 0, self.head.token_map] = logits[:, -1].float()
            token = draft.add(state.process(full, draft.so_far)[:, 0])  # q is zero outside the token map
            if not draft.more(keep_drafting):
                break
            fed = token[:, None]
        return draft.draft()

    def on_step(self, state, step) -> None:
        if step.hidden_states is not None:
            # Holes and rejected drafts (-1) go to the buffer's last column, which nobody reads: no
            # boolean indexing, so no device sync.
            trash = self._hidden.shape[1] - 1
            positions = torch.where(step.hidden_positions >= 0, step.hidden_positions, trash)  # [B, M]
            rows = step.rows_host.to(state.device)[:, None].expand_as(positions)
            self._hidden[rows, positions] = step.hidden_states.to(self._hidden.dtype)
            self._started = True
        # Only what was read with the target's own hidden states stays: the drafts, read on predicted
        # ones, are read again with the real ones at the next draft.
        nothing = torch.zeros(step.rows_host.shape[0], dtype=torch.long)
        self._cached.keep(state, step.rows_host, nothing.to(state.device), nothing)

    def select_rows(self, state, keep, keep_host) -> None:
        self._cached.select_rows(state, keep)


@hookimpl
def specdec_register(registry):
    registry.register_drafter("hidden-state", HiddenStateDrafter)
