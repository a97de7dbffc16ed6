"""``specdec bench``: speed measured as ratios in one process, on the same models and prompts.

For every batch size: the target alone (batched ``generate``), Transformers' assisted generation
(batch 1 only: it refuses larger batches, so for those it runs row by row and says so), and
specdec with each requested drafter x policy. Each is warmed up, repeated, and its median kept.
Every specdec output is checked against the target's own greedy output. Speedups are ratios of
tokens per second: under greedy decoding every method writes the same tokens, so this is the ratio
of times; sampled runs write different continuations (of different lengths), so time alone would
not compare them.

The ideal speedup (Leviathan et al.) comes from the measured numbers: with alpha the per-token
acceptance probability, k the mean lookahead and c the draft/target cost ratio of one forward,
``(1 - alpha^(k+1)) / ((1 - alpha) (k c + 1))``. alpha is solved from the measured mean accepted
length tau = (1 - alpha^(k+1)) / (1 - alpha), so the ideal is tau / (k c + 1).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import attrs
import torch
from transformers import DynamicCache

from .config import ComponentSpec, SpecdecConfig
from .decoding import SpeculativeDecoder


@attrs.define
class BenchRow:
    batch_size: int
    method: str
    seconds: float
    new_tokens: int
    tokens_per_s: float
    speedup_vs_target: float | None = None
    speedup_vs_assisted: float | None = None
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    mean_lookahead: float | None = None
    alpha: float | None = None
    cost_ratio: float | None = None
    ideal_speedup: float | None = None
    ratio_to_ideal: float | None = None
    exact: bool | None = None
    note: str = ""


def solve_alpha(tau: float, k: float) -> float:
    """The per-token acceptance alpha with (1 - alpha^(k+1)) / (1 - alpha) = tau (bisection)."""
    if k <= 0 or tau <= 1:
        return 0.0
    if tau >= k + 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if (1 - mid ** (k + 1)) / (1 - mid) < tau:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def ideal_speedup(alpha: float, k: float, c: float) -> float:
    tau = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tau / (k * c + 1)


def _median_time(run: Callable[[], object], repeats: int, warmup: int):
    for _ in range(warmup):
        run()
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


@torch.no_grad()
def forward_cost(model, batch_size: int, context: int, repeats: int = 20) -> float:
    """Seconds for one single-token forward with ``context`` tokens cached (the draft's unit of work)."""
    ids = torch.randint(3, model.config.vocab_size, (batch_size, context), device=model.device)
    cache = DynamicCache()
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    step = ids[:, -1:]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(input_ids=step, past_key_values=cache, use_cache=True, logits_to_keep=1)
        times.append(time.perf_counter() - start)
        cache.crop(-1)
    return statistics.median(times)


def _new_token_rows(sequences: torch.Tensor, prompt_width: int, eos: list[int], pad: int) -> list[list[int]]:
    rows = []
    for row in sequences[:, prompt_width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


def run_bench(
    config: SpecdecConfig,
    prompts: list[str],
    batch_sizes: list[int],
    methods: list[tuple[str, str]],
    max_new_tokens: int = 64,
    repeats: int = 3,
    warmup: int = 1,
    assisted: bool = True,
    sampling: dict | None = None,
    on_progress: Callable[[str], None] = lambda message: None,
) -> list[BenchRow]:
    """Measure every (drafter, policy) pair in ``methods`` at every batch size; see the module doc."""
    target, tokenizer = config.load_target()
    eos = target.generation_config.eos_token_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    generate_kwargs = dict(config.sampling)
    generate_kwargs.update(do_sample=False, max_new_tokens=max_new_tokens)
    if sampling:
        # Sampled runs verify by rejection sampling; outputs are random, so there is no exactness
        # check (tests/test_rejection.py checks the distribution) and no assisted baseline.
        generate_kwargs.update(do_sample=True, **sampling)
        assisted = False
    results: list[BenchRow] = []
    decoders = {}
    for drafter, policy in methods:
        spec = config.with_choices(drafter=drafter, policy=policy, verifier="rejection" if sampling else None)
        decoders[(drafter, policy)] = SpeculativeDecoder.from_config(spec, target=target)
    assisted_cache: dict[tuple[str, str], tuple[float, int]] = {}
    draft_model = next((d.drafter.model for d in decoders.values() if getattr(d.drafter, "name", "") == "model"), None)

    for batch_size in batch_sizes:
        batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
        encoded = [tokenizer(b, return_tensors="pt", padding=True) for b in batches]

        def target_alone():
            return [target.generate(**e, pad_token_id=pad, **generate_kwargs) for e in encoded]

        on_progress(f"batch {batch_size}: target alone")
        base_time, base_out = _median_time(target_alone, repeats, warmup)
        base_rows = [r for out, e in zip(base_out, encoded) for r in _new_token_rows(out, e["input_ids"].shape[1], eos, pad)]
        base_tokens = sum(len(r) for r in base_rows)
        base_rate = base_tokens / base_time
        results.append(BenchRow(batch_size, "target alone", base_time, base_tokens, base_rate, 1.0))

        target_cost = forward_cost(target, batch_size, context=128)
        assisted_rates: dict[tuple[str, str], float] = {}
        for (drafter, policy), decoder in decoders.items():
            k = getattr(decoder.policy, "k", getattr(decoder.policy, "initial", 5))
            if not assisted:
                break
            hf_kwargs = {}
            if drafter == "model" and draft_model is not None:
                draft_model.generation_config.num_assistant_tokens = k
                draft_model.generation_config.num_assistant_tokens_schedule = "heuristic" if policy == "heuristic" else "constant"
                draft_model.generation_config.assistant_confidence_threshold = 0.0
                hf_kwargs["assistant_model"] = draft_model
            elif drafter == "ngram":
                hf_kwargs["prompt_lookup_num_tokens"] = k
            else:
                continue
            label = f"transformers assisted ({drafter}, {policy})"
            note = "" if batch_size == 1 else "row by row: transformers refuses batch > 1"
            rows = [tokenizer([p], return_tensors="pt") for p in prompts]

            def assisted_run():
                return [target.generate(**r, pad_token_id=pad, **generate_kwargs, **hf_kwargs) for r in rows]

            # Row by row is the same work at every batch size: measure it once.
            if (drafter, policy) not in assisted_cache:
                on_progress(f"batch {batch_size}: {label}")
                seconds, outs = _median_time(assisted_run, repeats, warmup)
                new = sum(len(_new_token_rows(o, r["input_ids"].shape[1], eos, pad)[0]) for o, r in zip(outs, rows))
                assisted_cache[(drafter, policy)] = (seconds, new)
            seconds, new = assisted_cache[(drafter, policy)]
            assisted_rates[(drafter, policy)] = new / seconds
            results.append(BenchRow(batch_size, label, seconds, new, new / seconds, new / seconds / base_rate, note=note))

        for (drafter, policy), decoder in decoders.items():
            label = f"specdec ({drafter}, {policy})"

            def specdec_run():
                return [decoder.generate(**e, **generate_kwargs) for e in encoded]

            on_progress(f"batch {batch_size}: {label}")
            seconds, outs = _median_time(specdec_run, repeats, warmup)
            rows_out = [r for out, e in zip(outs, encoded) for r in _new_token_rows(out.sequences, e["input_ids"].shape[1], eos, pad)]
            new = sum(len(r) for r in rows_out)
            drafted = sum(o.stats.drafted for o in outs)
            accepted = sum(o.stats.accepted for o in outs)
            row_steps = sum(o.stats.row_steps for o in outs)
            tau = new / row_steps if row_steps else 0.0
            k_mean = drafted / row_steps if row_steps else 0.0
            if drafter == "model":
                c = forward_cost(decoder.drafter.model, batch_size, context=128) / target_cost
            else:
                c = 0.0
            alpha = solve_alpha(tau, k_mean)
            ideal = tau / (k_mean * c + 1) if row_steps else None
            speedup = new / seconds / base_rate
            hf = assisted_rates.get((drafter, policy))
            results.append(
                BenchRow(
                    batch_size, label, seconds, new, new / seconds,
                    speedup_vs_target=speedup,
                    speedup_vs_assisted=new / seconds / hf if hf else None,
                    acceptance_rate=accepted / drafted if drafted else 0.0,
                    mean_accepted_length=tau,
                    mean_lookahead=k_mean,
                    alpha=alpha,
                    cost_ratio=c,
                    ideal_speedup=ideal,
                    ratio_to_ideal=speedup / ideal if ideal else None,
                    exact=None if sampling else rows_out == base_rows,
                )
            )
    return results
