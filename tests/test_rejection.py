"""Verifier ``rejection``: its maths on hand-made distributions, and the distribution of whole
continuations against the target's own sampling, with a chi-square test that is shown to catch a
wrong residual and a missing warper."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from specdec import ConfigError, Draft, SpeculativeDecoder
from specdec.drafters import ModelDrafter, NGramDrafter
from specdec.plugins import get_registry
from specdec.policies import ConstantLookahead
from specdec.verifiers import GreedyVerifier, RejectionVerifier
from specdec.verifiers.greedy import greedy_verdict

from .conftest import left_padded, perturbed_copy, tiny_llama

VOCAB = 8
NEW_TOKENS = 3
PASS_P = 1e-3  # a correct sampler fails this with probability 1e-3 (and the seeds are fixed)
FAIL_P = 1e-6  # what a broken one must reach


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, vocab=VOCAB)


@pytest.fixture(scope="module")
def draft(target):
    return perturbed_copy(target, 0.15)


# --- the statistic -----------------------------------------------------------------------------


def exact_continuations(target, prompt: list[int], new_tokens: int, sampling: dict) -> torch.Tensor:
    """P(continuation) for every continuation of ``new_tokens`` tokens, [V ** n] float64, index
    sum_i x_i V^(n-1-i), from the processed scores ``target.generate`` itself samples from."""
    probs = torch.ones(1, dtype=torch.float64)
    prefixes = torch.tensor([prompt])
    for _ in range(new_tokens):
        out = target.generate(
            prefixes,
            attention_mask=torch.ones_like(prefixes),
            max_new_tokens=1,
            do_sample=True,
            output_scores=True,
            return_dict_in_generate=True,
            **sampling,
        )
        step = out.scores[0].double().softmax(-1)  # [P, V]
        probs = (probs[:, None] * step).flatten()
        count = prefixes.shape[0]
        prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(count)[:, None]], 1)
    return probs


def chi_square(samples: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """p-value of Pearson's chi-square test that each group of sampled continuations ([N, n]) follows
    its exact distribution; groups are independent, so statistics and degrees of freedom add up.
    Cells expected fewer than 5 times are pooled; a sample the target cannot produce gives 0."""
    statistic, dof = 0.0, 0
    for tokens, probs in zip(samples, expected):
        n = tokens.shape[1]
        code = (tokens * VOCAB ** torch.arange(n - 1, -1, -1)).sum(1)
        counts = torch.bincount(code, minlength=VOCAB**n).double()
        mean = probs * tokens.shape[0]
        if bool((counts[mean == 0] > 0).any()):
            return 0.0
        small = mean < 5
        observed = torch.cat([counts[~small], counts[small].sum()[None]])
        mean = torch.cat([mean[~small], mean[small].sum()[None]])
        observed, mean = observed[mean > 0], mean[mean > 0]
        statistic += float(((observed - mean) ** 2 / mean).sum())
        dof += observed.shape[0] - 1
    if dof == 0:
        return 1.0  # a single possible outcome, and it was the only one drawn
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(statistic / 2.0)))


def sample_continuations(decoder, prompts, copies, sampling, seed=1, new_tokens=NEW_TOKENS):
    """``copies`` samples per prompt, all as rows of one left-padded ``generate`` call."""
    input_ids, mask = left_padded(prompts * copies)
    out = decoder.generate(
        input_ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=True,
        generator=torch.Generator().manual_seed(seed),
        **sampling,
    )
    new = out.sequences[:, -new_tokens:]
    return [new[i :: len(prompts)] for i in range(len(prompts))], out.stats


class WrongResidual(RejectionVerifier):
    """Deliberately broken: after a rejection it samples from p instead of norm(max(0, p - q))."""

    @staticmethod
    def residual(p, q):
        return p


SETTINGS = {
    "temperature 1": dict(temperature=1.0, top_k=0),
    "temperature 0.7, top-k 4": dict(temperature=0.7, top_k=4),
    "temperature 1.5, top-p 0.8": dict(temperature=1.5, top_k=0, top_p=0.8),
    "temperature 0.8, top-k 5, top-p 0.9": dict(temperature=0.8, top_k=5, top_p=0.9),
    # A processor that reads input_ids (applied per draft position) before warpers that do not
    # (applied to every position at once): the order between the two kinds must hold.
    "repetition penalty 1.5, temperature 0.9, top-k 5": dict(repetition_penalty=1.5, temperature=0.9, top_k=5),
}
ONE_PROMPT = [[1, 2, 3, 4]]
MIXED_BATCH = [[1, 2, 3, 4], [5, 6], [7, 1, 2, 3, 4, 5]]  # different lengths: left padding


def speculative(target, drafter, verifier=None, k=3):
    return SpeculativeDecoder(
        target=target, drafter=drafter, policy=ConstantLookahead(k=k), verifier=verifier or RejectionVerifier()
    )


# --- maths on hand-made distributions ----------------------------------------------------------


def sampling_state(seed=0):
    return SimpleNamespace(do_sample=True, generator=torch.Generator().manual_seed(seed))


def as_scores(p: torch.Tensor) -> torch.Tensor:
    return p.float().log()


class TestRejectionMaths:
    """``RejectionVerifier.verify`` on distributions built by hand, many identical rows at once."""

    rows = 20000

    def test_draft_equal_to_target_keeps_every_draft(self):
        """q = p: every draft is kept and the bonus token comes from p after the last one."""
        p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.2, 0.2, 0.6]])  # [K + 1 = 3, V = 3]
        p = p.expand(self.rows, -1, -1)
        draft = Draft(
            tokens=torch.tensor([0, 2]).expand(self.rows, -1),
            lengths=torch.full((self.rows,), 2),
            probs=p[:, :2],
            token_probs=torch.tensor([0.5, 0.8]).expand(self.rows, -1),
        )
        verdict = RejectionVerifier().verify(sampling_state(), draft, as_scores(p))
        assert bool((verdict.accepted == 2).all())
        freq = torch.bincount(verdict.next_token, minlength=3).double() / self.rows
        assert torch.allclose(freq, torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64), atol=0.015)
        assert torch.allclose(verdict.target_probs, p[:, 2].gather(1, verdict.next_token[:, None])[:, 0])

    def test_acceptance_rate_and_residual(self):
        """Keep with probability min(1, p/q); after a rejection draw from norm(max(0, p - q))."""
        p = torch.tensor([[0.2, 0.5, 0.3], [0.3, 0.3, 0.4]]).expand(self.rows, -1, -1)
        q = torch.tensor([[0.6, 0.2, 0.2]]).expand(self.rows, -1, -1)
        draft = Draft(tokens=torch.zeros(self.rows, 1, dtype=torch.long), lengths=torch.ones(self.rows, dtype=torch.long), probs=q)
        verdict = RejectionVerifier().verify(sampling_state(), draft, as_scores(p))
        kept = verdict.accepted.double().mean()
        assert abs(float(kept) - 0.2 / 0.6) < 0.015
        rejected = verdict.accepted == 0
        freq = torch.bincount(verdict.next_token[rejected], minlength=3).double() / int(rejected.sum())
        residual = torch.tensor([0.0, 0.3, 0.1], dtype=torch.float64) / 0.4
        assert torch.allclose(freq, residual, atol=0.015)
        bonus = torch.bincount(verdict.next_token[~rejected], minlength=3).double() / int((~rejected).sum())
        assert torch.allclose(bonus, torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64), atol=0.02)

    def test_token_the_target_cannot_produce_is_always_rejected(self):
        p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.4, 0.4]]).expand(self.rows, -1, -1)
        q = torch.tensor([[0.9, 0.05, 0.05]]).expand(self.rows, -1, -1)
        draft = Draft(tokens=torch.zeros(self.rows, 1, dtype=torch.long), lengths=torch.ones(self.rows, dtype=torch.long), probs=q)
        verdict = RejectionVerifier().verify(sampling_state(), draft, as_scores(p))
        assert bool((verdict.accepted == 0).all()) and bool((verdict.next_token != 0).all())

    def test_drafts_without_probabilities_are_one_hot(self):
        """n-gram drafts (probs None): kept with probability p(x); the residual is p without x."""
        p = torch.tensor([[0.25, 0.5, 0.25], [0.3, 0.3, 0.4]]).expand(self.rows, -1, -1)
        draft = Draft(tokens=torch.ones(self.rows, 1, dtype=torch.long), lengths=torch.ones(self.rows, dtype=torch.long))
        verdict = RejectionVerifier().verify(sampling_state(), draft, as_scores(p))
        assert abs(float(verdict.accepted.double().mean()) - 0.5) < 0.015
        rejected = verdict.accepted == 0
        freq = torch.bincount(verdict.next_token[rejected], minlength=3).double() / int(rejected.sum())
        assert torch.allclose(freq, torch.tensor([0.5, 0.0, 0.5], dtype=torch.float64), atol=0.015)

    def test_ragged_rows_ignore_columns_past_their_length(self):
        """A row with no drafts samples from p at position 0; columns past a row's length are never kept."""
        p = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]).expand(3, -1, -1)
        draft = Draft(tokens=torch.zeros(3, 1, dtype=torch.long), lengths=torch.tensor([0, 1, 0]), probs=p[:, :1].clone())
        verdict = RejectionVerifier().verify(sampling_state(), draft, as_scores(p))
        assert verdict.accepted.tolist() == [0, 1, 0]
        assert verdict.next_token.tolist() == [0, 2, 0]

    def test_empty_draft_is_a_plain_target_sample(self):
        p = torch.tensor([[0.0, 1.0, 0.0]]).expand(4, -1, -1)
        verdict = RejectionVerifier().verify(sampling_state(), Draft.empty(4, torch.device("cpu")), as_scores(p))
        assert verdict.accepted.tolist() == [0] * 4 and verdict.next_token.tolist() == [1] * 4

    def test_empty_draft_draws_from_p_and_reports_its_probability(self):
        p = torch.tensor([[0.2, 0.5, 0.3]]).expand(4000, 1, -1)
        verdict = RejectionVerifier().verify(sampling_state(), Draft.empty(4000, torch.device("cpu")), as_scores(p))
        share = torch.bincount(verdict.next_token, minlength=3).float() / 4000
        assert torch.allclose(share, p[0, 0], atol=0.03)  # 4 standard errors at most
        assert torch.allclose(verdict.target_probs, p[0, 0][verdict.next_token])

    def test_residual_of_equal_distributions_is_p(self):
        p = torch.tensor([[0.25, 0.75]])
        assert torch.equal(RejectionVerifier.residual(p, p.clone()), p)

    def test_without_sampling_decides_like_greedy(self):
        scores = torch.randn(5, 4, 6, generator=torch.Generator().manual_seed(0))
        draft = Draft(tokens=scores[:, :3].argmax(-1).roll(1, 0), lengths=torch.tensor([3, 2, 0, 1, 3]))
        draft = Draft(tokens=torch.where(torch.rand(5, 3) < 0.5, draft.tokens, scores[:, :3].argmax(-1)), lengths=draft.lengths)
        state = SimpleNamespace(do_sample=False, generator=None)
        got, want = RejectionVerifier().verify(state, draft, scores), greedy_verdict(draft, scores)
        assert torch.equal(got.accepted, want.accepted) and torch.equal(got.next_token, want.next_token)
        assert torch.equal(got.target_probs, want.target_probs)


