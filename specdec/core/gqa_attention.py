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
(no position bias, soft cap, sinks or dropout), it calls ``scaled_dot_product_attention`` with the
mask and ``enable_gqa=True``, the kernel ``generate``'s own steps use; any other call goes to
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
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, position_bias=position_bias, **kwargs)


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
