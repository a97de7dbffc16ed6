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

**Static shapes** (``capacity`` given; ``SpeculativeDecoder(static_cache=True)``): every attention
layer is a transformers ``StaticLayer`` preallocated to ``capacity`` slots, written in place at the
next free column (all rows share the column, which is what keeps the cache rectangular), and the
slot mask and positions are preallocated alike, so a model sees the same shapes every step: the
full-capacity mask ``[P, capacity]`` and a block ``[P, n]``. Compaction is a gather in place
(valid slots to the left, the write column moved back) when fewer than ``headroom`` columns are
free. Rows that finish stay in the physical batch of ``P`` rows, fed holes, until the active rows
fit a smaller power of two; only then is the cache cut to that bucket (``row_map`` maps active
rows to physical ones).

**Rows leave an encoder-decoder batch lazily.** A row that leaves the batch means copying every
row that stays out of every layer's tensors (``index_select``), and with cross-attention that is the
encoder's keys and values: 37 MB per row for whisper-base in float32, whatever the row decoded. A
finished row kept in the batch instead costs one row's share of each forward. So a finished row
stays (fed holes, its outputs dropped) until the forwards spent on finished rows since the last cut
add up to ``KEEP_FINISHED_READS`` times the rows a cut would copy (the ski-rental rule: at most about
twice the cheaper of the two), and then the batch is cut to its active rows. Measured on a 2-core
CPU with whisper-base and its draft (docs/whisper.md): a cut copied 21 ms per staying row, and a row's
share of a plain step at batch 16 was 6.6 ms, hence 4. Transformers' ``generate`` never cuts; cutting
at every departure cost a Whisper batch of 16 about 6% of its time. A decoder-only model's per-row
cache is its own tokens' keys and values, cheap to copy next to a row's forward: its rows leave at
once, as do recurrent states.

Why not transformers' ``StaticCache`` as it is: its sliding-window layers
evict slots (the window is counted in positions here, by the mask), and it would not know about
holes; its ``StaticLayer`` is exactly the preallocated, index-written tensor pair wanted.
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import Cache, DynamicLayer, EncoderDecoderCache, LinearAttentionCacheLayerMixin, StaticLayer

from .recurrent import RecurrentStates


# A finished row stays in an encoder-decoder batch until finished rows have been read this many times
# per row a cut would copy (the module's docstring).
KEEP_FINISHED_READS = 4


def bucket(n: int) -> int:
    """The power of two at or above ``n`` (0 for 0): the widths and batch sizes static shapes use."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A static layer's whole key or value tensor, of which a cut batch reads its first rows."""
    return tensor if tensor._base is None else tensor._base


def static_cache(layers: int, capacity: int, device: torch.device) -> Cache:
    """A cache of ``layers`` full-attention ``StaticLayer``s of ``capacity`` slots each, for ``device``.

    Each layer's write offset starts on ``device``: a ``StaticLayer`` makes it on the CPU and moves it
    at its first write, a blocking host-to-device copy (a sync) per layer inside the first forward."""
    cache = Cache(layers=[StaticLayer(max_cache_len=capacity) for _ in range(layers)])
    for layer in cache.layers:
        layer.cumulative_length = torch.zeros((), dtype=layer.cumulative_length.dtype, device=device)
    return cache