# --- distribution of whole continuations ----------------------------------------------------------


class TestSampledDistribution:
    """Continuations sampled by specdec follow the target's own sampling distribution."""

    @pytest.mark.parametrize("setting", list(SETTINGS))
    @pytest.mark.parametrize("prompts,copies", [(ONE_PROMPT, 2000), (MIXED_BATCH, 700)], ids=["one prompt", "mixed batch"])
    def test_model_draft_matches_target(self, target, draft, setting, prompts, copies):
        sampling = SETTINGS[setting]
        samples, stats = sample_continuations(speculative(target, ModelDrafter(draft)), prompts, copies, sampling)
        assert 0.2 < stats.acceptance_rate < 0.9  # rejections and bonus tokens both happen
        expected = [exact_continuations(target, prompt, NEW_TOKENS, sampling) for prompt in prompts]
        assert chi_square(samples, expected) > PASS_P

    def test_same_statistic_rejects_a_wrong_residual(self, target, draft):
        """The test is honest: sampling the correction from p instead of the residual fails it."""
        sampling = SETTINGS["temperature 0.7, top-k 4"]
        samples, _ = sample_continuations(speculative(target, ModelDrafter(draft), WrongResidual()), MIXED_BATCH, 700, sampling)
        expected = [exact_continuations(target, prompt, NEW_TOKENS, sampling) for prompt in MIXED_BATCH]
        assert chi_square(samples, expected) < FAIL_P

    @pytest.mark.parametrize(
        "used,missing",
        [
            (dict(temperature=0.7, top_k=0), dict(temperature=0.7, top_k=4)),
            (dict(temperature=1.0, top_k=0), dict(temperature=0.7, top_k=0)),
        ],
        ids=["top-k", "temperature"],
    )
    def test_same_statistic_rejects_a_missing_warper(self, target, draft, used, missing):
        """The test is honest: decoding without one of the target's warpers fails it."""
        samples, _ = sample_continuations(speculative(target, ModelDrafter(draft)), ONE_PROMPT, 1500, used)
        assert chi_square(samples, [exact_continuations(target, ONE_PROMPT[0], NEW_TOKENS, missing)]) < FAIL_P

    def test_a_draft_on_bfloat16_weights_matches_target(self, target, draft, monkeypatch):
        """The pair in float32 on a CPU, every draft layer reading bfloat16 weights (``matmul_precision``
        "medium"): q is what the draft sampled from, so the continuations stay the target's."""
        from specdec.core import packed_linear

        from .conftest import pin_packing

        if not packed_linear.bfloat16_available():
            pytest.skip("no oneDNN bfloat16 matmul here")
        pin_packing(monkeypatch, start=2, smallest=1, one_row=True)  # every layer of these tiny models
        target32, draft32 = copy.deepcopy(target).float(), copy.deepcopy(draft).float()
        sampling = SETTINGS["temperature 0.8, top-k 5, top-p 0.9"]
        decoder = speculative(target32, ModelDrafter(draft32, matmul_precision="medium"))
        samples, stats = sample_continuations(decoder, MIXED_BATCH, 700, sampling)
        assert 0.2 < stats.acceptance_rate < 0.9
        assert draft32.lm_head.weight in packed_linear._PACKED_BF16  # the draft did read bfloat16
        expected = [exact_continuations(target32, prompt, NEW_TOKENS, sampling) for prompt in MIXED_BATCH]
        assert chi_square(samples, expected) > PASS_P

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
    def test_a_half_precision_pair_matches_the_targets_own_half_precision_sampling(self, target, draft, dtype):
        """Both models in half precision, as loaded: their logits leave every forward in that dtype,
        and the softmax, the warpers and the acceptance test run in float32 (issue 17). The
        continuations follow the target's own sampling in the same dtype, as closely as this
        statistic sees: a verify rounds its logits otherwise than a one-token step, by far less."""
        target_half, draft_half = copy.deepcopy(target).to(dtype), copy.deepcopy(draft).to(dtype)
        sampling = SETTINGS["temperature 0.8, top-k 5, top-p 0.9"]
        samples, stats = sample_continuations(speculative(target_half, ModelDrafter(draft_half)), MIXED_BATCH, 700, sampling)
        assert 0.2 < stats.acceptance_rate < 0.9
        assert target_half.dtype == draft_half.dtype == dtype  # nothing widened the models
        expected = [exact_continuations(target_half, prompt, NEW_TOKENS, sampling) for prompt in MIXED_BATCH]
        assert chi_square(samples, expected) > PASS_P
        # ... and in half precision the statistic still catches a wrong residual.
        wrong, _ = sample_continuations(speculative(target_half, ModelDrafter(draft_half), WrongResidual()),
                                        MIXED_BATCH, 700, sampling)
        assert chi_square(wrong, expected) < FAIL_P

    def test_ngram_drafts_match_target(self, target):
        """One-hot q: prompt-lookup drafts under sampling keep the target's distribution."""
        prompts = [[1, 2, 3, 1, 2], [4, 5, 4, 5, 4], [3, 3, 3]]
        sampling = SETTINGS["temperature 1"]
        samples, stats = sample_continuations(speculative(target, NGramDrafter()), prompts, 700, sampling)
        assert stats.drafted > 0 and stats.accepted > 0
        expected = [exact_continuations(target, prompt, NEW_TOKENS, sampling) for prompt in prompts]
        assert chi_square(samples, expected) > PASS_P

    def test_batch_of_one(self, target, draft):
        """One row per ``generate`` call, the generator carried from call to call."""
        sampling = SETTINGS["temperature 0.7, top-k 4"]
        decoder = speculative(target, ModelDrafter(draft))
        generator = torch.Generator().manual_seed(3)
        prompt = torch.tensor(ONE_PROMPT)
        rows = [
            decoder.generate(prompt, max_new_tokens=2, do_sample=True, generator=generator, **sampling).sequences[0, -2:]
            for _ in range(250)
        ]
        assert chi_square([torch.stack(rows)], [exact_continuations(target, ONE_PROMPT[0], 2, sampling)]) > PASS_P


