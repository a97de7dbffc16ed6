"""The bundled pair's draft model in float32 against bfloat16 weights (the drafters'
``matmul_precision``: "highest" against the default "auto"), constant k = 5 and ``cost-aware``,
greedy, against the target's own ``generate``; with a contender's name ending in ``unscreened``, the
target's LM head read in float32 at every verify (``screened_head=False``; by default greedy verifies
screen it in bfloat16 where this CPU runs that faster, core/screened_head.py).

One process; every contender runs every batch of the held-out prompts in turn, the order rotated
per batch and repeat; speedups are per repeat (sums of seconds) and shown as the median with the
spread; rows are compared with ``generate``'s.

    OMP_NUM_THREADS=1 python benchmarks/draft_precision.py --batch-sizes 1,4,16 --repeats 3
    OMP_NUM_THREADS=1 python benchmarks/draft_precision.py --contenders "k=5 auto,k=5 auto unscreened"
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from specdec import SpeculativeDecoder, bundled_pair_path  # noqa: E402
from specdec.core.packed_linear import cpu_name  # noqa: E402
from specdec.drafters import ModelDrafter  # noqa: E402
from specdec.policies import ConstantLookahead, CostAwareLookahead  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contenders", type=lambda text: [n.strip() for n in text.split(",")],
                        default=[f"{policy} {precision}" for policy in ("k=5", "cost-aware") for precision in ("highest", "auto")],
                        help='"<k=5|cost-aware> <highest|auto>[ unscreened]", comma-separated')
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    pair = bundled_pair_path()
    tokenizer = AutoTokenizer.from_pretrained(pair, padding_side="left")
    target, draft = (AutoModelForCausalLM.from_pretrained(pair / name, dtype=torch.float32).eval()
                     for name in ("target", "draft"))
    prompts = [json.loads(line)["prompt"] for line in (pair / "prompts.jsonl").read_text().splitlines()][: args.prompts]
    names = ["target"] + args.contenders
    decoders = {name: SpeculativeDecoder(target=target, drafter=ModelDrafter(draft, matmul_precision=name.split()[1]),
                                         policy=ConstantLookahead(k=5) if name.startswith("k=5") else CostAwareLookahead(),
                                         screened_head=not name.endswith(" unscreened"))
                for name in names[1:]}
    generation = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    @torch.no_grad()
    def run(name, inputs):
        if name == "target":
            return target.generate(**inputs, **generation)
        return decoders[name].generate(**inputs, **generation).sequences

    print(f"# {cpu_name()}, {args.threads} thread(s), torch {torch.__version__}")
    print("| batch | contender | speedup vs generate (median, min-max) | identical batches |")
    print("|---:|---|---:|---:|")
    for batch in (int(size) for size in args.batch_sizes.split(",")):
        groups = [tokenizer(prompts[start : start + batch], return_tensors="pt", padding=True)
                  for start in range(0, len(prompts) - batch + 1, batch)]
        for name in names:  # untimed: packing, the bfloat16 timings, the first calls' allocations
            run(name, groups[0])
        seconds = {name: [0.0] * args.repeats for name in names}
        identical = dict.fromkeys(names, 0)
        for repeat in range(args.repeats):
            for g, inputs in enumerate(groups):
                shift = (repeat + g) % len(names)
                outputs = {}
                for name in names[shift:] + names[:shift]:
                    started = time.perf_counter()
                    outputs[name] = run(name, inputs)
                    seconds[name][repeat] += time.perf_counter() - started
                for name in names:
                    identical[name] += torch.equal(outputs[name], outputs["target"])
        for name in names[1:]:
            ratios = [seconds["target"][r] / seconds[name][r] for r in range(args.repeats)]
            print(f"| {batch} | {name} | {statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f}) | "
                  f"{identical[name]}/{args.repeats * len(groups)} |", flush=True)


if __name__ == "__main__":
    main()
