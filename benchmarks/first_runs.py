"""What an iteration's first run at its batch size and width costs against the runs after it.

    OMP_NUM_THREADS=1 python benchmarks/first_runs.py [--drafter model|ngram] [--device cpu|cuda] \
        [--dtype float32|bfloat16|float16] [--max-new-tokens 64] [--compile none|draft|all] [--passes 1]

On the bundled pair, in a fresh process, ``cost-aware`` (logging every iteration it could time,
``batch_trace.Traced``) decodes 16 held-out prompts at batch 16, then at 4, then 4 prompts at 1,
greedy. Per (batch size, width, after a drafted iteration or not): how many runs, the first one's
milliseconds, the median of the rest, and their ratio. Where first runs are dear (a GPU loads and
chooses kernels, reserves memory), ``cost-aware`` leaves them untimed off the CPU
(``docs/strategies.md``, "a shape's first run"); this is the measurement behind doing so or not.
With ``--compile`` (static caches, the steps through torch.compile) a shape's first run compiles
it, and ``cost-aware`` leaves every iteration in which a graph was made untimed; ``--passes`` runs
the three batch sizes again, and each request's seconds and the k it chose show whether the policy
drafts once the graphs are made.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import attrs
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batch_trace import Traced  # noqa: E402
from bundled_pair import bundled_decoder, load_bundled_pair  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--drafter", choices=("model", "ngram"), default="model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--compile", choices=("none", "draft", "all"), default="none")
    parser.add_argument("--passes", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, tokenizer, draft, prompts = load_bundled_pair()
    dtype = getattr(torch, args.dtype)
    target, draft = target.to(args.device, dtype), draft.to(args.device, dtype)
    policy = Traced()
    policy.log = []
    decoder = bundled_decoder(target, draft, args.drafter, policy, False)
    if args.compile != "none":
        decoder = attrs.evolve(decoder, static_cache=True, compile=args.compile)
    for index in range(args.passes):
        for batch, count in ((16, 16), (4, 16), (1, 4)):
            seconds, chosen = 0.0, collections.Counter()
            for start in range(0, count, batch):
                encoded = tokenizer(prompts[start : start + batch], return_tensors="pt", padding=True).to(args.device)
                before, started = len(policy.log), time.perf_counter()
                decoder.generate(**encoded, max_new_tokens=args.max_new_tokens, do_sample=False)
                seconds += time.perf_counter() - started
                chosen.update(entry["k"] for entry in policy.log[before:] if "k" in entry)
            costs = {k: round(1e3 * c, 1) for k, c in (policy.decision.costs or {}).items() if k <= 4}
            print(f"pass {index}, batch {batch}: {seconds:.2f} s, k chosen {dict(sorted(chosen.items()))}; "
                  f"{policy._probes} probes so far, probing {policy._backoff}x rarer, last costs (ms) {costs}", flush=True)
    runs = collections.defaultdict(list)
    for entry in policy.log:
        if "seconds" in entry and entry["iteration"] > 0 and not entry["first"]:
            runs[(entry["batch"], entry["width"], entry["after_drafting"])].append(1e3 * entry["seconds"])
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"{device}, {args.dtype}, drafter {args.drafter}: iterations by (batch, width, after a drafted one)")
    print("batch width after-drafted runs  first ms  rest median ms  first/rest")
    ratios = []
    for (batch, width, warm), times in sorted(runs.items()):
        if len(times) < 2:
            continue
        rest = statistics.median(times[1:])
        ratios.append(times[0] / rest)
        print(f"{batch:5d} {width:5d} {str(warm):>12} {len(times):4d} {times[0]:9.1f} {rest:15.1f} {times[0] / rest:11.2f}")
    compiled = [entry["compiled_seconds"] for entry in policy.log if "compiled_seconds" in entry]
    if compiled:
        print(f"{len(compiled)} iterations compiled (not timed, not above): median {statistics.median(compiled):.2f} s, "
              f"max {max(compiled):.2f} s")
    if ratios:
        print(f"first/rest over {len(ratios)} shapes: median {statistics.median(ratios):.2f}, "
              f"range {min(ratios):.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()
