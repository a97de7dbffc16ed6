"""One tiny model per architecture family (tests/architectures.py): it builds, transformers'
generate runs on it, and specdec's greedy output equals generate's token for token.

A family specdec cannot decode exactly must be refused before decoding, with an error that names
the architecture and the reason (the sweep, benchmarks/check_architectures.py and
docs/architectures.md, covers every architecture).
"""

from __future__ import annotations

import functools

import pytest
import torch

from specdec import ConfigError, SpeculativeDecoder
from specdec.drafters import ModelDrafter, NGramDrafter
from specdec.policies import ConstantLookahead, HeuristicLookahead

from .architectures import FAMILIES, VOCAB, ragged_batch, tiny_family_model

NEW_TOKENS = 24

# family -> why specdec refuses it before decoding (specdec.core.models.REFUSED_ARCHITECTURES).
REFUSED: dict[str, str] = {
    "local": "local-attention layers apply their window through a fixed buffer indexed by cache slot",
}

CASES = {"batch3": None, "batch1": 2}  # the ragged batch, and its longest prompt alone


@functools.cache
def _inputs(case: str):
    ids, mask = ragged_batch()
    row = CASES[case]
    if row is None:
        return ids, mask
    keep = mask[row].bool()
    return ids[row, keep][None], mask[row, keep][None]


@functools.cache
def _reference(family: str, case: str) -> torch.Tensor:
    target = tiny_family_model(family)
    ids, mask = _inputs(case)
    with torch.no_grad():
        return target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_builds_and_generates(family):
    target = tiny_family_model(family)
    draft = tiny_family_model(family, draft=True)
    assert target.dtype == draft.dtype == torch.float64
    assert target.get_output_embeddings().weight.shape[0] == VOCAB
    assert sum(p.numel() for p in target.parameters()) < 1_000_000
    ids, mask = _inputs("batch3")
    out = _reference(family, "batch3")
    assert out.shape == (ids.shape[0], ids.shape[1] + NEW_TOKENS)
    assert torch.equal(out[:, : ids.shape[1]], ids)
    with torch.no_grad():
        logits = target(input_ids=ids, attention_mask=mask).logits
    assert torch.isfinite(logits).all()


def _exactness_params():
    for family in FAMILIES:
        if family in REFUSED:
            continue
        for drafter in ("model", "ngram"):
            for policy in ("constant", "heuristic"):
                for case in CASES:
                    yield pytest.param(family, drafter, policy, case, id=f"{family}-{drafter}-{policy}-{case}")


@pytest.mark.parametrize("family", list(REFUSED))
@pytest.mark.parametrize("role", ["target", "draft"])
def test_family_refused_before_decoding(family, role):
    """As target or as draft, the model is refused at construction, naming the architecture and the reason."""
    model = tiny_family_model(family)
    other = tiny_family_model("full")
    target, draft = (model, other) if role == "target" else (other, model)
    with pytest.raises(ConfigError, match=f"\\({FAMILIES[family]}\\) cannot be decoded exactly by specdec: .*"
                                          f"{REFUSED[family]}"):
        decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft))
        ids, mask = _inputs("batch1")
        decoder.generate(ids, attention_mask=mask, max_new_tokens=2)


@pytest.mark.parametrize("family, drafter, policy, case", list(_exactness_params()))
def test_family_exact(family, drafter, policy, case):
    target = tiny_family_model(family)
    ids, mask = _inputs(case)
    drafter_ = ModelDrafter(tiny_family_model(family, draft=True)) if drafter == "model" else NGramDrafter(max_ngram=3)
    policy_ = ConstantLookahead(k=4) if policy == "constant" else HeuristicLookahead()
    decoder = SpeculativeDecoder(target=target, drafter=drafter_, policy=policy_)
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out.sequences, _reference(family, case))
