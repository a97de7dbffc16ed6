"""Acceptance at each draft position given that the drafts before it were accepted (the bundled pair).

    python benchmarks/conditional_acceptance.py [--k 8] [--batch-sizes 1,4] [--drafters model,ngram]

``cost-aware`` models a draft as independent tokens, each accepted with one probability alpha per
row, so that k drafts commit ``(1 - alpha^(k+1)) / (1 - alpha)`` tokens. This measures how far that
is from the real process: with a constant k, for every position j it counts the row-steps that
reached j (all drafts before it accepted) and those that accepted j as well. A flat profile is what
the model assumes; one that rises with j means accepted drafts come in runs, and the geometric
model undervalues long drafts against short ones. Greedy (``--sampled``: temperature 0.7, top-p 0.9 and
rejection sampling, ``policy_grid.py``'s), 16 held-out prompts, counts only (no timing).

It also reports how much the rows of a request differ (what ``cost-aware``'s ``history_strength``
measures): per request, the variance of the rows' rates (accepted / (accepted + rejections)) less
its sampling part p (1 - p) / n, as a Beta prior's pseudo-counts p (1 - p) / variance - 1 (few: rows
differ for good; many: they are alike and a spread of estimates is noise), and how far a row's rate
over its first 15 steps predicts the rest (the correlation over the rows).

    python benchmarks/conditional_acceptance.py --k 1 --batch-sizes 16 --prompts 64   # stop 40's table
"""

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's specdec, not an installed copy

from specdec import SpeculativeDecoder  # noqa: E402
from specdec.core.components import Observer  # noqa: E402
from specdec.drafters import ModelDrafter, NGramDrafter  # noqa: E402
from specdec.policies import ConstantLookahead  # noqa: E402
from specdec.policies.cost_aware import expected_tokens  # noqa: E402
from specdec.verifiers import GreedyVerifier, RejectionVerifier  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bundled_pair import generation_options  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAIR = ROOT / "models/python-pair"

parser = argparse.ArgumentParser()
parser.add_argument("--k", type=int, default=8)
parser.add_argument("--batch-sizes", default="1,4")
parser.add_argument("--drafters", default="model,ngram")
parser.add_argument("--prompts", type=int, default=16)
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--sampled", action="store_true", help="temperature 0.7, top-p 0.9 (policy_grid.py's)")
args = parser.parse_args()
sampling = generation_options(args.sampled)


class PositionCounts(Observer):
    """Per draft position j (1-based): row-steps that reached it, and those that accepted it."""

    name = "position-counts"

    def __init__(self):
        self.reached, self.accepted = collections.Counter(), collections.Counter()
        self.drafted = self.kept = 0
        self.requests = []  # per request: [row] [accepted, rejections] after 15 steps and at the end

    def begin(self, state, target):
        self.rows = [[0, 0] for _ in range(state.batch_size)]
        self.requests.append((self.rows, None))
        self.steps = 0

    def on_step(self, state, step):
        for row, drafted, accepted in zip(step.rows_host.tolist(), step.drafted_host.tolist(), step.accepted_host.tolist()):
            self.drafted += drafted
            self.kept += accepted
            self.rows[row][0] += accepted
            self.rows[row][1] += drafted == 0 or accepted < drafted  # cost-aware's truncation-aware count
            for j in range(1, min(drafted, accepted + 1) + 1):
                self.reached[j] += 1
                self.accepted[j] += j <= accepted
        self.steps += 1
        if self.steps == 15:
            self.requests[-1] = (self.rows, [list(r) for r in self.rows])


def row_spread(rows, early) -> str:
    """How much one request's rows differ: see the module docstring."""
    seen = [a + r for a, r in rows]
    rates = [a / n for (a, _), n in zip(rows, seen) if n]
    if len(rates) < 2:
        return "one row"
    pooled = sum(a for a, _ in rows) / sum(seen)
    variance = statistics.pvariance(rates) - statistics.mean(pooled * (1 - pooled) / n for n in seen if n)
    strength = pooled * (1 - pooled) / variance - 1 if variance > 0 else float("inf")
    text = f"rate {pooled:.2f} (lowest row {min(rates):.2f}), pseudo-counts {strength:.1f}"
    if early is not None:
        first = [a / (a + r) if a + r else pooled for a, r in early]
        rest = [(a - ea) / max(a + r - ea - er, 1) for (a, r), (ea, er) in zip(rows, early)]
        if statistics.pstdev(first) > 0 and statistics.pstdev(rest) > 0:
            text += f", first 15 steps against the rest: correlation {statistics.correlation(first, rest):.2f}"
    return text


torch.set_num_threads(1)
tokenizer = AutoTokenizer.from_pretrained(PAIR / "target")
tokenizer.padding_side = "left"
target = AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float32).eval()
prompts = [json.loads(line)["prompt"] for line in (PAIR / "prompts.jsonl").read_text().splitlines()[: args.prompts]]
drafters = {"model": lambda: ModelDrafter(str(PAIR / "draft")), "ngram": NGramDrafter}
for name in args.drafters.split(","):
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        counts = PositionCounts()
        decoder = SpeculativeDecoder(target=target, drafter=drafters[name](), policy=ConstantLookahead(k=args.k),
                                     verifier=RejectionVerifier() if args.sampled else GreedyVerifier(), observers=[counts])
        generator = torch.Generator().manual_seed(0)
        for i in range(0, len(prompts), batch_size):
            batch = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True)
            decoder.generate(**batch, max_new_tokens=args.max_new_tokens, generator=generator, **sampling)
        rates = [counts.accepted[j] / counts.reached[j] if counts.reached[j] else float("nan") for j in range(1, args.k + 1)]
        # What a row commits at each k: measured (from the conditional rates) and geometric at the
        # truncation-aware alpha cost-aware would fit (accepted / (accepted + rejections)).
        rejections = sum(counts.reached[j] - counts.accepted[j] for j in counts.reached)
        alpha = counts.kept / (counts.kept + rejections) if counts.kept + rejections else 0.0
        measured, survive = [1.0], 1.0
        for rate in rates:
            survive *= rate if rate == rate else 0.0
            measured.append(measured[-1] + survive)
        geometric = [float(expected_tokens(alpha, k)) for k in range(args.k + 1)]
        print(f"{name} batch {batch_size}: acceptance at position 1..{args.k} given the drafts before it: "
              + " ".join(f"{r:.2f}" for r in rates))
        print(f"  tokens per step at k = 1..{args.k}: measured " + " ".join(f"{m:.2f}" for m in measured[1:])
              + f"; geometric (alpha {alpha:.2f}) " + " ".join(f"{g:.2f}" for g in geometric[1:]))
        if batch_size > 1:
            for index, (rows, early) in enumerate(counts.requests):
                print(f"  request {index}: " + row_spread(rows, early))
