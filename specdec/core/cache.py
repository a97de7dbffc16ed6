"""A rectangular KV cache whose rows may hold holes.

Rows of a speculative batch accept different numbers of drafted tokens. Rather than cropping the
whole batch to the shortest acceptance, or realigning every row each step, rejected slots stay in
the cache as *holes*: the 2D attention mask hides them and position ids count only valid slots,
which gives the same logits as the compact sequence (tests/test_cache.py checks it to 1e-12 in
float64 for Llama and GPT-2; the exactness tests cover every model family in tests/architectures.py).
Each slot also remembers its position, from which windowed and chunked attention masks are built
(core/masks.py). When holes dominate, `compact` gathers each row's valid slots to the
right and drops the columns nobody needs.

Decisions about shapes (when to compact) need the row lengths on the host; the caller passes them
in from numbers it has already synced, so the cache itself never forces a device sync.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer, EncoderDecoderCache, LinearAttentionCacheLayerMixin

from .recurrent import RecurrentStates


def _self_attention_layers(cache: Cache) -> list:
    # An encoder-decoder cache keeps the cross-attention cache apart: its length is the encoder's,
    # it never holds holes and it is never compacted.
    if isinstance(cache, EncoderDecoderCache):
        cache = cache.self_attention_cache
    return list(cache.layers)


class SlotCache:
    """A transformers ``Cache`` plus the per-row bookkeeping of which slots are valid.

    ``slot_mask[b, j]`` says whether slot j of row b holds a token of that row's sequence and
    ``positions[b, j]`` is that token's position; ``n_valid[b]`` is how many slots are valid, which
    is also the position id of the row's next token.
    """

    def __init__(self, cache: Cache, batch_size: int, device: torch.device):
        self.cache = cache
        # Recurrent layers' states, rewound to each row's last kept token (core/recurrent.py).
        layers = _self_attention_layers(cache)
        recurrent = any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in layers)
        self.recurrent = RecurrentStates(cache) if recurrent else None
        # A model without attention layers (Mamba) reads the mask as "which tokens of this block are
        # real", not "which slots may be attended".
        self.attends = not recurrent or any(isinstance(layer, DynamicLayer) for layer in layers)
        self.slot_mask = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)
        self.positions = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
        self.n_valid = torch.zeros(batch_size, dtype=torch.long, device=device)
        # Each row's real prompt tokens (a window that bites only after the prompt, core/masks.py).
        self.prompt_lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.compactions = 0

    @property
    def length(self) -> int:
        return self.slot_mask.shape[1]

    def extend(self, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reserve slots for a block of new tokens; return ``(attention_mask, position_ids)`` for it.

        ``valid`` is ``[B, n]`` bool: False columns are holes from the start (padding in a ragged
        block).
        """
        # Holes get the position of the valid token before them; they are masked, so it only has
        # to be a legal index.
        position_ids = (self.n_valid[:, None] + valid.cumsum(1) - 1).clamp_(min=0)  # [B, n]
        self.slot_mask = torch.cat([self.slot_mask, valid], dim=1)  # [B, L + n]
        self.positions = torch.cat([self.positions, position_ids], dim=1)  # [B, L + n]
        self.n_valid = self.n_valid + valid.sum(1)
        return self.slot_mask.long(), position_ids

    def drop_tail(self, n: int, keep_columns: torch.Tensor, widest: int | None = None) -> None:
        """Of the last ``n`` slots, turn every column from ``keep_columns[b]`` on into a hole.

        ``widest``, when given, is the largest number of valid slots any row holds afterwards, as
        the caller knows it on the host; it decides whether to compact.
        """
        if n == 0:
            return
        if self.recurrent is not None:
            self.recurrent.rewind(keep_columns)
        tail = self.slot_mask[:, -n:]  # [B, n]
        kept = torch.arange(n, device=tail.device)[None, :] < keep_columns[:, None]
        self.n_valid = self.n_valid - (tail & ~kept).sum(1)
        self.slot_mask = torch.cat([self.slot_mask[:, :-n], tail & kept], dim=1)
        if widest is not None:
            self.maybe_compact(widest)

    def select_rows(self, index: torch.Tensor, widest: int) -> None:
        """Keep only the rows in ``index`` (finished rows leave the batch)."""
        for layer in _self_attention_layers(self.cache):
            if isinstance(layer, DynamicLayer):  # the attention part of a hybrid layer too
                layer.batch_select_indices(index)
        if isinstance(self.cache, EncoderDecoderCache):
            self.cache.cross_attention_cache.batch_select_indices(index)
        if self.recurrent is not None:
            self.recurrent.select_rows(index)
        self.slot_mask = self.slot_mask[index]
        self.positions = self.positions[index]
        self.n_valid = self.n_valid[index]
        self.prompt_lengths = self.prompt_lengths[index]
        self.maybe_compact(widest)

    def maybe_compact(self, widest: int) -> None:
        # Holes dominate: the cache is at least twice as long as its fullest row needs.
        if self.length >= 16 and self.length - widest >= widest:
            self.compact(widest)

    def compact(self, width: int) -> None:
        """Gather every row's valid slots to the right end of a cache ``width`` slots long."""
        length = self.length
        # Sort key puts holes first and valid slots after them, each group in slot order, so the
        # last `width` columns of the order are exactly the valid slots (left-padded by holes).
        positions = torch.arange(length, device=self.slot_mask.device)
        key = self.slot_mask.long() * length + positions[None, :]
        order = key.argsort(dim=1)[:, length - width :]  # [B, width]
        self.slot_mask = self.slot_mask.gather(1, order)
        self.positions = self.positions.gather(1, order)
        for layer in _self_attention_layers(self.cache):
            if not isinstance(layer, DynamicLayer) or not getattr(layer, "is_initialized", False):
                continue
            if layer.keys is None or layer.keys.numel() == 0:
                continue
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, index)
            index = order[:, None, :, None].expand(-1, layer.values.shape[1], -1, layer.values.shape[-1])
            layer.values = layer.values.gather(2, index)
            indexer_keys = getattr(layer, "indexer_keys", None)  # sparse attention's indexer (DSA)
            if isinstance(indexer_keys, torch.Tensor) and indexer_keys.dim() == 3 and indexer_keys.shape[1] == length:
                layer.indexer_keys = indexer_keys.gather(1, order[:, :, None].expand(-1, -1, indexer_keys.shape[-1]))
        self.compactions += 1
