"""Batch 1 on the bundled pair: what a lookahead that moves costs against a constant one, per phase.

    OMP_NUM_THREADS=1 python benchmarks/width_mix.py --drafter model --sampled --ks 4,5 --cycles 3/5 3/4/5 \
        [--variants alpha_decay=0.95] --prompts 16 --passes 2

Contenders, prompt by prompt in a rotating order after an untimed warm-up on 4 prompts: ``cost-aware``
(untraced), each ``--variants`` entry (``cost-aware`` with those options), constant k for each of
``--ks``, and for each ``--cycles`` entry a policy that cycles through those widths (3/5: 3, 5, 3,
...). Per contender: tokens per second, tokens per iteration, and ``PhaseTimes``' milliseconds per
iteration (lookahead, draft, verify, commit, bookkeeping). A cycle of mean width k against constant
k shows the two costs of a k that moves: fewer tokens (they are concave in k) and dearer iterations
(docs/benchmarks.md, stop 55). Sampled texts differ per contender (one generator for all), so
tokens per iteration vary by a few percent between runs.
"""

import argparse
import collections
import sys
import time
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bundled_pair import add_run_arguments, bundled_decoder, generation_options, load_bundled_pair  # noqa: E402

from specdec.config import parse_options  # noqa: E402
from specdec.errors import ConfigError  # noqa: E402
from specdec.core.components import LookaheadPolicy  # noqa: E402
from specdec.observers.phases import PHASES, PhaseTimes  # noqa: E402
from specdec.policies import ConstantLookahead, CostAwareLookahead  # noqa: E402


@attrs.define(eq=False)
class Cycle(LookaheadPolicy):
    """k = ``widths[0]``, ``widths[1]``, ... in turn, one per iteration."""

    name = "cycle"
    widths: tuple = (3, 5)
    _turn: int = 0

    def lookahead(self, state) -> torch.Tensor:
        self._turn += 1
        return torch.full((state.active,), self.widths[self._turn % len(self.widths)], dtype=torch.long)


def main():
    parser = argparse.ArgumentParser()
    add_run_arguments(parser, prompts=16, passes=2)
    parser.add_argument("--ks", default="4,5", help="constant lookaheads")
    parser.add_argument("--cycles", nargs="*", default=[], help="widths cycled through, e.g. 3/5")
    parser.add_argument("--variants", nargs="*", default=[], help="more cost-aware contenders, name=value[,name=value]")
    args = parser.parse_args()
    policies = {"cost-aware": CostAwareLookahead()}
    try:  # before the models load: a mistyped variant is an error at once, not after them
        for variant in args.variants:
            policies[f"cost-aware {variant}"] = CostAwareLookahead(**parse_options("policy", "cost-aware", variant.split(","), "--variants"))
    except (ConfigError, ValueError) as exc:  # a name it does not have, or a value its validators refuse
        parser.error(str(exc))
    torch.set_num_threads(1)
    target, tokenizer, draft, prompts = load_bundled_pair()
    sampling = generation_options(args.sampled)
    for k in args.ks.split(","):
        policies[f"k={k}"] = ConstantLookahead(k=int(k))
    for cycle in args.cycles:
        policies[f"cycle {cycle}"] = Cycle(widths=tuple(int(w) for w in cycle.split("/")))
    phases = {name: PhaseTimes() for name in policies}
    decoders = {name: bundled_decoder(target, draft, args.drafter, policy, args.sampled, observers=[phases[name]])
                for name, policy in policies.items()}
    encoded = [tokenizer([p], return_tensors="pt") for p in prompts[: args.prompts]]
    names, seconds, tokens = list(decoders), collections.Counter(), collections.Counter()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for e in encoded[:4]:
            for name in names:
                decoders[name].generate(**e, max_new_tokens=args.max_new_tokens, generator=generator, **sampling)
        for observer in phases.values():
            observer.reset()
        for r in range(args.passes):
            for i, e in enumerate(encoded):
                shift = (i + r) % len(names)
                for name in names[shift:] + names[:shift]:
                    start = time.perf_counter()
                    out = decoders[name].generate(**e, max_new_tokens=args.max_new_tokens, generator=generator, **sampling)
                    seconds[name] += time.perf_counter() - start
                    tokens[name] += out.sequences.shape[1] - e["input_ids"].shape[1]
    for name in names:
        observer = phases[name]
        iterations = max(observer.iterations, 1)
        per = {phase: 1000 * observer.seconds[phase] / iterations for phase in PHASES}
        print(f"{name}: {tokens[name] / seconds[name]:.1f} tok/s, {observer.iterations} iterations, "
              f"{tokens[name] / iterations:.3f} tok/iter, " + ", ".join(f"{k} {v:.3f}" for k, v in per.items())
              + f" ms; total {sum(per.values()):.2f} ms/iter")


if __name__ == "__main__":
    main()
