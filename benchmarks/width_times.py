"""What each width costs and how often ``cost-aware`` drafts it, against the constants, at batch 1.

    OMP_NUM_THREADS=1 python benchmarks/width_times.py [--drafter model|ngram] [--sampled] [--prompts 16]
        [--passes 3] [--ks 0,2,3,5]

Prompt by prompt on the bundled pair, in an order that rotates every prompt: one ``cost-aware`` kept
across the run and a constant policy for each of ``--ks``. After the first pass (a warm-up, not
counted), it prints each contender's tokens per second over the first constant's, and per lookahead
width the iterations that asked for it and their median wall time (from one lookahead to the next;
"after 0" marks an iteration that followed a plain step, whose drafter first catches up). Where
``cost-aware`` never drafts a width, or drafts it dearer than a constant does, its cost model is
the place to look: on a Zen 3 EPYC it drafted 2 or 4 and almost never 3, which a constant drafts
in 30.5 ms against 27.6 and 38.1 ms for 2 and 5 (``docs/benchmarks.md``, stop 49).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's specdec, not an installed copy

from specdec.policies import ConstantLookahead, CostAwareLookahead  # noqa: E402

from bundled_pair import add_run_arguments, bundled_decoder, generation_options, load_bundled_pair  # noqa: E402


def timed(policy_class):
    """``policy_class`` that keeps (iteration, width, time) at every lookahead."""

    @attrs.define(eq=False)
    class Timed(policy_class):
        marks: list = attrs.field(factory=list, init=False)

        def lookahead(self, state):
            now = time.perf_counter()
            out = super().lookahead(state)
            self.marks.append((state.iteration, int(out.max()), now))
            return out

    return Timed


def iteration_times(marks) -> list[tuple[str, float]]:
    """(width label, seconds) of each iteration but a request's first (it reads the prompt) and its last."""
    out = []
    for before, (iteration, width, start), (following, _, end) in zip([None, *marks], marks, marks[1:]):
        if iteration > 0 and following == iteration + 1:
            resumed = before is not None and before[1] == 0 and width > 0
            out.append((f"{width} after 0" if resumed else str(width), end - start))
    return out


def main():
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    parser.add_argument("--ks", default="0,2,3,5", help="constant lookaheads to run beside cost-aware")
    args = parser.parse_args()
    try:
        ks = [int(k) for k in args.ks.split(",")]
    except ValueError:
        parser.error(f"--ks must be comma-separated integers, got {args.ks!r}")
    if args.passes < 2 or args.prompts < 1 or any(k < 0 for k in ks):
        parser.error("--passes must be at least 2 (the first is a warm-up), --prompts at least 1, every k >= 0")
    torch.set_num_threads(1)
    sampling = generation_options(args.sampled)
    target, tokenizer, draft, prompts = load_bundled_pair()
    encoded = [tokenizer(p, return_tensors="pt") for p in prompts[: args.prompts]]
    policies = {"cost-aware": timed(CostAwareLookahead)(), **{f"k={k}": timed(ConstantLookahead)(k=k) for k in ks}}
    decoders = {name: bundled_decoder(target, draft, args.drafter, p, args.sampled) for name, p in policies.items()}
    order, turn = list(decoders), 0
    widths = {name: collections.defaultdict(list) for name in decoders}
    seconds, tokens = collections.Counter(), collections.Counter()
    for index in range(args.passes):
        for number, e in enumerate(encoded):
            shift = turn % len(order)
            turn += 1
            for name in order[shift:] + order[:shift]:
                policies[name].marks = []
                generator = torch.Generator().manual_seed(number)
                start = time.perf_counter()
                out = decoders[name].generate(**e, max_new_tokens=args.max_new_tokens, generator=generator, **sampling)
                if index == 0:
                    continue
                seconds[name] += time.perf_counter() - start
                tokens[name] += out.stats.new_tokens
                for label, took in iteration_times(policies[name].marks):
                    widths[name][label].append(took)
    first = f"k={ks[0]}" if ks else "cost-aware"
    base = tokens[first] / seconds[first]
    for name in decoders:
        cells = ", ".join(f"{label}: {len(times)} x {1000 * statistics.median(times):.1f} ms"
                          for label, times in sorted(widths[name].items(), key=lambda item: (len(item[0]), item[0])))
        print(f"{name}: {tokens[name] / seconds[name] / base:.3f}x of {first}; widths {cells}")


if __name__ == "__main__":
    main()
