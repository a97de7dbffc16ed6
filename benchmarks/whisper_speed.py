"""Speculative Whisper decoding vs the target alone, on a whisper-tiny-shaped model built from a config.

    python benchmarks/whisper_speed.py [--batch-sizes 1,4] [--max-new-tokens 64] [--repeats 3]

No checkpoint can be downloaded here, so the target has random weights (4 + 4 layers, d_model
384, the tests' Whisper-shaped 1768-token vocabulary, float32) and acceptance is set by the draft:

* ``truncated``: a ``shared_encoder`` draft made of the target's own embeddings, first decoder
  layer and output projection (layer skipping). To give it something to agree with, the target's
  decoder layers after the first write into the residual stream damped by ``--damp`` (their
  compute is unchanged: same shapes, same FLOPs), so acceptance is a dial, not a property of a
  trained pair; the run reports what it reached. This shows the loop's speed and exactness at a
  realistic acceptance with whisper-tiny's real cost structure;
* ``random``: an untrained 1-layer Distil-Whisper-style decoder: acceptance near 0, the worst case
  (every iteration pays a draft and a verify for one token).

Every speculative output is checked against the target's greedy ``generate``.
"""

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec import SpeculativeDecoder  # noqa: E402
from specdec.drafters import SharedEncoderDrafter  # noqa: E402
from specdec.policies import ConstantLookahead  # noqa: E402
from specdec.whisper import WhisperSpeculativeDecoder  # noqa: E402
from tests.tiny_whisper import decoder_of, features, tiny_distil_decoder, tiny_whisper  # noqa: E402

SHAPE = dict(d_model=384, encoder_layers=4, decoder_layers=4, heads=6, ffn=1536)

parser = argparse.ArgumentParser()
parser.add_argument("--batch-sizes", default="1,4")
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--k", type=int, default=5)
parser.add_argument("--damp", type=float, default=0.1, help="scale of decoder layers 2.. output projections")
args = parser.parse_args()

target = tiny_whisper(seed=0, scale=0.05, **SHAPE).float()
with torch.no_grad():
    for layer in target.model.decoder.layers[1:]:
        for projection in (layer.self_attn.out_proj, layer.encoder_attn.out_proj, layer.fc2):
            projection.weight.mul_(args.damp)
            projection.bias.mul_(args.damp)
truncated = decoder_of(target)
truncated.model.decoder.layers = truncated.model.decoder.layers[:1]
truncated.config.decoder_layers = 1
random_draft = tiny_distil_decoder(seed=1, scale=0.05, **dict(SHAPE, decoder_layers=1)).float()
drafts = {"truncated": truncated, "random": random_draft}


def timed(fn):
    fn()  # warm-up
    times, out = [], None
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; target "
      f"{sum(p.numel() for p in target.parameters()) / 1e6:.1f}M params, drafts "
      f"{sum(p.numel() for p in truncated.parameters()) / 1e6:.1f}M / {sum(p.numel() for p in random_draft.parameters()) / 1e6:.1f}M "
      f"(embeddings included), damp {args.damp}, median of {args.repeats}")
print("batch | method | s | tok/s | vs target | accept | tokens/call | RTFx | exact")
for batch in [int(b) for b in args.batch_sizes.split(",")]:
    audio = features(batch, seed=batch).float()
    options = dict(max_new_tokens=args.max_new_tokens, max_length=None, language="en", task="transcribe")
    base_s, base = timed(lambda: target.generate(audio, **options))
    # generate returns only the new tokens (the decoder prompt is stripped); eos also pads finished rows.
    new = int((base != target.generation_config.eos_token_id).sum())
    print(f"{batch} | target alone | {base_s:.3f} | {new / base_s:.1f} | 1.00x | | | {batch * 30 / base_s:.0f} |")
    for name, draft in drafts.items():
        whisper = WhisperSpeculativeDecoder(
            SpeculativeDecoder(target=target, drafter=SharedEncoderDrafter(copy.deepcopy(draft)), policy=ConstantLookahead(k=args.k))
        )
        seconds, out = timed(lambda: whisper.generate(audio, **options))
        stats = whisper.stats
        exact = torch.equal(out, base)
        print(
            f"{batch} | specdec (shared_encoder {name}, k={args.k}) | {seconds:.3f} | {new / seconds:.1f} | "
            f"{base_s / seconds:.2f}x | {stats.decode.acceptance_rate:.0%} | {stats.tokens_per_target_call:.2f} | "
            f"{stats.rtfx:.0f} | {'yes' if exact else 'NO'}"
        )
