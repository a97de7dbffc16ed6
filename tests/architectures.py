"""Tiny random float64 models of every decoder-only architecture family, built from configs.

One generic config shrinker (``tiny_config``) walks a config's attributes and shrinks every size
it knows (widths, depths, heads, vocabularies, SSM and convolution sizes, expert counts), sets
every sliding window and attention chunk it finds to ``WINDOW`` tokens so that they bite within a
few dozen tokens, and keeps per-layer patterns (``layer_types`` and friends) short but mixed.
``OVERRIDES`` holds what the generic shrinker gets wrong for particular architectures.

``tiny_model(arch)`` builds any architecture of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``;
``tiny_family_model(family)`` one representative per family of ``FAMILIES`` (with
``draft=True``, its perturbed copy, the draft of the exactness tests). ``benchmarks/
check_architectures.py`` sweeps every architecture with the same code.
"""

from __future__ import annotations

import functools
import torch

from .conftest import left_padded, perturbed_copy

VOCAB = 128
WINDOW = 8
HIDDEN = 64
PAD, BOS, EOS = 0, 1, 2
# Relative noise of the draft's weights: about half of its drafts are accepted (see the sweep's
# acceptance column in docs/architectures.md).
DRAFT_NOISE = 0.05

# One representative architecture per family; the family decides how the KV cache must behave.
FAMILIES: dict[str, str] = {
    "full": "llama",  # classic full attention, rotary positions
    "sliding": "mistral",  # every layer a sliding window
    "mixed_sliding": "gemma2",  # sliding and full layers alternate (layer_types)
    "per_layer_shapes": "gemma4_text",  # sliding and full layers of different head sizes (per_layer_config)
    "kv_shared": "gemma3n_text",  # the last layers read earlier layers' caches (num_kv_shared_layers)
    "chunked": "llama4_text",  # chunked attention layers plus full ones
    "local": "gpt_neo",  # local windows through a slot-indexed buffer: re-read whole, no cache
    "cache_positions": "roformer",  # positions from the cache length: re-read whole, no cache
    "own_state": "recurrent_gemma",  # recurrent and attention states inside its layers: re-read whole
    "bidirectional": "cpmant",  # attention bidirectional within a forward: replayed row by row as generate reads
    "widened_mask": "git",  # with a cache its mask is widened over the padding: replayed row by row
    "appended_token": "xlm",  # generate reads each next token from an appended mask token, without a cache
    "evicted_window": "moshi",  # a window only generate's evicting cache applies: full over the prompt
    "alibi": "bloom",  # ALiBi position biases, no position ids
    "mla": "deepseek_v3",  # multi-head latent attention (+ MoE)
    "moe": "mixtral",  # sparse mixture of experts
    "ssm": "mamba",  # pure selective state space model
    "ssm2": "mamba2",  # pure SSM, multi-head (SSD)
    "hybrid_ssm": "jamba",  # mamba layers and attention layers (+ MoE)
    "gated_delta": "qwen3_next",  # gated delta-net linear attention + full attention
    "short_conv": "lfm2",  # short convolutions + full attention
    "sparse_indexed": "deepseek_v32",  # MLA with a sparse-attention indexer key cache (DSA)
}

# generate's keyword arguments where its defaults do not compute the model's own output. From
# transformers 5.24 generate hands XLM a cache under the name ``cache``, which XLM's forward (whose
# ``cache`` argument predates the rename) uses to cut its input to the tokens after the cached ones:
# the token before the appended mask token is never read, and left-padded rows score NaN. Without a
# cache XLM reads the whole sequence, as every transformers before 5.24 did.
GENERATE_KWARGS: dict[str, dict] = {"xlm": {"use_cache": False}}


def reference_generate(model, ids, mask, **kwargs):
    """``model.generate`` greedy, as the reference the tests and the sweep compare specdec with."""
    kwargs = {**GENERATE_KWARGS.get(model.config.model_type, {}), **kwargs}
    return model.generate(ids, attention_mask=mask, do_sample=False, **kwargs)


