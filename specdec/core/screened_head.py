"""Greedy verifies on a CPU: the target's LM head read in bfloat16, and in float32 only the logits
that could be the argmax.

A verify over a few tokens reads the whole LM head from memory, and on a small model that is a
large share of the forward: SmolLM2-135M's 49152 x 576 head is 113 MB of its 540 MB of float32
weights, 6.6-7.4 ms of a 3-6 token verify on a Zen 4 EPYC, cold as the loop meets it (one thread,
packed). Greedy verification needs only each position's argmax. So, where the verifier says so
(``Verifier.argmax_only``) and no logits processor changes the scores, the head runs in two passes:

1. the logits of every token from bfloat16 copies of the head and of the rows (oneDNN, float32
   accumulation): half the bytes, 3.3-5.0 ms there;
2. float32 logits, from one matmul over the head rows they need, for the tokens whose bfloat16
   logit is within ``2 * bound(row)`` of the row's largest (18 a row on SmolLM2, the median),
   written over their bfloat16 values; where those rows are more than ``MOST_OF_THE_HEAD`` of the
   vocabulary (a target unsure of its next token), float32 logits for every token instead.

Why the argmax stays the target's. For a row ``x`` (K features) and a head row ``w_v``, rounding
``x`` and ``w_v`` to bfloat16 (8 significant bits, unit roundoff ``2^-8``) and adding the K products
in float32 in any order (unit roundoff ``u = 2^-24``, ``gamma_K = K u / (1 - K u)``) errs by at most
``(2^-7 + 2^-16 + gamma_K (1 + 2^-7 + 2^-16)) * sum_i |x_i w_vi|``, and ``sum_i |x_i w_vi| <=
||x|| ||w_v|| <= ||x|| max_v ||w_v||`` (Cauchy-Schwarz). ``bound(row)`` is that, plus ``2 gamma_K``
of the same for the float32 logits that ``generate`` and the second pass compute, with 1% for the
norms' own rounding (``error_factor``). A token outside the candidates has a bfloat16 logit more
than ``2 * bound`` below the row's largest, so its float32 logit is below that largest token's:
the argmax is among the candidates, decided on float32 logits as ``generate`` decides it. Ties
closer than float32's rounding can fall either way, as between any two float32 matmul kernels
(``core/packed_linear.py``'s packed steps add their products in another order than ``generate``'s
already). The tokens outside keep their bfloat16 logits, so the target's probability of the
chosen token (``Verdict.target_probs``, which confidence policies read) is exact to about 1%.

Logits processors that only suppress tokens (Whisper's ``SuppressTokensLogitsProcessor`` and
``SuppressTokensAtBeginLogitsProcessor``) keep the screen: the candidates are then each row's
largest among the tokens not suppressed, taken for both cases of the at-begin set (suppressed at
the first generated position, not after), so that the argmax after the processors is among them
wherever in the block that position falls (``suppression_masks``). So does Whisper's timestamp
grammar (``WhisperTimeStampLogitsProcessor``, which ``generate(return_timestamps=True)`` and so every
long-form transcription runs), after the suppressions: it masks text only as a whole (every token
below eot, or below the first timestamp) and it compares the timestamps' total probability with the
best text token's. So the screen computes every token from eot on in float32 (``exact_from``:
Whisper's special tokens and its 1,501 timestamps, 3 % of whisper-base's head) and takes the
candidates among the text tokens below: the best text token, the timestamps' log-sum-exp and so the
argmax after the grammar are float32's (the softmax's normaliser, common to both sides of the
comparison, reads the other tokens' bfloat16 logits). Any other processor reads or changes the
scores and turns the screen off.

Calls of 2 to ``MAX_ROWS`` rows, and a lone row's wider verifies, are screened: a plain step at
batch 1 stays ``generate``'s own, as it stays unpacked, and wider batched verifies keep float32
(their unsure rows make the screen dearer than it saves). Where bfloat16 runs a head's shape no
faster on this CPU (timed once per machine with the packed layers, ``packed_linear.bfloat16_at``;
CPUs without AVX-512 BF16 or AMX emulate it), nothing changes. float64 targets, the exactness
proofs' dtype, are never screened.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import packed_linear
from .packed_linear import bfloat16_at, packed_weight_bfloat16, trial_width

_log = logging.getLogger(packed_linear.__name__)  # the packed layers' logger: one verbosity for both
_PLANS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # head weight -> (its _version, widths, max row norm)


def error_factor(features: int) -> float:
    """``bound(row) / (||row|| * max_v ||w_v||)`` for a head of ``features`` inputs (the docstring above)."""
    unit = 2.0 ** -24
    gamma = features * unit / (1 - features * unit)
    rounding = 2.0 ** -7 + 2.0 ** -16
    return 1.01 * (rounding + gamma * (1 + rounding) + 2 * gamma)


def applies_to(model: torch.nn.Module) -> bool:
    """Whether ``model``'s LM head could be screened on this machine: a bias-free ``nn.Linear`` of
    float32 weights on the CPU, large enough to be packed, with no forward of its own set by
    someone else, on a torch whose oneDNN runs bfloat16."""
    head = head_of(model)
    return (head is not None and head.bias is None and "forward" not in head.__dict__
            and head.weight.dtype == torch.float32 and head.weight.device.type == "cpu"
            and head.weight.numel() >= packed_linear.MIN_WEIGHT and packed_linear.available()
            and packed_linear.bfloat16_available())


def head_of(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The LM head the screen would serve: ``model``'s output embeddings, an exact ``nn.Linear``."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    return head if type(head) is torch.nn.Linear else None


def prepare(model: torch.nn.Module) -> frozenset[int]:
    """Time the head's shape in bfloat16 (once per machine) and make its bfloat16 copy and norm now,
    not in the first verify that the cost-aware policies time; the trial widths it is screened at."""
    head = head_of(model)
    if head.weight not in _PLANS and packed_linear._untimed([head], packed_linear._MEASURED_BF16, packed_linear.BF16_KEY):
        started = time.perf_counter()  # said as the packed layers' first timings are
        _log.info("timing the LM head of %s in bfloat16 on this CPU (once per machine, kept in %s)",
                  packed_linear._named(model), packed_linear.measurements_file())
        widths = _plan(head.weight)[1]
        _log.info("timed in %.1f s", time.perf_counter() - started)
    else:
        widths = _plan(head.weight)[1]
    if widths:
        packed_weight_bfloat16(head.weight)
    return widths


def _plan(weight: torch.Tensor) -> tuple[int, frozenset[int], float]:
    known = _PLANS.get(weight)
    if known is None or known[0] != weight._version:
        with torch.no_grad():
            largest = float(torch.linalg.vector_norm(weight, dim=1).max())
        known = _PLANS[weight] = (weight._version, bfloat16_at(weight, "auto"), largest)
    return known


def suppression_masks(processors, model: torch.nn.Module) -> tuple[torch.Tensor, ...] | None:
    """What the screen of ``model``'s LM head must take each row's largest logit over, given the
    request's logits processors: ``()`` without processors (all tokens), one ``[V]`` mask of
    suppressed tokens per case where they only suppress tokens (both cases of an at-begin set), None
    where some processor does anything else (no screen). Whisper's timestamp grammar after them keeps
    the screen, with the tokens from ``exact_from(processors)`` on in float32."""
    from .state import _CachedSuppression, _prepared_processor  # the masks the loop's processors apply

    if not processors:
        return ()
    weight = head_of(model).weight
    always = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)
    at_begin = None
    grammar = False
    for processor in processors:
        if _is_timestamp_grammar(processor):
            eot = processor.eos_token_id
            if not (isinstance(eot, int) and eot < processor.timestamp_begin <= weight.shape[0]):
                return None
            grammar = True
            continue
        if grammar:  # a suppression after the grammar would hide a token its comparison read
            return None
        prepared = _prepared_processor(processor, weight.shape[0], weight.device)
        if type(prepared) is not _CachedSuppression:
            return None
        if prepared.at_begin:
            at_begin = prepared.mask if at_begin is None else at_begin | prepared.mask
        else:
            always |= prepared.mask
    return (always,) if at_begin is None else (always, always | at_begin)


def _is_timestamp_grammar(processor) -> bool:
    from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

    return type(processor) is WhisperTimeStampLogitsProcessor  # exactly: a subclass may read more


def exact_from(processors) -> int | None:
    """The first token of the tail that a screen under ``processors`` computes in float32 throughout:
    eot where Whisper's timestamp grammar is among them (``suppression_masks``), else None."""
    return next((int(p.eos_token_id) for p in processors or () if _is_timestamp_grammar(p)), None)


