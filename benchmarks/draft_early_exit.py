"""Ending a draft early (a host sync per draft position) vs masking stopped rows, on the bundled pair.

    OMP_NUM_THREADS=1 python benchmarks/draft_early_exit.py [--batch-sizes 1,16] [--prompts 16]
        [--max-new-tokens 64] [--repeats 3] [--policy draft-confidence] [--threshold 0.4]

Both settings decode the same prompts with the same policy, interleaved (the order swaps every
repeat); prints the median seconds, draft forwards and the ratio. Greedy output is the same by
construction (checked here too).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's specdec, not an installed copy

from specdec import SpeculativeDecoder  # noqa: E402
from specdec.config import SpecdecConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

parser = argparse.ArgumentParser()
parser.add_argument("--config", default=str(ROOT / "plugins.toml"))
parser.add_argument("--batch-sizes", default="1,16")
parser.add_argument("--prompts", type=int, default=16)
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--policy", default="draft-confidence")
parser.add_argument("--threshold", type=float, default=0.4)
parser.add_argument("--max-tokens", type=int, default=8)
args = parser.parse_args()
torch.set_num_threads(1)

config = SpecdecConfig.from_toml(args.config).with_choices(
    policy=args.policy, policy_options=dict(threshold=args.threshold, max_tokens=args.max_tokens))
target, tokenizer = config.load_target()
decoders = {}
for exit_early in (True, False):
    decoder = SpeculativeDecoder.from_config(config, target=target)
    decoder.draft_early_exit = exit_early
    decoders["early exit (sync)" if exit_early else "masked (no sync)"] = decoder
lines = (ROOT / "models/python-pair/prompts.jsonl").read_text().splitlines()[: args.prompts]
prompts = [json.loads(line)["prompt"] for line in lines]

for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
    batches = [tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True)
               for i in range(0, len(prompts), batch_size)]
    times = {name: [] for name in decoders}
    calls, outputs = {}, {}
    for repeat in range(args.repeats + 1):  # the first round warms up
        order = list(decoders.items()) if repeat % 2 == 0 else list(decoders.items())[::-1]
        for name, decoder in order:
            start = time.perf_counter()
            outs = [decoder.generate(**b, max_new_tokens=args.max_new_tokens) for b in batches]
            if repeat:
                times[name].append(time.perf_counter() - start)
            calls[name] = sum(o.stats.draft_calls for o in outs)
            outputs[name] = [o.sequences for o in outs]
    same = all(torch.equal(a, b) for a, b in zip(*outputs.values()))
    medians = {name: statistics.median(t) for name, t in times.items()}
    first = next(iter(medians.values()))
    for name, seconds in medians.items():
        print(f"batch {batch_size:3d}  {name:18s} {seconds:7.2f} s  draft forwards {calls[name]:5d}  "
              f"time vs early exit {seconds / first:.3f}  same output: {same}")
