"""Constant k against ``cost-aware`` (and another checkout's ``cost-aware``), prompt by prompt.

    OMP_NUM_THREADS=1 python benchmarks/interleaved_ab.py [--drafter ngram|model] [--batch-size 1] \
        [--num-prompts 8] [--repeats 8] [--ks 0,1,2] [--greedy] [--baseline PATH/TO/OTHER/CHECKOUT ...]

On a shared 2-vCPU host the load drifts over seconds: a pass of 8 prompts (about 8 s) per
contender, as ``policy_grid.py`` times them, lands on a different load each, and the same
constant k read 7.8-9.0 s in three passes minutes apart (stop 42). Here every contender decodes
each batch of ``--batch-size`` prompts in turn (the order rotating from batch to batch), so a
slow stretch of the host hits them all alike, and the rates (new tokens per second) over
``--repeats`` passes are compared: sampled contenders draw different texts, which end (eos) at
different lengths. Sampled (temperature 0.7, top-p 0.9, rejection sampling) unless ``--greedy``; each
pass seeds every contender's generator alike. Each ``--baseline`` names another checkout (a
``git worktree`` of an earlier commit) whose ``specdec/policies/cost_aware.py`` runs as a contender of
its own, on this checkout's loop, so that a change to the policy is measured against the code
before it in the same run. ``cost-aware`` keeps what it measured across batches and passes, as
in a server.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's specdec, not an installed copy

from specdec.policies import ConstantLookahead, CostAwareLookahead  # noqa: E402

from bundled_pair import bundled_decoder, load_bundled_pair  # noqa: E402


def baseline_policy(checkout: Path, index: int):
    """The ``CostAwareLookahead`` class of another checkout, loaded beside this one's."""
    path = checkout / "specdec/policies/cost_aware.py"
    if not path.is_file():
        raise SystemExit(f"--baseline: {path} does not exist")
    from specdec.core.state import DecodeState
    if not hasattr(DecodeState, "generated_host"):  # what checkouts before stop 42 read
        DecodeState.generated_host = lambda state: torch.tensor(state.progress_host()[0])
        DecodeState.remaining_host = lambda state: torch.tensor(state.progress_host()[1])
    spec = importlib.util.spec_from_file_location(f"specdec.policies.cost_aware_baseline{index}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CostAwareLookahead


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--drafter", choices=("ngram", "model"), default="ngram")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ks", default="0,1,2", help="constant ks, comma-separated; the first is what ratios are to")
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--baseline", type=Path, nargs="*", default=[], help="other checkouts whose cost-aware runs too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, tokenizer, draft, prompts = load_bundled_pair()
    sampling = dict(do_sample=False) if args.greedy else dict(do_sample=True, temperature=0.7, top_p=0.9)

    def make(policy):
        return bundled_decoder(target, draft, args.drafter, policy, sampled=not args.greedy)

    ks = [int(k) for k in args.ks.split(",")]
    decoders = {f"constant k={k}": make(ConstantLookahead(k=k)) for k in ks}
    for index, checkout in enumerate(args.baseline):
        decoders[f"cost-aware ({checkout.name})"] = make(baseline_policy(checkout, index)())
    decoders["cost-aware"] = make(CostAwareLookahead())
    chunks = [prompts[i : i + args.batch_size] for i in range(0, args.num_prompts, args.batch_size)]
    encoded = [tokenizer(chunk, return_tensors="pt", padding=True) for chunk in chunks]
    totals = collections.defaultdict(list)  # name -> seconds per pass
    produced = collections.defaultdict(list)  # name -> new tokens per pass
    for repeat in range(args.repeats):
        generators = {name: torch.Generator().manual_seed(repeat) for name in decoders}
        seconds, tokens = collections.Counter(), collections.Counter()
        for index, batch in enumerate(encoded):
            order = list(decoders.items())
            order = order[index % len(order):] + order[: index % len(order)]
            for name, decoder in order:
                start = time.perf_counter()
                out = decoder.generate(**batch, max_new_tokens=args.max_new_tokens, generator=generators[name], **sampling)
                seconds[name] += time.perf_counter() - start
                tokens[name] += out.stats.new_tokens
        for name in decoders:
            totals[name].append(seconds[name])
            produced[name].append(tokens[name])
        print(f"pass {repeat}: " + ", ".join(f"{name} {seconds[name]:.2f} s {tokens[name]} tokens" for name in decoders),
              flush=True)

    def rate(name, passes=None):
        passes = range(args.repeats) if passes is None else passes
        return sum(produced[name][p] for p in passes) / sum(totals[name][p] for p in passes)

    reference = f"constant k={ks[0]}"
    best = max((name for name in decoders if name.startswith("constant")), key=rate)
    for name in decoders:
        ratios = [rate(name, [p]) / rate(reference, [p]) for p in range(args.repeats)]
        print(f"{name:24s} {sum(totals[name]):8.2f} s {sum(produced[name]):6d} tokens  "
              f"{rate(name) / rate(reference):.3f}x of {reference}, {rate(name) / rate(best):.3f} of the best "
              f"constant ({best}); per pass " + " ".join(f"{r:.3f}" for r in ratios))


if __name__ == "__main__":
    main()
