"""specdec on an accelerator with real-shaped models built on the device (issue 17, item 4).

    # the GPU run (1x H100; about 10 minutes):
    python benchmarks/gpu_bench.py --device cuda --dtype bfloat16 --out gpu_bench.json
    # the smoke test (CPU, tiny shapes, a minute):
    OMP_NUM_THREADS=1 python benchmarks/gpu_bench.py --smoke

Nothing is downloaded: the target is a random Llama-shaped model (default about 0.7B parameters:
hidden 1536, 20 layers, GQA 12/4 heads, vocabulary 32000) built from a config on the device, and
the draft is the target truncated to its first ``--draft-layers`` layers (same embeddings and
head, a layer-skip draft; ``--draft-noise`` perturbs it further). A random deep model barely agrees
with its truncated self (0-5% acceptance in a CPU check at 20 layers), so what the target's later
layers write to the residual stream is scaled by ``--tail-scale``: the agreement knob, which leaves
every cost as the shapes make it (CPU check, 20 layers 256 wide, k = 5: 0.01 -> 71% acceptance,
0.03 -> 43%; the default 0.015 sits between). Every figure is printed with the acceptance it ran at
(``accept``, ``tau``), and the ideal speedup (Leviathan et al.) is computed from those and the
measured cost ratio c of a draft forward to a target forward.

Contenders, per batch size (default 1, 4, 16, 64), interleaved after one untimed call each (which
also compiles what is compiled):
  target            ``target.generate`` greedy, dynamic cache
  target+static     ``generate(cache_implementation="static")``: transformers compiles the forward
                    on CUDA (its strongest plain baseline); eager elsewhere
  assisted          transformers' assisted generation (batch 1 only: it refuses batches)
  specdec           the dynamic path
  specdec+static    ``static_cache=True`` (preallocated caches, fixed step shapes)
  specdec+compile   ``static_cache=True, compile="draft"`` (CUDA graphs on CUDA)
  specdec+compile-all ``static_cache=True, compile="all"``: the target's verify steps compiled too
  specdec+compile-all+cost-aware  the same with ``cost-aware`` (which since stop 68 leaves the
                    iterations that compiled, and off the CPU each shape's first run, untimed)
  specdec+cost-aware  the dynamic path with the ``cost-aware`` policy instead of a constant k (its
                    choices and its timings of the iterations are summarised after the table)
  specdec+cost-aware+phases  the same with the ``phases`` observer synchronising the device at every
                    phase: slower (five syncs an iteration), for the median milliseconds of each
                    phase in its drafted and its plain iterations, printed after the table
Reported: tokens/s, the speedup over ``target`` (median of paired repeats), acceptance, tokens per
target call (tau), the ideal and the share reached, peak device memory, and the share of rows
identical to ``target``'s own output in the same dtype (half precision: batched matmuls of
different shapes round differently, in transformers too; 100% is expected only in float32/64).
Each row that differs is explained (``specdec.exactness``): at its first differing token the target
is run once more on the shared prefix alone, in its dtype and in float64; a margin between the two
tokens within the dtype's rounding there is a near-tie that a different matmul shape flips.
Results are written to ``--out`` after every batch size, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import attrs
import torch
import transformers
from torch._dynamo.utils import counters
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's specdec, not an installed copy

from specdec import SpeculativeDecoder  # noqa: E402
from specdec.drafters import ModelDrafter  # noqa: E402
from specdec.exactness import Explainer, first_divergence  # noqa: E402
from specdec.observers import PhaseTimes  # noqa: E402
from specdec.policies import ConstantLookahead  # noqa: E402
from specdec.policies.cost_aware import compile_work_begun  # noqa: E402

from batch_trace import Traced  # noqa: E402  cost-aware, logging each decision and timed iteration

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--device", default="cuda")
parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "float64"])
parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, float32, batch 1 and 4: checks the script")
parser.add_argument("--batch-sizes", default="1,4,16,64")
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--prompt-tokens", default="64,256", help="prompt lengths drawn uniformly from this range (ragged)")
parser.add_argument("--prompts", type=int, default=64, help="prompts per batch size (a multiple of the largest batch)")
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--k", type=int, default=5, help="constant lookahead")
parser.add_argument("--hidden", type=int, default=1536)
parser.add_argument("--layers", type=int, default=20)
parser.add_argument("--heads", type=int, default=12)
parser.add_argument("--kv-heads", type=int, default=4)
parser.add_argument("--intermediate", type=int, default=4096)
parser.add_argument("--vocab", type=int, default=32000)
parser.add_argument("--init", type=float, default=0.02, help="initializer_range of the random target")
parser.add_argument("--draft-layers", type=int, default=2)
parser.add_argument("--tail-scale", type=float, default=0.015,
                    help="scale of what the target's layers past the draft's write to the residual stream (their "
                         "o_proj and down_proj): the agreement knob; their cost is unchanged")
parser.add_argument("--draft-noise", type=float, default=0.0, help="Gaussian noise on the draft's matrices, times their spread")
parser.add_argument("--contenders", default=None,
                    help="comma-separated, of target,target+static,assisted,specdec,specdec+static,specdec+compile,"
                         "specdec+compile-all,specdec+compile-all+cost-aware,specdec+cost-aware,specdec+cost-aware+phases (default: all; --smoke: all but specdec+compile, whose CPU compilation "
                         "takes minutes)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out", default=None, help="also write the rows as JSON here")
args = parser.parse_args()

if args.smoke:
    args.device, args.dtype = "cpu", "float32"
    args.batch_sizes, args.max_new_tokens, args.prompt_tokens, args.prompts, args.repeats = "1,4", 16, "8,24", 4, 1
    args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab = 64, 4, 4, 2, 128, 512
    args.draft_layers, args.init = 1, 0.2
    args.contenders = args.contenders or "target,target+static,assisted,specdec,specdec+static,specdec+cost-aware"
args.contenders = args.contenders or ("target,target+static,assisted,specdec,specdec+static,specdec+compile,"
                                      "specdec+cost-aware")
device, dtype = torch.device(args.device), getattr(torch, args.dtype)
if device.type == "cpu":
    torch.set_num_threads(1)
cuda = device.type == "cuda"


def sync():
    if cuda:
        torch.cuda.synchronize(device)


def build_pair():
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         intermediate_size=args.intermediate, max_position_embeddings=4096,
                         initializer_range=args.init, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         tie_word_embeddings=False)
    with device:  # built on the device: nothing this size travels
        target = LlamaForCausalLM(config).to(dtype).eval()
    # A random deep model and its truncated self barely agree (acceptance near 0): what the layers
    # past the draft's write to the residual stream is scaled down, so the target is the draft plus
    # a correction of tunable size. Costs are those of the shapes; the agreement is printed.
    with torch.no_grad():
        for layer in target.model.layers[args.draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(args.tail_scale)
            layer.mlp.down_proj.weight.mul_(args.tail_scale)
    draft_config = copy.deepcopy(config)
    draft_config.num_hidden_layers = args.draft_layers
    with device:
        draft = LlamaForCausalLM(draft_config).to(dtype).eval()
    # The draft is the target's first layers with its embeddings, final norm and head.
    state = {name: tensor for name, tensor in target.state_dict().items()
             if not name.startswith("model.layers.") or int(name.split(".")[2]) < args.draft_layers}
    draft.load_state_dict(state)
    if args.draft_noise:
        generator = torch.Generator(device=device).manual_seed(args.seed + 1)
        with torch.no_grad():
            for parameter in draft.parameters():
                if parameter.dim() > 1:
                    noise = torch.randn(parameter.shape, generator=generator, device=device, dtype=torch.float32)
                    parameter.add_((noise * args.draft_noise * parameter.float().std()).to(dtype))
    for model in (target, draft):
        # No eos: every row writes max_new_tokens, so rates compare like with like.
        model.generation_config = GenerationConfig(pad_token_id=0, eos_token_id=None, bos_token_id=1)
    # Assisted generation drafts k tokens every step, as specdec's constant policy does.
    draft.generation_config.update(num_assistant_tokens=args.k, num_assistant_tokens_schedule="constant",
                                   assistant_confidence_threshold=0.0)
    return target, draft


def prompts(count: int) -> list[list[int]]:
    low, high = (int(v) for v in args.prompt_tokens.split(","))
    generator = torch.Generator().manual_seed(args.seed + 2)
    lengths = torch.randint(low, high + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, args.vocab, (n,), generator=generator).tolist() for n in lengths]


def left_padded(rows: list[list[int]]):
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def step_cost(model, batch: int, context: int = 256, repeats: int = 20) -> float:
    """Seconds of one single-token forward with ``context`` tokens cached (synchronised)."""
    from transformers import DynamicCache

    from specdec.core.models import cache_argument

    ids = torch.randint(3, args.vocab, (batch, context), device=device)
    cache = DynamicCache()
    model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_argument(model): cache})
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        model(input_ids=ids[:, -1:], use_cache=True, logits_to_keep=1, **{cache_argument(model): cache})
        sync()
        times.append(time.perf_counter() - start)
        cache.crop(-1)
    return statistics.median(times)


class IterationPhases(PhaseTimes):
    """``phases`` that also keeps each iteration's own seconds per phase (``rows``)."""

    def begin(self, state, target) -> None:
        super().begin(state, target)
        self.__dict__.setdefault("rows", [])

    def start(self) -> None:
        super().start()
        self.__dict__["current"] = {}

    def mark(self, phase: str) -> None:
        before = self.seconds[phase]
        super().mark(phase)
        self.current[phase] = self.seconds[phase] - before
        if phase == "bookkeeping":
            self.rows.append(self.current)


