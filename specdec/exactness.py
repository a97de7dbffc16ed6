"""Why a row of specdec's differs from the target's own ``generate``: a near-tie or a bug.

Outside float64, a (k + 1)-token verify and a one-token step compute the same logits in matmuls of
other shapes, rounded otherwise (README, "What exact means"); where the target's top two tokens
are closer than that rounding, the two paths can choose differently and the rows part. A wrong
acceptance would part them too. ``explain_divergence`` tells the two apart at the first token
where a row parts: it reads the target alone on the shared prefix in its own dtype and in float64,
so that the dtype's rounding error there is measured, and compares the margin by which the
reference chose its token with it::

    from specdec.exactness import explain_divergence, first_divergence

    at = first_divergence(reference_new_tokens, specdec_new_tokens, eos_token_id=tokenizer.eos_token_id)
    if at is not None:
        position, theirs, ours = at
        why = explain_divergence(target, prompt_ids + reference_new_tokens[:position], theirs, ours,
                                 reference_margin=float(logits[position][row, theirs] - logits[position][row, ours]))
        why.near_tie   # True: the reference's margin is within what this dtype's rounding moves

``reference_margin`` is the margin in the reference's own logits (``generate(...,
output_logits=True, return_dict_in_generate=True)``); without it, the margin of the lone read in
the model's dtype stands in. ``benchmarks/half_precision.py`` runs this over the shipped configs.
"""

from __future__ import annotations

import copy
import math

import attrs
import torch


@attrs.frozen
class Divergence:
    """The target's view of the first token where two greedy rows part.

    ``reference_token`` is the one the reference (``generate``) chose, ``other_token`` the other
    path's; margins are the first's logit minus the second's. ``rounding`` is how far the model's
    dtype moves the two logits from float64 on this prefix, together, as one lone read measures it:
    the sum of both logits' moves, or twice the largest move among the target's ``NEIGHBOURS`` top
    logits if that is more (a read's error on two logits is one sample, and can be near zero by
    luck where another shape errs by an ulp). ``ulp`` is the dtype's spacing at the reference
    token's logit: logits are stored in the dtype, so two that differ by one ulp may stand for
    values arbitrarily close.

    Two paths part where each rounds the margin its own way: the reference's margin is at most the
    sum of the two paths' errors, each about what the lone read measures. So a near-tie is a
    reference margin of at most twice ``rounding``, plus one ulp. Measured on trained models
    (docs/benchmarks.md, stops 66-67): 50 near-ties of one run, read again, came to at most 0.37
    of this line (0.93 with the two logits' moves alone), and the first wrong token of a verifier that keeps
    every draft to at least 2.6 times it in bfloat16 (those nearest are drafts that were the
    target's second choice) and 16 times in float16.
    """

    reference_token: int
    other_token: int
    reference_margin: float
    rounding: float
    ulp: float
    float64_margin: float
    logit: float

    @property
    def near_tie(self) -> bool:
        """Whether the reference's margin is within what the dtype's rounding moves: another shape
        of the same computation may choose the other token. False means a wrong choice (a bug)."""
        return self.reference_margin <= 2 * self.rounding + self.ulp

    @property
    def float64_agrees_with_reference(self) -> bool:
        """Which token exact arithmetic chooses (at a near-tie, either path may be the one that
        rounded away from it)."""
        return self.float64_margin >= 0


# How many of the target's top logits (in float64) measure its dtype's rounding at a prefix.
NEIGHBOURS = 50


def spacing(dtype: torch.dtype, value: float) -> float:
    """The distance between neighbouring numbers of ``dtype`` near ``value`` (one ulp)."""
    if not dtype.is_floating_point:
        raise ValueError(f"{dtype} is not a floating-point dtype")
    info = torch.finfo(dtype)
    magnitude = max(abs(value), info.tiny)  # below the smallest normal number the spacing stays the same
    return info.eps * 2.0 ** (math.frexp(magnitude)[1] - 1)


def first_divergence(reference: list[int], other: list[int], eos_token_id: int | list[int] | None = None
                     ) -> tuple[int, int, int] | None:
    """``(position, reference's token, other's token)`` at the first new token where two rows part,
    or None when they are equal. Rows end at their first end of sequence (``eos_token_id``, one or a
    list: what follows is padding, and Whisper's ``generate`` drops its longest row's end); a row
    that is a prefix of the other ended there, so its token at that position is the (first) end."""
    ends = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)

    def ended(row: list[int]) -> list[int]:
        cut = next((i for i, token in enumerate(row) if token in ends), len(row))
        return [*row[:cut], ends[0] if ends else -1]

    reference, other = ended(reference), ended(other)
    for position, (theirs, ours) in enumerate(zip(reference, other)):
        if theirs != ours:
            return position, theirs, ours
    return None


@torch.no_grad()
def explain_divergence(target, prefix: list[int], reference_token: int, other_token: int, *,
                       reference_margin: float | None = None, exact_target=None, **inputs) -> Divergence:
    """The target's logits for both tokens after ``prefix``, alone, in its dtype and in float64.

    ``prefix`` is the row's tokens without padding (an encoder-decoder model's decoder tokens, its
    encoder inputs in ``inputs``, e.g. ``input_features=``). ``exact_target`` is a float64 copy of
    ``target`` to reuse across calls (``Explainer`` keeps one); without it one is made (on the
    target's device: for a large model, pass one on the CPU).
    """
    if exact_target is None:
        exact_target = copy.deepcopy(target).to(torch.float64)
    pair = [reference_token, other_token]
    own_all, exact_all = _last_logits(target, prefix, inputs), _last_logits(exact_target, prefix, inputs)
    own, exact = own_all[pair], exact_all[pair]
    if reference_margin is None:
        reference_margin = float(own[0] - own[1])
    # One read's error on two logits is one sample, and may be near zero by luck where another shape
    # errs by an ulp; the largest error among the top logits (the candidates' neighbours, of their
    # magnitude) says how far this dtype moves a logit there.
    moves = (own_all - exact_all).abs()
    neighbours = moves[exact_all.topk(min(NEIGHBOURS, exact_all.numel())).indices]
    rounding = max(float((own - exact).abs().sum()), 2 * float(neighbours.max()))
    return Divergence(reference_token=reference_token, other_token=other_token, reference_margin=reference_margin,
                      rounding=rounding, ulp=spacing(target.dtype, float(exact[0])),
                      float64_margin=float(exact[0] - exact[1]), logit=float(exact[0]))


@attrs.define
class Explainer:
    """``explain_divergence`` for one target over many rows: its float64 copy is made when the
    first row needs it and kept (a copy per row would cost a model's worth of memory each time)."""

    target: object
    _exact: object = attrs.field(default=None, init=False)

    def __call__(self, prefix: list[int], reference_token: int, other_token: int, *,
                 reference_margin: float | None = None, **inputs) -> Divergence:
        if self._exact is None:
            self._exact = copy.deepcopy(self.target).to(torch.float64)
        return explain_divergence(self.target, prefix, reference_token, other_token,
                                  reference_margin=reference_margin, exact_target=self._exact, **inputs)


def _last_logits(model, prefix: list[int], inputs: dict) -> torch.Tensor:
    device = next(model.parameters()).device
    ids = torch.tensor([prefix], device=device)
    moved = {name: value.to(device, model.dtype) if torch.is_floating_point(value) else value.to(device)
             for name, value in inputs.items()}
    if model.config.is_encoder_decoder:
        logits = model(decoder_input_ids=ids, **moved).logits
    else:
        logits = model(input_ids=ids, **moved).logits
    return logits[0, -1].double()
