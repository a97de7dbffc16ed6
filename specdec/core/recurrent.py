"""Recurrent states (Mamba, gated delta nets, short convolutions) in a cache with holes.

An attention cache drops a rejected token by hiding its slot; a recurrent state has no slots: once
it has read k drafts it holds all of them. So the states are read one token at a time after the
prompt (transformers' recurrent layers only continue from a state one token at a time anyway), a
checkpoint of every layer's state is kept after each token of the round, and when the verifier has
decided, each row's state is set back to the checkpoint after its last kept token. A row whose
column is a hole in a ragged block keeps the state it had before that column.

The checkpoints of one round cost, per row and per token read, the size of every recurrent and conv
state of the model (``bytes_per_row``); they are freed when the round ends.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionCacheLayerMixin,
)

Snapshot = list[torch.Tensor | None]


def config_cache(model) -> Cache | None:
    """transformers' own cache layout for a model whose layers need more than keys and values
    (recurrent or conv states, sparse-attention indexer keys), with every attention layer keeping
    all its slots: windows are applied by the mask, in positions (a sliding layer that keeps its
    last W slots would drop tokens still inside the window). None for plain attention models, which
    get a lazily built ``DynamicCache()``."""
    try:
        cache = DynamicCache(config=model.config)
    except Exception:  # a config transformers cannot lay a cache out for: the model has its own
        return None
    if all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers):
        return None
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionAndSlidingWindowAttentionLayer):
            cache.layers[i] = LinearAttentionAndFullAttentionLayer(number_of_states=layer.number_of_states)
        elif type(layer) is DynamicSlidingWindowLayer:
            cache.layers[i] = DynamicLayer()
    return cache


class RecurrentStates:
    """The recurrent and conv states of a cache's linear-attention layers, as one list of tensors."""

    def __init__(self, cache: Cache):
        self.layers = [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
        self.checkpoints: list[Snapshot] = []  # one per token read this round, after the round's start

    @property
    def started(self) -> bool:
        """Whether the prompt has been read (states exist; from now on one token at a time)."""
        return any(any(layer.has_previous_state.values()) for layer in self.layers)

    def _slots(self):
        for layer in self.layers:
            for i in range(layer.number_of_states):
                yield layer, "conv_states", i
                yield layer, "recurrent_states", i

    def snapshot(self) -> Snapshot:
        return [None if getattr(layer, name)[i] is None else getattr(layer, name)[i].clone()
                for layer, name, i in self._slots()]

    def _write(self, values: Snapshot) -> None:
        for (layer, name, i), value in zip(self._slots(), values):
            if value is not None:
                getattr(layer, name)[i] = value

    def keep_rows(self, before: Snapshot, advanced: torch.Tensor) -> None:
        """Rows where ``advanced`` ([B] bool) is False go back to ``before`` (their column was a hole)."""
        now = [getattr(layer, name)[i] for layer, name, i in self._slots()]  # read, not copied
        self._write([
            new if old is None else torch.where(advanced.view(-1, *[1] * (new.dim() - 1)), new, old)
            for new, old in zip(now, before)
        ])

    def begin_round(self) -> None:
        # Before the prompt there is no state to go back to (and no row ever keeps less than it).
        self.checkpoints = [self.snapshot() if self.started else None]

    def record(self, columns: int) -> None:
        """``columns`` more tokens were read; the state now is the checkpoint after the last of them."""
        self.checkpoints.extend([None] * (columns - 1))
        self.checkpoints.append(self.snapshot())

    def rewind(self, kept: torch.Tensor) -> None:
        """End the round: row b's state becomes the checkpoint after its first ``kept[b]`` tokens."""
        # Only the end of a block read at once (the prompt) has a checkpoint, and no row keeps part of
        # such a block, so every kept[b] names a checkpoint. The map is built on the host and copied
        # without waiting: no device sync.
        present = [i for i, c in enumerate(self.checkpoints) if c is not None]
        position = torch.zeros(len(self.checkpoints), dtype=torch.long)
        position[present] = torch.arange(len(present))
        index = position.to(kept.device, non_blocking=True)[kept]  # [B]
        rewound = []
        for states in zip(*(self.checkpoints[i] for i in present)):
            if states[0] is None:
                rewound.append(None)
                continue
            stacked = torch.stack(states)  # [C, B, ...]
            rows = torch.arange(stacked.shape[1], device=kept.device)
            rewound.append(stacked[index, rows])
        self._write(rewound)
        self.checkpoints = []

    def select_rows(self, index: torch.Tensor) -> None:
        for layer in self.layers:
            LinearAttentionCacheLayerMixin.reorder_cache(layer, index)

    def bytes_per_row(self) -> int:
        """Memory of one row's states: what each checkpoint costs per row and per token read."""
        return sum(value[0].numel() * value.element_size() for value in self.snapshot() if value is not None)
