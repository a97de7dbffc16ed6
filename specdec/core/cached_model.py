"""A model and its cache of every active row's committed tokens: the target and each draft model use one.

One round of a model in an iteration is ``read`` (once or more) then ``keep``:

- ``read(state, tokens, valid)`` feeds the model, in one forward, the committed tokens it has not
  read yet (the catch-up, right-aligned, on the first read of a round) followed by ``tokens``:
  speculative tokens (the target's drafts to verify, a draft model's own last drafted token);
- ``keep(state, kept, kept_host)`` ends the round once the verifier has decided: of the speculative
  tokens read this round, each row's first ``kept[b]`` are now committed and stay, the rest are
  rejected and leave the cache.

What "leave the cache" means depends on the kind of state, and is defined here once for each:

- attention keys and values (full, sliding-window, chunked): rejected slots become holes that the
  attention mask hides (``SlotCache``); position ids count only valid slots, and windows are
  counted in positions, not slots (``core/masks.py``);
- recurrent states (Mamba, gated delta nets, short convolutions): a state cannot be cropped, so
  the round starts from a checkpoint of the committed state and, when a row rejected anything,
  the accepted tokens are read again from that checkpoint (``_replay``).
"""

from __future__ import annotations

import torch

from .models import CausalLMRunner, Seq2SeqRunner


class CachedModel:
    """``runner``'s model plus a ``SlotCache`` of the request's active rows, and how far each row's
    committed tokens have been read (``fed_host``, buffer positions, CPU)."""

    def __init__(self, runner: CausalLMRunner | Seq2SeqRunner):
        self.runner = runner
        self.slots = None
        self.fed_host: torch.Tensor | None = None  # [R] long, CPU, by original row id
        self._round_columns = 0  # slots reserved since the last keep
        self._catch_up_columns = 0  # of which the committed tokens read at the round's start
        self._round_start_host: torch.Tensor | None = None  # [B] lengths of the active rows at the first read

    @property
    def model(self):
        return self.runner.model

    def begin(self, state) -> None:
        """A new request: an empty cache for all its rows."""
        self.slots = self.runner.new_cache(state.batch_size)
        self.fed_host = torch.zeros(state.batch_size, dtype=torch.long)
        self._round_columns = self._catch_up_columns = 0
        self._round_start_host = None

    @property
    def reading(self) -> bool:
        """Whether a round is open (something was read since the last ``keep``)."""
        return self._round_start_host is not None

    def read(
        self,
        state,
        tokens: torch.Tensor | None = None,  # [B, n] speculative tokens
        valid: torch.Tensor | None = None,  # [B, n] bool; None: all valid
        logits_to_keep: int = 1,
    ) -> torch.Tensor:  # [B, logits_to_keep, V]
        """One forward over what this round has not read yet: the unread committed tokens (first read of
        a round only) and then ``tokens``. ``logits[:, -1]`` is every row's next-token distribution."""
        device = state.device
        if tokens is None:
            tokens = torch.zeros(state.active, 0, dtype=torch.long, device=device)
        if valid is None:
            valid = torch.ones(tokens.shape, dtype=torch.bool, device=device)
        if not self.reading:
            catch_up, catch_up_valid = state.committed_since(self.fed_host[state.rows_host])  # [B, W]
            self._round_start_host = state.lengths_host[state.rows_host].clone()
            self._catch_up_columns = catch_up.shape[1]
            if self.slots.recurrent is not None and tokens.shape[1]:
                # Recurrent states read the committed block first, as generate reads the prompt,
                # then each speculative token with a checkpoint after it.
                first = self._forward(catch_up, catch_up_valid, max(logits_to_keep - tokens.shape[1], 1))
                rest = self._forward(tokens, valid, min(logits_to_keep, tokens.shape[1]))
                return torch.cat([first, rest], dim=1)[:, -logits_to_keep:]
            tokens = torch.cat([catch_up, tokens], dim=1)
            valid = torch.cat([catch_up_valid, valid], dim=1)
        return self._forward(tokens, valid, logits_to_keep)

    def _forward(self, tokens, valid, logits_to_keep):
        self._round_columns += tokens.shape[1]
        return self.runner.forward(self.slots, tokens, valid, logits_to_keep=logits_to_keep)

    def keep(self, state, rows_host: torch.Tensor, kept: torch.Tensor, kept_host: torch.Tensor) -> None:
        """End the round: row b's first ``kept[b]`` speculative tokens read this round are committed
        (device and host copies of the same numbers); the rest leave the cache.

        ``rows_host`` are the original ids of the rows that read this round (the active rows then).
        """
        if not self.reading:
            return  # nothing was read this iteration
        self.slots.drop_tail(self._round_columns, keep_columns=self._catch_up_columns + kept)
        self.fed_host[rows_host] = self._round_start_host + kept_host
        self._round_columns = self._catch_up_columns = 0
        self._round_start_host = None
        self.slots.maybe_compact(self._widest(state, rows_host))

    def select_rows(self, state, keep: torch.Tensor) -> None:
        """Finished rows leave the batch; ``state.rows_host`` already holds the rows that stay."""
        self.slots.select_rows(keep, widest=self._widest(state, state.rows_host))
        self.runner.select_rows(keep)

    def _widest(self, state, rows_host: torch.Tensor) -> int:
        """The most valid slots any of ``rows_host`` holds: committed tokens read, less prompt padding."""
        return int((self.fed_host - state.padding_host)[rows_host].max())
