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
  after the prompt every token is read on its own with a checkpoint after it, and each row goes
  back to the checkpoint after its last kept token (``core/recurrent.py``);
- state that cannot hold holes at all (``REREAD_ARCHITECTURES``: slot-indexed windows, positions
  counted from the cache length, states outside transformers' cache classes): there is no
  ``SlotCache``; every read hands the ``RereadingRunner`` each row's committed tokens and the
  round's speculative ones, which it reads whole or over a cache per row that it crops back to
  the tokens each row kept.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .cache import bucket, dense_block, empty_block
from . import gqa_attention, screened_head
from .packed_linear import applies_to, copy_free_plan, pack, too_big_to_pack
from .models import CausalLMRunner, RereadingRunner, Seq2SeqRunner

# Free columns a static cache keeps for the next rounds; fewer, and it compacts (core/cache.py).
STATIC_HEADROOM = 64


class CachedModel:
    """``runner``'s model plus a ``SlotCache`` of the request's active rows, and how far each row's
    committed tokens have been read (``fed_host``, buffer positions, CPU)."""

    def __init__(self, runner: CausalLMRunner | RereadingRunner | Seq2SeqRunner, role: str = "draft",
                 matmul_precision: str = "highest"):
        self.runner = runner
        self.role = role  # "target" or "draft": which models ``state.compile`` names
        # A drafter's: its packed steps read bfloat16 weights ("medium", or "auto" where measured
        # faster; core/packed_linear.py). The target's steps are always its own dtype's (but for
        # the screened LM head of greedy verifies, whose argmax stays float32's: core/screened_head.py).
        self.matmul_precision = "highest" if role == "target" else matmul_precision
        self.slots = None
        self.fed_host: torch.Tensor | None = None  # [R] long, CPU, by original row id
        self._round_columns = 0  # slots reserved since the last keep
        self._catch_up_columns = 0  # of which the committed tokens read at the round's start
        self._round_start_host: torch.Tensor | None = None  # [B] lengths of the active rows at the first read
        self._round_start: torch.Tensor | None = None  # the same, on the device
        self._speculative_read = 0  # speculative tokens read this round
        self.positions: torch.Tensor | None = None  # [B, n] buffer positions of the last read's tokens
        self.valid: torch.Tensor | None = None  # [B, n] which of them are tokens, not holes

    @property
    def model(self):
        return self.runner.model

    def begin(self, state) -> None:
        """A new request: an empty cache for all its rows (none for a re-reading runner)."""
        self.slots = self.runner.new_cache(state.batch_size, static_capacity(state) if state.static_shapes else None)
        self.runner.compiled_steps = self.role in state.compile
        # Multi-token steps switch their linear layers: to packed copies of the weights, or without
        # packed_weights to the copy-free routes measured faster (core/packed_linear.py).
        self.runner.packed_steps = (not self.runner.rereads and not self.runner.compiled_steps
                                    and applies_to(self.model))
        self.runner.weight_copies = state.packed_weights
        # A drafter's one-token steps too: only the target's plain steps must stay generate's own.
        self.runner.packed_one_row = self.runner.packed_steps and state.packed_weights and self.role != "target"
        self.runner.matmul_precision = self.matmul_precision if self.runner.packed_one_row else "highest"
        # Greedy verifies of a float32 target: its LM head in bfloat16, the argmax's candidates in float32.
        screens = (self.role == "target" and state.screen_suppressed is not None and self.runner.packed_steps
                   and screened_head.applies_to(self.model))
        # A lone row's verifies (up to screened_head.MAX_ROWS tokens) never read a screened head's
        # packed float32 copy (101 MiB on whisper-base, stop 60), and its rare reads that need float32
        # logits of every token run on torch's path (screened_head.screened_head): the copy is made
        # only by a batched request.
        leave = (screened_head.head_of(self.model),) if screens and state.batch_size == 1 else ()
        if self.runner.packed_steps and state.packed_weights:
            pack(self.model, self.runner.matmul_precision, leave=leave)  # now, not in the first step the policies time
        if self.runner.packed_steps and (not state.packed_weights or too_big_to_pack(self.model)):
            copy_free_plan(self.model)  # timed (once per machine) now, as pack does
        self.runner.screened_steps = screens and bool(screened_head.prepare(self.model))
        if leave and state.packed_weights and not self.runner.screened_steps:
            # not screened on this machine: its verifies read the packed float32 copy after all
            pack(self.model, self.runner.matmul_precision)
        self.runner.screen_suppressed = state.screen_suppressed if self.runner.screened_steps else ()
        self.runner.screen_exact_from = state.screen_exact_from if self.runner.screened_steps else None
        self.runner.grouped_steps = (not self.runner.rereads and not self.runner.compiled_steps
                                     and gqa_attention.applies_to(self.model))
        if self.slots is not None:
            # A drafter's begin runs inside the loop (its first draft): no sync for the copy.
            self.slots.prompt_lengths = (state.prompt_width - state.padding_host).to(state.device, non_blocking=True)
        self._spec, self._spec_valid = [], []  # a re-reading runner's speculative tokens of this round
        self.fed_host = torch.zeros(state.batch_size, dtype=torch.long)
        self._round_columns = self._catch_up_columns = self._speculative_read = 0
        self._round_start_host = None

    def end(self, state) -> None:
        """The request is over: let go of its cache and of what the runner read for it, which would
        otherwise live on until the next request's begin, through that request's encoder pass
        (whisper-base: about 40 MiB a row, most of it the cross-attention keys and values over 1,500
        frames). A static cache stays: the next request of its shape decodes into it."""
        if not state.static_shapes:
            self.slots = None
        self.positions = self.valid = self._round_start = None
        self.runner.end()

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
        embed=None,
        hidden: bool = False,
        siblings: int = 0,
    ):
        """One forward over what this round has not read yet: the unread committed tokens (first read of
        a round only) and then ``tokens``. ``logits[:, -1]`` is every row's next-token distribution.
        The last ``siblings`` of ``tokens`` are alternatives to the first (``reads_siblings``): its
        position, and only what comes before it in view.

        ``embed(tokens, positions)``, when given, turns the block into the model's input embeddings
        (a drafter that feeds more than token ids); ``positions`` are each token's buffer position
        (``self.positions`` keeps those of the last read). With ``hidden`` the model's last hidden
        states of every column read come back too: ``(logits, hidden [B, n, H])``.
        """
        device = state.device
        dense = valid is None  # no hole in the block, known on the host (SlotCache.extend)
        if tokens is None:  # a plain step: the committed tokens only
            tokens = empty_block(state.active, device, torch.long)
        if valid is None:
            valid = dense_block(tokens.shape[0], tokens.shape[1], device)
        speculative = tokens.shape[1]
        if not self.reading:
            self._round_start_host = state.lengths_host[state.rows_host].clone()
            self._round_start = state.lengths[state.rows]
        if self.runner.rereads:
            return self._reread(state, tokens, valid, logits_to_keep, embed, hidden)
        positions = None  # buffer positions matter only to embed and to read_positions (hidden states)
        if (embed is not None or hidden) and speculative:
            steps = torch.arange(speculative, device=device)
            if siblings:  # alternatives to the first token: its position
                steps[-siblings:] = 0
            positions = self._round_start[:, None] + self._speculative_read + steps
        self._speculative_read += speculative
        if self._round_columns == 0:  # the round's first read catches up on the committed tokens
            fed_host = self.fed_host[state.rows_host]
            catch_up, catch_up_valid, catch_up_positions = state.committed_since(fed_host, bucketed=self.slots.static)  # [B, W]
            self._catch_up_columns = catch_up.shape[1]
            # Worth asking only where it can matter: a block known dense, or a recurrent read of it alone.
            catch_up_dense = (dense or self.slots.recurrent is not None) and not self.slots.static \
                and state.backlog_is_dense(fed_host, catch_up.shape[1])
            if not speculative:  # nothing to put after the catch-up
                positions = self._remember(catch_up_valid, catch_up_positions if embed is not None or hidden else None)
                return self._forward(catch_up, catch_up_valid, positions, logits_to_keep, embed, hidden, catch_up_dense)
            if self.slots.recurrent is not None:
                # Recurrent states read the committed block first, as generate reads the prompt,
                # then each speculative token with a checkpoint after it.
                first = self._forward(catch_up, catch_up_valid, catch_up_positions,
                                      max(logits_to_keep - speculative, 1), embed, hidden, catch_up_dense)
                rest = self._forward(tokens, valid, positions, min(logits_to_keep, speculative), embed, hidden, dense)
                self._remember(torch.cat([catch_up_valid, valid], dim=1), positions, catch_up_positions)
                return _joined(first, rest, logits_to_keep, hidden)
            dense = dense and catch_up_dense
            tokens = torch.cat([catch_up, tokens], dim=1)
            valid = torch.cat([catch_up_valid, valid], dim=1)
            positions = self._remember(valid, positions, catch_up_positions)
        else:
            self._remember(valid, positions)
        tree = (tokens.shape[1] - speculative, siblings) if siblings else None
        return self._forward(tokens, valid, positions, logits_to_keep, embed, hidden, dense, tree)

    def _reread(self, state, tokens, valid, logits_to_keep, embed, hidden):
        """``read`` for a ``RereadingRunner``: it gets each row's committed tokens and the round's
        speculative ones so far, whole, and reads them as generate would. The columns "read" are those
        a ``SlotCache`` would have read (the unread committed tokens, then ``tokens``), for
        ``read_positions``."""
        if embed is not None or hidden:
            raise ConfigError(f"{type(self.model).__name__} is read from token ids as generate reads it: it takes "
                              "no input embeddings and hands out no hidden states")
        device = state.device
        speculative = tokens.shape[1]
        if not self._spec:  # the round's first read: the committed tokens not read yet are its first columns
            _, catch_up_valid, catch_up_positions = state.committed_since(self.fed_host[state.rows_host])
        else:
            catch_up_valid = torch.zeros(state.active, 0, dtype=torch.bool, device=device)
            catch_up_positions = torch.zeros(state.active, 0, dtype=torch.long, device=device)
        self._spec.append(tokens)
        self._spec_valid.append(valid)
        self._speculative_read += speculative
        read = self._speculative_read
        positions = self._round_start[:, None] + (read - speculative) + torch.arange(speculative, device=device)
        self._remember(torch.cat([catch_up_valid, valid], dim=1), positions, catch_up_positions)
        spec, spec_valid = torch.cat(self._spec, dim=1), torch.cat(self._spec_valid, dim=1)  # [B, read]
        logits = None
        lengths_host = self._round_start_host
        # Rows of one committed length are read together: no padding but the prompt's own, so every
        # model (those that count padding from the right or from pad ids too) sees generate's inputs.
        for length in lengths_host.unique().tolist():
            group_host = (lengths_host == length).nonzero().flatten()
            group = group_host.to(device, non_blocking=True)
            rows = state.rows[group]
            committed = state.sequences[rows, :length]
            mask = torch.cat([state.token_mask[rows, :length].long(),
                              torch.ones(group.shape[0], read, dtype=torch.long, device=device)], dim=1)
            # Columns past a row's last valid speculative token (a shorter draft) repeat that token:
            # they come after everything scored, so a causal model never sees them.
            ahead = torch.cat([committed[:, -1:], spec[group]], dim=1)
            last = ahead.gather(1, spec_valid[group].sum(1, keepdim=True))
            sequences = torch.cat([committed, torch.where(spec_valid[group], spec[group], last)], dim=1)
            # A replayed row's cache still holds what it read before this read and still stands.
            before = self.fed_host[state.rows_host[group_host]] if read == speculative else \
                lengths_host[group_host] + read - speculative
            replay = (state.rows_host[group_host].tolist(), before.tolist(), state.prompt_width)
            out = self.runner.read_sequences(sequences, mask, logits_to_keep, rows=group, replay=replay)
            if logits is None:
                logits = out.new_empty(state.active, *out.shape[1:])
            logits[group] = out
        return logits

    def _remember(self, valid, positions, catch_up_positions=None):
        """Keep the last read's columns for ``read_positions``; return their positions (None if unwanted)."""
        if positions is not None and catch_up_positions is not None:
            positions = torch.cat([catch_up_positions, positions], dim=1)
        self.positions, self.valid = positions, valid
        return positions

    def _forward(self, tokens, valid, positions, logits_to_keep, embed, hidden, dense, siblings=None):
        self._round_columns += tokens.shape[1]
        inputs_embeds = None if embed is None else embed(tokens, positions)
        return self.runner.forward(self.slots, tokens, valid, logits_to_keep=logits_to_keep,
                                   inputs_embeds=inputs_embeds, hidden=hidden, dense=dense, siblings=siblings)

    @property
    def reads_siblings(self) -> bool:
        """Whether ``read`` takes ``siblings`` (``CausalLMRunner.reads_siblings``); a re-reading runner does not."""
        return not self.runner.rereads and self.runner.reads_siblings(self.slots)

    def read_positions(self, state) -> torch.Tensor:
        """[B, n] the buffer position of each column of the last read whose token is now committed,
        -1 for holes and rejected tokens (call after the commit)."""
        committed = self.valid & (self.positions < state.lengths[state.rows][:, None] - 1)
        return torch.where(committed, self.positions, -1)

    def keep(self, state, rows_host: torch.Tensor, kept: torch.Tensor, kept_host: torch.Tensor) -> None:
        """End the round: row b's first ``kept[b]`` speculative tokens read this round are committed
        (device and host copies of the same numbers); the rest leave the cache.

        ``rows_host`` are the original ids of the rows that read this round (the active rows then).
        """
        if not self.reading:
            return  # nothing was read this iteration
        self.fed_host[rows_host] = self._round_start_host + kept_host
        self._round_start_host = self._round_start = None
        if self.slots is None:  # a re-reading runner: nothing is kept but how far the rows are read
            self._spec, self._spec_valid = [], []
            self._speculative_read = 0
            return
        # A plain step read only committed tokens: nothing to drop (recurrent states still close their round).
        if self._speculative_read or self.slots.recurrent is not None:
            kept_list = kept_host.tolist()  # on the host: no tensor op
            most, least = (max(kept_list), min(kept_list)) if kept_list else (0, 0)
            self.slots.drop_tail(self._round_columns, keep_columns=self._catch_up_columns + kept,
                                 common=self._round_columns - self._catch_up_columns - most,
                                 shared=self._catch_up_columns + least)
        self._round_columns = self._catch_up_columns = self._speculative_read = 0
        widest = self._widest(state, rows_host)
        self.slots.maybe_compact(widest)
        physical = self.slots.release_finished(widest)
        if physical is not None:  # finished rows kept in the batch have cost more than moving the others
            self.runner.select_rows(physical)
            state.row_cuts += 1

    def select_rows(self, state, keep: torch.Tensor) -> None:
        """Finished rows leave the batch; ``state.rows_host`` already holds the rows that stay."""
        if self.slots is None:  # a re-reading runner frees the caches of the rows that left
            self.runner.keep_caches(state.rows_host.tolist())
            self.runner.select_rows(keep)
            return
        physical = self.slots.select_rows(keep, widest=self._widest(state, state.rows_host))
        if physical is not None:  # the rows the model sees changed (not at every departure: SlotCache.release_finished)
            self.runner.select_rows(physical)
            state.row_cuts += 1

    def _widest(self, state, rows_host: torch.Tensor) -> int:
        """The most valid slots any of ``rows_host`` holds: committed tokens read, less prompt padding."""
        fed, padding = self.fed_host.tolist(), state.padding_host.tolist()
        return max((fed[row] - padding[row] for row in rows_host.tolist()), default=0)


def static_capacity(state) -> int:
    """Slots a static cache preallocates per row: the prompt's width (as read, in a power-of-two
    block), every new token, one more, and the headroom of holes between compactions; rounded up
    to 64. A wider block than that grows the cache once (``SlotCache.regrowths``)."""
    need = bucket(state.prompt_width) + state.max_new_tokens + 1 + STATIC_HEADROOM
    return -(-need // 64) * 64


def _joined(first, rest, logits_to_keep: int, hidden: bool):
    """Two reads of one round as one: logits (and hidden states) side by side."""
    if not hidden:
        return torch.cat([first, rest], dim=1)[:, -logits_to_keep:]
    return torch.cat([first[0], rest[0]], dim=1)[:, -logits_to_keep:], torch.cat([first[1], rest[1]], dim=1)