# The most columns a GrowingLayer adds when it fills (half its length below that).
GROWTH_LIMIT = 1024


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends in place: its keys and values are views of the first columns
    of a larger tensor, reallocated when it fills with half its length again as room (at most
    ``GROWTH_LIMIT`` columns, so that a long prompt's cache holds little unused memory). A token is
    copied a few times in all while the cache is short, and past that the cache once per
    ``GROWTH_LIMIT`` new tokens. transformers' ``DynamicLayer`` concatenates the whole cache with
    every step's new tokens, a copy of every cached key and value per step: on the project's Xeon
    that was 6 of a batch-16 plain step's 45 ms on the bundled pair (``docs/benchmarks.md``, stop
    38). Whoever cuts the views (``SlotCache._cut``, ``crop``) keeps the tensor; whoever replaces
    them (compaction, ``_columns``) hands the next ``update`` a tensor of its own, which it copies into
    a new one. Used by every dynamic ``SlotCache`` for its plain attention layers; ``generate`` keeps
    transformers' own."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._whole_keys = self._whole_values = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._whole_keys, self.keys = _append_in_place(self._whole_keys, self.keys, key_states)
        self._whole_values, self.values = _append_in_place(self._whole_values, self.values, value_states)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """The kept rows, gathered straight into the first columns of new whole tensors: one copy of
        the columns in use, where ``DynamicLayer``'s ``keys[indices]`` is an advanced-indexing gather
        that the next ``update`` would copy again (at batch 16 on the bundled pair, one layer's
        tensor took 0.34 ms so, 0.70 ms by ``keys[indices]``)."""
        if self.get_seq_length() == 0 or not (_views_of(self._whole_keys, self.keys)
                                              and _views_of(self._whole_values, self.values)):
            super().batch_select_indices(indices)
            return
        length = self.keys.shape[2]
        for name in ("keys", "values"):
            whole = getattr(self, f"_whole_{name}")
            kept = whole.new_empty(indices.shape[0], *whole.shape[1:])
            torch.index_select(getattr(self, name), 0, indices, out=kept[:, :, :length])
            setattr(self, f"_whole_{name}", kept)
            setattr(self, name, kept[:, :, :length])


def _views_of(whole: torch.Tensor | None, held: torch.Tensor) -> bool:
    """Whether ``held`` is the first columns of ``whole`` (what ``GrowingLayer`` hands out, or a cut of it)."""
    return (whole is not None and held.dim() == 4 and held.data_ptr() == whole.data_ptr()
            and held.stride() == whole.stride() and held.shape[:2] == whole.shape[:2]
            and held.shape[3] == whole.shape[3] and held.dtype == whole.dtype)


