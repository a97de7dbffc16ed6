"""How often a fresh ``cost-aware`` stays on plain steps through a pass where drafting pays.

    OMP_NUM_THREADS=1 python benchmarks/stuck_passes.py [--seeds 10] [--passes 4] [--mode sampled]

The bundled pair, batch 1, the model drafter: for each seed a new policy decodes the first
``--prompts`` prompts ``--passes`` times (it keeps what it measured across requests, as in a
server), and each pass reports its seconds and the mean k the policy chose. A pass is stuck when
that mean is under ``--stuck-below`` drafts per step. The count is the measure: on a shared host
seconds drift between runs, while a stuck pass is a decision, and it took a third longer than its
neighbours in stop 28 and 29 (docs/benchmarks.md). Timing-driven, so counts differ between runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's specdec, not an installed copy

from specdec import SpeculativeDecoder  # noqa: E402
from bundled_pair import generation_options, load_bundled_pair  # noqa: E402
from specdec.core.components import Observer  # noqa: E402
from specdec.drafters import ModelDrafter  # noqa: E402
from specdec.policies import CostAwareLookahead  # noqa: E402
from specdec.verifiers import GreedyVerifier, RejectionVerifier  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@attrs.define(eq=False)
class ChosenK(Observer):
    """The k the policy chose at every step."""

    policy: CostAwareLookahead
    ks: list = attrs.field(factory=list)
    name = "chosen-k"

    def on_step(self, state, step) -> None:
        self.ks.append(self.policy.decision.k if self.policy.decision is not None else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--passes", type=int, default=4, help="passes over the prompts per seed (the first one too)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--mode", choices=("sampled", "greedy"), default="sampled",
                        help="sampled: temperature 0.7, top-p 0.9 (the cell stop 28 found stuck)")
    parser.add_argument("--stuck-below", type=float, default=0.8, help="a pass's mean k under this is stuck")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    torch.set_num_threads(1)
    target, tokenizer, draft, prompts = load_bundled_pair()
    prompts = prompts[: args.prompts]
    encoded = [tokenizer([p], return_tensors="pt") for p in prompts]
    sampling = generation_options(args.mode == "sampled")
    verifier = RejectionVerifier() if args.mode == "sampled" else GreedyVerifier()
    runs = []
    for seed in range(args.seeds):
        policy = CostAwareLookahead()
        chosen = ChosenK(policy)
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft), policy=policy, verifier=verifier,
                                     observers=[chosen])
        generator = torch.Generator().manual_seed(seed)
        passes = []
        for _ in range(args.passes):
            start, began = len(chosen.ks), time.perf_counter()
            for e in encoded:
                decoder.generate(**e, max_new_tokens=args.max_new_tokens, generator=generator, **sampling)
            ks = chosen.ks[start:]
            passes.append(dict(seconds=time.perf_counter() - began, k_mean=sum(ks) / max(len(ks), 1)))
        stuck = sum(p["k_mean"] < args.stuck_below for p in passes)
        runs.append(dict(seed=seed, passes=passes, stuck=stuck))
        shown = ", ".join(f"{p['seconds']:.2f} s k {p['k_mean']:.2f}" for p in passes)
        print(f"seed {seed}: {shown}{f'  ({stuck} stuck)' if stuck else ''}", flush=True)
    total = sum(r["stuck"] for r in runs)
    seconds = [p["seconds"] for r in runs for p in r["passes"]]
    print(f"stuck passes: {total} of {args.seeds * args.passes} (mean k under {args.stuck_below}); "
          f"seconds per pass: median {statistics.median(seconds):.2f}")
    if args.json:
        args.json.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, runs=runs,
                                             stuck=total), indent=1))


if __name__ == "__main__":
    main()
