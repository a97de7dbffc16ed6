"""Where the time of one speculative iteration goes (batch 1, the bundled pair, greedy).

    python benchmarks/profile_loop.py [--prompts 8] [--max-new-tokens 64]

Prints ms per iteration and cProfile's top functions by own time: the share spent in the models'
forwards versus the loop's own bookkeeping.
"""

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

from specdec.plugins.config import SpecdecConfig

ROOT = Path(__file__).resolve().parent.parent

parser = argparse.ArgumentParser()
parser.add_argument("--config", default=str(ROOT / "plugins.toml"))
parser.add_argument("--prompts", type=int, default=8)
parser.add_argument("--max-new-tokens", type=int, default=64)
args = parser.parse_args()

config = SpecdecConfig.from_toml(args.config)
target, tokenizer = config.load_target()
decoder = config.build_decoder(target=target)
lines = (ROOT / "models/python-pair/prompts.jsonl").read_text().splitlines()[: args.prompts]
batches = [tokenizer([json.loads(line)["prompt"]], return_tensors="pt") for line in lines]
for batch in batches[:2]:  # warm-up
    decoder.generate(**batch, max_new_tokens=args.max_new_tokens)

profile = cProfile.Profile()
iterations, start = 0, time.perf_counter()
profile.enable()
for batch in batches:
    iterations += decoder.generate(**batch, max_new_tokens=args.max_new_tokens).stats.iterations
profile.disable()
elapsed = time.perf_counter() - start
print(f"{elapsed / iterations * 1000:.1f} ms per iteration over {iterations} iterations (profiled)")
pstats.Stats(profile).sort_stats("tottime").print_stats(20)
