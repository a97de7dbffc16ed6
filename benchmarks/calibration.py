"""How well the draft's and the target's confidence predict acceptance, on the bundled pair.

Runs the pair with a fixed long draft (``--k``; the classifier's training setting) and records, at
every draft position up to and including the first rejection: the draft's probability q of its
token, the draft's entropy, the position, the target's probability of the row's last committed
token, and whether the target accepted the token. Prints reliability tables (bins of the predicted
probability against the observed acceptance), acceptance by position and each feature's ranking
power (AUC).

    OMP_NUM_THREADS=1 python benchmarks/calibration.py [--sampled] [--prompts 0:16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's specdec, not an installed copy

from specdec import SpeculativeDecoder  # noqa: E402
from bundled_pair import load_bundled_pair  # noqa: E402
from specdec.drafters import ModelDrafter  # noqa: E402
from specdec.training.classifier import _OracleRecorder  # noqa: E402
from specdec.verifiers import GreedyVerifier, RejectionVerifier  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """P(score of a random accepted position > score of a random rejected one)."""
    order = score.argsort()
    ranks = torch.empty_like(score, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(score) + 1, dtype=torch.float64)
    positives = label.bool()
    n_pos, n_neg = int(positives.sum()), int((~positives).sum())
    if not n_pos or not n_neg:
        return float("nan")
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def table(name: str, value: torch.Tensor, label: torch.Tensor, edges) -> None:
    print(f"\n{name}: bin | positions | mean predicted | observed acceptance")
    for low, high in zip(edges[:-1], edges[1:]):
        inside = (value >= low) & (value < high) if high < edges[-1] else (value >= low) & (value <= high)
        if int(inside.sum()):
            print(f"  [{low:.2f}, {high:.2f}) | {int(inside.sum()):5d} | {float(value[inside].mean()):.3f} | "
                  f"{float(label[inside].float().mean()):.3f}")


def collect(decoder, tokenizer, prompts, k, sampling):
    recorder = _OracleRecorder(max_tokens=k - 1)
    collector = SpeculativeDecoder(target=decoder.target, drafter=decoder.drafter, policy=recorder,
                                   verifier=RejectionVerifier() if sampling else GreedyVerifier())
    generator = torch.Generator().manual_seed(0)
    for i in range(0, len(prompts), 8):
        batch = tokenizer(prompts[i : i + 8], return_tensors="pt", padding=True)
        options = dict(do_sample=True, temperature=0.7, top_p=0.9, generator=generator) if sampling else dict(do_sample=False)
        collector.generate(**batch, max_new_tokens=64, **options)
    return recorder


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=9)
    parser.add_argument("--prompts", default="0:16")
    parser.add_argument("--sampled", action="store_true")
    args = parser.parse_args()
    target, tokenizer, draft, prompts = load_bundled_pair()
    decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft))
    lo, hi = (int(x) for x in args.prompts.split(":"))
    prompts = prompts[lo:hi]
    # _OracleRecorder labels with the greedy oracle only under greedy verification; under sampling
    # the label is the rejection verifier's draw (accepted < position), which is what it records too.
    recorder = collect(decoder, tokenizer, prompts, args.k, args.sampled)
    features, labels = torch.cat(recorder.features), torch.cat(recorder.labels)
    token_prob, entropy, position, target_conf = features.unbind(1)
    print(f"{'sampled' if args.sampled else 'greedy'}: {len(labels)} draft positions, acceptance {float(labels.float().mean()):.3f}")
    edges = [0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]
    table("draft q of its token", token_prob, labels, edges)
    first = position == 0
    table("target's p of the last committed token (position-0 drafts only)", target_conf[first], labels[first], edges)
    print("\nacceptance by position (given every earlier draft was accepted):")
    for j in range(int(position.max()) + 1):
        at = position == j
        print(f"  position {j}: {int(at.sum()):5d} positions, acceptance {float(labels[at].float().mean()):.3f}")
    from specdec.policies.classifier import StopClassifier

    classifier = StopClassifier.load(ROOT / "models/python-pair/classifier.safetensors")
    predicted = classifier.accept_probability(features)
    table("the bundled classifier's estimate", predicted, labels, edges)
    print(f"  share of positions it sends below 0.5 (stop): {float((predicted < 0.5).float().mean()):.3f}")
    print("\nAUC (ranking power for acceptance of this token):")
    for name, value in [("token_prob", token_prob), ("-entropy", -entropy), ("-position", -position),
                        ("target_confidence", target_conf), ("classifier", predicted)]:
        print(f"  {name:18s} {auc(value, labels):.3f}")


if __name__ == "__main__":
    main()
