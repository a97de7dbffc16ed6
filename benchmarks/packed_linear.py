"""What a block of n tokens costs on a CPU, on torch's linear path and on oneDNN-packed weights.

    OMP_NUM_THREADS=1 python benchmarks/packed_linear.py [--model FOLDER] [--rows 1,2,3,4,6,8,16]

First the bare linear layers of a few weight shapes (the LM heads and MLPs of SmolLM2-135M and
whisper-base, the bundled target's), then, with ``--model``, the model's forward over n new tokens
after a 100-token prompt, its cache copied fresh for every call (untimed), torch's path, specdec's
packed steps and the same without padding a call to a faster wider width interleaved
(``core/packed_linear.py``). Medians of ``--repeats`` calls, in ms; the ratios are to torch's. Speculation pays on a CPU only where a block of k + 1 tokens costs about one token.
The bare layers are timed hot (one weight, called again and again); the column "specdec packs it"
is ``faster_at``, which times them cold, as a forward reads them (``time_shape``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.core.packed_linear import (MIN_WEIGHT, available, faster_at, pack, packed_layers,  # noqa: E402
                                        packed_steps, packed_weight, padded_widths)

from packing_rules import packing_rule  # noqa: E402

SHAPES = [(49152, 576), (51865, 512), (4096, 512), (1536, 576), (576, 1536), (2048, 512), (1024, 512), (576, 576),
          (512, 512), (192, 576)]


def median_ms(call, repeats: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a causal LM folder: time its forward too")
    parser.add_argument("--rows", default="1,2,3,4,6,8,16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not available():
        sys.exit("this torch has no oneDNN linear ops: nothing to compare")
    rows = [int(n) for n in args.rows.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print("| weight | specdec packs it (measured) | " + " | ".join(f"{n} rows" for n in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    with torch.no_grad():
        for out_features, in_features in SHAPES:
            weight = torch.randn(out_features, in_features)
            packed = packed_weight(weight)
            cells = []
            for n in rows:
                x = torch.randn(n, in_features)
                plain = median_ms(lambda: F.linear(x, weight), args.repeats)
                fast = median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), args.repeats)
                cells.append(f"{plain:.3f} / {fast:.3f} ({fast / plain:.2f})")
            packed_at = faster_at(weight) if weight.numel() >= MIN_WEIGHT else frozenset()
            chosen = ("no (small)" if weight.numel() < MIN_WEIGHT else "never" if not packed_at
                      else f"at {', '.join(map(str, sorted(packed_at)))} rows")
            if packed_at and (widths := padded_widths(weight)):
                chosen += ", " + ", ".join(f"{n} padded to {wide}" for n, wide in widths.items() if n in packed_at)
            print(f"| {out_features} x {in_features} | {chosen} | " + " | ".join(cells) + " |")
        if args.model:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
            prompt = torch.randint(0, model.config.vocab_size, (1, 100))
            cache = model(prompt, use_cache=True).past_key_values
            print(f"\n{args.model}: forward over n tokens after a 100-token prompt, torch / packed ms (ratio)")
            print("packed at: " + "; ".join(
                f"{out} x {inp}: {', '.join(map(str, sorted(at)))} rows" + "".join(f", {n} -> {wide}" for n, wide in widths if n in at)
                for (out, inp), at, widths in sorted({(tuple(m.weight.shape), at, tuple(padded_widths(m.weight).items()))
                                                       for m, at in packed_layers(model)})))
            pack(model)
            # Interleaved (torch, packed, packed unpadded, torch, ...) so that a neighbour's load
            # hits all alike; the cache is copied fresh before each call, outside the timed forward.
            # "unpadded": the measured rule without padding a call to a faster, wider width.
            paths = ("torch", "packed", "unpadded")
            times = {(n, path): [] for n in rows for path in paths}
            for _ in range(args.repeats):
                for n in rows:
                    x = torch.randint(0, model.config.vocab_size, (1, n))
                    for path in paths:
                        fresh = copy.deepcopy(cache)
                        with torch.no_grad(), packing_rule("unpadded" if path == "unpadded" else None), \
                                packed_steps(model, n) if path != "torch" else contextlib.nullcontext():
                            start = time.perf_counter()
                            model(x, past_key_values=fresh, use_cache=True, logits_to_keep=n)
                            times[(n, path)].append(time.perf_counter() - start)
            print("tokens: torch / packed (ratio) / packed, unpadded (ratio), ms")
            for n in rows:
                plain, fast, unpadded = (statistics.median(times[(n, path)]) * 1e3 for path in paths)
                print(f"{n}: {plain:.1f} / {fast:.1f} ({fast / plain:.2f}) / {unpadded:.1f} ({unpadded / plain:.2f})")


if __name__ == "__main__":
    main()
