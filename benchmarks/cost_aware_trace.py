"""What ``cost-aware`` chooses on SmolLM2 chat prompts of one kind, against a constant k, with prompt lookup.

    python benchmarks/cost_aware_trace.py [--kind summarise] [--prompts 2] [--max-k 8] [--k 10] [--warm 3]

The policy decodes the prompts ``--warm`` times (it keeps its cost fit and pooled acceptance
across requests), then once more while every choice is recorded; the constant k decodes the same
prompts. Prints the k chosen per iteration, the policy's cost model and goodput at its last choices,
and per request: seconds, iterations, drafted and accepted tokens (greedy, batch 1, one thread).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's specdec, not an installed copy

from specdec import SpeculativeDecoder  # noqa: E402
from specdec.drafters import NGramDrafter  # noqa: E402
from specdec.policies import ConstantLookahead, CostAwareLookahead  # noqa: E402

HERE = Path(__file__).resolve().parent

parser = argparse.ArgumentParser()
parser.add_argument("--target", default=str(Path("~/.cache/specdec/models/smollm2-135m-instruct").expanduser()))
parser.add_argument("--kind", default="summarise", help="code, explain, summarise or creative")
parser.add_argument("--prompts", type=int, default=2)
parser.add_argument("--max-k", type=int, default=8, help="cost-aware's max_k")
parser.add_argument("--k", type=int, default=10, help="the constant k to compare with")
parser.add_argument("--warm", type=int, default=3, help="passes over the prompts before the recorded one")
parser.add_argument("--max-new-tokens", type=int, default=48)
args = parser.parse_args()

records = [json.loads(line) for line in (HERE / "smollm2_prompts.jsonl").read_text().splitlines() if line.strip()]
chosen = [r for r in records if r["kind"] == args.kind][: args.prompts]
if not chosen:
    parser.error(f"--kind {args.kind!r}: no such prompts in smollm2_prompts.jsonl")
torch.set_num_threads(1)
target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
tokenizer = AutoTokenizer.from_pretrained(args.target)
inputs = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                                  add_generation_prompt=True), return_tensors="pt",
                    add_special_tokens=False) for r in chosen]
gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id,
           pad_token_id=tokenizer.pad_token_id)
policy = CostAwareLookahead(max_k=args.max_k)
decoders = {
    f"cost-aware (max_k={args.max_k})": SpeculativeDecoder(target=target, drafter=NGramDrafter(max_ngram=3, min_ngram=2),
                                                        policy=policy),
    f"constant k={args.k}": SpeculativeDecoder(target=target, drafter=NGramDrafter(max_ngram=3, min_ngram=2),
                                               policy=ConstantLookahead(k=args.k)),
}
for _ in range(args.warm):
    for decoder in decoders.values():
        for batch in inputs:
            decoder.generate(**batch, **gen)
decisions = []
choose = policy.choose
policy.choose = lambda *a, **k: decisions.append(choose(*a, **k)) or decisions[-1]
for name, decoder in decoders.items():
    for batch in inputs:
        started = time.perf_counter()
        stats = decoder.generate(**batch, **gen).stats
        print(f"{name}: {time.perf_counter() - started:.2f} s, {stats.iterations} iterations, "
              f"{stats.drafted} drafted, {stats.accepted} accepted, {stats.new_tokens} new tokens")
print("cost-aware's k per iteration:", [d.k for d in decisions])
last = next((d for d in reversed(decisions) if d.costs), None)
if last is not None:
    print("its cost model (ms):", {k: round(1000 * v, 1) for k, v in last.costs.items()})
    print("its goodput (tokens/s):", {k: round(v, 1) for k, v in last.goodput.items()})
