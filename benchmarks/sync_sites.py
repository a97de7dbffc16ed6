"""Every host-device synchronisation the decode loop makes on a CUDA device, with where it comes from
(issue 17, item 3).

    python benchmarks/sync_sites.py            # on a CUDA machine; a few seconds
    python benchmarks/sync_sites.py --cpu      # checks the script (no sync detection on a CPU)

The test (tests/test_hot_path.py::TestOneSyncPerIteration) stops at the first sync outside the
commit; this lists them all in one run, so that one device session finds every one. It decodes a
tiny ragged batch with several drafters, policies and verifiers under
``torch.cuda.set_sync_debug_mode("warn")`` (the commit, the iteration's one sync, exempt) and prints,
per configuration, how many syncs each call site made (the innermost specdec frames of the stack),
and whether the output equals the target's own ``generate``.
"""

from __future__ import annotations

import collections
import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's specdec and tests

from specdec import SpeculativeDecoder  # noqa: E402
from specdec.decoding.ops import syncs_outside_commit  # noqa: E402
from specdec.drafters import ModelDrafter, NGramDrafter  # noqa: E402
from specdec.policies import ConstantLookahead, CostAwareLookahead, DraftConfidenceLookahead  # noqa: E402
from specdec.verifiers import GreedyVerifier, RejectionVerifier  # noqa: E402
from tests.conftest import left_padded, perturbed_copy, tiny_llama  # noqa: E402

VOCAB = 32
PROMPTS = [[1, 2, 3, 1, 2], [4, 5], [6, 7, 8, 9, 10, 11, 6, 7], [12]]
NEW_TOKENS = 16
ROOT = str(Path(__file__).resolve().parent.parent / "specdec")


def configurations(draft):
    yield "model + draft-confidence", dict(drafter=ModelDrafter(draft), policy=DraftConfidenceLookahead(threshold=0.3, max_tokens=6))
    yield "model(alternatives=3) + cost-aware", dict(drafter=ModelDrafter(draft, alternatives=3), policy=CostAwareLookahead())
    yield "model + constant 5", dict(drafter=ModelDrafter(draft), policy=ConstantLookahead(k=5))
    yield "model + constant 5, static cache", dict(drafter=ModelDrafter(draft), policy=ConstantLookahead(k=5), static_cache=True)
    yield "ngram + constant 3", dict(drafter=NGramDrafter(), policy=ConstantLookahead(k=3))
    yield "model + constant 5, sampled", dict(drafter=ModelDrafter(draft), policy=ConstantLookahead(k=5),
                                              verifier=RejectionVerifier(), sample=True)


def main() -> int:
    device = torch.device("cpu" if "--cpu" in sys.argv else "cuda")
    target = tiny_llama(20, vocab=VOCAB, layers=2, dtype=torch.float32, init=0.3)
    draft = perturbed_copy(target, 0.1).to(device)
    target = target.to(device)
    input_ids, mask = (t.to(device) for t in left_padded(PROMPTS))
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        stack = traceback.extract_stack()[:-1]
        frames = [f for f in stack if f.filename.startswith(ROOT)]
        if frames:
            sites[" <- ".join(f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))] += 1
        else:  # no specdec frame (stop 33 saw one such): where the warning was raised, whoever's code it is
            sites["(outside specdec) " + " <- ".join(f"{f.filename}:{f.lineno} {f.name}" for f in reversed(stack[-3:]))] += 1

    failures = 0
    for name, options in configurations(draft):
        sample = options.pop("sample", False)
        options.setdefault("verifier", GreedyVerifier())
        decoder = SpeculativeDecoder(target=target, **options)
        kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=sample)
        decoder.generate(input_ids, attention_mask=mask, **kwargs)  # warm-up: lazy initialisations sync
        sites.clear()
        state = decoder.prepare(input_ids, mask, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        with warnings.catch_warnings():  # restores showwarning
            warnings.simplefilter("always")
            warnings.showwarning = record
            with syncs_outside_commit("warn"):
                out = decoder.decode(state)
        exact = ""
        if not sample:
            expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
            exact = ", identical to generate" if torch.equal(out.sequences, expected) else ", DIFFERS from generate"
        total = sum(sites.values())
        failures += bool(total)
        print(f"{name}: {out.stats.iterations} iterations, {total} syncs outside the commit{exact}", flush=True)
        for site, count in sites.most_common():
            print(f"    {count:4d}  {site}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
