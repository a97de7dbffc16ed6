"""Where the time of one speculative iteration goes (the bundled pair; greedy unless --temperature).

    python benchmarks/profile_loop.py [--prompts 8] [--batch-size 1] [--max-new-tokens 64]
        [--temperature 0.7 --top-p 0.9]

Prints ms per iteration and cProfile's top functions by own time: the share spent in the models'
forwards versus the loop's own bookkeeping.
"""

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

from specdec import SpeculativeDecoder
from specdec.config import SpecdecConfig

ROOT = Path(__file__).resolve().parent.parent

parser = argparse.ArgumentParser()
parser.add_argument("--config", default=str(ROOT / "plugins.toml"))
parser.add_argument("--prompts", type=int, default=8)
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--batch-size", type=int, default=1)
parser.add_argument("--temperature", type=float, default=0.0)
parser.add_argument("--top-p", type=float, default=1.0)
parser.add_argument("--sort", default="tottime", help="pstats order: tottime or cumtime")
parser.add_argument("--top", type=int, default=20, help="functions to print")
args = parser.parse_args()

config = SpecdecConfig.from_toml(args.config)
target, tokenizer = config.load_target()
sampling = {}
if args.temperature > 0:
    config = config.with_choices(verifier="rejection")
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p)
decoder = SpeculativeDecoder.from_config(config, target=target)
lines = (ROOT / "models/python-pair/prompts.jsonl").read_text().splitlines()[: args.prompts]
prompts = [json.loads(line)["prompt"] for line in lines]
batches = [
    tokenizer(prompts[i : i + args.batch_size], return_tensors="pt", padding=True)
    for i in range(0, len(prompts), args.batch_size)
]
for batch in batches[:2]:  # warm-up
    decoder.generate(**batch, max_new_tokens=args.max_new_tokens, **sampling)

profile = cProfile.Profile()
iterations, start = 0, time.perf_counter()
profile.enable()
for batch in batches:
    iterations += decoder.generate(**batch, max_new_tokens=args.max_new_tokens, **sampling).stats.iterations
profile.disable()
elapsed = time.perf_counter() - start
print(f"{elapsed / iterations * 1000:.1f} ms per iteration over {iterations} iterations (profiled)")
pstats.Stats(profile).sort_stats(args.sort).print_stats(args.top)