@contextlib.contextmanager
def screened_head(model: torch.nn.Module, suppressed: tuple[torch.Tensor, ...] = (), exact_from: int | None = None):
    """Within it, ``model``'s LM head screens its multi-row calls (at the widths ``prepare`` found
    bfloat16 faster at), each row's argmax taken over the tokens outside each of ``suppressed``
    (``suppression_masks``) and below ``exact_from``, the tokens from there on in float32
    (``exact_from``); other calls go to the forward it had on entry (a packed one, or its own)."""
    head = head_of(model)
    previous = head.__dict__.get("forward")
    fallback = previous
    if (fallback is not None and not packed_linear.has_packed_copy(head.weight)
            and not packed_linear.is_copy_free(fallback)):
        # A head left unpacked for a lone row's request (CachedModel.begin) stays so: its rare full
        # reads (a verify of more than MAX_ROWS tokens, rows unsure of most of the vocabulary) run on
        # torch's path rather than make a float32 copy for them (101 MiB on whisper-base). A copy-free
        # forward (packed_weights = false) makes none: they run on it.
        fallback = None
    head.forward = functools.partial(_screened_forward, head, fallback or type(head).forward.__get__(head), suppressed,
                                     exact_from)
    try:
        yield
    finally:
        if previous is None:
            head.__dict__.pop("forward", None)
        else:
            head.forward = previous


