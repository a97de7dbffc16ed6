"""The bundled pair: dynamic vs static shapes vs compiled steps, with per-phase timings (issue 17, issue 13 item 3).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/static_compile.py [--batch-sizes 1,16] [--prompts 16]
        [--max-new-tokens 64] [--repeats 3] [--k 5] [--contenders dynamic,static,static+draft,static+all]

Every contender decodes the same prompts greedily with the constant policy; they are interleaved
(the order rotates every repeat) after a first call each, which is timed apart: for compiled
contenders it includes torch.compile's work. For each: tokens/s and the speedup over the target's
own ``generate`` (median of paired repeats), identical rows, acceptance, the ideal (Leviathan,
from the measured tau, mean k and draft/target cost ratio c, as ``specdec bench`` computes it)
and the share of it reached, and milliseconds per iteration in each phase of the loop (the
``phases`` observer, which reads the host clock only: on a CPU that is the work), with the draft
phase per draft forward.
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

from specdec import SpeculativeDecoder  # noqa: E402
from specdec.bench import forward_cost  # noqa: E402
from specdec.config import SpecdecConfig  # noqa: E402
from specdec.observers import PhaseTimes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONTENDERS = {
    "dynamic": dict(),
    "static": dict(static_cache=True),
    "static+draft": dict(static_cache=True, compile="draft"),
    "static+all": dict(static_cache=True, compile="all"),
}

parser = argparse.ArgumentParser()
parser.add_argument("--config", default=str(ROOT / "plugins.toml"))
parser.add_argument("--batch-sizes", default="1,16")
parser.add_argument("--prompts", type=int, default=16)
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--k", type=int, default=5)
parser.add_argument("--contenders", default="dynamic,static,static+draft")
parser.add_argument("--out", default=None, help="also write the rows as JSON here")
args = parser.parse_args()
torch.set_num_threads(1)

config = SpecdecConfig.from_toml(args.config).with_choices(policy="constant", policy_options={"k": args.k})
target, tokenizer = config.load_target()
names = args.contenders.split(",")
timers = {name: PhaseTimes() for name in names}
decoders = {}
for name in names:
    drafter, policy, verifier, observers = config.build_components([timers[name]])
    decoders[name] = SpeculativeDecoder(target=target, drafter=drafter, policy=policy, verifier=verifier,
                                        observers=observers, **CONTENDERS[name])
draft_model = next(iter(decoders.values())).drafter.model
lines = (ROOT / "models/python-pair/prompts.jsonl").read_text().splitlines()[: args.prompts]
prompts = [json.loads(line)["prompt"] for line in lines]
eos = target.generation_config.eos_token_id
rows_out = []

for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
    batches = [tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True)
               for i in range(0, len(prompts), batch_size)]

    def run_target():
        return [target.generate(**b, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
                for b in batches], None

    def run_specdec(decoder):
        outs = [decoder.generate(**b, max_new_tokens=args.max_new_tokens) for b in batches]
        return [o.sequences for o in outs], outs

    runs = {"target": run_target, **{name: (lambda d=decoders[name]: run_specdec(d)) for name in names}}
    first_call, samples, outputs = {}, {name: [] for name in runs}, {}
    for name, run in runs.items():
        start = time.perf_counter()
        outputs[name] = run()
        first_call[name] = time.perf_counter() - start
    for timer in timers.values():
        timer.reset()
    order = list(runs)
    for repeat in range(args.repeats):
        shift = repeat % len(order)
        for name in order[shift:] + order[:shift]:
            start = time.perf_counter()
            outputs[name] = runs[name]()
            samples[name].append(time.perf_counter() - start)

    def new_rows(sequences_list):
        rows = []
        for sequences, b in zip(sequences_list, batches):
            for row in sequences[:, b["input_ids"].shape[1]:].tolist():
                cut = next((i + 1 for i, t in enumerate(row) if t == eos), len(row))
                rows.append(row[:cut])
        return rows

    reference = new_rows(outputs["target"][0])
    tokens = sum(len(r) for r in reference)
    target_cost = forward_cost(target, batch_size, context=128)
    c = forward_cost(draft_model, batch_size, context=128) / target_cost
    print(f"\nbatch {batch_size}: {len(prompts)} prompts, {tokens} new tokens; c = {c:.3f}; "
          f"target alone {statistics.median(samples['target']):.2f} s ({tokens / statistics.median(samples['target']):.1f} tok/s)")
    print(f"{'contender':14s} {'first call':>10s} {'tok/s':>7s} {'vs target':>10s} {'identical':>9s} {'accept':>6s} "
          f"{'tau':>5s} {'ideal':>6s} {'of ideal':>8s} | ms/iteration: " + " ".join(f"{p:>11s}" for p in
          ["lookahead", "draft", "verify", "commit", "bookkeeping", "total"]) + "  draft ms/forward")
    for name in names:
        rows = new_rows(outputs[name][0])
        outs = outputs[name][1]
        identical = sum(a == b for a, b in zip(rows, reference)) / len(reference)
        drafted = sum(o.stats.drafted for o in outs)
        accepted = sum(o.stats.accepted for o in outs)
        row_steps = sum(o.stats.row_steps for o in outs)
        draft_calls = sum(o.stats.draft_calls for o in outs)
        tau, k_mean = sum(len(r) for r in rows) / row_steps, drafted / row_steps
        ideal = tau / (k_mean * c + 1)
        paired = [t / s for s, t in zip(samples[name], samples["target"])]
        speedup = statistics.median(paired)
        phases = timers[name].per_iteration_ms()
        draft_per_forward = timers[name].seconds["draft"] * 1000 / max(draft_calls * args.repeats, 1)
        print(f"{name:14s} {first_call[name]:9.1f}s {tokens / statistics.median(samples[name]):7.1f} "
              f"{speedup:5.2f}x [{min(paired):.2f}-{max(paired):.2f}] {identical:8.0%} {accepted / drafted:6.0%} {tau:5.2f} "
              f"{ideal:5.2f}x {speedup / ideal:8.0%} | " + " ".join(f"{phases[p]:11.2f}" for p in
              ["lookahead", "draft", "verify", "commit", "bookkeeping", "total"]) + f"  {draft_per_forward:8.2f}")
        rows_out.append(dict(batch_size=batch_size, contender=name, first_call_s=first_call[name],
                             tokens_per_s=tokens / statistics.median(samples[name]), speedup=speedup, paired=paired,
                             identical=identical, acceptance=accepted / drafted, tau=tau, ideal=ideal, c=c,
                             of_ideal=speedup / ideal, phases_ms=phases, draft_ms_per_forward=draft_per_forward))
if args.out:
    Path(args.out).write_text(json.dumps(rows_out, indent=1))
