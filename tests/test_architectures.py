"""One tiny model per architecture family (tests/architectures.py): it builds, transformers'
generate runs on it, and specdec's greedy output equals generate's token for token.

Families whose cache cannot hold the holes of rejected drafts are re-read whole at every forward
(``RereadingRunner``), which is exact too. Where transformers' own generate gives a row of a batch
another output than the row alone, there is no one output to match: specdec refuses that request
as a target (with the architecture and the reason), and these tests prove that generate disagrees
with itself there. The sweep (benchmarks/check_architectures.py, docs/architectures.md) covers
every architecture.
"""

from __future__ import annotations

import functools

import pytest
import torch

from specdec import ConfigError, InputError, SpeculativeDecoder
from specdec.core.models import CausalLMRunner, RereadingRunner, runner_for
from specdec.drafters import ModelDrafter, NGramDrafter
from specdec.errors import RereadWarning
from specdec.policies import ConstantLookahead, CostAwareLookahead, HeuristicLookahead

from .architectures import FAMILIES, VOCAB, ragged_batch, reference_generate, tiny_family_model, tiny_model
from .conftest import Recorder
from .test_cost_aware import Ticks

NEW_TOKENS = 24

# Families without a cache that can hold holes: runner_for gives them a RereadingRunner.
REREAD = {"local", "cache_positions", "own_state", "bidirectional", "widened_mask", "appended_token"}
# Architectures on which transformers' generate gives a batched row another output than the row
# alone -> the words specdec's refusal uses for that request.
GENERATE_DISAGREES = {"rwkv": "on a batch of more than one row: its one-token steps add a \\[B, H\\] state"}

CASES = {"batch3": None, "batch1": 2}  # the ragged batch, and its longest prompt alone


@functools.cache
def _inputs(case: str):
    ids, mask = ragged_batch()
    row = CASES[case]
    if row is None:
        return ids, mask
    keep = mask[row].bool()
    return ids[row, keep][None], mask[row, keep][None]


def _row_alone(row: int):
    ids, mask = ragged_batch()
    keep = mask[row].bool()
    return ids[row, keep][None], mask[row, keep][None]


@functools.cache
def _reference(family: str, case: str) -> torch.Tensor:
    target = tiny_family_model(family)
    ids, mask = _inputs(case)
    with torch.no_grad():
        return reference_generate(target, ids, mask, max_new_tokens=NEW_TOKENS)


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


@pytest.mark.parametrize("family", list(FAMILIES))
def test_families_without_a_cache_for_holes_are_reread_and_say_so(family, recwarn):
    runner = runner_for(tiny_family_model(family))
    rereads = [w for w in recwarn if issubclass(w.category, RereadWarning)]
    if family in REREAD:
        assert isinstance(runner, RereadingRunner)
        assert f"({FAMILIES[family]}) cannot keep rejected drafts as holes" in str(rereads[0].message)
        assert "pays only for short sequences" in str(rereads[0].message)
    else:
        assert isinstance(runner, CausalLMRunner) and not rereads


def test_a_reread_model_is_not_run_with_a_cache_by_mistake():
    with pytest.raises(ConfigError, match=r"\(gpt_neo\) cannot keep a cache with holes: .*slot.*RereadingRunner"):
        CausalLMRunner(tiny_family_model("local"))


def _exactness_params():
    for family in FAMILIES:
        for drafter in ("model", "ngram"):
            for policy in ("constant", "heuristic", "cost-aware"):
                for case in CASES:
                    yield pytest.param(family, drafter, policy, case, id=f"{family}-{drafter}-{policy}-{case}")


def _cost_aware() -> CostAwareLookahead:
    """The default policy on a fake clock that prices drafting cheap, with a probe every 4th
    iteration: its k moves between plain steps (k = 0) and several widths, the same in every run."""
    clock = Ticks(lambda k: 1.0 + 0.1 * k)
    clock.policy = CostAwareLookahead(clock=clock, probe_rate=0.25, max_k=6)
    return clock.policy