# --- end to end ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target64():
    return tiny_llama(10, vocab=32, layers=2, dtype=torch.float64, init=0.2)


class TestRejectionDecoding:
    """``rejection`` inside the loop."""

    def test_draft_equal_to_target_accepts_everything(self, target64):
        decoder = speculative(target64, ModelDrafter(copy.deepcopy(target64)), k=4)
        input_ids, mask = left_padded([[1, 2, 3], [4, 5, 6, 7, 8], [9]])
        out = decoder.generate(
            input_ids, attention_mask=mask, max_new_tokens=12, do_sample=True, temperature=0.8, top_p=0.9,
            generator=torch.Generator().manual_seed(0),
        )
        assert out.stats.drafted > 20
        assert out.stats.acceptance_rate == 1.0

    @pytest.mark.parametrize("drafter", ["model", "ngram"])
    def test_greedy_equals_target_generate(self, target64, drafter):
        draft = ModelDrafter(tiny_llama(11, vocab=32, layers=1, dtype=torch.float64, init=0.2)) if drafter == "model" else NGramDrafter()
        input_ids, mask = left_padded([[1, 2, 3, 1, 2], [4, 5], [6, 7, 8, 9, 10, 11, 6, 7], [12]])
        expected = target64.generate(input_ids, attention_mask=mask, max_new_tokens=15, do_sample=False)
        out = speculative(target64, draft, k=4).generate(input_ids, attention_mask=mask, max_new_tokens=15, do_sample=False)
        assert torch.equal(out.sequences, expected)
        assert out.stats.drafted > 0

    def test_generator_makes_sampling_reproducible(self, target64):
        decoder = speculative(target64, ModelDrafter(tiny_llama(11, vocab=32, dtype=torch.float64, init=0.2)))
        input_ids, mask = left_padded([[1, 2, 3], [4, 5, 6, 7]])

        def run(seed):
            generator = torch.Generator().manual_seed(seed)
            return decoder.generate(input_ids, attention_mask=mask, max_new_tokens=20, do_sample=True, generator=generator).sequences

        assert torch.equal(run(0), run(0))
        assert not torch.equal(run(0), run(1))

    def test_registered_and_greedy_still_refuses_sampling(self, target64):
        assert isinstance(get_registry().create("verifier", "rejection"), RejectionVerifier)
        decoder = speculative(target64, NGramDrafter(), GreedyVerifier())
        with pytest.raises(ConfigError, match="rejection"):
            decoder.generate(torch.tensor([[1, 2]]), max_new_tokens=2, do_sample=True)


