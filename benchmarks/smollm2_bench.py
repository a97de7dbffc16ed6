"""SmolLM2-135M-Instruct on the CPU: the target alone, Transformers' prompt lookup, specdec with ``ngram``
and with a trained ``hidden_state`` head, on held-out chat prompts of four kinds.

One process; every contender runs on the same prompts, interleaved per repeat with the order rotated;
``torch.set_num_threads`` (default 1). Greedy rows of specdec are compared with the target's own
``generate`` on the same batch (float32). Prints a JSON summary and Markdown tables.

    python benchmarks/smollm2_bench.py --head models/smollm2-135m-instruct-head/head.safetensors \
        --runs b1-greedy,b4-greedy,b1-sampled --repeats 3 --json out/smollm2_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from contextlib import nullcontext
from datetime import date
from pathlib import Path

import attrs
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from specdec import SpeculativeDecoder  # noqa: E402
from specdec.core.components import Observer  # noqa: E402
from specdec.core import state as state_module  # noqa: E402
from specdec.core.models import cache_argument  # noqa: E402
from specdec.core.packed_linear import cpu_name, packed_everywhere  # noqa: E402
from specdec.drafters import FallbackDrafter, HiddenStateDrafter, HiddenStateHead, NGramDrafter  # noqa: E402
from specdec.policies import (ConstantLookahead, CostAwareLookahead, DraftConfidenceLookahead,  # noqa: E402
                              HeuristicLookahead)
from specdec.verifiers import GreedyVerifier, RejectionVerifier  # noqa: E402

from packing_rules import RULES, packing_rule  # noqa: E402

KINDS = ["code", "explain", "summarise", "creative"]
SAMPLING = dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=0)


@attrs.define(eq=False)
class PositionStats(Observer):
    """Drafted and accepted counts per draft position, and row-steps, across calls."""

    name = "positions"
    drafted: list = attrs.field(factory=lambda: [0] * 64)
    accepted: list = attrs.field(factory=lambda: [0] * 64)
    row_steps: int = 0
    new_tokens: int = 0

    def on_step(self, state, step) -> None:
        self.row_steps += int(step.rows_host.numel())
        self.new_tokens += int(step.appended_host.sum())
        for d, a in zip(step.drafted_host.tolist(), step.accepted_host.tolist()):
            for j in range(min(d, 64)):
                self.drafted[j] += 1
                if j < a:
                    self.accepted[j] += 1

    def take(self) -> dict:
        out = {"drafted": self.drafted[:], "accepted": self.accepted[:], "row_steps": self.row_steps,
               "new_tokens": self.new_tokens}
        self.drafted, self.accepted, self.row_steps, self.new_tokens = [0] * 64, [0] * 64, 0, 0
        return out


def new_tokens(sequences: torch.Tensor, prompt_width: int, eos: int) -> list[list[int]]:
    """Each row's new tokens up to and including the first eos."""
    rows = []
    for row in sequences[:, prompt_width:].tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


def load_prompts(path: Path, per_kind: int, kinds=KINDS) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    chosen = []
    for kind in kinds:
        chosen += [r for r in records if r["kind"] == kind][:per_kind]
    return chosen


