"""What one ``specdec generate`` call gets from ``cost-aware``: a policy built for that call alone.

    OMP_NUM_THREADS=1 python benchmarks/cold_start.py [--drafter model|ngram] [--sampled] [--prompts 16] [--passes 3]
        [--batch-size 1] [--variant OPTION=VALUE ...]

``policy_grid.py`` keeps one ``cost-aware`` across its passes, so that after the first its cost fit
and pooled acceptance are warm; the CLI builds the policy anew for every call. Here, call by call
on the bundled pair (one prompt, or ``--batch-size`` prompts, per call), in an order that rotates
every call: the target alone, constant k = 5 (the default), ``cost-aware`` built for this call
("cold"), one built for this call from the ``memory`` file the calls before it wrote ("remembered",
what ``specdec generate`` does since stop 50; the file starts empty) and one kept across the run
("warm", cold on its first calls). Each ``--variant`` adds a
cold one with that option changed (``--variant prior_strength=4``; the value is read as JSON).
Prints, per pass, each contender's tokens per second over the target's in that pass, and the
share of the cost-aware policies' iterations that were plain steps.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's specdec, not an installed copy

from specdec.policies import ConstantLookahead, CostAwareLookahead  # noqa: E402

from bundled_pair import add_run_arguments, bundled_decoder, generation_options, load_bundled_pair  # noqa: E402


@attrs.define(eq=False)
class Counted(CostAwareLookahead):
    """``cost-aware`` that keeps the width of every lookahead it returns."""

    widths: list = attrs.field(factory=list, init=False)

    def lookahead(self, state):
        out = super().lookahead(state)
        self.widths.append(int(out.max()))
        return out


def plain_share(widths: list[int]) -> float:
    return sum(w == 0 for w in widths) / max(len(widths), 1)


def main():
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--variant", action="append", default=[], metavar="OPTION=VALUE",
                        help="a cold cost-aware with this option (a JSON value), beside the default one")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    for flag, value in (("--prompts", args.prompts), ("--passes", args.passes), ("--max-new-tokens", args.max_new_tokens),
                        ("--batch-size", args.batch_size)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    variants = {}
    for variant in args.variant:
        option, equals, value = variant.partition("=")
        if not equals:
            parser.error(f"--variant {variant}: expected OPTION=VALUE, e.g. prior_strength=4")
        try:
            variants[f"cost-aware, cold, {variant}"] = {option: json.loads(value)}
            Counted(**variants[f"cost-aware, cold, {variant}"])
        except (ValueError, TypeError) as error:
            parser.error(f"--variant {variant}: {error}")
    torch.set_num_threads(1)
    sampling = generation_options(args.sampled)
    target, tokenizer, draft, prompts = load_bundled_pair()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = prompts[: args.prompts]
    encoded = [tokenizer(prompts[i : i + args.batch_size], return_tensors="pt", padding=True)
               for i in range(0, len(prompts), args.batch_size)]
    warm = Counted()
    warm_decoder = bundled_decoder(target, draft, args.drafter, warm, args.sampled)
    constant = bundled_decoder(target, draft, args.drafter, ConstantLookahead(k=5), args.sampled)
    memory = Path(tempfile.mkdtemp(prefix="cold-start-")) / "cost-aware.json"
    widths: dict[str, list[int]] = {name: [] for name in ("cost-aware, cold", "cost-aware, remembered", *variants)}
    widths["cost-aware, warm"] = warm.widths

    def cold(name, options):
        def run(e, generator):
            policy = Counted(**options)
            out = bundled_decoder(target, draft, args.drafter, policy, args.sampled).generate(
                **e, max_new_tokens=args.max_new_tokens, generator=generator, **sampling)
            widths[name].extend(policy.widths)
            return out.sequences
        return run

    methods = {
        "target alone": lambda e, g: target.generate(**e, pad_token_id=pad, max_new_tokens=args.max_new_tokens, **sampling),
        "constant k=5": lambda e, g: constant.generate(**e, max_new_tokens=args.max_new_tokens, generator=g, **sampling).sequences,
        "cost-aware, cold": cold("cost-aware, cold", {}),
        "cost-aware, remembered": cold("cost-aware, remembered", {"memory": str(memory)}),
        **{name: cold(name, options) for name, options in variants.items()},
        "cost-aware, warm": lambda e, g: warm_decoder.generate(**e, max_new_tokens=args.max_new_tokens, generator=g,
                                                               **sampling).sequences,
    }
    order, turn, passes = list(methods), 0, []
    for index in range(args.passes):
        tokens = dict.fromkeys(methods, 0)
        seconds = dict.fromkeys(methods, 0.0)
        marks = {name: len(w) for name, w in widths.items()}
        for number, e in enumerate(encoded):
            shift = turn % len(order)
            turn += 1
            for name in order[shift:] + order[:shift]:
                torch.manual_seed(number)  # the target's own sampling
                generator = torch.Generator().manual_seed(number)
                start = time.perf_counter()
                sequences = methods[name](e, generator)
                seconds[name] += time.perf_counter() - start
                tokens[name] += int((sequences[:, e["input_ids"].shape[1]:] != pad).sum())
        base = tokens["target alone"] / seconds["target alone"]
        row = dict(pass_=index, vs_target={n: (tokens[n] / seconds[n]) / base for n in methods},
                   plain_share={n: plain_share(w[marks[n]:]) for n, w in widths.items()})
        passes.append(row)
        print(f"pass {index}: " + ", ".join(f"{n} {r:.3f}x" for n, r in row["vs_target"].items())
              + "; plain steps: " + ", ".join(f"{n.removeprefix('cost-aware, ')} {r:.0%}" for n, r in row["plain_share"].items()),
              flush=True)
    later = passes[1:] or passes
    print("median over passes: " + ", ".join(
        f"{n} {statistics.median(p['vs_target'][n] for p in passes):.3f}x" for n in methods)
        + f" (warm after its first pass: {statistics.median(p['vs_target']['cost-aware, warm'] for p in later):.3f}x)")
    if args.json:
        args.json.write_text(json.dumps(dict(args=vars(args) | {"json": str(args.json)}, passes=passes), indent=1))
    shutil.rmtree(memory.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