def _append_in_place(whole: torch.Tensor | None, held: torch.Tensor, new: torch.Tensor):
    """``new`` [B, H, n, D] written after ``held``'s columns: returns the whole tensor and the view of it
    that holds both."""
    length = held.shape[2] if held.dim() == 4 else 0  # a fresh layer holds a 1-D empty tensor
    end = length + new.shape[2]
    if not _views_of(whole, held) or end > whole.shape[2]:
        grown = new.new_empty(*new.shape[:2], end + min(max(end // 2, 16), GROWTH_LIMIT), new.shape[3])
        if length:
            grown[:, :, :length].copy_(held)
        whole = grown
    whole[:, :, length:end].copy_(new)
    return whole, whole[:, :, :end]


def grow_in_place(cache: Cache) -> Cache:
    """``cache`` with its plain attention layers (made now or, in a lazily built cache, later) growing
    in place (``GrowingLayer``); layers of other kinds, and the cross-attention of an encoder-decoder
    cache, as they are."""
    for part in (cache.self_attention_cache,) if isinstance(cache, EncoderDecoderCache) else (cache,):
        if getattr(part, "layer_class_to_replicate", None) is DynamicLayer:
            part.layer_class_to_replicate = GrowingLayer
        for i, layer in enumerate(getattr(part, "layers", [])):
            if type(layer) is DynamicLayer and not layer.is_initialized:
                part.layers[i] = GrowingLayer()
    return cache


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

    def __init__(self, cache: Cache, batch_size: int, device: torch.device, capacity: int | None = None,
                 headroom: int = 64):
        self.cache = cache if capacity is not None else grow_in_place(cache)
        self.capacity = capacity  # None: dynamic (the cache grows in place, GrowingLayer)
        self.headroom = headroom
        self._used = 0  # static: the next free column, the same for every row
        self.regrowths = 0
        self.cuts = 0  # drop_tail calls that cut columns off instead of leaving holes
        # Recurrent layers' states, rewound to each row's last kept token (core/recurrent.py).
        layers = _self_attention_layers(cache)
        recurrent = any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in layers)
        self.recurrent = RecurrentStates(cache) if recurrent else None
        # A model without attention layers (Mamba) reads the mask as "which tokens of this block are
        # real", not "which slots may be attended".
        self.attends = not recurrent or any(isinstance(layer, DynamicLayer) for layer in layers)
        # Active row b lives in physical row row_map[b]: finished rows stay a while in a static or an
        # encoder-decoder cache (the module's docstring); None where rows leave at once.
        lazy = capacity is not None or (isinstance(cache, EncoderDecoderCache) and not recurrent)
        self.row_map = torch.arange(batch_size, device=device) if lazy else None
        self.idle_reads = 0  # forwards' rows spent on finished rows since the batch was last cut
        self.row_cuts = 0  # times a lazy batch was cut to its active rows (copies of every row's tensors)
        self.slot_mask = torch.zeros(batch_size, capacity or 0, dtype=torch.bool, device=device)
        self.positions = torch.zeros(batch_size, capacity or 0, dtype=torch.long, device=device)
        self.n_valid = torch.zeros(batch_size, dtype=torch.long, device=device)
        # Each row's real prompt tokens (a window that bites only after the prompt, core/masks.py).
        self.prompt_lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.compactions = 0
        self._row_map_identity = True
        # Whether a slot may be a hole, as known on the host: False until a block that may hold one
        # is read or drafts are rejected into holes (a lone row's rejected drafts are cut off instead).
        self.holes = False
        # Encoder frames its cross-attention reads, where narrowed to fewer than the encoder output
        # has (narrow_cross_attention); None: all of them.
        self.cross_frames: int | None = None

    @property
    def static(self) -> bool:
        return self.capacity is not None

    @property
    def length(self) -> int:
        """Columns in use (static: the next free column)."""
        return self._used if self.static else self.slot_mask.shape[1]

    @property
    def physical_batch(self) -> int:
        """Rows the model sees: the active rows, or (static) their power-of-two bucket."""
        return self.slot_mask.shape[0]

    def to_physical(self, rows: torch.Tensor, fill=0) -> torch.Tensor:
        """Active rows' ``[B, ...]`` values placed in their physical rows of a ``[P, ...]`` tensor;
        rows that finished get ``fill``. Dynamic caches have no other rows: returned as they are."""
        if self.row_map is None or (rows.shape[0] == self.physical_batch and self._identity):
            return rows
        out = rows.new_full((self.physical_batch, *rows.shape[1:]), fill)
        return out.index_copy_(0, self.row_map, rows)

    def to_active(self, rows: torch.Tensor) -> torch.Tensor:
        """The active rows of a ``[P, ...]`` model output."""
        if self.row_map is None or (rows.shape[0] == self.row_map.shape[0] and self._identity):
            return rows
        return rows.index_select(0, self.row_map)

    def extend(self, valid: torch.Tensor, dense: bool = False, siblings: tuple[int, int] | None = None) -> torch.Tensor:
        """Reserve slots for a block of new tokens; return its ``position_ids`` ``[B, n]`` (the
        attention mask is ``slot_mask``, with the new slots in it).

        ``valid`` is ``[B, n]`` bool: False columns are holes from the start (padding in a ragged
        block). ``dense`` says, from what the caller knows on the host, that every column is valid:
        the block then needs no scan, and a cache that has never held a hole stays known to hold
        none (``holes``), which lets one-token steps go without a mask and without asking the device.
        ``siblings`` ``(first, count)``: the last ``count`` columns are alternatives to column
        ``first`` and take its position (a token tree's siblings; their own mask keeps them apart).
        """
        if siblings is not None:
            first, count = siblings
            position_ids = self.extend(valid, False)
            position_ids[:, -count:] = (self.n_valid - valid.sum(1) + valid[:, :first].sum(1))[:, None]
            self.positions[:, -count:] = position_ids[:, -count:]
            return position_ids
        if self.row_map is not None:
            self.idle_reads += self.physical_batch - self.row_map.shape[0]
        n = valid.shape[1]
        if dense and not self.static:
            position_ids = self.n_valid[:, None]  # [B, n]
            if n > 1:
                position_ids = position_ids + torch.arange(n, device=self.n_valid.device)
            self.n_valid = self.n_valid + n
            self.slot_mask = torch.nn.functional.pad(self.slot_mask, (0, n), value=True)
            self.positions = torch.cat([self.positions, position_ids], dim=1)
            return position_ids
        self.holes = True  # the block may hold some; nobody asks the device which
        # Holes get the position of the valid token before them; they are masked, so it only has
        # to be a legal index.
        position_ids = (self.n_valid[:, None] + valid.cumsum(1) - 1).clamp_(min=0)  # [B, n]
        self.n_valid = self.n_valid + valid.sum(1)
        if self.static:
            start = self._used
            if start + n > self.capacity:
                self._grow(start + n)
            self.slot_mask[:, start : start + n] = valid  # [P, capacity]: written in place
            self.positions[:, start : start + n] = position_ids
            self._used = start + n
            return position_ids
        self.slot_mask = torch.cat([self.slot_mask, valid], dim=1)  # [B, L + n]
        self.positions = torch.cat([self.positions, position_ids], dim=1)  # [B, L + n]
        return position_ids

    def _grow(self, needed: int) -> None:
        """A block wider than the free columns (compaction runs between rounds and keeps ``headroom``
        free, so only a lookahead wider than that gets here): reallocate every static tensor larger,
        a one-off change of shape (counted in ``regrowths``)."""
        capacity = -(-(needed + self.headroom) // 64) * 64
        extra = capacity - self.capacity
        self.slot_mask = torch.cat([self.slot_mask, self.slot_mask.new_zeros(self.slot_mask.shape[0], extra)], dim=1)
        self.positions = torch.cat([self.positions, self.positions.new_zeros(self.positions.shape[0], extra)], dim=1)
        for layer in _self_attention_layers(self.cache):
            layer.max_cache_len = capacity
            if getattr(layer, "is_initialized", False):
                for name in ("keys", "values"):
                    old = getattr(layer, name)
                    grown = torch.cat([old, old.new_zeros(*old.shape[:2], extra, old.shape[3])], dim=2)
                    torch._dynamo.mark_static_address(grown)
                    setattr(layer, name, grown)
        self.capacity = capacity
        self.regrowths += 1

    def drop_tail(self, n: int, keep_columns: torch.Tensor, widest: int | None = None, common: int = 0,
                  shared: int = 0) -> None:
        """Of the last ``n`` slots, turn every column from ``keep_columns[b]`` on into a hole.

        ``widest``, when given, is the largest number of valid slots any row holds afterwards, as
        the caller knows it on the host; it decides whether to compact. ``common`` (host int) is how
        many of the last columns every row drops (``n`` less the largest ``keep_columns``): a
        dynamic cache cuts them off instead of keeping them as holes, so that a batch of one never
        holds a hole and its one-token steps need no mask. ``shared`` (host int) is how many of the
        first columns every row keeps (the smallest ``keep_columns``): when that is all that is left
        after the cut, no row has anything to drop.
        """
        if n == 0:
            return
        if common > 0 and self._can_cut():
            self._cut(common)
            n -= common
        if n > shared or n > 0 and self.recurrent is not None:  # recurrent states rewind even so
            self._mark_holes(n, keep_columns)
        if widest is not None:
            self.maybe_compact(widest)

    def _mark_holes(self, n: int, keep_columns: torch.Tensor) -> None:
        self.holes = True
        if self.recurrent is not None:
            self.recurrent.rewind(keep_columns)
        keep_columns = self.to_physical(keep_columns)  # finished rows keep nothing new
        end = self.length
        tail = self.slot_mask[:, end - n : end]  # [B, n]
        kept = torch.arange(n, device=tail.device)[None, :] < keep_columns[:, None]
        self.n_valid = self.n_valid - (tail & ~kept).sum(1)
        if self.static:
            self.slot_mask[:, end - n : end] = tail & kept
        else:
            self.slot_mask = torch.cat([self.slot_mask[:, :-n], tail & kept], dim=1)

    def _can_cut(self) -> bool:
        """Whether the last columns can be cut off every layer: a dynamic cache whose self-attention
        layers are plain ones holding one column per slot (a sliding-window layer that has let old
        tokens go, recurrent states and sparse-attention indexers are left to the hole path)."""
        if self.static or self.recurrent is not None:
            return False
        for layer in _self_attention_layers(self.cache):
            if type(layer) not in (DynamicLayer, GrowingLayer) or getattr(layer, "indexer_keys", None) is not None:
                return False
            if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.shape[2] != self.length:
                return False
        return True

    def _cut(self, m: int) -> None:
        """Drop the last ``m`` columns of every row (they are being dropped from every row anyway)."""
        tail = self.slot_mask[:, -m:]
        self.n_valid = self.n_valid - tail.sum(1)
        self.slot_mask = self.slot_mask[:, :-m]
        self.positions = self.positions[:, :-m]
        for layer in _self_attention_layers(self.cache):
            if getattr(layer, "is_initialized", False) and layer.keys is not None:
                layer.keys = layer.keys[:, :, :-m]
                layer.values = layer.values[:, :, :-m]
        self.cuts += 1

    @property
    def _identity(self) -> bool:
        return self._row_map_identity

    def select_rows(self, index: torch.Tensor, widest: int) -> torch.Tensor | None:
        """Keep only the active rows in ``index`` (finished rows leave the batch). Returns the
        physical rows kept, for whoever keeps per-row model inputs (encoder outputs), or None when
        the physical batch did not change (finished rows stay a while: the module's docstring)."""
        if self.row_map is None:
            self._select_physical(index)
            self.maybe_compact(widest)
            return index
        self.row_map, self._row_map_identity = self.row_map[index], False
        return self.release_finished(widest)

    def release_finished(self, widest: int) -> torch.Tensor | None:
        """Cut the physical batch to the active rows if it is time (static: when they fit a smaller
        bucket; dynamic: when the forwards spent on finished rows outweigh a copy of the active ones).
        Returns the physical rows kept, or None when nothing changed. Host numbers only: no sync."""
        if self.row_map is None:
            return None
        active, physical = self.row_map.shape[0], self.physical_batch
        if self.static:
            size = bucket(active)
            if size >= physical:  # the rows still need this batch (a request of 6 rows is a bucket of its own)
                return None
            # The active rows first, in order, then finished ones to fill the bucket (a stable sort
            # of "finished?" lists them; no nonzero, so no device sync).
            finished = torch.ones(physical, dtype=torch.bool, device=self.row_map.device).index_fill_(0, self.row_map, False)
            fillers = finished.long().argsort(stable=True)[active:size]
            index = torch.cat([self.row_map, fillers])
        else:
            if active == physical or self.idle_reads < KEEP_FINISHED_READS * active:
                return None
            index = self.row_map
        self.row_map, self._row_map_identity = torch.arange(active, device=index.device), True
        self.idle_reads = 0
        self.row_cuts += 1
        self._select_physical(index)
        self.maybe_compact(widest)
        return index

    def _select_physical(self, index: torch.Tensor) -> None:
        for layer in _self_attention_layers(self.cache):
            if isinstance(layer, DynamicLayer):  # the attention part of a hybrid layer too
                layer.batch_select_indices(index)
            elif isinstance(layer, StaticLayer) and getattr(layer, "is_initialized", False):
                # The kept rows are gathered into the first rows of the request's own tensors, and the
                # layer reads a view of them: every bucket's cache starts at the address of the
                # first, so compiled steps' CUDA graphs, captured per bucket, replay in the next
                # request (which gets the whole tensors back: CausalLMRunner.new_cache).
                for name in ("keys", "values"):
                    tensor = getattr(layer, name)
                    whole = full_tensor(tensor)
                    whole[: index.shape[0]].copy_(tensor.index_select(0, index))
                    setattr(layer, name, whole[: index.shape[0]])
                    torch._dynamo.mark_static_address(getattr(layer, name))
        if isinstance(self.cache, EncoderDecoderCache):
            self.cache.cross_attention_cache.batch_select_indices(index)
        if self.recurrent is not None:
            self.recurrent.select_rows(index)
        self.slot_mask = self.slot_mask[index]
        self.positions = self.positions[index]
        self.n_valid = self.n_valid[index]
        self.prompt_lengths = self.prompt_lengths[index]

    def maybe_compact(self, widest: int) -> None:
        if self.static:
            # Fewer than `headroom` free columns: gather the valid slots back to the left.
            if self._used + self.headroom > self.capacity and self._used > widest:
                self.compact(widest)
            return
        # Holes dominate: the cache is at least twice as long as its fullest row needs.
        if self.length >= 16 and self.length - widest >= widest:
            self.compact(widest)

    def _columns_aligned(self) -> bool:
        """Whether every self-attention layer that holds keys holds one column per slot, as
        ``compact``'s row numbers assume (a sliding-window layer that has let old tokens go does not:
        its holes stay, which only costs time)."""
        for layer in _self_attention_layers(self.cache):
            keys = getattr(layer, "keys", None) if getattr(layer, "is_initialized", False) else None
            if isinstance(layer, DynamicLayer) and isinstance(keys, torch.Tensor) and keys.dim() == 4 \
                    and keys.shape[2] not in (0, self.length):
                return False
        return True

    def compact(self, width: int) -> None:
        """Gather every row's valid slots to the right end of a cache ``width`` slots long (static:
        of its first ``width`` columns, in place, and write from there on)."""
        if self.static:
            self._compact_in_place(width)
            return
        if not self._columns_aligned():
            return
        length = self.length
        # Sort key puts holes first and valid slots after them, each group in slot order, so the
        # last `width` columns of the order are exactly the valid slots (left-padded by holes).
        positions = torch.arange(length, device=self.slot_mask.device)
        key = self.slot_mask.long() * length + positions[None, :]
        order = key.argsort(dim=1)[:, length - width :]  # [B, width]
        rows = {}  # _columns' row numbers per layout: the layers of a cache share one or two
        self.slot_mask = self.slot_mask.gather(1, order)
        self.positions = self.positions.gather(1, order)
        for layer in _self_attention_layers(self.cache):
            if not isinstance(layer, DynamicLayer) or not getattr(layer, "is_initialized", False):
                continue
            if layer.keys is None or layer.keys.numel() == 0:
                continue
            layer.keys, layer.values = _columns(layer.keys, order, rows), _columns(layer.values, order, rows)
            indexer_keys = getattr(layer, "indexer_keys", None)  # sparse attention's indexer (DSA)
            if isinstance(indexer_keys, torch.Tensor) and indexer_keys.dim() == 3 and indexer_keys.shape[1] == length:
                layer.indexer_keys = indexer_keys.gather(1, order[:, :, None].expand(-1, -1, indexer_keys.shape[-1]))
        self.compactions += 1

    def _compact_in_place(self, width: int) -> None:
        used = self._used
        positions = torch.arange(used, device=self.slot_mask.device)
        key = self.slot_mask[:, :used].long() * used + positions[None, :]
        order = key.argsort(dim=1)[:, used - width :]  # [P, width]: each row's last valid slots, in order
        self.slot_mask[:, :width] = self.slot_mask[:, :used].gather(1, order)
        self.slot_mask[:, width:] = False
        self.positions[:, :width] = self.positions[:, :used].gather(1, order)
        for layer in _self_attention_layers(self.cache):
            if not getattr(layer, "is_initialized", False):
                continue
            for name in ("keys", "values"):
                tensor = getattr(layer, name)
                index = order[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[-1])
                tensor[:, :, :width] = tensor[:, :, :used].gather(2, index)  # in place: the address stays
            layer.cumulative_length.fill_(width)
        self._used = width
        self.compactions += 1


def _columns(tensor: torch.Tensor, order: torch.Tensor, rows: dict) -> torch.Tensor:
    """``tensor`` [B, H, L, D] with, per row b, the columns ``order[b]`` [W]: [B, H, W, D]. One
    ``index_select`` of whole D-wide rows over the tensor's memory seen as rows of D: on the
    project's Xeon 0.8 ms for a batch-16 layer's keys, where ``gather`` along the columns (an index
    per element) took 2.6. A ``GrowingLayer``'s keys are the first columns of a longer tensor: the
    row numbers step over its unused columns rather than copying the view first. ``rows`` keeps the
    row numbers per layout, for the next layer."""
    batch, heads, length, width = tensor.shape
    stride = tensor.stride()
    if stride[3] != 1 or stride[2] != width or stride[1] % width or stride[0] % width:
        tensor = tensor.contiguous()
        stride = tensor.stride()
    per_row, per_head = stride[0] // width, stride[1] // width
    layout = (batch, heads, per_row, per_head)
    if layout not in rows:
        rows[layout] = (torch.arange(batch, device=tensor.device).view(batch, 1, 1) * per_row
                        + torch.arange(heads, device=tensor.device).view(1, heads, 1) * per_head
                        + order[:, None, :]).reshape(-1)
    memory = tensor.as_strided(((batch - 1) * per_row + (heads - 1) * per_head + length, width), (width, 1))
    return memory.index_select(0, rows[layout]).view(batch, heads, order.shape[1], width)


def share_cross_attention(a: SlotCache, b: SlotCache, layers: list[tuple[int, int]]) -> int:
    """Let two encoder-decoder caches of one request share cross-attention keys and values.

    ``layers``: pairs (layer of ``a``, layer of ``b``) whose cross-attention projections are equal
    and that read the same encoder output, so their keys and values are the same tensors: whichever
    cache has computed a pair's layer lends it to the other (the tensors are shared, not copied; a
    later cut of either cache indexes them into new ones). Only while both caches still hold every
    row of the request in its original order (no cut yet). Returns how many layers were lent.
    """
    if a.row_map is None or b.row_map is None or a.row_cuts or b.row_cuts or a.physical_batch != b.physical_batch:
        return 0
    if not (isinstance(a.cache, EncoderDecoderCache) and isinstance(b.cache, EncoderDecoderCache)):
        return 0
    lent = 0
    for i, j in layers:
        if a.cache.is_updated.get(i) and not b.cache.is_updated.get(j) and a.cross_frames is None:
            _lend(a.cache, i, b.cache, j)
            lent += 1
        elif b.cache.is_updated.get(j) and not a.cache.is_updated.get(i) and b.cross_frames is None:
            _lend(b.cache, j, a.cache, i)
            lent += 1
    return lent


def narrow_cross_attention(slots: SlotCache, frames: int) -> None:
    """Let an encoder-decoder cache's cross-attention read only the first ``frames`` encoder frames
    from now on: its keys and values become views of their first ``frames`` (nothing is copied; a
    later cut indexes the views into smaller tensors). A narrowed cache lends none of its layers
    (``share_cross_attention``): the other model reads every frame."""
    if not isinstance(slots.cache, EncoderDecoderCache):
        return
    narrowed = False
    for layer in slots.cache.cross_attention_cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys.shape[-2] > frames:
            layer.keys, layer.values = layer.keys[..., :frames, :], layer.values[..., :frames, :]
            narrowed = True
    if narrowed:
        slots.cross_frames = frames


def _lend(source: EncoderDecoderCache, i: int, dest: EncoderDecoderCache, j: int) -> None:
    given = source.cross_attention_cache.layers[i]
    layers = dest.cross_attention_cache.layers
    while len(layers) <= j:
        layers.append(DynamicLayer())
    layer = layers[j]
    layer.dtype, layer.device = given.keys.dtype, given.keys.device
    layer.keys, layer.values, layer.is_initialized = given.keys, given.values, True
    dest.is_updated[j] = True


@functools.lru_cache(maxsize=256)
def empty_block(batch: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A ``[batch, 0]`` block: the speculative tokens of a plain step, the input ids that row-wise
    processors do not read. Shared, as it holds nothing to change: on a small model each tensor op
    of a plain step costs about 1/2000 of it."""
    return torch.zeros(batch, 0, dtype=dtype, device=device)


@functools.lru_cache(maxsize=256)
def dense_block(batch: int, width: int, device: torch.device) -> torch.Tensor:
    """``[batch, width]`` all true: the ``valid`` of a block without holes (each draft step's token,
    a full draft). Shared, like ``empty_block``: nobody writes into a read's ``valid``."""
    return torch.ones(batch, width, dtype=torch.bool, device=device)