def contenders(run: str, target, head, heuristic_max: int, only=(), other_head=None):
    """name -> callable(batch, gen_kwargs) -> (sequences, positions dict or None)."""
    sampled, batch = run.endswith("sampled"), int(run[1:].split("-")[0])
    verifier = RejectionVerifier() if sampled else GreedyVerifier()
    observer = PositionStats()

    def plain(packed=False, **extra):
        def go(inputs, kwargs):
            # packed: every call as wide as this machine packs (2 or 4 rows and up, measured) on
            # oneDNN-packed weights, the prefill included
            # (core/packed_linear.py), the plain baseline for what specdec's packed steps gain alone.
            with torch.no_grad(), packed_everywhere(target) if packed else nullcontext():
                return target.generate(**inputs, **kwargs, **extra), None
        return go

    def spec(drafter, policy, packed=True, sorted_top_p=False, rule=None, screened=True):
        decoder = SpeculativeDecoder(target=target, drafter=drafter, policy=policy, verifier=verifier,
                                     observers=[observer], packed_weights=packed, screened_head=screened)

        def go(inputs, kwargs):
            # sorted_top_p: top-p through transformers' warper (a sort of the vocabulary per position),
            # not specdec's nucleus read from the top candidates (core/state.py, _NucleusTopP).
            candidates = state_module.NUCLEUS_CANDIDATES
            state_module.NUCLEUS_CANDIDATES = 0 if sorted_top_p else candidates
            try:
                with packing_rule(rule):
                    out = decoder.generate(**inputs, **kwargs)
            finally:
                state_module.NUCLEUS_CANDIDATES = candidates
            return out.sequences, observer.take()
        return go

    def behind_lookup(which=head, then=2, n=2, alternatives=0, precision="auto"):
        """Prompt lookup where the row's last n tokens recur, the head elsewhere (drafters/fallback.py);
        the head's first-position alternatives verified too (greedy) where ``alternatives``; its linear
        layers in float32 with ``precision`` "highest" (its ``matmul_precision``; the default, "auto",
        reads bfloat16 weights where this CPU runs them faster)."""
        return FallbackDrafter(NGramDrafter(max_ngram=3, min_ngram=n),
                               HiddenStateDrafter(which, alternatives=alternatives, matmul_precision=precision),
                               then_max_tokens=then)

    def confidence_auto():
        return DraftConfidenceLookahead(threshold="auto", max_tokens=10)

    behind = "specdec ngram>=2 else hidden_state"  # the contenders' names behind prompt lookup

    found = {"target": plain(), "target (packed)": plain(packed=True)}
    if batch == 1:
        found["prompt lookup (10)"] = plain(prompt_lookup_num_tokens=10)
    # specdec's plain steps only: its floor against generate (batched ones packed, as "target (packed)").
    found["specdec k=0"] = spec(NGramDrafter(max_ngram=3), ConstantLookahead(k=0))
    found["specdec ngram heuristic"] = spec(NGramDrafter(max_ngram=3), HeuristicLookahead())
    # Prompt lookup alone as the fallback's first drafter runs it: a long constant k, and cost-aware.
    found["specdec ngram>=2 k=10"] = spec(NGramDrafter(max_ngram=3, min_ngram=2), ConstantLookahead(k=10))
    found["specdec ngram>=2 cost-aware"] = spec(NGramDrafter(max_ngram=3, min_ngram=2), CostAwareLookahead())
    found["specdec ngram>=2 cost-aware by position"] = spec(NGramDrafter(max_ngram=3, min_ngram=2),
                                                            CostAwareLookahead(per_position=True))
    ks = (2, 3, 4) if (batch == 1 and not sampled) else (2, 3)
    for k in ks:
        found[f"specdec hidden_state k={k}"] = spec(HiddenStateDrafter(head), ConstantLookahead(k=k))
    found["specdec hidden_state heuristic"] = spec(HiddenStateDrafter(head),
                                                   HeuristicLookahead(initial=3, max_tokens=heuristic_max))
    # Prompt lookup where it matches, the head elsewhere (drafters/fallback.py).
    for n, k, then in ((2, 6, 2), (3, 6, 2), (2, 10, 2), (2, 10, 3)):
        found[f"specdec ngram>={n} else hidden_state k={k}/{then}"] = spec(behind_lookup(head, then=then, n=n), ConstantLookahead(k=k))
        found[f"specdec ngram>={n} else hidden_state k={k}/{then} unscreened"] = spec(
            behind_lookup(head, then=then, n=n), ConstantLookahead(k=k), screened=False)
    # The policy that measures costs and falls back to plain steps where drafting does not pay.
    found["specdec hidden_state cost-aware"] = spec(HiddenStateDrafter(head), CostAwareLookahead())
    found[f"{behind} cost-aware"] = spec(behind_lookup(), CostAwareLookahead())
    found[f"{behind} cost-aware by position"] = spec(behind_lookup(), CostAwareLookahead(per_position=True))
    # The head's own confidence: a row stops drafting where its recalibrated q says the next token
    # is not worth its measured cost (threshold "auto"), so a doubtful first token costs a plain step.
    found["specdec hidden_state draft-confidence auto"] = spec(HiddenStateDrafter(head),
                                                               DraftConfidenceLookahead(threshold="auto", max_tokens=3))
    found[f"{behind} draft-confidence auto"] = spec(behind_lookup(), confidence_auto())
    # The head's next best candidates for the first position verified in the same forward (a token
    # tree of one level; greedy only: under sampling they are not drafted). cost-aware reads them where
    # their measured price pays; "(always)" reads them whenever the head drafted (stops 23-24).
    for count in (2, 3, 5, 8):
        found[f"{behind} cost-aware +{count} alternatives"] = spec(behind_lookup(alternatives=count), CostAwareLookahead())
        # The head drafting up to 3 tokens, with the alternatives: where a wide verify costs what a narrow one does.
        found[f"{behind} cost-aware then 3 +{count} alternatives"] = spec(behind_lookup(then=3, alternatives=count),
                                                                        CostAwareLookahead())
        found[f"{behind} cost-aware +{count} alternatives (always)"] = spec(behind_lookup(alternatives=count),
                                                                           CostAwareLookahead(alternatives="always"))
        found[f"{behind} cost-aware by position +{count} alternatives"] = spec(behind_lookup(alternatives=count),
                                                                               CostAwareLookahead(per_position=True))
        found[f"{behind} draft-confidence auto +{count} alternatives"] = spec(behind_lookup(alternatives=count),
                                                                             confidence_auto())
        # The head's weights as loaded, float32, as every contender ran before stop 51 (the default
        # matmul_precision "auto" reads bfloat16 copies where this CPU runs them faster).
        found[f"{behind} cost-aware +{count} alternatives fp32"] = spec(
            behind_lookup(alternatives=count, precision="highest"), CostAwareLookahead())
        found[f"{behind} draft-confidence auto +{count} alternatives fp32"] = spec(
            behind_lookup(alternatives=count, precision="highest"), confidence_auto())
        # The target's LM head read in float32 at every verify, as before stop 52 (greedy verifies
        # now screen it in bfloat16 where this CPU runs that faster; core/screened_head.py).
        found[f"{behind} cost-aware +{count} alternatives unscreened"] = spec(behind_lookup(alternatives=count),
                                                                             CostAwareLookahead(), screened=False)
        # Prompt lookup's long runs on summaries: the constant's k = 10 against cost-aware's max_k = 8.
        found[f"{behind} cost-aware max_k=10 +{count} alternatives"] = spec(behind_lookup(alternatives=count),
                                                                            CostAwareLookahead(max_k=10))
    # Multi-token steps without packed copies of the weights (core/packed_linear.py): on torch's own
    # linear path until stop 64, on the copy-free routes measured faster since stop 65; the shipped
    # config so, with its LM head's screen and without (no copy of any of the target's weights).
    found[f"{behind} cost-aware +3 alternatives (unpacked)"] = spec(behind_lookup(alternatives=3), CostAwareLookahead(),
                                                                   packed=False)
    found[f"{behind} cost-aware +3 alternatives (unpacked unscreened)"] = spec(
        behind_lookup(alternatives=3), CostAwareLookahead(), packed=False, screened=False)
    found["specdec hidden_state k=3 (unpacked)"] = spec(HiddenStateDrafter(head), ConstantLookahead(k=3), packed=False)
    found["specdec ngram>=2 k=10 (unpacked)"] = spec(NGramDrafter(max_ngram=3, min_ngram=2), ConstantLookahead(k=10),
                                                     packed=False)
    found[f"{behind} cost-aware (unpacked)"] = spec(behind_lookup(), CostAwareLookahead(), packed=False)
    found[f"{behind} draft-confidence auto (unpacked)"] = spec(behind_lookup(), confidence_auto(), packed=False)
    for rule in RULES:
        # Constant k: the same drafts and verifies on each step path, so only the steps' cost differs.
        found[f"specdec hidden_state k=2 ({rule})"] = spec(HiddenStateDrafter(head), ConstantLookahead(k=2), rule=rule)
        found[f"specdec ngram>=2 k=10 ({rule})"] = spec(NGramDrafter(max_ngram=3, min_ngram=2), ConstantLookahead(k=10),
                                                       rule=rule)
        found[f"{behind} cost-aware ({rule})"] = spec(behind_lookup(), CostAwareLookahead(), rule=rule)
        found[f"{behind} draft-confidence auto ({rule})"] = spec(behind_lookup(), confidence_auto(), rule=rule)
        found[f"{behind} cost-aware +3 alternatives ({rule})"] = spec(behind_lookup(alternatives=3), CostAwareLookahead(),
                                                                     rule=rule)
    found[f"{behind} cost-aware (sorted top-p)"] = spec(behind_lookup(), CostAwareLookahead(), sorted_top_p=True)
    found["specdec k=0 (sorted top-p)"] = spec(NGramDrafter(max_ngram=3), ConstantLookahead(k=0), sorted_top_p=True)
    # The head drafting up to 3 tokens behind prompt lookup, now that a 4-token verify costs less.
    found[f"{behind} cost-aware then 3"] = spec(behind_lookup(then=3), CostAwareLookahead())
    found[f"{behind} draft-confidence auto then 3"] = spec(behind_lookup(then=3), confidence_auto())
    if other_head is not None:  # another head on the same prompts in the same run (--compare-head)
        found["specdec hidden_state k=2 (compared head)"] = spec(HiddenStateDrafter(other_head), ConstantLookahead(k=2))
        found["specdec hidden_state cost-aware (compared head)"] = spec(HiddenStateDrafter(other_head), CostAwareLookahead())
        found[f"{behind} k=10/2 (compared head)"] = spec(behind_lookup(other_head), ConstantLookahead(k=10))
        found[f"{behind} cost-aware (compared head)"] = spec(behind_lookup(other_head), CostAwareLookahead())
        found[f"{behind} cost-aware +3 alternatives (compared head)"] = spec(behind_lookup(other_head, alternatives=3),
                                                                            CostAwareLookahead())
    return {name: go for name, go in found.items() if not only or name in only or name == "target"}


