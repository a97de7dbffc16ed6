"""Cost-aware against every constant k, per cell (batch size x greedy/sampled x drafter).

For each cell: the target alone, ``constant`` at each k of ``--ks`` and ``cost-aware``, timed in
interleaved passes; medians of ``--repeats`` passes after ``--warmup``. Within a pass every method
decodes a batch of prompts in turn before any decodes the next batch (since stop 36; stops 34-35 ran
one method's whole pass, all its batches, before the next method's), and the order rotates by one
method every batch, so load drift on a shared machine hits all of them alike even where the host's
speed moves by 20-30% within minutes (the Xeon of stop 36). The cost-aware decoder of a
(mode, drafter) is one instance across batch sizes, as it would be in a server: it keeps what it
measured. Greedy outputs are checked against the target's. From the batch size at which specdec
packs the target's weights on this CPU (``core/packed_linear.py``), ``generate`` on the same packed
layers runs too ("target alone, packed weights"): a batch's plain steps are packed steps, so that
row tells the kernel's share of a speedup from the speculation's.

    OMP_NUM_THREADS=1 python benchmarks/policy_grid.py --out grid.json [--variants prior_strength=12 ...]

Per cell it also reports ``held_out_vs_best``, ``cost-aware`` against the best constant k chosen on
the other passes (pass by pass, the median): the best of five noisy constants measured on the same
passes is biased upwards by the noise that made it the best. And ``vs_best_interval``, a 90%
bootstrap interval of ``cost-aware``'s rate over the best constant's, the batches resampled: how far
apart the two may be by this run's noise alone. ``per_batch`` keeps every batch's tokens and seconds.

``--variants`` adds ``cost-aware`` contenders with other options (each its own instance, kept
across batch sizes like the default one), named after their options.

``--decisions FILE`` keeps what the default ``cost-aware`` decided at every iteration, and every
iteration it timed (``batch_trace.Traced``'s records), one JSON line each, with the cell and the
pass (``repeat``, the warm-up passes first): on the Zen 3 EPYC of stop 45 it drafted through a
sampled batch-16 cell at 0.80 of plain steps once and took plain steps in a rerun, and the failing
run had kept nothing to tell why (both timed the draft in float16; stop 46).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's specdec, not an installed copy

from specdec import SpeculativeDecoder  # noqa: E402
from specdec.config import parse_options  # noqa: E402
from specdec.core.packed_linear import applies_to, packed_everywhere, packs_at  # noqa: E402
from specdec.drafters import ModelDrafter, NGramDrafter  # noqa: E402
from specdec.policies import ConstantLookahead, CostAwareLookahead  # noqa: E402
from specdec.verifiers import GreedyVerifier, RejectionVerifier  # noqa: E402

from batch_trace import Traced  # noqa: E402
from bundled_pair import generation_options, load_bundled_pair  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--modes", default="greedy,sampled")
    parser.add_argument("--drafters", default="model,ngram")
    parser.add_argument("--ks", default="1,2,3,4,5,6")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--batch1-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--confidence", action="store_true",
                        help="also time draft-/target-confidence and the classifier, fixed thresholds and 'auto'")
    parser.add_argument("--no-constant", action="store_true", help="skip the constant-k sweep")
    parser.add_argument("--variants", nargs="*", default=[],
                        help="more cost-aware contenders, each with options name=value[,name=value] set")
    parser.add_argument("--out", default="policy-grid.json")
    parser.add_argument("--decisions", type=Path, default=None,
                        help="JSON lines of cost-aware's every decision and timing, per cell and pass")
    args = parser.parse_args()
    torch.manual_seed(0)
    target, tokenizer, draft, prompts = load_bundled_pair()
    most = max(args.num_prompts, args.batch1_prompts)
    if most > len(prompts):
        parser.error(f"--num-prompts/--batch1-prompts {most}: the bundled pair has {len(prompts)} prompts")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ks = [int(k) for k in args.ks.split(",")]
    if args.decisions:
        args.decisions.write_text("")
    results = []
    for mode in args.modes.split(","):
        sampling = generation_options(mode == "sampled")
        for drafter_name in args.drafters.split(","):
            def make(policy):
                drafter = ModelDrafter(draft) if drafter_name == "model" else NGramDrafter(max_ngram=3)
                verifier = RejectionVerifier() if mode == "sampled" else GreedyVerifier()
                return SpeculativeDecoder(target=target, drafter=drafter, policy=policy, verifier=verifier)

            decoders = {} if args.no_constant else {f"constant k={k}": make(ConstantLookahead(k=k)) for k in ks}
            policy = Traced() if args.decisions else CostAwareLookahead()
            if args.decisions:
                policy.log = []  # Traced's records, written out after each of its batches
            decoders["cost-aware"] = make(policy)
            for variant in args.variants:
                options = parse_options("policy", "cost-aware", variant.split(","), "--variants")
                decoders[f"cost-aware {variant}"] = make(CostAwareLookahead(**options))
            if args.confidence and drafter_name == "model":
                from specdec.policies import ClassifierLookahead, DraftConfidenceLookahead, TargetConfidenceLookahead

                weights = str(ROOT / "models/python-pair/classifier.safetensors")
                for threshold in (0.4, "auto"):
                    decoders[f"draft-confidence {threshold}"] = make(DraftConfidenceLookahead(threshold=threshold))
                for threshold in (0.5, "auto"):
                    decoders[f"target-confidence {threshold}"] = make(TargetConfidenceLookahead(threshold=threshold))
                for threshold in (0.5, "auto"):
                    decoders[f"classifier {threshold}"] = make(ClassifierLookahead(weights=weights, threshold=threshold))
            for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
                count = args.batch1_prompts if batch_size == 1 else args.num_prompts
                chunks = [prompts[i : i + batch_size] for i in range(0, count, batch_size)]
                encoded = [tokenizer(c, return_tensors="pt", padding=True) for c in chunks]
                generator = torch.Generator().manual_seed(0)

                def run_target(e):
                    return target.generate(**e, pad_token_id=pad, max_new_tokens=args.max_new_tokens, **sampling), None

                def runner(decoder):
                    def run(e):
                        out = decoder.generate(**e, max_new_tokens=args.max_new_tokens, generator=generator, **sampling)
                        return out.sequences, out
                    return run

                methods = {"target alone": run_target}
                if batch_size > 1 and applies_to(target) and packs_at(target, batch_size):
                    # specdec's batched plain steps read packed weights (core/packed_linear.py): generate
                    # on the same packed layers tells the kernel's share of a speedup from the speculation's.
                    def run_target_packed(e):
                        with packed_everywhere(target):
                            return run_target(e)

                    methods["target alone, packed weights"] = run_target_packed
                methods.update({name: runner(d) for name, d in decoders.items()})
                times = {name: [] for name in methods}
                tokens = {name: [] for name in methods}
                per_batch = {name: [] for name in methods}  # per pass: [(new tokens, seconds)] per batch
                stats = {name: None for name in methods}
                exact = {}
                load = open("/proc/loadavg").read().split()[0]
                order = list(methods)
                turn = 0
                for r in range(args.warmup + args.repeats):
                    # Batch by batch, every method in turn; the order rotates every batch, so that no
                    # method always runs right after another (or first, or last).
                    seconds = {name: 0.0 for name in methods}
                    batches = {name: [] for name in methods}
                    produced = {name: [] for name in methods}
                    results_of = {name: [] for name in methods}
                    for e in encoded:
                        shift = turn % len(order)
                        turn += 1
                        for name in order[shift:] + order[:shift]:
                            start = time.perf_counter()
                            sequences, out = methods[name](e)
                            took = time.perf_counter() - start
                            seconds[name] += took
                            batches[name].append((int((sequences[:, e["input_ids"].shape[1]:] != pad).sum()), took))
                            if args.decisions and name == "cost-aware":
                                with args.decisions.open("a") as log:
                                    for record in policy.log:
                                        log.write(json.dumps(dict(mode=mode, drafter=drafter_name, batch_size=batch_size,
                                                                  repeat=r, **record)) + "\n")
                                policy.log.clear()
                            produced[name].append(sequences)
                            results_of[name].append(out)
                    for name in methods:
                        sequences, outs = produced[name], results_of[name]
                        outs = None if outs[0] is None else outs
                        new = sum(int((s[:, e["input_ids"].shape[1]:] != pad).sum()) for s, e in zip(sequences, encoded))
                        if r >= args.warmup:
                            times[name].append(seconds[name])
                            tokens[name].append(new)
                            per_batch[name].append(batches[name])
                            if outs is not None:
                                drafted = sum(o.stats.drafted for o in outs)
                                steps = sum(o.stats.row_steps for o in outs)
                                accepted = sum(o.stats.accepted for o in outs)
                                stats[name] = dict(k_mean=drafted / steps, accept=accepted / drafted if drafted else 0.0,
                                                   tau=sum(o.stats.new_tokens for o in outs) / steps)
                    reference = produced["target alone"]
                    for name in decoders:
                        if mode == "greedy":
                            exact[name] = exact.get(name, True) and all(
                                torch.equal(a, b) for a, b in zip(produced[name], reference))
                rates = {name: statistics.median(n / t for n, t in zip(tokens[name], times[name])) for name in methods}
                # Paired: each pass's rate over the target's rate in the same pass, then the median,
                # so that load drift between passes cancels.
                paired = {name: statistics.median((n / t) / (bn / bt) for n, t, bn, bt in
                                                  zip(tokens[name], times[name], tokens["target alone"], times["target alone"]))
                          for name in methods}
                base = rates["target alone"]
                constants = [n for n in methods if n.startswith("constant")]
                best_constant = max(constants, key=rates.get) if constants else "cost-aware"
                cell = dict(mode=mode, drafter=drafter_name, batch=batch_size, load_before=load,
                            load_after=open("/proc/loadavg").read().split()[0],
                            rates=rates, speedup={n: rates[n] / base for n in methods}, paired=paired,
                            best_constant=best_constant,
                            cost_aware_vs_best=rates["cost-aware"] / rates[best_constant],
                            # the best constant k by the paired ratios too: on a noisy host the two can name
                            # different k and disagree by 8% in one cell (docs/benchmarks.md, stop 37)
                            paired_best_constant=max(constants, key=paired.get) if constants else None,
                            paired_vs_best=paired["cost-aware"] / max(paired[n] for n in constants) if constants else None,
                            stats=stats, exact=exact,
                            held_out_vs_best=held_out_vs_best(paired_by_pass(tokens, times), constants),
                            vs_best_interval=bootstrap_interval(per_batch, "cost-aware", best_constant) if constants else None,
                            per_batch=per_batch)
                results.append(cell)
                print(json.dumps({k: v for k, v in cell.items() if k not in ("rates", "stats", "speedup", "per_batch")}),
                      flush=True)
                Path(args.out).write_text(json.dumps(results, indent=1))


def paired_by_pass(tokens: dict, times: dict) -> dict[str, list[float]]:
    """Each method's rate over the target's, pass by pass."""
    base = [n / t for n, t in zip(tokens["target alone"], times["target alone"])]
    return {name: [n / t / b for n, t, b in zip(tokens[name], times[name], base)] for name in tokens}


def held_out_vs_best(paired: dict[str, list[float]], constants: list[str]) -> float | None:
    """``cost-aware`` against the best constant k chosen on the other passes: the median over passes.

    The best of several constants measured on the same passes is the best plus whatever noise
    favoured it (the winner's curse): with the constants within a few percent of each other, the
    maximum of their noisy rates overstates the best by about one spread of a pass. Chosen on the
    other passes, the constant's rate on this one carries no such bias. None with fewer than 2 passes."""
    passes = len(paired["cost-aware"])
    if passes < 2 or not constants:
        return None
    ratios = []
    for r in range(passes):
        chosen = max(constants, key=lambda name: statistics.median(v for i, v in enumerate(paired[name]) if i != r))
        ratios.append(paired["cost-aware"][r] / paired[chosen][r])
    return statistics.median(ratios)


def bootstrap_interval(per_batch: dict, name: str, other: str, draws: int = 2000, seed: int = 0) -> list[float]:
    """The 5th and 95th percentiles of ``name``'s rate over ``other``'s, the batches of every pass resampled
    with replacement (each method's tokens over its seconds in the resampled batches; a batch's pair of
    methods ran back to back, so a batch is resampled for both at once)."""
    units = [(a, b) for pass_a, pass_b in zip(per_batch[name], per_batch[other]) for a, b in zip(pass_a, pass_b)]
    rng = random.Random(seed)
    ratios = []
    for _ in range(draws):
        sample = [units[rng.randrange(len(units))] for _ in units]
        mine = sum(a[0] for a, _ in sample) / sum(a[1] for a, _ in sample)
        theirs = sum(b[0] for _, b in sample) / sum(b[1] for _, b in sample)
        ratios.append(mine / theirs)
    ratios.sort()
    return [ratios[int(0.05 * draws)], ratios[int(0.95 * draws) - 1]]


if __name__ == "__main__":
    main()
