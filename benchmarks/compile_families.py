"""Compiled static steps per model family: whole graphs, or where they break.

On a GPU, ``compile="all"`` (``[target] compile``, static cache) runs each draft and verify step
as a CUDA graph (``torch.compile(mode="reduce-overhead")``). A graph break splits that graph and
runs Python between its parts, and a recompile on the next request records the graphs again:
either gives back most of what the graphs save. Dynamo makes the same graphs on a CPU, so both
are counted here without a GPU, for one tiny float64 model of each family of
``tests/architectures.py`` (the families the static path takes; the rest are refused with their
reason): a ragged batch of three prompts, the ``model`` drafter (a perturbed copy) at constant
k = 4, 24 new tokens, two requests.

    python benchmarks/compile_families.py [--only full,sliding] [--timeout 300] [--json out.json]
    python benchmarks/compile_families.py --only moe,mla --dtype float32 --experts grouped_mm

Columns: exact (both requests equal ``generate``), graphs made by the first request, graph
breaks (with dynamo's reasons), graphs made by the second request (0: every step found its graph).
Each family runs in a forked child with a time limit.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path

from family_setup import arch_lib  # first: the checkout on the path, one thread, quiet warnings

import torch  # noqa: E402
import transformers  # noqa: E402

from specdec import ConfigError, SpeculativeDecoder  # noqa: E402
from specdec.drafters import ModelDrafter  # noqa: E402
from specdec.policies import ConstantLookahead  # noqa: E402

NEW_TOKENS = 24


def check_family(family: str, dtype: torch.dtype, experts: str | None) -> dict:
    from torch._dynamo.utils import counters

    target = arch_lib.tiny_family_model(family).to(dtype)  # the child's own copy (forked)
    draft = arch_lib.tiny_family_model(family, draft=True).to(dtype)
    if experts and target._can_set_experts_implementation():  # an MoE model
        for model in (target, draft):
            model.set_experts_implementation(experts)
    ids, mask = arch_lib.ragged_batch()
    greedy = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    reference = arch_lib.reference_generate(target, ids, mask, **greedy)
    result = dict(family=family, arch=arch_lib.FAMILIES[family])
    try:
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft), policy=ConstantLookahead(k=4),
                                     static_cache=True, compile="all")
        counters.clear()
        first = decoder.generate(ids, attention_mask=mask, **greedy).sequences
    except ConfigError as exc:  # a refusal with its reason; anything else is a crash (below)
        return dict(result, verdict="REFUSED", detail=str(exc).splitlines()[0])
    result.update(graphs=counters["stats"]["unique_graphs"], breaks=dict(counters["graph_break"]))
    counters.clear()
    second = decoder.generate(ids, attention_mask=mask, **greedy).sequences
    result.update(graphs_next_request=counters["stats"]["unique_graphs"],
                  exact=bool(torch.equal(first, reference) and torch.equal(second, reference)))
    whole = not result["breaks"] and not result["graphs_next_request"]
    result["verdict"] = ("WHOLE" if whole else "BROKEN") if result["exact"] else "MISMATCH"
    return result


def _child(family, dtype, experts, connection):
    try:
        result = check_family(family, dtype, experts)
    except BaseException as exc:  # noqa: BLE001
        result = dict(family=family, arch=arch_lib.FAMILIES[family], verdict="CRASH",
                      detail=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    connection.send(result)
    connection.close()


def run_isolated(family: str, timeout: float, dtype: torch.dtype, experts: str | None) -> dict:
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(family, dtype, experts, send), daemon=True)
    started = time.perf_counter()
    process.start()
    send.close()
    result = receive.recv() if receive.poll(timeout) else None
    process.join(5)
    if process.is_alive():
        process.kill()
        process.join()
    if result is None:
        result = dict(family=family, arch=arch_lib.FAMILIES[family], verdict="CRASH",
                      detail=f"timed out after {timeout:.0f} s or died (exit code {process.exitcode})")
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="comma-separated families (default: every one of tests/architectures.py)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per family (default 300)")
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32"])
    parser.add_argument("--experts", choices=["eager", "grouped_mm", "batched_mm"],
                        help="MoE models' experts_implementation (the tiny models are built with 'eager': torch's "
                             "grouped_mm has no float64 kernel on a CPU; transformers' default is grouped_mm)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    families = args.only.split(",") if args.only else list(arch_lib.FAMILIES)
    unknown = [f for f in families if f not in arch_lib.FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(arch_lib.FAMILIES)}")
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; one thread; {args.dtype}; "
          f"experts {args.experts or 'as built (eager)'}; {NEW_TOKENS} new tokens, two requests", flush=True)
    print("| family | model | verdict | graphs | graph breaks | graphs on the next request | exact | seconds |")
    print("|---|---|---|---:|---|---:|---|---:|")
    results = []
    for family in families:
        r = run_isolated(family, args.timeout, dtype, args.experts)
        results.append(r)
        if r["verdict"] in ("REFUSED", "CRASH"):
            print(f"| {family} | {r['arch']} | {r['verdict']} | - | {r['detail']} | - | - | {r['seconds']} |", flush=True)
            continue
        breaks = "; ".join(f"{n} x {reason.splitlines()[0]}" for reason, n in r["breaks"].items()) or "none"
        print(f"| {family} | {r['arch']} | {r['verdict']} | {r['graphs']} | {breaks} | {r['graphs_next_request']} "
              f"| {'yes' if r['exact'] else 'NO'} | {r['seconds']} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if any(r["verdict"] in ("MISMATCH", "CRASH") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