def run_one(run: str, target, tokenizer, head, prompts, args, other_head=None) -> dict:
    sampled, batch = run.endswith("sampled"), int(run[1:].split("-")[0])
    eos = tokenizer.eos_token_id
    gen = dict(max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    if sampled:
        gen.update(SAMPLING)
    else:
        gen.update(do_sample=False)
    groups = []  # batches of one kind each
    for kind in KINDS:
        rows = [p for p in prompts if p["kind"] == kind]
        for start in range(0, len(rows), batch):
            chunk = rows[start : start + batch]
            if len(chunk) < batch:
                continue
            texts = [tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}], tokenize=False,
                                                   add_generation_prompt=True) for p in chunk]
            inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            groups.append((kind, inputs))
    named = contenders(run, target, head, args.heuristic_max, args.only, other_head)
    names = list(named)
    # records[name][repeat][kind] = {"time", "tokens", positions...}
    records = {n: [defaultdict(lambda: {"time": 0.0, "tokens": 0, "drafted": [0] * 64, "accepted": [0] * 64,
                                        "row_steps": 0}) for _ in range(args.repeats)] for n in names}
    exact = {n: [0, 0] for n in names}  # identical rows, rows (greedy only)
    failed: dict[str, str] = {}
    # Untimed: what a process pays once (packing the target's weights: 0.85 s for SmolLM2) would
    # otherwise land on whichever contender runs first.
    for name in names if args.warmup else ():
        kwargs = dict(gen, max_new_tokens=min(8, args.max_new_tokens))
        if sampled and name.startswith("specdec"):
            kwargs["generator"] = torch.Generator().manual_seed(0)
        try:
            named[name](groups[0][1], kwargs)
        except Exception:  # noqa: BLE001 - the timed runs report it
            pass
    for repeat in range(args.repeats):
        for g, (kind, inputs) in enumerate(groups):
            shift = (repeat + g) % len(names)
            order = names[shift:] + names[:shift]
            reference = None
            outputs = {}
            for name in order:
                if name in failed:
                    continue
                kwargs = dict(gen)
                if sampled:
                    seed = 1000 * repeat + g
                    torch.manual_seed(seed)
                    if name.startswith("specdec"):
                        kwargs["generator"] = torch.Generator().manual_seed(seed)
                started = time.perf_counter()
                try:
                    sequences, positions = named[name](inputs, kwargs)
                except Exception as exc:  # noqa: BLE001 - report it, keep the others running
                    failed[name] = f"{type(exc).__name__}: {exc}"
                    print(f"[{run}] {name} failed: {failed[name]}", file=sys.stderr, flush=True)
                    continue
                seconds = time.perf_counter() - started
                rows = new_tokens(sequences, inputs["input_ids"].shape[1], eos)
                outputs[name] = rows
                record = records[name][repeat][kind]
                record["time"] += seconds
                record["tokens"] += sum(len(r) for r in rows)
                if positions:
                    record["row_steps"] += positions["row_steps"]
                    for j in range(64):
                        record["drafted"][j] += positions["drafted"][j]
                        record["accepted"][j] += positions["accepted"][j]
            if not sampled:
                reference = outputs["target"]
                for name in names:
                    if name in outputs and name != "target":
                        exact[name][0] += sum(a == b for a, b in zip(outputs[name], reference))
                        exact[name][1] += len(reference)
            print(f"[{run}] repeat {repeat + 1}/{args.repeats} group {g + 1}/{len(groups)} ({kind}) done",
                  file=sys.stderr, flush=True)
    result = summarise(run, [n for n in names if n not in failed], records, exact, args.repeats)
    result["failed"] = failed
    return result


