"""Attention masks that count windows in positions, not cache slots.

transformers builds sliding-window and chunked masks from cache slot indices, and its sliding-window
cache layers keep only the last W slots. A cache with holes breaks both: rejected slots count
against the window, so a token still inside the window by position is hidden. For models whose
layers attend through a window or in chunks, ``AttentionLayout`` builds the 4D masks itself from
each slot's position (``SlotCache.positions``), one per kind of layer, and hands them to the model
prepared (transformers uses a 4D mask, or a dict of them by layer type, as it is). Full-attention
models keep the 2D slot mask, which is what transformers expects and what the tests prove exact.
"""

from __future__ import annotations

import functools
import inspect
import sys

import attrs
import torch

from ..errors import ConfigError

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
_ATTENTION_KINDS = (FULL, SLIDING, CHUNKED)
# A window that only generate's sliding-window cache applies, by evicting slots, under a full mask
# (Moshi): the prompt, read in one forward, attends fully; every later token sees the last W.
EVICTED = "evicted_window"
# What a modeling module calls when its layers really attend through a window or in chunks; a
# config may carry a sliding_window that its eager and sdpa attention never apply (Moshi).
_BUILDERS = {SLIDING: "create_sliding_window_causal_mask", CHUNKED: "create_chunked_causal_mask"}
_MASK_FORMATS = ("sdpa", "eager")  # implementations that take a prepared 4D mask as it is
# Layer types that read the 2D mask of the block itself (which of its tokens are real), as
# transformers' create_recurrent_attention_mask makes it: recurrent and convolution layers.
_BLOCK_MASK_TYPES = ("linear_attention", "conv")