# Attribute name -> tiny value, applied wherever a config has the attribute.
SIZES: dict[str, int] = {
    # widths
    "hidden_size": HIDDEN, "d_model": HIDDEN, "n_embd": HIDDEN, "embed_dim": HIDDEN, "dim": HIDDEN,
    "word_embed_proj_dim": HIDDEN, "embedding_size": HIDDEN, "attention_hidden_size": HIDDEN,
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": VOCAB, "lru_width": HIDDEN, "input_embedding_size": HIDDEN,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "d_inner": 128, "ffn_hidden_size": 128,
    "intermediate_size_mlp": 128, "dense_intermediate_size": 128, "dim_ff": 128, "decoder_ffn_dim": 128,
    "feed_forward_size": 128, "emb_dim": HIDDEN,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "shared_intermediate_size": 32,
    "shared_experts_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32, "expert_ffn_hidden_size": 32,
    # heads
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "decoder_attention_heads": 4,
    "attention_heads": 4, "swa_num_attention_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "swa_num_key_value_heads": 2, "num_query_groups": 2,
    "head_dim": 16, "attention_head_dim": 16, "dim_head": 16, "d_head": 16, "swa_head_dim": 16, "kv_channels": 16,
    "attention_head_size": 16,
    # multi-head latent attention
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "qk_head_dim": 16, "index_head_dim": 16, "index_n_heads": 2, "o_lora_rank": 16,
    # experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "moe_k": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1, "first_k_dense_replace": 1, "num_dense_layers": 1,
    # state space models, linear attention and convolutions
    "state_size": 16, "ssm_state_size": 16, "mamba_d_state": 16, "time_step_rank": 8, "mamba_dt_rank": 8,
    "mamba_d_conv": 4, "conv_kernel": 4, "mamba_expand": 2, "expand": 2,
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_headdim": 16,
    "n_mamba_heads": 8, "mamba_n_groups": 1, "mamba_ngroups": 1, "n_groups": 1,
    "mamba_chunk_size": 16, "chunk_size": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_heads": 4, "linear_head_dim": 16, "linear_conv_kernel_dim": 4,
    # vocabularies and context
    "vocab_size": VOCAB, "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128, "max_seq_len": 128,
    "max_target_positions": 128, "num_nextn_predict_layers": 0,
}

# Windows and chunks: small enough to bite within a 20-token prompt and 24 new tokens.
WINDOWS: dict[str, int] = {
    "sliding_window": WINDOW, "attention_chunk_size": WINDOW, "window_size": WINDOW, "sliding_window_size": WINDOW,
    "attention_window_size": WINDOW, "local_attention_window_len": WINDOW,
}

LAYER_COUNT_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")