@pytest.mark.parametrize("family, drafter, policy, case", list(_exactness_params()))
def test_family_exact(family, drafter, policy, case):
    target = tiny_family_model(family)
    ids, mask = _inputs(case)
    drafter_ = ModelDrafter(tiny_family_model(family, draft=True)) if drafter == "model" else NGramDrafter(max_ngram=3)
    policy_ = {"constant": lambda: ConstantLookahead(k=4), "heuristic": HeuristicLookahead,
               "cost-aware": _cost_aware}[policy]()
    recorder = Recorder()
    decoder = SpeculativeDecoder(target=target, drafter=drafter_, policy=policy_, observers=[recorder])
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out.sequences, _reference(family, case))
    if policy == "cost-aware" and drafter == "model":  # plain steps mixed with drafted widths
        widths = {step.draft.width for step in recorder.steps}
        assert 0 in widths and len(widths) >= 3, widths


@pytest.mark.parametrize("draft", ["chain", "tree"])
@pytest.mark.parametrize("family", [family for family in FAMILIES if family not in REREAD])
def test_family_exact_on_the_accelerator_path(family, draft, monkeypatch):
    """What a GPU runs, proven on the CPU: every forward reads a prepared 4D mask (off the CPU,
    transformers' mask creation from a 2D mask syncs the device, so ``CausalLMRunner`` builds them
    there; on the CPU it does not) and drafts run to their full width, rows stopped by masks
    (``draft_early_exit=False``). "tree": the draft's first-position alternatives are verified too."""
    from specdec.core.masks import AttentionLayout

    monkeypatch.setattr("specdec.core.models.PREPARE_MASKS_ON_CPU", True)
    built = []
    masks = AttentionLayout.masks
    monkeypatch.setattr(AttentionLayout, "masks", lambda self, *args, **kwargs: built.append(1) or masks(self, *args, **kwargs))
    target = tiny_family_model(family)
    ids, mask = _inputs("batch3")
    drafter = ModelDrafter(tiny_family_model(family, draft=True), alternatives=2 if draft == "tree" else 0)
    decoder = SpeculativeDecoder(target=target, drafter=drafter, policy=ConstantLookahead(k=4), draft_early_exit=False)
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out.sequences, _reference(family, "batch3"))
    if runner_for(target).prepares_masks_off_cpu:
        assert built, "no prepared mask was built: the accelerator's path was not taken"
    assert runner_for(target).prepares_masks_off_cpu or family in ("alibi", "ssm", "ssm2", "sparse_indexed")


@pytest.mark.parametrize("arch", list(GENERATE_DISAGREES))
def test_where_generate_disagrees_with_itself_the_request_is_refused(arch):
    """generate gives a row of the ragged batch another output than the row alone (so no output is
    *the* output); specdec refuses that batch as a target, naming the architecture and the reason,
    and is exact on every row alone."""
    target, draft = tiny_model(arch), tiny_model(arch, draft=True)
    ids, mask = ragged_batch()
    with torch.no_grad():
        batch = reference_generate(target, ids, mask, max_new_tokens=NEW_TOKENS)
        alone = []
        for r in range(3):
            row_ids, row_mask = _row_alone(r)
            alone.append(reference_generate(target, row_ids, row_mask, max_new_tokens=NEW_TOKENS))
    assert any(not torch.equal(batch[r, -NEW_TOKENS:], alone[r][0, -NEW_TOKENS:]) for r in range(3))
    decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(draft), policy=ConstantLookahead(k=4))
    with pytest.raises(InputError, match=f"\\({arch}\\) cannot be decoded exactly by specdec {GENERATE_DISAGREES[arch]}"):
        decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    for r in range(3):
        row_ids, row_mask = _row_alone(r)
        out = decoder.generate(row_ids, attention_mask=row_mask, max_new_tokens=NEW_TOKENS)
        assert torch.equal(out.sequences, alone[r])


@pytest.mark.parametrize("arch", list(GENERATE_DISAGREES))
def test_a_draft_model_is_not_refused_where_its_generate_disagrees(arch):
    """Drafts change only the speed: the same model drafts for a full-attention target on the padded batch."""
    target = tiny_family_model("full")
    ids, mask = ragged_batch()
    decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(tiny_model(arch)), policy=ConstantLookahead(k=3))
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out.sequences, _reference("full", "batch3"))