@attrs.frozen
class AttentionLayout:
    """The kinds of attention a model's layers use (``layer_types``), with the sliding window and the
    chunk size, in positions."""

    kinds: tuple[str, ...]  # the distinct attention kinds among the layers
    others: tuple[str, ...] = ()  # layer types that are not attention (conv, linear_attention, mamba ...)
    sliding_window: int | None = None
    chunk_size: int | None = None
    implementation: str = "sdpa"

    @classmethod
    def of(cls, model) -> AttentionLayout:
        config = model.config.get_text_config(decoder=True)
        window = getattr(config, "sliding_window", None)
        if not isinstance(window, int):
            window = getattr(config, "sliding_window_size", None)
        if getattr(config, "use_sliding_window", True) is False:
            window = None
        chunk = getattr(config, "attention_chunk_size", None)
        layer_types = getattr(config, "layer_types", None)
        others = ()
        if layer_types:
            kinds = tuple(kind for kind in _ATTENTION_KINDS if kind in layer_types)
            others = tuple(sorted(set(layer_types) - set(_ATTENTION_KINDS)))
        elif isinstance(window, int):
            kinds = (SLIDING,)  # one window for every layer (Mistral, Phi-3, Starcoder2, ...)
        else:
            kinds = (FULL,)
        source = _modeling_source(model)
        if source is not None:  # keep only the kinds the model's own code builds masks for
            # A window the code does not build is still applied by generate's cache when transformers
            # lays the model's cache out with sliding-window layers: then it bites after the prompt.
            unbuilt = EVICTED if _generate_cache_evicts(model) else FULL
            kinds = tuple(kind if kind not in _BUILDERS or _BUILDERS[kind] in source else
                          (unbuilt if kind == SLIDING else FULL) for kind in kinds)
            kinds = tuple(dict.fromkeys(kinds))
        implementation = getattr(config, "_attn_implementation", None) or "sdpa"
        return cls(kinds, others, window if isinstance(window, int) else None,
                   chunk if isinstance(chunk, int) else None, implementation)

    @property
    def takes_prepared_masks(self) -> bool:
        """Whether the attention implementation uses a prepared 4D mask as it is (sdpa, eager)."""
        return self.implementation in _MASK_FORMATS

    @property
    def builds_every_mask(self) -> bool:
        """Whether ``masks`` can build what every layer reads: an attention kind of its own, and besides
        those only layers that read the block's 2D mask. Other attention (sparse indexers, hybrid
        layers, ...) is left to transformers, which builds its masks from the 2D slot mask."""
        return bool(self.kinds) and self.takes_prepared_masks and set(self.others) <= set(_BLOCK_MASK_TYPES)

    @property
    def counts_positions(self) -> bool:
        """Whether some layer attends through a window or in chunks (then the loop builds the masks)."""
        return any(kind != FULL for kind in self.kinds)

    def check(self, model) -> None:
        if self.counts_positions and self.implementation not in _MASK_FORMATS:
            raise ConfigError(
                f"{type(model).__name__} uses {' and '.join(self.kinds)} with attn_implementation="
                f"{self.implementation!r}; specdec builds its window masks for 'sdpa' or 'eager': load the model "
                "with attn_implementation='sdpa'"
            )
        if EVICTED in self.kinds and len(self.kinds) > 1:
            raise ConfigError(
                f"{type(model).__name__} applies its sliding window only through generate's evicting cache, under "
                f"one mask for every layer, but its layers are {' and '.join(self.kinds)}: specdec cannot build that mask"
            )
        if (SLIDING in self.kinds or EVICTED in self.kinds) and self.sliding_window is None or \
                CHUNKED in self.kinds and self.chunk_size is None:
            raise ConfigError(f"{type(model).__name__}'s config names {self.kinds} layers but no window or chunk size")

    def masks(
        self,
        slot_mask: torch.Tensor,  # [B, L] bool: which slots hold a token (the new block's included)
        positions: torch.Tensor,  # [B, L] long: each slot's position
        query_positions: torch.Tensor,  # [B, n] long: positions of the block read now
        dtype: torch.dtype,
        first_query_slot: int | None = None,  # the block's first slot; default: the last n slots
        prompt_lengths: torch.Tensor | None = None,  # [B] long: real prompt tokens (EVICTED windows)
        branches: torch.Tensor | None = None,  # [n] long: a token tree's branch of each block column
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The prepared 4D mask ``[B, 1, n, L]`` of each attention kind: a tensor if there is one kind,
        else a dict by layer type. A static cache passes its full capacity as L and the block's
        first slot (columns past the block are empty slots, hidden like holes). With ``branches``
        (-1: the trunk, seen by every column; 0, 1, ...: a branch) a column of the block sees the
        block's trunk and its own branch only: siblings at one position do not see each other."""
        length, n = slot_mask.shape[1], query_positions.shape[1]
        first = length - n if first_query_slot is None else first_query_slot
        if n == 1 and branches is None and self.kinds == (FULL,):
            # One token (a draft step, a plain step): positions count a row's valid slots, so every
            # valid slot's is at most the new token's and the mask is the slot mask itself, with the
            # token's own slot (a hole where the row reads nothing) seeing itself. 2 kernels
            # instead of the general case's 6; on a GPU each is a launch, and a draft of k tokens
            # builds k + 1 masks.
            visible = slot_mask.clone()
            visible.select(1, first).fill_(True)
            visible = visible[:, None, :]  # [B, 1, L]
        else:
            key_pos = positions[:, None, :]  # [B, 1, L]
            query_pos = query_positions[:, :, None]  # [B, n, 1]
            visible = slot_mask[:, None, :] & (key_pos <= query_pos)  # [B, n, L]
            # A query slot that is a hole still sees itself, so no row of the mask is empty (an
            # empty row makes NaNs that the next layer would read from the cache).
            own = torch.arange(first, first + n, device=slot_mask.device)
            if branches is not None:
                key_branch = torch.full((length,), -1, dtype=torch.long, device=slot_mask.device)
                key_branch[first : first + n] = branches
                visible = visible & ((key_branch[None, :] == -1) | (key_branch[None, :] == branches[:, None]))[None]
            # An elementwise or, not ``visible[:, arange(n), own] = True``: that index_put syncs the
            # device (the H200 run's sync_sites.py found it, once per forward).
            visible = visible | (torch.arange(length, device=slot_mask.device) == own[:, None])[None]
        masks = {}
        for kind in self.kinds:
            seen = visible
            if kind == SLIDING:
                seen = visible & (query_pos - key_pos < self.sliding_window)
            elif kind == CHUNKED:
                seen = visible & (key_pos // self.chunk_size == query_pos // self.chunk_size)
            elif kind == EVICTED:  # generate reads the prompt in one forward, with every slot still there
                in_prompt = query_pos < prompt_lengths[:, None, None]
                seen = visible & (in_prompt | (query_pos - key_pos < self.sliding_window))
            seen = seen[:, None]  # [B, 1, n, L]
            if self.implementation == "eager":
                seen = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, torch.finfo(dtype).min)
            masks[kind] = seen
        # Recurrent and conv layers read the 2D mask of the block itself (transformers'
        # create_recurrent_attention_mask): which of its tokens are real; none for one token.
        for kind in self.others:
            masks[kind] = slot_mask[:, first : first + n].long() if n > 1 else None
        return masks[self.kinds[0]] if len(masks) == 1 else masks


def _generate_cache_evicts(model) -> bool:
    """Whether the cache generate lays out for the model has sliding-window (evicting) layers."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    try:
        layers = DynamicCache(config=model.config).layers
    except Exception:  # a config transformers cannot lay a cache out for: it has its own
        return False
    return any(type(layer) is DynamicSlidingWindowLayer for layer in layers)


def _modeling_source(model) -> str | None:
    """The source of the module that defines the model's classes, or None when it cannot be read."""
    return _module_source(type(model).__module__)


@functools.cache
def _module_source(name: str) -> str | None:
    # Read once per process: a draft model's runner is built for every request.
    try:
        return inspect.getsource(sys.modules[name])
    except (OSError, TypeError, KeyError):
        return None