# What the generic shrinker gets wrong, per architecture (applied last, as config kwargs).
OVERRIDES: dict[str, dict] = {
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "max_window_layers": 1},
    "mixtral": {"sliding_window": None},
    "mamba2": {"num_heads": 8, "head_dim": 16, "time_step_limit": (0.0, float("inf"))},
    "bamba": {"attn_layer_indices": [1, 3], "num_hidden_layers": 4},
    "jamba": {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
              "expert_layer_offset": 1, "use_mamba_kernels": False},
    "lfm2": {"num_hidden_layers": 4, "full_attn_idxs": [1, 3], "layer_types": None},
    "lfm2_moe": {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
                 "num_dense_layers": 1},
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    "zamba": {"attention_hidden_size": 2 * HIDDEN, "mamba_d_head": 16, "n_mamba_heads": 8},
    "zamba2": {"attention_hidden_size": 2 * HIDDEN, "attention_head_dim": 2 * HIDDEN // 4, "mamba_headdim": 16,
               "n_mamba_heads": 8, "num_hidden_layers": 4, "hybrid_layer_ids": [1, 3],
               "layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"]},
    "xlstm": {"embedding_dim": HIDDEN, "num_heads": 4},
    "deepseek_v2": {"topk_group": 1, "n_group": 1, "num_experts_per_tok": 2},
    "ministral": {"head_dim": 16},
    "hunyuan_v1_dense": {"head_dim": 16},
    "hunyuan_v1_moe": {"head_dim": 16},
    "falcon_h1": {"mamba_d_ssm": 2 * HIDDEN, "mamba_n_heads": 8, "mamba_d_head": 16},
    "recurrent_gemma": {"num_hidden_layers": 3},
    "nemotron": {"num_key_value_heads": 2},  # None by default: the generic shrinker leaves it
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1},
    # the last num_kv_shared_layers layers read the cache of the last earlier layer of their kind:
    # both kinds must come before them
    "gemma3n_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2,
                     "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]},
    "granitemoehybrid": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "attention"],
                         "mamba_n_heads": 8, "mamba_d_head": 16},
    "gpt_neo": {"num_layers": 2, "attention_types": [[["global", "local"], 1]], "attention_layers": ["global", "local"]},
    "mpt": {"attn_config": {"alibi": True, "attn_impl": "torch"}},
    # generate appends mask_token_id to read the next token; the default (0) is the pad id here,
    # which XLM masks out, and every logit would be 0
    "xlm": {"mask_token_id": 5},
}


def _float64_safe_eager_mask(*args, dtype: torch.dtype = torch.float32, **kwargs):
    """transformers' eager mask, with float32's lowest value in float64 models.

    Eager attention adds ``finfo(float64).min`` to the scores and then takes the softmax in
    float32, where that value is -inf: a query that sees only padding (every left-padding slot)
    gets NaN, which the next layer spreads to every token of the row (0 * NaN). float32's lowest
    value survives the cast, masks exactly as well, and gives padding queries a harmless uniform
    attention instead.
    """
    from transformers.masking_utils import eager_mask

    mask = eager_mask(*args, dtype=dtype, **kwargs)
    if mask is not None and dtype == torch.float64:
        mask = mask.clamp(min=torch.finfo(torch.float32).min)
    return mask


