"""Replay greedy decoding offline to compare lookahead choices without timing noise.

Under greedy decoding the output is the target's own whatever k a policy picks, and so is what a
deterministic drafter proposes from a given prefix: the draft model's argmax after the committed
tokens, or prompt lookup's copy. So whether the draft's j-th token would be accepted from a given
position is a fact of the text, not of the run: one teacher-forced pass of the draft model over
the target's output (prompt lookup on its prefixes) gives, for every position, how many drafts in
a row the target would accept from there. A policy then replays on that record: each iteration
it picks k, commits ``min(run, k) + 1`` tokens (ngram: at most what the lookup found, plus one)
and pays ``T(width)`` for the width it drafted, from a table of iteration costs measured once in
the loop (``--measure``) or given (``--costs``); prompt lookup's draft is as wide as what it found
(until stop 42 the replay charged ``T(k)``, overcharging it). Tokens per unit of cost, against the best constant k in
hindsight and a per-iteration oracle, say how well a k choice follows the acceptance, with the
same costs for every contender and no noise between runs. ``cost-aware`` itself is replayed (at
several ``alpha_decay`` values), driven through its hooks with a clock that advances by each
iteration's cost from the table: its cost fit, acceptance estimate, exploration and probes are the
policy's own. ``draft-confidence`` at fixed
thresholds (model drafter) replays too: a row drafts while its latest token's draft probability
stays at or above the threshold (that token still proposed), up to ``--max-k``, and pays ``T(m)`` for
the m it drafted. The probabilities are the teacher-forced pass's, which are the draft's own up to
its first rejected token; after it they are an approximation, which moves only how many doomed drafts
an iteration pays for, never what it accepts.

    OMP_NUM_THREADS=1 python benchmarks/lookahead_replay.py [--drafter model|ngram] [--prompts 16] \
        [--max-new-tokens 128] [--measure | --costs 1,1.3,1.5,...] [--decays 0.7,0.8,0.9,0.95] \
        [--thresholds 0.3,0.5,0.7]

Sampled decoding does not replay this way: acceptance there is a coin flipped per position.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec import SpeculativeDecoder  # noqa: E402
from bundled_pair import load_bundled_pair  # noqa: E402
from specdec.drafters import ModelDrafter, NGramDrafter  # noqa: E402
from specdec.policies import ConstantLookahead, CostAwareLookahead  # noqa: E402
from specdec.policies.draft_confidence import confident  # noqa: E402


def accepted_runs(draft, tokens: list[int], prompt_len: int, drafter: str, max_k: int) -> list[tuple]:
    """For each committed length L from the prompt on: (drafts the drafter offers at L, of those the
    target accepts in a row, the draft's probability of each token it offers or None), the offer
    capped at ``max_k``."""
    out = []
    if drafter == "model":
        with torch.no_grad():
            probs = draft(torch.tensor([tokens])).logits[0].float().softmax(-1)  # [T, V]: row j guesses token j + 1
        confidence, guess = (values.tolist() for values in probs.max(-1))
        match = [guess[j - 1] == tokens[j] for j in range(len(tokens))]
        for length in range(prompt_len, len(tokens)):
            run = 0
            while length + run < len(tokens) and run < max_k and match[length + run]:
                run += 1
            out.append((max_k, run, confidence[length - 1 : length - 1 + max_k]))
        return out
    lookup = NGramDrafter(max_ngram=3)
    for length in range(prompt_len, len(tokens)):
        text = torch.tensor(tokens[:length], dtype=torch.int64).numpy().tobytes()
        follow = lookup._follow(text, 8)
        proposal = [] if follow is None else tokens[follow : min(follow + max_k, length)]
        run = 0
        while run < len(proposal) and length + run < len(tokens) and proposal[run] == tokens[length + run]:
            run += 1
        out.append((len(proposal), run, None))
    return out


def greedy_records(target, tokenizer, draft, prompts, drafter: str, max_k: int, max_new_tokens: int) -> list[list[tuple]]:
    """Per prompt, ``accepted_runs`` over the target's greedy output (up to its first end-of-text)."""
    records = []
    for prompt in prompts:
        e = tokenizer([prompt], return_tensors="pt")
        with torch.no_grad():
            out = target.generate(**e, max_new_tokens=max_new_tokens, do_sample=False)[0].tolist()
        eos = target.generation_config.eos_token_id
        end = len(out)
        for j in range(e["input_ids"].shape[1], len(out)):
            if out[j] == eos:
                end = j + 1
                break
        records.append(accepted_runs(draft, out[:end], e["input_ids"].shape[1], drafter, max_k))
    return records


def replay(records, costs: list[float], policy) -> tuple[float, float, int]:
    """Tokens and cost of decoding every record with ``policy`` (``begin()`` per request, then per
    iteration ``lookahead(budget) -> k``, ``width(confidence, drafted)`` where it stops drafts itself,
    and ``observe(k, drafted, accepted, seconds)``); returns (tokens, cost, iterations)."""
    tokens = cost = iterations = 0
    for runs in records:
        position = 0
        policy.begin()
        while position < len(runs):
            budget = len(runs) - position - 1  # drafts the row may still make
            k = min(policy.lookahead(budget), budget)
            offered, run, confidence = runs[position]
            drafted = policy.width(confidence, min(offered, k))
            if policy.pays_for_width:  # a confidence stop: the width it drafted, not its cap
                k = drafted
            accepted = min(run, drafted)
            policy.observe(k, drafted, accepted, costs[drafted])  # the verify is as wide as the draft
            position += accepted + 1
            tokens += accepted + 1
            cost += costs[drafted]
            iterations += 1
    return tokens, cost, iterations


class Constant:
    """A constant k."""

    pays_for_width = False

    def __init__(self, k):
        self.k = k

    def begin(self):
        pass

    def lookahead(self, budget):
        return self.k

    def width(self, confidence, drafted):
        return drafted

    def observe(self, k, drafted, accepted, seconds):
        pass


class Confidence(Constant):
    """``draft-confidence`` at a fixed threshold (its own rule, ``confident``), capped at ``k``."""

    pays_for_width = True

    def __init__(self, threshold, k):
        super().__init__(k)
        self.threshold = threshold

    def width(self, confidence, drafted):
        for j in range(drafted):
            if not confident(torch.tensor(confidence[j]), self.threshold):
                return j + 1  # the doubtful token is still proposed
        return drafted


class CostAware(Constant):
    """The ``cost-aware`` policy itself, driven through its hooks on a one-row request whose clock
    advances by each iteration's cost from the table: its own cost fit, acceptance estimate, initial
    exploration and probes, with no timing noise."""

    def __init__(self, **options):
        self.now = 0.0
        self.policy = CostAwareLookahead(clock=lambda: self.now, **options)
        self.state = None

    def begin(self):
        self.state = SimpleNamespace(batch_size=1, rows_host=torch.zeros(1, dtype=torch.long), row_cuts=0,
                                     iteration=0, verify_alternatives=True, left=0, generated=0)
        self.state.progress_host = lambda: ([self.state.generated], [self.state.left])
        self.policy.begin(self.state, None)

    def lookahead(self, budget):
        self.state.left = budget + 1  # tokens the row may still commit
        return int(self.policy.lookahead(self.state)[0])

    def observe(self, k, drafted, accepted, seconds):
        self.now += seconds
        self.policy.on_step(self.state, SimpleNamespace(
            rows_host=self.state.rows_host, drafted_host=torch.tensor([drafted]),
            accepted_host=torch.tensor([accepted]), appended_host=torch.tensor([accepted + 1]),
            draft=SimpleNamespace(alternatives=None, width=drafted)))
        self.state.iteration += 1
        self.state.generated += accepted + 1


def oracle_rate(records, costs, max_k) -> float:
    """The best tokens per cost any k sequence reaches (dynamic programming per record, then the
    best common rate by bisection on lambda: maximise tokens - lambda * cost)."""
    def best(lam):
        total_tokens = total_cost = 0.0
        for runs in records:
            n = len(runs)
            value = [0.0] * (n + 1)  # best tokens - lam * cost from position i to the end
            choice = [(0, 0.0)] * (n + 1)
            for i in range(n - 1, -1, -1):
                offered, run, _ = runs[i]
                options = []
                for k in range(0, min(max_k, n - i - 1) + 1):
                    step = min(run, min(offered, k)) + 1
                    width = min(offered, k)
                    options.append((step - lam * costs[width] + value[min(i + step, n)], step, costs[width]))
                value[i], step, c = max(options)
                choice[i] = (step, c)
            i = 0
            while i < n:
                step, c = choice[i]
                total_tokens += step
                total_cost += c
                i += step
        return total_tokens, total_cost
    low, high = 0.0, 10.0
    for _ in range(40):
        lam = (low + high) / 2
        t, c = best(lam)
        low, high = (lam, high) if t - lam * c > 0 else (low, lam)
    t, c = best(low)
    return t / c


def measure_costs(target, draft, tokenizer, prompts, drafter, max_k, new_tokens) -> list[float]:
    """Seconds per iteration at each constant k (k = 0: specdec's plain step), in plain steps; the best
    of two passes, each iteration carrying its share of the prompts' prefill (a little more at a
    larger k, which takes fewer iterations)."""
    encoded = [tokenizer([p], return_tensors="pt") for p in prompts]
    seconds = []
    for k in range(0, max_k + 1):
        drafting = ModelDrafter(draft) if drafter == "model" else NGramDrafter(max_ngram=3)
        decoder = SpeculativeDecoder(target=target, drafter=drafting, policy=ConstantLookahead(k=k))
        best = math.inf
        for _ in range(2):
            start, iterations = time.perf_counter(), 0
            for e in encoded:
                out = decoder.generate(**e, max_new_tokens=new_tokens, do_sample=False)
                iterations += out.stats.target_calls
            best = min(best, (time.perf_counter() - start) / iterations)
        seconds.append(best)
    return [s / seconds[0] for s in seconds]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="model", choices=["model", "ngram"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--costs", default=None, help="T(0), T(1), ... T(max_k) in any unit (default: --measure)")
    parser.add_argument("--measure", action="store_true", help="time the loop at every constant k on 4 prompts")
    parser.add_argument("--decays", default="0.6,0.7,0.8,0.9,0.95")
    parser.add_argument("--thresholds", default="0.2,0.3,0.4,0.5,0.6,0.7,0.8",
                        help="draft-confidence thresholds to replay (model drafter)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    target, tokenizer, draft, prompts = load_bundled_pair()
    prompts = prompts[: args.prompts]
    if args.costs:
        costs = [float(c) for c in args.costs.split(",")]
        if len(costs) != args.max_k + 1:
            parser.error(f"--costs needs {args.max_k + 1} values (k = 0 .. {args.max_k})")
    else:
        costs = measure_costs(target, draft, tokenizer, prompts[:4], args.drafter, args.max_k, 48)
    print("costs (plain steps):", " ".join(f"k={k}:{c:.3f}" for k, c in enumerate(costs)), flush=True)
    records = greedy_records(target, tokenizer, draft, prompts, args.drafter, args.max_k, args.max_new_tokens)
    results = {}
    for k in range(0, args.max_k + 1):
        t, c, n = replay(records, costs, Constant(k))
        results[f"constant k={k}"] = dict(rate=t / c, tokens_per_call=t / n)
    for decay in [float(d) for d in args.decays.split(",")]:
        t, c, n = replay(records, costs, CostAware(alpha_decay=decay, max_k=args.max_k))
        results[f"cost-aware, alpha_decay {decay}"] = dict(rate=t / c, tokens_per_call=t / n)
    if args.drafter == "model":
        for threshold in [float(t) for t in args.thresholds.split(",")]:
            t, c, n = replay(records, costs, Confidence(threshold, args.max_k))
            results[f"draft-confidence {threshold}"] = dict(rate=t / c, tokens_per_call=t / n)
    results["oracle"] = dict(rate=oracle_rate(records, costs, args.max_k), tokens_per_call=None)
    best_constant = max((n for n in results if n.startswith("constant")), key=lambda n: results[n]["rate"])
    print(f"{args.drafter}, {len(records)} prompts, {sum(len(r) for r in records)} new tokens; best constant: {best_constant}")
    for name, r in results.items():
        per_call = "" if r["tokens_per_call"] is None else f"  tokens/call {r['tokens_per_call']:.2f}"
        print(f"  {name:36s} speedup {r['rate']:.3f}  vs best constant {r['rate'] / results[best_constant]['rate']:.3f}{per_call}")
    if args.json:
        args.json.write_text(json.dumps(dict(costs=costs, results=results), indent=1))


if __name__ == "__main__":
    main()
