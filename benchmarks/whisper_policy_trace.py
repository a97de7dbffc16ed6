"""``cost-aware`` against constant lookaheads on real whisper-base at batch 1, with what it chose.

Utterance by utterance, in rotating order, in one process: base's ``generate``, specdec with a
``cost-aware`` that logs its decisions (``batch_trace.Traced``) and specdec with each constant k of
``--ks``, every one with the shipped shared-encoder draft and one decoder kept over all its calls
(as ``specdec transcribe`` keeps one). It prints each contender's decoder speed over base's (the
encoder's forward timed by a hook and left out) and end to end, the k ``cost-aware`` chose, and the
median time of its iterations per drafted width (the first of each request left out, as the policy
leaves it out). ``whisper_real_speed.py`` measures more (batch sizes, RTFx, acceptance, memory);
this says why ``cost-aware`` lands where it does against the best constant (issue 13).

    OMP_NUM_THREADS=1 python benchmarks/whisper_policy_trace.py --audio-dir /tmp/speech-eval --passes 2
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from batch_trace import Traced  # noqa: E402
from whisper_real_speed import add_pair_arguments, EncoderClock, load_pair_and_speech  # noqa: E402

from specdec import SpeculativeDecoder  # noqa: E402
from specdec.drafters import SharedEncoderDrafter  # noqa: E402
from specdec.policies import ConstantLookahead  # noqa: E402
from specdec.whisper import WhisperSpeculativeDecoder  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_arguments(parser)
    parser.add_argument("--limit", type=int, default=16, help="the first N English utterances")
    parser.add_argument("--passes", type=int, default=2, help="timed passes, after one untimed utterance each")
    parser.add_argument("--ks", default="1,2,3", help="constant lookaheads beside cost-aware")
    parser.add_argument("--max-k", type=int, default=8, help="cost-aware's max_k")
    parser.add_argument("--precision", default="int8", help="the draft's matmul_precision (whisper.toml's: int8)")
    parser.add_argument("--per-position", action="store_true", help="cost-aware's per_position (acceptance by draft position)")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    if args.passes < 1 or args.limit < 1 or any(k < 0 for k in ks):
        parser.error("--passes and --limit must be at least 1, every k >= 0")

    target, draft, features = load_pair_and_speech(args)
    traced = Traced(max_k=args.max_k, per_position=args.per_position)
    traced.log = []

    def speculative(policy):
        decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=draft, matmul_precision=args.precision),
                                     policy=policy)
        whisper = WhisperSpeculativeDecoder(decoder)
        return lambda x: whisper.generate(x, language="en", task="transcribe")

    runs = {"base": lambda x: target.generate(x, language="en", task="transcribe"), "cost-aware": speculative(traced)}
    runs.update({f"constant k={k}": speculative(ConstantLookahead(k=k)) for k in ks})
    names = list(runs)
    clock = EncoderClock(target)
    wall, encoder = collections.Counter(), collections.Counter()
    with torch.no_grad():
        for name in names:  # untimed: packing the decoder's weights once per process
            runs[name](features[0])
        traced.log.clear()
        turn = 0
        for _ in range(args.passes):
            for x in features:
                for name in names[turn % len(names):] + names[: turn % len(names)]:
                    started, encoded = time.perf_counter(), clock.seconds
                    runs[name](x)
                    wall[name] += time.perf_counter() - started
                    encoder[name] += clock.seconds - encoded
                turn += 1
    decoder = {name: wall[name] - encoder[name] for name in names}
    print(f"{len(features)} utterances x {args.passes} passes, batch 1, greedy, one thread")
    for name in names:
        print(f"{name:>16}: decoder {decoder[name]:6.2f} s, {decoder['base'] / decoder[name]:.3f}x of base; "
              f"end to end {wall[name]:6.2f} s, {wall['base'] / wall[name]:.3f}x")
    chosen = collections.Counter(entry["k"] for entry in traced.log if "k" in entry)
    print("cost-aware's k:", ", ".join(f"{k}: {n}" for k, n in sorted(chosen.items())))
    widths = collections.defaultdict(list)
    for entry in traced.log:
        if "width" in entry and not entry["first"]:
            widths[entry["width"]].append(entry["seconds"])
    print("its iterations by drafted width:", ", ".join(
        f"{w}: {len(s)} x {1000 * statistics.median(s):.1f} ms" for w, s in sorted(widths.items())))


if __name__ == "__main__":
    main()
