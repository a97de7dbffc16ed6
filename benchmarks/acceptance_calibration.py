"""Batch 1 on the bundled pair: does a row's acceptance estimate in ``cost-aware`` say anything?

    OMP_NUM_THREADS=1 python benchmarks/acceptance_calibration.py --drafter model --sampled --prompts 24 \
        [--max-new-tokens 128] [--options prior_strength=96 alpha_decay=0.97]

Runs ``cost-aware`` (with ``--options``) prompt by prompt, and for every drafted iteration records
the acceptance the policy read for the row when it chose k (``_row_alphas``), the pooled acceptance
where the row was in its text (``pooled_at``) and what the target then kept: accepted drafts and
whether one was rejected, the policy's own truncation-aware counts. It prints the realised
acceptance (accepted / (accepted + rejections)) against the predicted one, overall, per octave of
tokens generated, and per bin of the prediction. A row estimate that carries information rises
with its bins; one that is noise about the pool realises the pool's rate in every bin, and then
every choice it moves is a choice the pool would have made better (docs/benchmarks.md, stop 56).
No timing is read: the numbers do not depend on the machine, only the texts (sampled with one
generator, seeded) and the policy's choices do.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bundled_pair import add_run_arguments, bundled_decoder, generation_options, load_bundled_pair  # noqa: E402

from specdec.config import parse_options  # noqa: E402
from specdec.errors import ConfigError  # noqa: E402
from specdec.policies import CostAwareLookahead  # noqa: E402
from specdec.policies.cost_aware import generated_bucket  # noqa: E402

BINS = ((0.0, 0.6), (0.6, 0.7), (0.7, 0.8), (0.8, 0.9), (0.9, 1.0))


def summary(records: list[tuple], label: str) -> str:
    accepted = sum(r[3] for r in records)
    rejected = sum(r[4] for r in records)
    return (f"{label:<22} {len(records):5d} {sum(r[0] for r in records) / len(records):10.3f} "
            f"{sum(r[1] for r in records) / len(records):8.3f} {accepted / max(accepted + rejected, 1):9.3f} "
            f"{sum(r[5] for r in records) / len(records):7.2f}")


def main():
    parser = argparse.ArgumentParser()
    add_run_arguments(parser, prompts=24, passes=1)
    parser.add_argument("--options", nargs="*", default=[], help="cost-aware options, name=value")
    args = parser.parse_args()
    try:  # before the models load: a mistyped option is an error at once, not after them
        policy = CostAwareLookahead(**parse_options("policy", "cost-aware", args.options, "--options"))
    except (ConfigError, ValueError) as exc:  # a name it does not have, or a value its validators refuse
        parser.error(str(exc))
    torch.set_num_threads(1)
    target, tokenizer, draft, prompts = load_bundled_pair()
    records, chosen = [], {}
    plan, on_step = policy.plan, policy.on_step

    def recorded_plan(state, alpha=None):
        widths = plan(state, alpha)
        generated = policy._generated[0]
        chosen.update(k=int(widths[0]), alpha=policy._row_alphas([0])[0], pool=policy.pooled_at(generated),
                      octave=generated_bucket(generated))
        return widths

    def recorded_step(state, step):
        drafted, accepted = int(step.drafted_host[0]), int(step.accepted_host[0])
        if chosen.get("k", 0) > 0 and drafted > 0:
            records.append((chosen["alpha"], chosen["pool"], chosen["octave"], accepted,
                            1 if accepted < drafted else 0, chosen["k"]))
        on_step(state, step)

    policy.plan, policy.on_step = recorded_plan, recorded_step
    decoder = bundled_decoder(target, draft, args.drafter, policy, args.sampled)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(args.passes):
            for prompt in prompts[: args.prompts]:
                encoded = tokenizer([prompt], return_tensors="pt")
                decoder.generate(**encoded, max_new_tokens=args.max_new_tokens, generator=generator,
                                 **generation_options(args.sampled))
    print(f"{'drafted iterations':<22} {'n':>5} {'predicted':>10} {'pool':>8} {'realised':>9} {'mean k':>7}")
    print(summary(records, "all"))
    for octave in sorted({r[2] for r in records}):
        print(summary([r for r in records if r[2] == octave], f"octave {octave}"))
    for low, high in BINS:
        inside = [r for r in records if low <= r[0] < high]
        if inside:
            print(summary(inside, f"predicted {low:.1f}-{high:.1f}"))


if __name__ == "__main__":
    main()