def report_phases(policy, phases: IterationPhases, batch: int) -> None:
    """Median milliseconds per phase of the drafted and of the plain iterations (device synchronised
    at every phase), from the timed runs' iterations paired with ``policy``'s decisions."""
    decisions = [e for e in policy.log if "k" in e]
    rows, policy.log[:], phases.rows[:] = list(phases.rows), [], []
    if len(decisions) != len(rows):
        print(f"    phases: {len(rows)} iterations against {len(decisions)} decisions; not paired")
        return
    for label, keep in (("drafted", lambda k: k > 0), ("plain", lambda k: k == 0)):
        chosen = [row for row, e in zip(rows, decisions) if keep(e["k"]) and e["batch"] == batch]
        if chosen:
            medians = {phase: 1e3 * statistics.median(row.get(phase, 0.0) for row in chosen) for phase in chosen[0]}
            print(f"    cost-aware+phases at batch {batch}, {len(chosen)} {label} iterations, median ms: "
                  + ", ".join(f"{phase} {ms:.2f}" for phase, ms in medians.items()), flush=True)


def report_policy(policy, batch: int) -> None:
    """What ``cost-aware`` chose at this batch size and what it measured (its log since the last report)."""
    log, policy.log[:] = list(policy.log), []
    decisions = [e for e in log if "k" in e and e["batch"] == batch]
    timed = [e for e in log if "seconds" in e and e["batch"] == batch]
    chosen = statistics.multimode([e["k"] for e in decisions]) if decisions else []
    counts = {k: sum(e["k"] == k for e in decisions) for k in sorted({e["k"] for e in decisions})}
    print(f"    cost-aware at batch {batch}: k chosen {counts} (mode {chosen}), "
          f"{sum(e['probing'] for e in decisions)} probes", flush=True)
    for width in sorted({e["width"] for e in timed}):
        for kind, keep in (("after drafting", True), ("after plain", False)):
            runs = [e for e in timed if e["width"] == width and e["after_drafting"] == keep and not e["first"]]
            apart = [round(1e3 * e["seconds"], 1) for e in runs if e["first_run"]]  # not timed: one-time work
            seconds = [e["seconds"] for e in runs if not e["first_run"]]
            if seconds:
                print(f"    width {width} {kind}: {len(seconds)} timed, median {1e3 * statistics.median(seconds):.2f} ms, "
                      f"first three {[round(1e3 * s, 1) for s in seconds[:3]]} ms, max {1e3 * max(seconds):.1f} ms"
                      + (f"; first runs set apart {apart} ms" if apart else ""))
            elif apart:
                print(f"    width {width} {kind}: only first runs, set apart {apart} ms")
    compiled = [round(1e3 * e["compiled_seconds"]) for e in log if "compiled_seconds" in e and e["batch"] == batch]
    if compiled:
        print(f"    {len(compiled)} iteration(s) compiled or recorded a CUDA graph, not timed: {compiled[:8]} ms")
    first_reads = [1e3 * e["seconds"] for e in timed if e["first"]]
    if first_reads:
        print(f"    first reads: {len(first_reads)}, median {statistics.median(first_reads):.1f} ms")
    if decisions and decisions[-1]["costs"]:
        last = decisions[-1]
        print(f"    last decision: costs (ms) {{{', '.join(f'{k}: {1e3 * c:.2f}' for k, c in last['costs'].items())}}}, "
              f"goodput {{{', '.join(f'{k}: {g:.1f}' for k, g in last['goodput'].items())}}}, "
              f"resume {last['resume']}, first read {last['first_read']}", flush=True)