def test_a_refused_architecture_is_refused_before_decoding_as_target_or_draft(monkeypatch):
    """No architecture is refused today; the mechanism stays for one that cannot be made exact."""
    from specdec.core import models

    monkeypatch.setitem(models.REFUSED_ARCHITECTURES, "gpt_neo", "a reason of the sweep")
    local, full = tiny_family_model("local"), tiny_family_model("full")
    for target, draft in ((local, full), (full, local)):
        with pytest.raises(ConfigError, match=r"\(gpt_neo\) cannot be decoded exactly by specdec: a reason of the sweep"):
            SpeculativeDecoder(target=target, drafter=ModelDrafter(draft))


@pytest.mark.parametrize("family", ["bidirectional", "widened_mask", "appended_token", "evicted_window", "local"])
def test_the_scores_are_generates_own_logits(family):
    """Tokens of tiny random models can agree by luck: every score the verifier sees equals generate's
    logits for the same position (CPM-Ant read in one forward per sequence, say, gets the tokens
    right and these logits wrong by several units). On the padded batch: GIT's padding shows."""
    from specdec.verifiers import GreedyVerifier

    seen = []

    class Recording(GreedyVerifier):
        def verify(self, state, draft, scores):
            verdict = super().verify(state, draft, scores)
            for b, row in enumerate(state.rows_host.tolist()):
                seen.append((row, int(state.lengths_host[row]), scores[b].clone(), int(verdict.accepted[b])))
            return verdict

    target = tiny_family_model(family)
    ids, mask = _inputs("batch3")
    with torch.no_grad():
        reference = reference_generate(target, ids, mask, max_new_tokens=NEW_TOKENS,
                                       output_logits=True, return_dict_in_generate=True)
    decoder = SpeculativeDecoder(target=target, drafter=ModelDrafter(tiny_family_model(family, draft=True)),
                                 policy=ConstantLookahead(k=4), verifier=Recording())
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(out.sequences, reference.sequences)
    compared = 0
    for row, length, scores, accepted in seen:
        for j in range(accepted + 1):  # the positions that lie on the final sequence
            step = length - ids.shape[1] + j
            if step < NEW_TOKENS:
                assert (scores[j] - reference.logits[step][row]).abs().max() < 1e-5
                compared += 1
    assert compared >= NEW_TOKENS * ids.shape[0]


@pytest.mark.parametrize("family, longest", [("local", 5), ("widened_mask", 1), ("cache_positions", 5)])
def test_a_cache_per_row_reads_only_what_is_new(family, longest):
    """A model whose cache can be cropped keeps one per row: after the prompt, a forward reads a row's
    new tokens (at most k + 1 at once, or one per forward where generate's order of reads matters),
    never the whole sequence again."""
    target = tiny_family_model(family)
    widths = []
    handle = target.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape),
                                              with_kwargs=True)
    ids, mask = _inputs("batch3")
    try:
        decoder = SpeculativeDecoder(target=target, drafter=NGramDrafter(max_ngram=3), policy=ConstantLookahead(k=4))
        out = decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    finally:
        handle.remove()
    assert torch.equal(out.sequences, _reference(family, "batch3"))
    prompts = [shape for shape in widths if shape[1] >= ids.shape[1]]
    assert len(prompts) == ids.shape[0] and all(shape[0] == 1 for shape in widths)  # one prompt read per row
    assert max(shape[1] for shape in widths if shape[1] < ids.shape[1]) <= longest


def test_finished_rows_free_their_caches():
    """Rows of different budgets finish at different iterations; a cache per row leaves with its row."""
    target = tiny_family_model("local")
    ids, mask = _inputs("batch3")
    decoder = SpeculativeDecoder(target=target, drafter=NGramDrafter(max_ngram=3), policy=ConstantLookahead(k=2))
    eos = int(_reference("local", "batch3")[0, ids.shape[1] + 3])  # row 0 ends early on its 4th new token
    out = decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    with torch.no_grad():
        expected = reference_generate(target, ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    assert torch.equal(out.sequences, expected)
    runner = decoder._target.runner
    assert set(runner._caches) <= {1, 2}  # row 0 finished first and freed its cache
