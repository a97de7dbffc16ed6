"""What a SmolLM2 verify costs by width, and whether the 4D mask of first-position alternatives adds to it.

A verify over the chain d1 .. dk reads k + 1 tokens; with A alternatives it reads A more, through a
4D mask that keeps the siblings apart (``core/masks.py``), where a chain verify passes a 2D mask.
This times one cached forward of SmolLM2-135M-Instruct over 1 to 11 tokens after a context of
``--context`` tokens, as a multiple of a one-token step with no mask (``generate``'s step): with
no mask, a 2D mask and a 4D mask of the same width, each on torch's linear path and on the
oneDNN-packed weights specdec's multi-token steps use (``core/packed_linear.py``). Medians of
``--repeats`` interleaved passes, one thread. ``--compare-rule RULE`` adds a column: the 2D mask on
weights packed by an earlier rule of ``benchmarks/packing_rules.py`` (e.g. "from a width on").
``--grouped`` adds one more: the 2D mask on packed weights with the grouped-query attention of
specdec's steps (``core/gqa_attention.py``), the path specdec's verify takes since stop 26.

    OMP_NUM_THREADS=1 python benchmarks/verify_width_cost.py [--target DIR] [--context 250] [--repeats 7] \
        [--compare-rule RULE] [--grouped]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.core import gqa_attention, packed_linear  # noqa: E402
from specdec.core.model_cache import cached_model_dir  # noqa: E402

from packing_rules import RULES, packing_rule  # noqa: E402

WIDTHS = (1, 2, 3, 4, 5, 6, 8, 11, 12)
MASKS = ("none", "2d", "4d")


def masks(width: int, context: int) -> dict[str, dict]:
    """The attention_mask argument of each kind for a block of ``width`` after ``context`` tokens."""
    four = torch.zeros(1, 1, width, context + width)
    later = torch.triu(torch.ones(width, width, dtype=torch.bool), 1)  # a chain's causal block
    four[0, 0, :, context:] = four[0, 0, :, context:].masked_fill(later, torch.finfo(torch.float32).min)
    return {"none": {}, "2d": {"attention_mask": torch.ones(1, context + width, dtype=torch.long)},
            "4d": {"attention_mask": four}}


@torch.no_grad()
def timed(model, prefix: torch.Tensor, width: int, mask: dict, packed: bool, grouped: bool = False) -> float:
    cache = DynamicCache(config=model.config)
    model(input_ids=prefix, past_key_values=cache, use_cache=True)
    context = prefix.shape[1]
    block = torch.randint(100, 10000, (1, width))
    positions = torch.arange(context, context + width)[None]
    switch = packed_linear.packed_steps(model, width) if packed else contextlib.nullcontext()
    attention = gqa_attention.gqa_steps(model) if grouped else contextlib.nullcontext()
    started = time.perf_counter()
    with switch, attention:
        model(input_ids=block, past_key_values=cache, use_cache=True, position_ids=positions, logits_to_keep=width, **mask)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="the converted folder (default: specdec's cache)")
    parser.add_argument("--context", type=int, default=250)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--compare-rule", choices=RULES, default=None,
                        help="add a column: the 2D mask on weights packed by this earlier rule")
    parser.add_argument("--grouped", action="store_true",
                        help="add a column: the 2D mask on packed weights with specdec's grouped-query attention")
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = args.target or cached_model_dir("smollm2-135m-instruct")
    if folder is None or not Path(folder).exists():
        raise SystemExit("SmolLM2-135M-Instruct is not converted: run `specdec models fetch smollm2-135m-instruct`")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    packed_linear.pack(model)
    prefix = torch.randint(100, 10000, (1, args.context))
    times: dict[tuple, list[float]] = {}
    columns = [(kind, packed) for kind in MASKS for packed in (False, True)]
    for _ in range(args.repeats):
        for width in WIDTHS:
            for kind, mask in masks(width, args.context).items():
                for packed in (False, True):
                    times.setdefault((width, kind, packed), []).append(timed(model, prefix, width, mask, packed))
            if args.grouped:
                times.setdefault((width, "2d", "grouped"), []).append(
                    timed(model, prefix, width, masks(width, args.context)["2d"], True, grouped=True))
            if args.compare_rule:
                with packing_rule(args.compare_rule):
                    packed_linear.packed_layers(model)  # the rule's layers chosen before the timer, as specdec's are
                    times.setdefault((width, "2d", args.compare_rule), []).append(
                        timed(model, prefix, width, masks(width, args.context)["2d"], True))
    if args.grouped:
        columns.append(("2d", "grouped"))
    if args.compare_rule:
        columns.append(("2d", args.compare_rule))
    step = statistics.median(times[(1, "none", False)])
    print(f"one-token step, no mask, torch's path: {1000 * step:.1f} ms ({packed_linear.cpu_name()})")
    names = {False: "torch", True: "packed", "grouped": "packed, grouped attention"}
    print("| tokens | " + " | ".join(f"{kind} {names.get(path, f'packed ({path})')}" for kind, path in columns) + " |")
    print("|---:|" + "---:|" * len(columns))
    for width in WIDTHS:
        cells = [f"{statistics.median(times[(width, kind, path)]) / step:.2f}" for kind, path in columns]
        print(f"| {width} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