def explain_differences(target, rows: list[list[int]], reference: list[list[int]], most: int = 8) -> list[dict]:
    """For each row that differs from the target's (at most ``most``), ``specdec.exactness``'s
    account of its first differing token: the target alone on the shared prefix, in its dtype and
    in float64, and whether the margin between the two tokens is within the dtype's rounding there
    (a near-tie that another matmul shape flips) or not (a wrong acceptance)."""
    found, explain = [], Explainer(target)
    for index, (row, expected) in enumerate(zip(rows, reference)):
        if row == expected or len(found) >= most:
            continue
        # Rows are left-padded alike (same prompt batch) and never end early (no eos here).
        start = len(expected) - args.max_new_tokens
        at, theirs, ours = first_divergence(expected[start:], row[start:])
        pads = next(i for i, t in enumerate(expected) if t != 0)  # left padding: prompts never draw id 0
        why = explain(expected[pads:start + at], theirs, ours)
        found.append(dict(row=index, position=at, **attrs.asdict(why), near_tie=why.near_tie))
    return found


def main():
    target, draft = build_pair()
    size = sum(p.numel() for p in target.parameters()) / 1e6
    draft_size = sum(p.numel() for p in draft.parameters()) / 1e6
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"device {name}, {args.dtype}; target {size:.0f}M parameters ({args.layers} layers), "
          f"draft {draft_size:.0f}M ({args.draft_layers} layers, noise {args.draft_noise}); k = {args.k}; "
          f"{args.max_new_tokens} new tokens per row")
    wanted = args.contenders.split(",")
    traced, traced_too, traced_compiled = Traced(), Traced(), Traced()
    traced.log, traced_too.log, traced_compiled.log = [], [], []
    phases = IterationPhases(sync=True)
    decoders = {
        "specdec": dict(),
        "specdec+static": dict(static_cache=True),
        "specdec+compile": dict(static_cache=True, compile="draft"),
        "specdec+compile-all": dict(static_cache=True, compile="all"),
        "specdec+compile-all+cost-aware": dict(static_cache=True, compile="all", policy=traced_compiled),
        "specdec+cost-aware": dict(policy=traced),
        "specdec+cost-aware+phases": dict(policy=traced_too, observers=[phases]),
    }
    decoders = {label: SpeculativeDecoder(target=target, drafter=ModelDrafter(draft),
                                          **{"policy": ConstantLookahead(k=args.k), **options})
                for label, options in decoders.items() if label in wanted}
    greedy = dict(do_sample=False, max_new_tokens=args.max_new_tokens)
    results = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        rows = prompts(max(args.prompts, batch) // batch * batch)
        batches = [left_padded(rows[i:i + batch]) for i in range(0, len(rows), batch)]

        def plain(**options):
            return lambda: ([target.generate(ids, attention_mask=mask, **greedy, **options) for ids, mask in batches], None)

        runs = {}
        if "target" in wanted:
            runs["target"] = plain()
        if "target+static" in wanted:
            runs["target+static"] = plain(cache_implementation="static")
        if "assisted" in wanted and batch == 1:
            runs["assisted"] = plain(assistant_model=draft)
        for label, decoder in decoders.items():
            def run(decoder=decoder):
                outs = [decoder.generate(ids, attention_mask=mask, **greedy) for ids, mask in batches]
                return [o.sequences for o in outs], outs
            runs[label] = run
        samples = {label: [] for label in runs}
        outputs, memory = {}, {}
        # Graphs compiled and CUDA graphs skipped, per contender: at warm-up, and during the timed
        # repeats (where any is a recompile that the timing pays for); and the compile work begun
        # while timed, CUDA graph recordings included (a re-recording is paid for too).
        compiled = {label: [0, 0, 0, 0] for label in runs}  # graphs at warm-up, graphs timed, cudagraph skips, work timed

        def counted(label, call, timed):
            graphs, skips = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
            work = compile_work_begun()
            result = call()
            compiled[label][1 if timed else 0] += counters["stats"]["unique_graphs"] - graphs
            compiled[label][2] += counters["inductor"]["cudagraph_skips"] - skips
            compiled[label][3] += (compile_work_begun() - work) if timed else 0
            return result

        for label, run in runs.items():  # one untimed call: warm-up, compilation, peak memory
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            outputs[label] = counted(label, run, timed=False)
            sync()
            memory[label] = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
        order = list(runs)
        for repeat in range(args.repeats):
            shift = repeat % len(order)
            for label in order[shift:] + order[:shift]:
                sync()
                start = time.perf_counter()
                outputs[label] = counted(label, runs[label], timed=True)
                sync()
                samples[label].append(time.perf_counter() - start)
        tokens = len(rows) * args.max_new_tokens
        c = step_cost(draft, batch) / step_cost(target, batch)
        reference = [row for out in outputs["target"][0] for row in out.tolist()] if "target" in outputs else None
        base = samples.get("target")
        print(f"\nbatch {batch}: {len(rows)} prompts, {tokens} new tokens, c = {c:.3f}")
        print(f"{'contender':26s} {'tok/s':>9s} {'vs target':>17s} {'accept':>6s} {'tau':>5s} {'ideal':>6s} "
              f"{'of ideal':>8s} {'occupancy':>9s} {'peak GiB':>8s} {'identical':>9s}")
        for label in runs:
            seconds = statistics.median(samples[label])
            paired = [b / s for s, b in zip(samples[label], base)] if base else [float("nan")]
            speedup = statistics.median(paired)
            row = dict(batch=batch, contender=label, tokens_per_s=tokens / seconds, speedup=speedup, paired=paired,
                       peak_gib=memory[label], c=c, device=name, dtype=args.dtype)
            sequences, outs = outputs[label]
            flat = [r for out in sequences for r in out.tolist()]
            row["identical"] = (sum(a == b for a, b in zip(flat, reference)) / len(flat)) if reference else None
            if reference and label != "target":
                row["differences"] = explain_differences(target, flat, reference)
            accept = tau = ideal = occupancy = None
            if outs is not None:
                drafted = sum(o.stats.drafted for o in outs)
                accept = sum(o.stats.accepted for o in outs) / drafted if drafted else 0.0
                row_steps = sum(o.stats.row_steps for o in outs)
                tau, k_mean = tokens / row_steps, drafted / row_steps
                ideal = tau / (k_mean * c + 1)
                # a batch runs until its slowest row ends: the share of its row slots still decoding
                occupancy = row_steps / sum(o.stats.iterations * o.stats.rows for o in outs)
            row.update(acceptance=accept, tau=tau, ideal=ideal, of_ideal=speedup / ideal if ideal else None,
                       occupancy=occupancy,
                       graphs_at_warmup=compiled[label][0], graphs_timed=compiled[label][1],
                       cudagraph_skips=compiled[label][2], compile_work_timed=compiled[label][3])
            results.append(row)

            def fmt(value, spec):
                return format(value, spec) if value is not None else "-"

            print(f"{label:26s} {row['tokens_per_s']:9.1f} {speedup:6.2f}x [{min(paired):.2f}-{max(paired):.2f}] "
                  f"{fmt(accept, '6.0%')} {fmt(tau, '5.2f')} {fmt(ideal, '5.2f')} {fmt(row['of_ideal'], '8.0%')} "
                  f"{fmt(occupancy, '9.0%')} {fmt(memory[label], '8.2f')} {fmt(row['identical'], '9.0%')}", flush=True)
            for d in row.get("differences", []):
                print(f"    row {d['row']}: first differs at new token {d['position']} ({d['reference_token']} vs "
                      f"{d['other_token']}); the target alone there: margin {d['reference_margin']:.4f} "
                      f"({d['reference_margin'] / d['ulp']:.0f} ulp), its dtype's rounding {d['rounding']:.4f}, float64 "
                      f"margin {d['float64_margin']:+.4f} -> {'near-tie' if d['near_tie'] else 'NOT A NEAR-TIE'}", flush=True)
        for label, (warm, timed, skips, work) in compiled.items():
            if warm or timed or skips or work:
                print(f"    {label}: {warm} graph(s) compiled at warm-up, {timed} during the timed repeats"
                      f"{' (recompiled: the timing pays for it)' if timed else ''}; {skips} CUDA graph skip(s); "
                      f"{work} compile(s) or CUDA graph recording(s) begun while timed", flush=True)
        for label in ("specdec+cost-aware", "specdec+compile-all+cost-aware"):
            if label in decoders:
                print(f"    {label}:")
                report_policy(decoders[label].policy, batch)
        if "specdec+cost-aware+phases" in decoders:
            report_phases(decoders["specdec+cost-aware+phases"].policy, phases, batch)
        if args.out:  # after every batch size: a run cut short keeps what it finished
            Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
