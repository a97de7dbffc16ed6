"""What the re-reading fallback costs: tokens/s of ``generate`` and of specdec on a tiny model.

A model whose cache cannot hold holes (``specdec.core.models.REREAD_ARCHITECTURES``) is re-read
whole at every forward of the target and of the draft model. This times, at batch 1 on one CPU
thread, ``target.generate(do_sample=False)`` against specdec with the ``model`` drafter (the
target's perturbed copy, the sweep's draft) and the ``ngram`` drafter, ``ConstantLookahead(k=4)``,
for the three ways ``RereadingRunner`` reads a model: a cache per row read in blocks (GPT-Neo), a
cache per row read one token per forward (GIT, as generate reads it), whole sequences with no
cache (OpenAI-GPT); and, for scale, a model with a cache with holes (Llama); at a short and a long
prompt. Contenders are interleaved and
the median of ``--repeats`` runs is reported; every run is checked token for token.

    OMP_NUM_THREADS=1 python benchmarks/reread_cost.py [--archs gpt_neo,git,openai-gpt,llama] [--new-tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

torch.set_num_threads(1)
warnings.filterwarnings("ignore")

from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()

from tests import architectures as arch_lib  # noqa: E402
from tests.conftest import perturbed_copy  # noqa: E402
from specdec import SpeculativeDecoder  # noqa: E402
from specdec.drafters import ModelDrafter, NGramDrafter  # noqa: E402
from specdec.policies import ConstantLookahead  # noqa: E402


def build(arch: str, positions: int):
    """The sweep's tiny float64 model of ``arch`` with room for ``positions`` tokens, and its draft."""
    names = [name for name in ("max_position_embeddings", "n_positions") if hasattr(arch_lib.config_class(arch)(), name)]
    config = arch_lib.tiny_config(arch, **{name: positions for name in names})
    torch.manual_seed(0)
    target = arch_lib._finish(arch_lib.model_class(arch)(config))
    return target, arch_lib._finish(perturbed_copy(target, arch_lib.DRAFT_NOISE, seed=1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", default="16,448", help="prompt lengths (comma-separated)")
    parser.add_argument("--archs", default="gpt_neo,git,openai-gpt,llama", help="architectures (comma-separated)")
    args = parser.parse_args(argv)
    for arch in args.archs.split(","):
        for length in (int(n) for n in args.prompts.split(",")):
            target, draft = build(arch, length + args.new_tokens + 8)
            ids = torch.tensor(arch_lib.prompts((length,))[0])[None]
            contenders = {
                "generate": lambda: target.generate(ids, do_sample=False, max_new_tokens=args.new_tokens),
                "specdec model": SpeculativeDecoder(target=target, drafter=ModelDrafter(draft),
                                                   policy=ConstantLookahead(k=4)),
                "specdec ngram": SpeculativeDecoder(target=target, drafter=NGramDrafter(max_ngram=3),
                                                   policy=ConstantLookahead(k=4)),
            }
            times = {name: [] for name in contenders}
            accepted = {}
            with torch.no_grad():
                reference = contenders["generate"]()
                for _ in range(args.repeats + 1):  # the first round warms up and is dropped
                    for name, run in contenders.items():
                        started = time.perf_counter()
                        if name == "generate":
                            out = run()
                        else:
                            result = run.generate(ids, max_new_tokens=args.new_tokens)
                            out = result.sequences
                            accepted[name] = result.stats.accepted / max(result.stats.drafted, 1)
                        times[name].append(time.perf_counter() - started)
                        assert torch.equal(out, reference), f"{name} differs from generate on {arch}"
            for name, values in times.items():
                seconds = statistics.median(values[1:])
                note = f", {accepted[name]:.0%} of drafts accepted" if name in accepted else ""
                print(f"{arch:8s} prompt {length:4d}  {name:14s} {args.new_tokens / seconds:8.1f} tokens/s"
                      f"  ({seconds * 1000:7.1f} ms{note})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