def summarise(run, names, records, exact, repeats) -> dict:
    table = {}
    for kind in KINDS + ["all"]:
        kinds = KINDS if kind == "all" else [kind]
        per = {}
        for name in names:
            rates, speedups, drafted, accepted, row_steps, tokens = [], [], [0] * 64, [0] * 64, 0, 0
            for r in range(repeats):
                t = sum(records[name][r][k]["time"] for k in kinds)
                n = sum(records[name][r][k]["tokens"] for k in kinds)
                base_t = sum(records["target"][r][k]["time"] for k in kinds)
                base_n = sum(records["target"][r][k]["tokens"] for k in kinds)
                if t == 0 or base_t == 0:
                    continue
                rates.append(n / t)
                speedups.append((n / t) / (base_n / base_t))
                for k in kinds:
                    rec = records[name][r][k]
                    row_steps += rec["row_steps"]
                    tokens += rec["tokens"]
                    for j in range(64):
                        drafted[j] += rec["drafted"][j]
                        accepted[j] += rec["accepted"][j]
            if not rates:
                continue
            entry = {"tok_s": statistics.median(rates), "tok_s_min": min(rates), "tok_s_max": max(rates),
                     "speedup": statistics.median(speedups), "speedup_min": min(speedups),
                     "speedup_max": max(speedups)}
            if row_steps:
                entry["acceptance"] = sum(accepted) / max(sum(drafted), 1)
                entry["mean_acceptance_length"] = tokens / row_steps
                last = max([j for j in range(64) if drafted[j]] or [0])
                entry["per_position"] = [round(accepted[j] / drafted[j], 3) for j in range(min(last + 1, 8)) if drafted[j]]
            if kind == "all" and name in exact and exact[name][1]:
                entry["identical_rows"] = f"{exact[name][0]}/{exact[name][1]}"
            per[name] = entry
        table[kind] = per
    return {"run": run, "table": table}