def patch_float64_eager_masks() -> None:
    """Register ``_float64_safe_eager_mask`` as the mask of eager attention (idempotent)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    ALL_MASK_ATTENTION_FUNCTIONS.register("eager", _float64_safe_eager_mask)


patch_float64_eager_masks()


def _causal_lm_mapping() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def config_class(arch: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[arch]


def model_class(arch: str):
    import transformers

    name = _causal_lm_mapping()[arch]
    return getattr(transformers, name)


def _layer_count(values: dict) -> tuple[str | None, int | None]:
    for name in LAYER_COUNT_NAMES:
        if isinstance(values.get(name), int) and not isinstance(values.get(name), bool):
            return name, values[name]
    return None, None


def _short_origins(pattern: list, layers: int) -> list[int]:
    """Which layer of a per-layer pattern each of the ``layers`` kept ones copies: the first
    ``layers``, with the first layer of every missing kind put in at the end."""
    origins = list(range(min(layers, len(pattern))))
    kinds = list(dict.fromkeys(map(repr, pattern)))
    kept = {repr(pattern[i]) for i in origins}
    missing = [next(i for i, p in enumerate(pattern) if repr(p) == kind) for kind in kinds if kind not in kept]
    for i, origin in enumerate(missing[: layers - 1]):
        origins[layers - 1 - i] = origin
    return origins


def _short_pattern(pattern: list, layers: int) -> list:
    """The first ``layers`` entries of a per-layer pattern, with every kind of layer kept."""
    return [pattern[i] for i in _short_origins(pattern, layers)]


def _is_layer_keyed(value) -> bool:
    """A dict of per-layer settings keyed by layer index (Gemma 4's ``per_layer_config``: {"05": ...})."""
    return isinstance(value, dict) and bool(value) and all(isinstance(k, str) and k.isdigit() for k in value)


def _cover_length(pattern: list) -> int:
    """Length of the shortest prefix holding every kind of layer in ``pattern``."""
    kinds = set(map(repr, pattern))
    seen = set()
    for i, value in enumerate(pattern):
        seen.add(repr(value))
        if seen == kinds:
            return i + 1
    return len(pattern)


def _shrink_layer_entry(entry: dict, values: dict) -> dict:
    """One layer's own settings, its sizes shrunk in proportion to the config's: Gemma 4's full
    layers' head_dim of 512 against 256 stays twice the tiny head_dim."""
    out = _shrink_values(entry, None)
    for name, value in entry.items():
        default = values.get(name)
        if name in SIZES and isinstance(value, int) and isinstance(default, int) and default > 0:
            out[name] = max(1, SIZES[name] * value // default)
    return out


def _shrink_values(values: dict, layers: int | None) -> dict:
    """The tiny version of a config's attributes (a ``to_dict()``), sub-configs included."""
    out = {}
    layer_name, default_layers = _layer_count(values)
    per_layer = {name: value for name, value in values.items()
                 if isinstance(value, list) and default_layers and len(value) == default_layers and default_layers > 1
                 and name not in ("time_step_limit",)}
    if layers is None:
        cover = max([_cover_length(v) for v in per_layer.values()], default=2)
        layers = min(4, max(2, cover))
    # Layer-keyed settings follow the layers they were set for: the kept layer that copies layer j
    # of the longest per-layer pattern (the one the layer kinds come from) takes layer j's entry.
    pattern = max(per_layer.values(), key=lambda v: len(set(map(repr, v))), default=None)
    origins = _short_origins(pattern, layers) if pattern else list(range(layers))
    for name, value in values.items():
        if isinstance(value, dict) and name.endswith("config") and "model_type" in value:
            out[name] = _shrink_values(value, layers)
        elif _is_layer_keyed(value) and default_layers:
            width = len(next(iter(value)))
            out[name] = {str(i).zfill(width): _shrink_layer_entry(value[str(j).zfill(width)], values)
                         for i, j in enumerate(origins) if str(j).zfill(width) in value}
        elif name in per_layer:
            value = per_layer[name]
            is_index = all(isinstance(v, int) and not isinstance(v, bool) for v in value) and value == sorted(
                set(value)) and value[-1] >= default_layers - 1 and len(set(value)) == len(value) and value[0] == 0
            if is_index:
                out[name] = list(range(layers))
            elif name in SIZES and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                out[name] = [SIZES[name]] * layers  # a size per layer (Gemma 3n's intermediate_size)
            else:
                out[name] = _short_pattern(value, layers)
        elif name in LAYER_COUNT_NAMES and isinstance(value, int) and not isinstance(value, bool):
            out[name] = layers
        elif name in WINDOWS and value is not None and not isinstance(value, bool):
            out[name] = WINDOW
        elif name in SIZES and isinstance(value, int) and not isinstance(value, bool):
            out[name] = SIZES[name]
        elif name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            out[name] = {"pad_token_id": PAD, "bos_token_id": BOS, "eos_token_id": EOS,
                         "decoder_start_token_id": BOS}[name] if value is not None or name != "pad_token_id" else PAD
        elif isinstance(value, int) and not isinstance(value, bool) and name.endswith("_token_id") and value >= VOCAB:
            out[name] = VOCAB - 1 - (hash(name) % 8)  # image/audio/... placeholder ids: inside the vocabulary
        elif isinstance(value, list) and name.endswith(("_idxs", "_indices", "_layers")) and value and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value) and default_layers:
            kept = [v for v in value if v < layers]
            out[name] = kept or [layers - 1]
        else:
            out[name] = value
    return out


_SKIP_KEYS = {"transformers_version", "architectures", "_name_or_path", "model_type", "dtype", "torch_dtype",
              "id2label", "label2id", "_attn_implementation_autoset", "_commit_hash", "output_attentions"}


def tiny_config(arch: str, layers: int | None = None, **overrides):
    """The architecture's default config shrunk to a tiny one (see ``SIZES``, ``WINDOWS``, ``OVERRIDES``)."""
    cls = config_class(arch)
    default = cls()
    values = {k: v for k, v in default.to_dict().items() if k not in _SKIP_KEYS}
    values = _shrink_values(values, layers)
    if getattr(default, "is_decoder", None) is False and hasattr(default, "add_cross_attention"):
        values["is_decoder"] = True  # BERT-style models are causal LMs only as decoders
    for name, value in {**OVERRIDES.get(arch, {}), **overrides}.items():
        if isinstance(value, dict) and isinstance(values.get(name), dict):
            values[name] = {**values[name], **value}
        else:
            values[name] = value
    if isinstance(values.get("kv_lora_rank"), int) and "num_key_value_heads" in values:
        values["num_key_value_heads"] = values.get("num_attention_heads")  # MLA expands keys to every head
    if isinstance(values.get("qk_rope_head_dim"), int):  # MLA: rotary dims are the head_dim rope sees
        values["head_dim"] = values["qk_rope_head_dim"]
        if "qk_head_dim" in values:
            values["qk_head_dim"] = values["qk_rope_head_dim"] + values.get("qk_nope_head_dim", 0)
    values["tie_word_embeddings"] = False  # tied random embeddings make every model repeat its last token
    config = cls(**values)
    text = config.get_text_config(decoder=True)
    # A width the heads must divide: every head dim this config derives must be whole.
    for name in ("initializer_range",):
        if hasattr(text, name):
            setattr(text, name, 0.1)
    return config


def _finish(model, seed_everything: bool = True):
    model = model.double().eval()
    gen = model.generation_config
    gen.pad_token_id = PAD
    gen.bos_token_id = BOS
    gen.eos_token_id = None  # random models: never stop early, so windows and chunks fill up
    gen.do_sample = False
    for name in ("temperature", "top_p", "top_k"):
        setattr(gen, name, None)
    return model


@functools.cache
def _cached_model(arch: str, seed: int, layers: int | None, attn: str | None):
    config = tiny_config(arch, layers)
    if attn is not None:
        config._attn_implementation = attn
    try:  # torch's grouped_mm has no float64 kernel on CPU; the per-expert loop does
        config._experts_implementation = "eager"
    except Exception:
        pass
    torch.manual_seed(seed)
    cls = model_class(arch)
    model = cls(config)
    return _finish(model)


def tiny_model(arch: str, seed: int = 0, draft: bool = False, layers: int | None = None, attn: str | None = None):
    """A tiny random float64 model of ``arch`` (cached: treat as read-only); ``draft=True`` gives
    its perturbed copy (noise ``DRAFT_NOISE``), the draft of the exactness checks."""
    model = _cached_model(arch, seed, layers, attn)
    if draft:
        return _cached_draft(arch, seed, layers, attn)
    return model


@functools.cache
def _cached_draft(arch: str, seed: int, layers: int | None, attn: str | None):
    return _finish(perturbed_copy(_cached_model(arch, seed, layers, attn), DRAFT_NOISE, seed=seed + 1))


def tiny_family_model(family: str, seed: int = 0, draft: bool = False):
    """The representative tiny model of ``family`` (a key of ``FAMILIES``), or its draft."""
    return tiny_model(FAMILIES[family], seed=seed, draft=draft)


def prompts(lengths=(11, 16, 20), seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    """Random prompts of the given lengths (token ids avoid pad, bos and eos)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def ragged_batch(lengths=(11, 16, 20), seed: int = 0, vocab: int = VOCAB):
    """A left-padded ``(input_ids, attention_mask)`` of prompts of different lengths."""
    return left_padded(prompts(lengths, seed, vocab), pad=PAD)


def is_decoder_only(arch: str) -> bool:
    try:
        return not config_class(arch)().is_encoder_decoder
    except Exception:
        return True