@pytest.mark.parametrize("top_p, keep", [(0.9, 1), (0.5, 1), (0.99, 5), (0.05, 1), (0.95, 3)])
def test_nucleus_top_p_keeps_what_transformers_top_p_keeps(top_p, keep):
    """The CPU's top-p without a sort (``state._NucleusTopP``) against transformers' own warper on a
    SmolLM2-sized vocabulary: peaked and flat rows (flat ones reach past the candidates and go
    through transformers' warper), rows a top-k already cut, tied scores (whose nucleus reaches past
    the candidates). Only the CPU gets it, and only for 0 < top_p < 1."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    from specdec.core.state import _NucleusTopP

    generator = torch.Generator().manual_seed(0)
    rows = [torch.randn(24, 49152, generator=generator) * scale for scale in (0.3, 1.0, 2.0, 4.0, 8.0, 16.0)]
    cut = TopKLogitsWarper(50)(None, torch.randn(24, 49152, generator=generator) * 3)
    tied = torch.zeros(4, 49152)
    tied[:, :10] = 5.0
    scores = torch.cat([*rows, cut, tied])
    warper = TopPLogitsWarper(top_p, min_tokens_to_keep=keep)
    expected = warper(None, scores.clone())
    out = _NucleusTopP(warper)(scores.new_empty(scores.shape[0], 0, dtype=torch.long), scores.clone())
    assert torch.equal(torch.isinf(out), torch.isinf(expected))
    assert torch.equal(out, expected)
    from specdec.core.state import _prepared_processor

    assert type(_prepared_processor(warper, 49152, torch.device("cpu"))) is _NucleusTopP
    assert _prepared_processor(warper, 49152, torch.device("meta")) is warper
    assert _prepared_processor(TopPLogitsWarper(1.0), 49152, torch.device("cpu")).__class__ is TopPLogitsWarper


def test_suppression_masks_are_built_once_per_token_list_and_do_what_the_processors_do(monkeypatch):
    """generate makes new suppress processors for every request; their [V] masks are built once per
    token list (isin over the vocabulary is 1 ms on Whisper's 51865 tokens, six times a request), and
    each prepared processor scores as transformers' own."""
    from transformers.generation.logits_process import (SuppressTokensAtBeginLogitsProcessor,
                                                        SuppressTokensLogitsProcessor)

    from specdec.core.state import _prepared_processor, _suppression_mask

    _suppression_mask.cache_clear()
    vocab, cpu = 300, torch.device("cpu")
    scores = torch.randn(2, vocab)
    requests = [[(SuppressTokensLogitsProcessor([5, 17, 299]), torch.zeros(2, 9, dtype=torch.long)),
                 (SuppressTokensAtBeginLogitsProcessor([220, 5], begin_index=4), torch.zeros(2, 4, dtype=torch.long))]
                for _ in range(3)]  # three requests, each with processors of its own
    expected = [[processor(ids, scores.clone()) for processor, ids in request] for request in requests]
    isin = torch.isin
    built = []
    monkeypatch.setattr(torch, "isin", lambda *args, **kwargs: built.append(1) or isin(*args, **kwargs))
    for request, outputs in zip(requests, expected):
        for (processor, ids), output in zip(request, outputs):
            assert torch.equal(_prepared_processor(processor, vocab, cpu)(ids, scores.clone()), output)
    assert len(built) == 2  # one mask per token list, for all three requests
    other = _prepared_processor(SuppressTokensLogitsProcessor([6]), vocab, cpu)
    assert len(built) == 3 and other.mask.nonzero().flatten().tolist() == [6]
