"""Where an iteration's time goes on real whisper-base with the shipped draft, per constant k.

    OMP_NUM_THREADS=1 python benchmarks/whisper_phases.py --audio-dir /tmp/speech-eval --ks 0,1,2,3

Batch 1, greedy, English utterances in rotating order, one decoder per k kept over all its calls
(as ``specdec transcribe`` keeps one). Per k: ms per iteration in each of the loop's phases
(``PhaseTimes``: lookahead, draft, verify, commit, bookkeeping), the draft's ms per drafted token,
and the verify's ms against k = 0's plain step, so that the draft step's cost (issue 14's c) and the
verify's growth with width are read apart; every run's tokens are checked against base's
``generate``. ``whisper_policy_trace.py`` gives whole iterations by width; this splits them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from whisper_real_speed import add_pair_arguments, load_pair_and_speech  # noqa: E402

from specdec import SpeculativeDecoder  # noqa: E402
from specdec.drafters import SharedEncoderDrafter  # noqa: E402
from specdec.observers.phases import PHASES, PhaseTimes  # noqa: E402
from specdec.policies import ConstantLookahead  # noqa: E402
from specdec.whisper import WhisperSpeculativeDecoder  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_arguments(parser)
    parser.add_argument("--limit", type=int, default=8, help="the first N English utterances")
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--ks", default="0,1,2,3", help="constant lookaheads (0: plain target steps in the loop)")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    if args.passes < 1 or args.limit < 1 or not ks or any(k < 0 for k in ks):
        parser.error("--passes and --limit must be at least 1, and --ks non-negative integers")

    target, draft, features = load_pair_and_speech(args)
    timers = {k: PhaseTimes() for k in ks}
    runs = {}
    for k in ks:
        decoder = SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(model=draft),
                                     policy=ConstantLookahead(k=k), observers=[timers[k]])
        runs[k] = WhisperSpeculativeDecoder(decoder)
    drafted = dict.fromkeys(ks, 0)
    mismatches = 0
    with torch.no_grad():
        references = [target.generate(x, language="en", task="transcribe") for x in features]
        for k in ks:  # untimed: packing the decoder's weights once per process
            runs[k].generate(features[0], language="en", task="transcribe")
            timers[k].reset()
        turn = 0
        for _ in range(args.passes):
            for x, reference in zip(features, references):
                for k in ks[turn % len(ks):] + ks[: turn % len(ks)]:
                    ids = runs[k].generate(x, language="en", task="transcribe")
                    mismatches += not torch.equal(ids.cpu(), reference.cpu())
                    drafted[k] += runs[k].stats.decode.drafted
                turn += 1
    plain = None
    if 0 in timers and timers[0].iterations:
        plain = 1000 * timers[0].seconds["verify"] / timers[0].iterations
    print(f"{len(features)} utterances x {args.passes} passes, batch 1, greedy, one thread; ms per iteration")
    print(f"{'k':>3} {'iterations':>10} " + " ".join(f"{p:>11}" for p in PHASES) + f" {'total':>8}"
          f" {'draft/token':>11} {'verify/plain':>12}")
    for k in ks:
        t = timers[k]
        per = {p: 1000 * t.seconds[p] / max(t.iterations, 1) for p in PHASES}
        per_token = 1000 * t.seconds["draft"] / drafted[k] if drafted[k] else float("nan")
        ratio = per["verify"] / plain if plain else float("nan")
        print(f"{k:>3} {t.iterations:>10} " + " ".join(f"{per[p]:>11.2f}" for p in PHASES)
              + f" {sum(per.values()):>8.2f} {per_token:>11.2f} {ratio:>12.2f}")
    print(f"token-identical to base's generate: {len(features) * args.passes * len(ks) - mismatches}/"
          f"{len(features) * args.passes * len(ks)}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
