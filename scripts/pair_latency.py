#!/usr/bin/env python
"""Single-token forward latency of the bundled target and draft on this CPU.

Batch 1, float32, torch.no_grad(), a DynamicCache pre-filled with ~200 tokens
of a held-out prompt; times one decode step (one new token) many times and
reports median and min per model and the cost ratio c = draft / target.

    python scripts/pair_latency.py --pair models/python-pair
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's specdec, not an installed copy

from specdec.core.models import cache_argument, returned_cache  # noqa: E402


def step_latency(model, ctx: torch.Tensor, reps: int, warmup: int) -> list[float]:
    """Time model(next_token, cache of len(ctx)) with a fresh copy of the cache each time."""
    times = []
    with torch.no_grad():
        out = model(input_ids=ctx, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        base = returned_cache(out)
        for i in range(warmup + reps):
            # grow the cache by one token per step, then crop back so every
            # timed step sees the same context length
            t0 = time.perf_counter()
            out = model(input_ids=tok, use_cache=True, **{cache_argument(model): base})
            dt = time.perf_counter() - t0
            base = returned_cache(out)
            base.crop(ctx.shape[1] - base.get_seq_length())  # transformers 5: negative = tokens to drop
            if i >= warmup:
                times.append(dt)
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="models/python-pair")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    pair = Path(args.pair)
    tok = AutoTokenizer.from_pretrained(pair)
    text = "".join(json.loads(line)["prompt"] for line in (pair / "prompts.jsonl").read_text().splitlines()[:8])
    ctx = torch.tensor([tok.encode(text)[: args.context]])
    res = {}
    for name in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(pair / name, dtype=torch.float32).eval()
        ts = step_latency(model, ctx, args.reps, warmup=20)
        res[name] = {"median_ms": 1000 * statistics.median(ts), "min_ms": 1000 * min(ts),
                     "params": sum(p.numel() for p in model.parameters())}
    res["c_median"] = res["draft"]["median_ms"] / res["target"]["median_ms"]
    res["c_min"] = res["draft"]["min_ms"] / res["target"]["min_ms"]
    res["context_tokens"] = ctx.shape[1]
    res["threads"] = args.threads
    print(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
