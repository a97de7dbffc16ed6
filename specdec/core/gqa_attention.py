"""A verify's grouped-query attention without copying the keys and values once per query group.

Most current LMs share each key/value head among several query heads (grouped-query attention:
SmolLM2-135M has 9 query heads on 3 key/value heads; Llama 3, Qwen, Mistral alike). Transformers'
``sdpa`` attention hands the grouping to ``scaled_dot_product_attention(enable_gqa=True)`` only where
no mask is given (a batch of one, one token a step: ``generate``'s steps), and reads a single query
token with a mask by folding the groups into the query; every other call, a block of several tokens
with a mask, first copies each key and value head once per group (``repeat_kv``). A speculative
verify is such a call, and the copy is of the whole cache: on the project's Xeon SmolLM2's 3-token
verify spent 9.2 ms of its 74 ms in those copies (60 of them, 150 us each over a 250-token context),
where ``generate``'s step spends none.

``gqa_steps(model)`` makes, for the forwards inside it, the model's attention layers that run
``sdpa`` run ``attention`` instead: on a CPU, with a tensor mask and nothing else ``sdpa`` would add
(no position bias, soft cap, sinks or dropout), it calls ``scaled_dot_product_attention`` once
over the key/value heads, each one's query heads folded into its query rows (``_folded``, since
stop 35; until then it passed ``enable_gqa=True``, the grouping ``generate``'s own steps use, which
took 2-2.5x as long for a few query rows on the project's EPYC); any other call goes to
Transformers' ``sdpa`` as before. It works by setting the attention layers' configs'
implementation to ``specdec_sdpa_gqa`` (registered with Transformers' ``AttentionInterface``, and
with its ``sdpa`` mask) for the forward only; the model is unchanged outside it. CPU only: CUDA's
SDPA kernels take a mask with ``enable_gqa`` on its slow math path (Transformers' own note), so a
GPU keeps ``repeat_kv``. Exact: the grouped kernel computes the same products as the one over
copied heads (bit for bit in the tests, float64 and float32), and specdec's greedy output is
``generate``'s (docs/benchmarks.md, stop 26).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "specdec_sdpa_gqa"

# model -> the configs its grouped attention layers read their implementation from
_CONFIGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, position_bias: torch.Tensor | None = None, **kwargs):
    """Transformers' ``sdpa`` attention, with a masked grouped call on a CPU run as one grouped kernel."""
    if (getattr(module, "num_key_value_groups", 1) > 1 and isinstance(attention_mask, torch.Tensor)
            and query.device.type == "cpu" and position_bias is None and not dropout
            and kwargs.get("softcap") is None and kwargs.get("s_aux") is None
            and not kwargs.get("output_attentions", False) and key.shape[-1] == value.shape[-1]):
        return _folded(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, position_bias=position_bias, **kwargs)


def _folded(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
            scaling: float | None) -> torch.Tensor:
    """Grouped attention with each key/value head's query heads folded into its query rows: query head
    h reads key/value head h // groups (``repeat_kv``'s order), so [B, heads, T, D] viewed as
    [B, kv heads, groups x T, D] puts every query that reads a key/value head beside the others, and
    one plain kernel call over the key/value heads does what ``enable_gqa`` does. Torch's CPU kernel
    runs a few query rows per head far better so: a 3-token block of SmolLM2 (9 heads on 3, 250
    cached tokens) takes 74 us folded against 170-180 us with ``enable_gqa`` (docs/benchmarks.md,
    stop 35). Each query row's sums are the same either way. A mask that differs between heads is
    not folded."""
    batch, heads, width, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    if mask.dim() != 4 or mask.shape[1] != 1 or heads != groups * kv_heads:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    rows = mask.shape[0]
    folded_mask = mask.expand(rows, groups, width, mask.shape[-1]).reshape(rows, 1, groups * width, mask.shape[-1])
    out = F.scaled_dot_product_attention(query.reshape(batch, kv_heads, groups * width, dim), key, value,
                                         attn_mask=folded_mask, scale=scaling)
    return out.view(batch, heads, width, out.shape[-1])


AttentionInterface.register(NAME, attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def applies_to(model: torch.nn.Module) -> bool:
    """Whether ``model`` is on a CPU and has attention layers with grouped key/value heads on ``sdpa``."""
    parameter = next(model.parameters(), None)
    return parameter is not None and parameter.device.type == "cpu" and bool(_configs(model))


def _configs(model: torch.nn.Module) -> list:
    configs = _CONFIGS.get(model)
    if configs is None:
        found = {}
        for module in model.modules():
            config = getattr(module, "config", None)
            if (getattr(module, "num_key_value_groups", 1) > 1 and config is not None
                    and getattr(config, "_attn_implementation", None) == "sdpa"):
                found[id(config)] = config
        configs = _CONFIGS[model] = list(found.values())
    return configs


@contextlib.contextmanager
def gqa_steps(model: torch.nn.Module):
    """Within it, ``model``'s grouped ``sdpa`` attention layers run ``attention``."""
    configs = [config for config in _configs(model) if config._attn_implementation == "sdpa"]
    for config in configs:
        # The internal field, not the property: its setter walks the sub-configs, which keep theirs.
        config._attn_implementation_internal = NAME
    try:
        yield
    finally:
        for config in configs:
            config._attn_implementation_internal = "sdpa"
