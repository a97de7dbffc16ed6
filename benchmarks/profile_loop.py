"""Where the time of one speculative iteration goes (the bundled pair; greedy unless --temperature).

    python benchmarks/profile_loop.py [--prompts 8] [--batch-size 1] [--max-new-tokens 64]
        [--temperature 0.7 --top-p 0.9]

Prints ms per iteration and cProfile's top functions by own time: the share spent in the models'
forwards versus the loop's own bookkeeping.

    python benchmarks/profile_loop.py --ops [--k 5] [--temperature 0.7 --top-p 0.9]

instead counts the tensor ops each iteration dispatches outside the models' forwards (a
``TorchDispatchMode``: deterministic, unlike a timing on a noisy host), with constant ``--k``, and
the call sites that dispatch most. On a CPU each costs 5-10 us. With ``--accelerator-path`` it
counts what a GPU runs instead: a prepared 4D mask at every forward and drafts to full width
(``draft_early_exit=False``), where each op that is not a view is a kernel launch.

    python benchmarks/profile_loop.py --plain-floor [--repeats 5]

instead times specdec's plain steps (constant k = 0) against the target's own ``generate`` on the
same prompts (sampled with --temperature, each with its own draws; time per token), interleaved,
with the loop's phases (``PhaseTimes``) and the target's forward timed alone in both: what specdec
adds to a step where it does not speculate (the "plain-step floor").
"""

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's specdec, not an installed copy

from specdec import SpeculativeDecoder  # noqa: E402
from specdec.config import SpecdecConfig  # noqa: E402

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
parser.add_argument("--plain-floor", action="store_true", help="time plain steps against generate (see above)")
parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats for --plain-floor")
parser.add_argument("--ops", action="store_true", help="count tensor ops per iteration (see above)")
parser.add_argument("--k", type=int, default=None, help="with --ops: a constant lookahead (default: the config's policy)")
parser.add_argument("--accelerator-path", action="store_true", help="with --ops: count the GPU's path (see above)")
args = parser.parse_args()
if args.plain_floor and args.batch_size != 1:
    parser.error("--plain-floor times batch 1 (generate's finished rows run on as padding; the token counts would differ)")

config = SpecdecConfig.from_toml(args.config)
target, tokenizer = config.load_target()
sampling = {}
if args.temperature > 0:
    config = config.with_choices(verifier="rejection")
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p)
if args.k is not None:
    config = config.with_choices(policy="constant", policy_options={"k": args.k})
decoder = SpeculativeDecoder.from_config(config, target=target)
lines = (ROOT / "models/python-pair/prompts.jsonl").read_text().splitlines()[: args.prompts]
prompts = [json.loads(line)["prompt"] for line in lines]
batches = [
    tokenizer(prompts[i : i + args.batch_size], return_tensors="pt", padding=True)
    for i in range(0, len(prompts), args.batch_size)
]
if args.plain_floor:
    import statistics

    import torch

    from specdec.observers import PhaseTimes

    torch.set_num_threads(1)
    phases = PhaseTimes()
    plain = SpeculativeDecoder.from_config(config.with_choices(policy="constant", policy_options={"k": 0}),
                                           target=target, extra_observers=[phases])
    forward = {"seconds": 0.0, "calls": 0}
    target.register_forward_pre_hook(lambda module, inputs: forward.__setitem__("started", time.perf_counter()))
    target.register_forward_hook(lambda module, inputs, output: forward.update(
        seconds=forward["seconds"] + time.perf_counter() - forward["started"], calls=forward["calls"] + 1))

    def timed(run):
        forward.update(seconds=0.0, calls=0)
        started, tokens = time.perf_counter(), 0
        for batch in batches:
            tokens += int(run(batch))
        return time.perf_counter() - started, tokens, forward["seconds"] / max(forward["calls"], 1)

    def generate(batch):
        out = target.generate(**batch, max_new_tokens=args.max_new_tokens, **(sampling or {"do_sample": False}))
        return (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]

    def specdec(batch):
        return plain.generate(**batch, max_new_tokens=args.max_new_tokens, **sampling).stats.new_tokens

    timed(generate), timed(specdec)  # warm-up
    rows = {"generate": [], "specdec k=0": []}
    for _ in range(args.repeats):
        for name, run in (("generate", generate), ("specdec k=0", specdec)):
            phases.reset()
            seconds, tokens, forward_s = timed(run)
            rows[name].append((1000 * seconds / tokens, 1000 * forward_s))
    for name, values in rows.items():
        step = statistics.median(v[0] for v in values)
        fwd = statistics.median(v[1] for v in values)
        print(f"{name:12s} {step:.3f} ms per token, target forward {fwd:.3f} ms, the rest {step - fwd:.3f} ms")
    ratio = statistics.median(g[0] / s[0] for g, s in zip(rows["generate"], rows["specdec k=0"]))
    print(f"specdec k=0 runs at {ratio:.3f}x of generate (median of {args.repeats} paired repeats)")
    print("specdec's phases (last repeat), ms per iteration:",
          {name: round(ms, 3) for name, ms in phases.per_iteration_ms().items()})
    raise SystemExit(0)

if args.ops:
    from specdec.core import models as runners
    from specdec.decoding.ops import iteration_ops

    if args.accelerator_path:
        runners.PREPARE_MASKS_ON_CPU = True
        decoder.draft_early_exit = False

    iterations = 0
    models = [model for model in (target, getattr(decoder.drafter, "model", None)) if model is not None]
    with iteration_ops(models, sites=True) as count:
        for batch in batches:
            iterations += decoder.generate(**batch, max_new_tokens=args.max_new_tokens, **sampling).stats.iterations
    print(f"{count.total / iterations:.1f} tensor ops per iteration outside the forwards ({iterations} iterations)")
    for (where, op), ops in count.sites.most_common(args.top):
        print(f"{ops / iterations:8.2f}  {where:40s} {op}")
    raise SystemExit(0)

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
