"""What ``cost-aware`` chooses in a batch, pass after pass, against a constant k (default 0) on the bundled pair.

    OMP_NUM_THREADS=1 python benchmarks/batch_trace.py [--drafter ngram|model] [--batch-size 16] \
        [--passes 5] [--against 0] [--sampled] [--json trace.json]

The policy first decodes the batch-1 and batch-4 passes that ``policy_grid.py`` runs before its
batch-16 cell (one each: it keeps what it measured across requests, as in a server), then
``--passes`` passes of ``--num-prompts`` prompts at ``--batch-size``, each right after constant
k = ``--against`` on the same prompts (interleaved, so that load drift hits both). Per pass: both
times, their ratio, the tokens the policy drafted and how often it chose each k; then the k it chose at every iteration of the batch (``p``
marks a probe), and every iteration it timed that drafted (its seconds, whether it followed a
drafted iteration, whether it was the request's first to draft). ``--json`` keeps every decision
(costs and goodput for k <= 3, the slowest and the mean row acceptance) and timing. Greedy, or with
``--sampled`` as ``policy_grid.py`` samples (temperature 0.7, top-p 0.9, rejection sampling).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's specdec, not an installed copy

from specdec.policies import ConstantLookahead, CostAwareLookahead  # noqa: E402
from specdec.policies.cost_aware import bucket_of  # noqa: E402

from bundled_pair import bundled_decoder, generation_options, load_bundled_pair  # noqa: E402


class Traced(CostAwareLookahead):
    """``cost-aware`` that logs each decision and each iteration it timed into ``log`` (with
    ``seconds``), and each it left untimed because it compiled (with ``compiled_seconds``)."""

    log: list

    def _record(self, iteration, now):
        if self._pending is not None:
            previous, batch, width, started, warm, first = self._pending
            first_run = (previous > 0 and iteration == previous + 1  # an iteration the policy times, or sets apart
                         and self._first_run(batch, width, warm, first, self._alt_pending))
            self.log.append(dict(iteration=previous, batch=batch, width=width, seconds=now - started,
                                 after_drafting=warm, first=first, first_run=first_run))
        super()._record(iteration, now)

    def _left_untimed(self):
        if self._pending is not None:  # one that began compile work (a first run is logged by _record)
            previous, batch, width, started, warm, first = self._pending
            self.log.append(dict(iteration=previous, batch=batch, width=width, compiled_seconds=self.clock() - started,
                                 after_drafting=warm, first=first))
        super()._left_untimed()

    def _fit_state(self, bucket):
        """The bucket's load and raw cells (seconds at load 1, decayed weight, decayed own timings),
        which the costs hide."""
        fit = self._fits.get(bucket)
        if fit is None:
            return {}
        return dict(load=fit.load, cells={k: (fit.mean[k], fit.weight[k], fit.count[k]) for k in sorted(fit.weight) if k <= 3})

    def plan(self, state, alpha=None):
        out = super().plan(state, alpha)
        decision, rows = self.decision, self._row_alphas(state.rows_host.tolist())
        bucket = bucket_of(decision.batch)
        self.log.append(dict(batch=decision.batch, k=decision.k, probing=decision.probing,
                             costs={k: c for k, c in (decision.costs or {}).items() if k <= 3},
                             goodput={k: g for k, g in decision.goodput.items() if k <= 3},
                             slowest_alpha=min(rows), mean_alpha=sum(rows) / len(rows),
                             resume=self._resume.get(bucket), first_read=self._first_read.get(bucket),
                             **self._fit_state(bucket)))
        return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--drafter", choices=("ngram", "model"), default="ngram")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--against", type=int, default=0, help="the constant k each pass is paired with")
    parser.add_argument("--sampled", action="store_true", help="temperature 0.7, top-p 0.9 (policy_grid.py's)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    sampling = generation_options(args.sampled)
    torch.set_num_threads(1)
    target, tokenizer, draft, prompts = load_bundled_pair()

    def make(policy):
        return bundled_decoder(target, draft, args.drafter, policy, args.sampled)

    def run(decoder, batch_size, count):
        chunks = [prompts[i : i + batch_size] for i in range(0, count, batch_size)]
        encoded = [tokenizer(c, return_tensors="pt", padding=True) for c in chunks]
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(0)
        outs = [decoder.generate(**e, max_new_tokens=args.max_new_tokens, generator=generator, **sampling)
                for e in encoded]
        return time.perf_counter() - start, sum(o.stats.drafted for o in outs)

    policy = Traced()
    policy.log = []
    plain, traced = make(ConstantLookahead(k=args.against)), make(policy)
    for batch_size, count in ((1, 8), (4, 16)):  # what policy_grid.py's cost-aware decoder has seen by then
        run(traced, batch_size, count)
    start_of_batch = len(policy.log)
    ratios = []
    for index in range(args.passes):
        plain_seconds, _ = run(plain, args.batch_size, args.num_prompts)
        before = len(policy.log)
        seconds, drafted = run(traced, args.batch_size, args.num_prompts)
        ratios.append(plain_seconds / seconds)
        chosen = collections.Counter(r["k"] for r in policy.log[before:] if "k" in r)
        print(f"pass {index}: constant k={args.against} {plain_seconds:.2f} s, cost-aware {seconds:.2f} s "
              f"({ratios[-1]:.3f}x), {drafted} tokens drafted, k chosen {dict(sorted(chosen.items()))}", flush=True)
    print(f"median over passes 1-{args.passes - 1}: {statistics.median(ratios[1:] or ratios):.3f}x of constant k = {args.against}")
    log = policy.log[start_of_batch:]
    print("k per iteration:", " ".join(f"{r['k']}{'p' if r['probing'] else ''}" for r in log if "k" in r))
    for r in log:
        if "seconds" in r and r["width"] > 0 and r["iteration"] > 0:
            print(f"  iteration {r['iteration']}: {r['width']} drafted at batch {r['batch']}, {r['seconds'] * 1e3:.1f} ms"
                  f"{', after drafting' if r['after_drafting'] else ''}{', the request' + chr(39) + 's first' if r['first'] else ''}")
    if args.json:
        args.json.write_text(json.dumps(dict(ratios=ratios, log=log), indent=1))


if __name__ == "__main__":
    main()