def markdown(result: dict) -> str:
    lines = [f"#### {result['run']}", "",
             "| kind | contender | tok/s (median, min–max) | speedup vs target (min–max) | acceptance | "
             "tokens/verify | acceptance per position | identical |",
             "|---|---|---|---|---|---|---|---|"]
    for kind, per in result["table"].items():
        for name, e in per.items():
            lines.append(
                f"| {kind} | {name} | {e['tok_s']:.1f} ({e['tok_s_min']:.1f}–{e['tok_s_max']:.1f}) | "
                f"{e['speedup']:.2f}x ({e['speedup_min']:.2f}–{e['speedup_max']:.2f}) | "
                f"{e.get('acceptance', float('nan')):.2f} | {e.get('mean_acceptance_length', float('nan')):.2f} | "
                f"{' '.join(f'{x:.2f}' for x in e.get('per_position', []))} | {e.get('identical_rows', '')} |")
    return "\n".join(lines)


@torch.no_grad()
def step_costs(target, head, context: int = 200, reps: int = 20) -> dict:
    """Milliseconds of one cached target forward over 1 and 5 tokens, and of one cached head token."""
    from transformers import DynamicCache

    ids = torch.randint(100, 10000, (1, context))
    out = {}
    for width in (1, 3, 5):
        times = []
        for _ in range(reps // 4 + 3):
            cache = DynamicCache(config=target.config)
            target(input_ids=ids, use_cache=True, **{cache_argument(target): cache})
            step = torch.randint(100, 10000, (1, width))
            started = time.perf_counter()
            target(input_ids=step, use_cache=True, **{cache_argument(target): cache})
            times.append(time.perf_counter() - started)
        out[f"target_{width}_ms"] = 1000 * statistics.median(times)
    hidden = head.config.hidden_size
    times = []
    cache = DynamicCache(config=head.config)
    head(inputs_embeds=torch.randn(1, context, 2 * hidden), past_key_values=cache, use_cache=True)
    for _ in range(reps):
        started = time.perf_counter()
        head(inputs_embeds=torch.randn(1, 1, 2 * hidden), past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - started)
    out["head_1_ms"] = 1000 * statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="the converted folder (default: specdec's cache)")
    parser.add_argument("--head", required=True)
    parser.add_argument("--compare-head", default=None,
                        help="a second head, run as '(compared head)' contenders (k=2, cost-aware, and behind prompt lookup)")
    parser.add_argument("--prompts", type=Path, default=HERE / "smollm2_prompts.jsonl")
    parser.add_argument("--per-kind", type=int, default=4, help="prompts per kind (batch 4 needs 4)")
    parser.add_argument("--b1-per-kind", type=int, default=2, help="prompts per kind at batch 1")
    parser.add_argument("--kinds", type=lambda text: [k.strip() for k in text.split(",")], default=KINDS,
                        help=f"comma-separated kinds of prompt to run (default: {','.join(KINDS)})")
    parser.add_argument("--runs", default="b1-greedy,b4-greedy,b1-sampled,b4-sampled")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="1: run each contender once, untimed, before timing")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--heuristic-max", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", type=lambda text: [n.strip() for n in text.split(",")], default=[],
                        help="comma-separated contender names to run (the target always runs)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    unknown = sorted(set(args.kinds) - set(KINDS))
    if unknown:
        parser.error(f"--kinds: unknown kind(s) {', '.join(unknown)}; the kinds are {', '.join(KINDS)}")

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from specdec.convert.gguf import convert_smollm2

    torch.set_num_threads(args.threads)
    path = args.target or str(convert_smollm2())
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    head = HiddenStateHead.load(args.head, target)
    head.attach(target.get_output_embeddings().weight)  # the drafter does this too (check_target)
    other_head = None
    if args.compare_head:
        other_head = HiddenStateHead.load(args.compare_head, target)
        other_head.attach(target.get_output_embeddings().weight)
    prompts = load_prompts(args.prompts, args.per_kind, args.kinds)
    loads = [open("/proc/loadavg").read().split()[0]]
    costs = step_costs(target, head)
    results = []
    for run in args.runs.split(","):
        batch = int(run[1:].split("-")[0])
        chosen = prompts if batch > 1 else load_prompts(args.prompts, min(args.per_kind, args.b1_per_kind), args.kinds)
        results.append(run_one(run, target, tokenizer, head, chosen, args, other_head))
        loads.append(open("/proc/loadavg").read().split()[0])
        print(markdown(results[-1]), file=sys.stderr, flush=True)
    summary = {"date": str(date.today()), "cpu": cpu_name(), "threads": args.threads, "loadavg_1min": loads,
               "step_costs_ms": costs, "args": {k: str(v) for k, v in vars(args).items()}, "results": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=1))
    for result in results:
        print()
        print(markdown(result))


if __name__ == "__main__":
    main()