def _screened_forward(head: torch.nn.Linear, fallback, suppressed: tuple[torch.Tensor, ...], exact_from: int | None,
                      x: torch.Tensor) -> torch.Tensor:
    weight = head._parameters["weight"]
    features = x.shape[-1]
    rows = x.numel() // features
    _, widths, largest = _plan(weight)
    lone = x.dim() == 3 and x.shape[0] == 1  # [1, tokens, features]: one row's verify
    if (rows < 2 or rows > MAX_ROWS and not lone or x.dtype != torch.float32 or torch.is_grad_enabled()
            or trial_width(rows) not in widths):
        return fallback(x)
    logits, _ = screened_logits(x.reshape(-1, features), weight, largest, suppressed,
                                full=fallback, exact_from=exact_from)
    return logits.view(*x.shape[:-1], logits.shape[-1])


# Batched calls of more rows keep the float32 head: they are batched verifies, whose rows after a
# rejected draft leave the target unsure and many tokens within the bound: SmolLM2's shipped config
# at batch 4 ran 1.58x with every width screened against 1.71x without (docs/benchmarks.md, stop 52),
# and a cold call of its head over 16-48 uncertain rows took 1.2-2.5x float32's time screened, where
# 4-12 rows took 0.64-0.78x (ad hoc). A lone row's wider verifies (cost-aware drafts up to 8 tokens)
# are screened: their head's float32 copy is never made (CachedModel.begin), and whisper-base's head
# over a lone row's 9 tokens took 3.0 ms screened, 4.2 ms on that copy, 14.2 ms on torch's path
# (cold, real hidden states; stop 63).
MAX_ROWS = 8

# Past this share of the head's rows among a call's candidates, float32 over the whole head is cheaper
# than gathering them (rows the target is unsure of: at batch 4-16 a verify's rows after rejected
# drafts kept 170-1000 candidates each in an ad hoc test, where batch 1's keep 18).
MOST_OF_THE_HEAD = 1 / 8


def screened_logits(flat: torch.Tensor, weight: torch.Tensor, largest: float, suppressed: tuple[torch.Tensor, ...] = (),
                    full=None, exact_from: int | None = None):
    """``(logits [R, V], (rows, tokens))``: ``flat [R, K] @ weight.T`` in bfloat16, with the
    candidates for each row's argmax (``rows[i]``, ``tokens[i]``) recomputed in float32; ``largest``
    is ``weight``'s largest row norm; with ``suppressed`` masks, the argmax over the tokens outside
    each of them; with ``exact_from``, every token from there on in float32 and the candidates taken
    below it. Where the candidates span more than ``MOST_OF_THE_HEAD`` of the vocabulary, the
    float32 logits of every token (``full(flat)``, or ``flat @ weight.T``)."""
    logits = torch.ops.mkldnn._linear_pointwise(flat.to(torch.bfloat16), packed_weight_bfloat16(weight), None,
                                                "none", [], "").float()  # [R, V]
    margin = torch.linalg.vector_norm(flat, dim=1, keepdim=True) * (2 * error_factor(flat.shape[1]) * largest)  # [R, 1]
    screened = logits
    if exact_from is not None:
        logits[:, exact_from:] = flat @ weight[exact_from:].T
        screened, suppressed = logits[:, :exact_from], tuple(mask[:exact_from] for mask in suppressed)
    if not suppressed:
        candidates = screened >= screened.amax(1, keepdim=True) - margin
    else:
        candidates = torch.zeros_like(screened, dtype=torch.bool)
        for mask in suppressed:
            allowed = screened.masked_fill(mask, -float("inf"))
            candidates |= allowed >= allowed.amax(1, keepdim=True) - margin
    at_row, token = candidates.nonzero(as_tuple=True)  # a CPU: no sync to avoid
    tokens, slot = torch.unique(token, return_inverse=True)  # the head rows any row needs, once each
    if tokens.numel() > MOST_OF_THE_HEAD * weight.shape[0]:
        return (full(flat) if full is not None else flat @ weight.T), (at_row, token)
    logits[at_row, token] = (flat @ weight[tokens].T)[at_row, slot]  # [R, u]: one float32 matmul
    return logits, (at_row, token)
