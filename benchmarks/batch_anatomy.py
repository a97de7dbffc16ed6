"""Where a batch's time goes on the bundled pair, per contender, interleaved batch by batch.

    OMP_NUM_THREADS=1 python benchmarks/batch_anatomy.py [--drafter ngram|model] [--batch-size 16] \
        [--num-prompts 64] [--ks 0,1,2] [--cost-aware] [--variants name=value[,...] ...] [--mixed 1,2] \
        [--constants name=value[,...] ...] \
        [--repeats 3] [--both-caches] [--sampled]

Each batch of ``--batch-size`` prompts is decoded greedily (or with ``--sampled`` as ``policy_grid.py``
samples: temperature 0.7, top-p 0.9, rejection sampling) by ``target.generate`` and then by each
contender (constant k for each of ``--ks``, and ``cost-aware`` with ``--cost-aware``) before the
next batch, so that a noisy neighbour slows all alike. Each ``--variants`` entry adds a
``cost-aware`` contender with those options set (e.g. ``objective=expected-makespan``), each
``--constants`` entry a ``constant`` one (e.g. ``k=5,max_batch=4``).
``--mixed`` adds a contender that draws its k at every iteration from the given ones (seeded):
whether changing k from one iteration to the next costs anything beyond each k's own iterations
(a policy that chooses k per iteration changes it). Printed per contender: its rate against
``generate`` (the sum of times, and the median of the per-batch ratios), against the best constant
k, and where its time went per batch: the first iteration (the prompt's prefill), the iterations at
the full batch, those after rows left (a smaller batch), and the cache cuts when rows leave
(``select_rows``), with each kind's median iteration.

``--both-caches`` runs every contender twice, with specdec's in-place cache layers
(``GrowingLayer``, ``core/cache.py``) and with transformers' ``DynamicLayer`` as it was before stop 38
(``grow_in_place`` patched out), to measure what appending in place buys.
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's specdec, not an installed copy

import specdec.core.cache as cache_module  # noqa: E402
from specdec.core.components import Observer  # noqa: E402
from specdec.core.hookspecs import hookimpl  # noqa: E402
from specdec.config import parse_options  # noqa: E402
from specdec.policies import ConstantLookahead, CostAwareLookahead  # noqa: E402

from bundled_pair import bundled_decoder, generation_options, load_bundled_pair  # noqa: E402

KINDS = ("first", "full batch", "smaller batch", "row cuts")


class MixedLookahead(ConstantLookahead):
    """k drawn at every iteration from ``choices``, the same for every row (seeded: the same draws each run)."""

    def __init__(self, choices: list[int]):
        super().__init__(k=max(choices))
        self.choices, self.random = choices, random.Random(0)

    def lookahead(self, state):
        return torch.full((int(state.rows_host.shape[0]),), self.random.choice(self.choices), dtype=torch.long)


class Anatomy(Observer):
    """Seconds per kind of iteration (``KINDS``), summed, and every iteration's own."""

    name = "anatomy"

    def __init__(self):
        self.seconds = collections.defaultdict(list)
        self._last = 0.0

    @hookimpl
    def specdec_begin(self, state, target):
        self._batch = state.batch_size
        self._last = time.perf_counter()

    @hookimpl
    def specdec_on_step(self, state, step):
        now = time.perf_counter()
        kind = "first" if step.iteration == 0 else "full batch" if len(step.rows_host) == self._batch else "smaller batch"
        self.seconds[kind].append(now - self._last)
        self._last = now

    @hookimpl
    def specdec_select_rows(self, state, keep, keep_host):
        now = time.perf_counter()
        self.seconds["row cuts"].append(now - self._last)
        self._last = now


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", choices=("ngram", "model"), default="ngram")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ks", default="0,1,2", help="constant k contenders, comma-separated")
    parser.add_argument("--cost-aware", action="store_true", help="cost-aware as a contender too")
    parser.add_argument("--variants", nargs="*", default=[], help="more cost-aware contenders, options name=value[,...]")
    parser.add_argument("--constants", nargs="*", default=[], help="more constant contenders, options name=value[,...]")
    parser.add_argument("--mixed", default=None, help="a contender drawing k per iteration from these, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--both-caches", action="store_true", help="each contender with transformers' DynamicLayer too")
    parser.add_argument("--sampled", action="store_true", help="temperature 0.7, top-p 0.9 (policy_grid.py's)")
    args = parser.parse_args()
    sampling = generation_options(args.sampled)
    torch.set_num_threads(1)
    target, tokenizer, draft, prompts = load_bundled_pair()
    batches = [tokenizer(prompts[i : i + args.batch_size], return_tensors="pt", padding=True)
               for i in range(0, args.num_prompts, args.batch_size)]
    policies = {f"k={k}": (lambda k=k: ConstantLookahead(k=int(k))) for k in args.ks.split(",")}
    if args.mixed:
        choices = [int(k) for k in args.mixed.split(",")]
        policies[f"k in {{{args.mixed}}}"] = lambda: MixedLookahead(choices)
    if args.cost_aware:
        policies["cost-aware"] = CostAwareLookahead
    for variant in args.variants:
        options = parse_options("policy", "cost-aware", variant.split(","), "--variants")
        policies[f"cost-aware {variant}"] = lambda options=options: CostAwareLookahead(**options)
    for variant in args.constants:
        options = parse_options("policy", "constant", variant.split(","), "--constants")
        policies[f"constant {variant}"] = lambda options=options: ConstantLookahead(**options)
    caches = ("in place", "concatenated") if args.both_caches else ("in place",)
    grow = cache_module.grow_in_place
    contenders = {}
    for name, policy in policies.items():
        for cache in caches:
            anatomy = Anatomy()
            decoder = bundled_decoder(target, draft, args.drafter, policy(), args.sampled, observers=[anatomy])
            contenders[name if len(caches) == 1 else f"{name}, {cache}"] = (decoder, anatomy, cache)
    times = collections.defaultdict(list)
    outputs = {}
    for repeat in range(args.repeats):
        for index, batch in enumerate(batches):
            start = time.perf_counter()
            expected = target.generate(**batch, max_new_tokens=args.max_new_tokens, **sampling)
            times["generate"].append(time.perf_counter() - start)
            for name, (decoder, _, cache) in contenders.items():
                cache_module.grow_in_place = grow if cache == "in place" else (lambda c: c)
                start = time.perf_counter()
                got = decoder.generate(**batch, max_new_tokens=args.max_new_tokens, **sampling).sequences
                times[name].append(time.perf_counter() - start)
                outputs[name] = outputs.get(name, True) and (args.sampled or torch.equal(got, expected))
        print(f"repeat {repeat} done", file=sys.stderr, flush=True)
    cache_module.grow_in_place = grow
    base = times["generate"]
    best = min((n for n in times if n.startswith("k=")), key=lambda n: sum(times[n]))
    count = len(base)
    print(f"{args.drafter} drafter, batch {args.batch_size}, {args.num_prompts} prompts, {args.repeats} repeats "
          f"({count} batches each); best constant: {best}")
    for name, seconds in times.items():
        line = (f"  {name:28s} vs generate {sum(base) / sum(seconds):.3f} (median {statistics.median(b / s for b, s in zip(base, seconds)):.3f})"
                f"  vs {best} {sum(times[best]) / sum(seconds):.3f}")
        if name in contenders:
            anatomy = contenders[name][1]
            line += "  per batch: " + ", ".join(
                f"{kind} {sum(anatomy.seconds[kind]) / count:.3f} s ({len(anatomy.seconds[kind]) / count:.1f} x "
                f"{1000 * statistics.median(anatomy.seconds[kind]):.1f} ms)" for kind in KINDS if anatomy.seconds[kind])
            line += "" if outputs[name] else "  OUTPUT DIFFERS FROM generate"
        print(line)


if __name__ == "__main__":
    main()
