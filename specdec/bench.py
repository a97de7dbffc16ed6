"""``specdec bench``: speed measured as ratios in one process, on the same models and prompts.

For every batch size the contenders are: the target alone (batched ``generate``), Transformers'
assisted generation (it refuses batches, so above batch 1 it runs row by row and says so) and
specdec with each requested drafter x policy. They are **interleaved**: after a warm-up, every
repeat runs each contender once over all the prompts, batch by batch: every contender decodes a
batch in turn before any decodes the next, in an order rotated by one at each batch, so a noisy
neighbour or a CPU frequency change hits all of them alike instead of whichever ran during it (on a
host whose speed moved 20-30% within minutes, one contender's whole pass at a time let the same
configuration read 1.03x and 0.94x; docs/benchmarks.md, stop 36). Speedups
are paired: repeat r's speedup is the contender's rate over the target's rate in the same
repeat; the median is reported with the minimum and maximum over repeats (the spread).

Speedups are ratios of tokens per second: under greedy decoding every method writes the same
tokens, so this is the ratio of times; sampled runs write different continuations (of different
lengths), so time alone would not compare them.

The ideal speedup (Leviathan et al.) comes from the measured numbers: with alpha the per-token
acceptance probability, k the mean lookahead and c the draft/target cost ratio of one forward,
``(1 - alpha^(k+1)) / ((1 - alpha) (k c + 1))``. alpha is solved from the measured mean accepted
length tau = (1 - alpha^(k+1)) / (1 - alpha), so the ideal is tau / (k c + 1). Every cost is a
ratio to ``generate``'s one-token step, and the target step of Leviathan's formula is specdec's own
plain step, p of ``generate``'s (``tau / (k c + p)``): specdec's cache appends in place where
``generate``'s concatenates the whole cache each step (``core/cache.py``), and its batched steps
read packed weights, so at large batches its plain step is the cheaper one (p = 0.70-0.80 at
batch 64 on the bundled pair on the project's Xeon, 0.94-1.01 at batch 1). A measured speedup above
the ideal is not a speedup but timing noise (or a mis-measured c or p): it is flagged as such.

Leviathan's ideal assumes that verifying k + 1 tokens costs one target step; on a CPU, and on a
GPU at large batches, it costs more. The **ceiling** counts that too: with v the measured time of
specdec's (k + 1)-token target forward over ``generate``'s one-token one (interpolated at the mean
lookahead), it is ``tau / (k c + v)``, what a loop with no overhead of its own would reach with
these models, this acceptance and this lookahead. The share of the ceiling reached is the loop's
own efficiency. c, p and v are timed in turn, a target step, the draft's steps and specdec's
target forwards in every repeat (``step_costs``), so that the machine's slow spells fall on all of
them alike.

Exactness is reported as the share of rows identical to the target's own greedy output. In
float64 it is 1 by construction; in float32 and half precision a (k+1)-token verification and a
one-token step can round a near-tie differently, so a few rows may part (README, "What exact means").
Each row that parts is explained at its first differing token (``exactness.explain_divergence``):
a near-tie, within what the dtype's rounding moves there, or a token the target ranks clearly
below its own, which is a wrong acceptance whatever the dtype (``BenchRow.wrong_tokens``).
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from typing import Callable, NamedTuple

import attrs
import torch
from transformers import DynamicCache

from .config import SpecdecConfig
from .core import gqa_attention, screened_head
from .core.cache import grow_in_place
from .core.models import cache_argument
from .core.packed_linear import applies_to, packed_everywhere, packed_steps, packs_at
from .core.types import token_id_list
from .decoding import SpeculativeDecoder
from .exactness import Explainer, first_divergence


@attrs.define
class BenchRow:
    batch_size: int
    method: str
    seconds: float  # median over repeats
    new_tokens: int
    tokens_per_s: float
    speedup_vs_target: float | None = None  # median of the paired per-repeat ratios
    speedup_vs_assisted: float | None = None
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    mean_lookahead: float | None = None
    alpha: float | None = None
    cost_ratio: float | None = None
    plain_step_cost: float | None = None  # p: specdec's one-token target step over generate's
    ideal_speedup: float | None = None
    ratio_to_ideal: float | None = None
    verify_cost: float | None = None  # v: specdec's (k + 1)-token target forward over generate's one-token one, at the mean k
    ceiling_speedup: float | None = None  # tau / (k c + v)
    ratio_to_ceiling: float | None = None
    occupancy: float | None = None  # row steps over iterations x rows: a batch's share still decoding, per iteration
    exact: bool | None = None  # every row identical to the target's (None: sampled, not checked)
    note: str = ""
    seconds_min: float | None = None
    seconds_max: float | None = None
    speedup_min: float | None = None
    speedup_max: float | None = None
    identical_rows: float | None = None  # share of rows identical to the target's greedy output
    rows: int | None = None
    near_ties: int | None = None  # rows that part from the target's at a near-tie (within the dtype's rounding)
    wrong_tokens: int | None = None  # rows that part where the target's margin is beyond that: a bug
    unexplained: str = ""  # why rows that part were not explained (a target too large to copy in float64)
    noise: bool = False  # the speedup is above the ideal: timing noise, not a result
    repeats: int = 0


def solve_alpha(tau: float, k: float) -> float:
    """The per-token acceptance alpha with (1 - alpha^(k+1)) / (1 - alpha) = tau (bisection)."""
    if k <= 0 or tau <= 1:
        return 0.0
    if tau >= k + 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if (1 - mid ** (k + 1)) / (1 - mid) < tau:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def ideal_speedup(alpha: float, k: float, c: float) -> float:
    tau = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tau / (k * c + 1)


def ceiling_speedup(tau: float, k: float, c: float, v: float) -> float:
    """The speedup of a loop with no overhead: ``tau`` tokens per iteration of ``k`` draft steps
    (``c`` target steps each) and a verify that costs ``v`` target steps."""
    return tau / (k * c + v)


@torch.no_grad()
def forward_cost(model, batch_size: int, context: int, repeats: int = 20, packed: bool = False) -> float:
    """Seconds for one single-token forward with ``context`` tokens cached (the draft's unit of work);
    with ``packed``, as specdec runs a drafter's step (on packed weights where that is faster)."""
    forward = _CachedForward(model, batch_size, context, 1, packed, one_row=packed)
    return statistics.median(forward.time() for _ in range(repeats))


class _CachedForward:
    """One model's forward over ``width`` new tokens per row after ``context`` cached ones, timed as
    often as asked, the cache cut back after each timing. ``verify``: as specdec's verify reads the
    block on a CPU, with its 2D mask and its grouped-query attention (``core/gqa_attention.py``).
    ``in_place``: through specdec's cache, which appends in place (``core/cache.py``), where
    ``generate``'s concatenates the whole cache with each step's keys and values (a third of its
    one-token step at batch 64 on the bundled pair)."""

    def __init__(self, model, batch_size: int, context: int, width: int, packed: bool = False, one_row: bool = False,
                 verify: bool = False, precision: str = "highest", screened: bool = False, copies: bool = True,
                 in_place: bool = False):
        self.model, self.width, self.packed, self.one_row = model, width, packed, one_row
        self.copies = copies  # packed copies of the weights, else the copy-free routes (packed_weights = false)
        self.precision = precision  # a drafter's matmul_precision (its steps' bfloat16 weights)
        self.screened = screened  # a greedy verify's LM head, screened in bfloat16 (core/screened_head.py)
        ids = torch.randint(3, model.config.vocab_size, (batch_size, context + width), device=model.device)
        self.cache = grow_in_place(DynamicCache()) if in_place else DynamicCache()
        self.argument = cache_argument(model)
        with torch.no_grad():
            model(input_ids=ids[:, :context], use_cache=True, logits_to_keep=1, **{self.argument: self.cache})
        self.block = ids[:, context:]
        self.grouped = verify and width > 1 and gqa_attention.applies_to(model)
        self.mask = ({"attention_mask": torch.ones(batch_size, context + width, dtype=torch.long, device=model.device)}
                     if verify and width > 1 else {})

    @torch.no_grad()
    def time(self, runs: int = 1) -> float:
        """Mean seconds per forward over ``runs`` forwards in a row, each one more cached (a draft's steps)."""
        with (packed_steps(self.model, self.block.numel(), self.one_row, self.precision, self.copies) if self.packed
              else nullcontext(),
              gqa_attention.gqa_steps(self.model) if self.grouped else nullcontext(),
              screened_head.screened_head(self.model) if self.screened else nullcontext()):
            start = time.perf_counter()
            for _ in range(runs):
                self.model(input_ids=self.block, use_cache=True, logits_to_keep=self.width, **self.mask,
                           **{self.argument: self.cache})
            seconds = (time.perf_counter() - start) / runs
        self.cache.crop(-self.width * runs)
        return seconds


def _screens(decoder, target) -> bool:
    """Whether ``decoder``'s greedy verifies screen ``target``'s LM head on this machine (without
    logits processors, as the bench's greedy runs decode)."""
    return (decoder.screened_head and decoder.verifier.argmax_only and applies_to(target)
            and screened_head.applies_to(target) and bool(screened_head.prepare(target)))


class StepCosts(NamedTuple):
    """What the ideal and the ceiling divide by, each a ratio to ``generate``'s one-token target step."""

    c: float  # a draft step (0 without a draft model)
    v: float  # specdec's (k + 1)-token verify at the mean lookahead k
    p: float  # specdec's own one-token target step: its plain step


def step_costs(target, draft, batch_size: int, k: float, context: int = 128, repeats: int = 20, packed: bool = False,
               draft_packed: bool = False, draft_precision: str = "highest", screened: bool = False,
               copies: bool = True) -> StepCosts:
    """(c, v, p) for the ideal and the ceiling at a mean lookahead ``k``, over ``generate``'s
    one-token target step (its cache concatenating, its weights unpacked): c a draft step (at the
    drafter's ``matmul_precision``), v a (k + 1)-token target forward (``verify_cost``) and p a
    one-token one, both read as specdec's verify reads them (through its in-place cache; with
    ``packed``, on packed weights, or on the copy-free routes without ``copies``; its mask and
    grouped attention, its LM head screened with ``screened``: without them the ceiling's verify ran
    slower than the loop's and the loop reached 101-108% of its ceiling), the draft's steps through
    the in-place cache too (without it a plain-step row at batch 64 read 124% of its ideal). That is
    the dynamic path's cache; a static cache's steps, which attend over its whole capacity, are not
    modelled.

    Timed in turn, as the loop runs them: each repeat times ``generate``'s one-token step, then
    round(k) draft steps in a row (their mean; the first reads weights the target's forward pushed out
    of the CPU's caches, as in the loop), then specdec's target forwards of one token and at the
    verify widths either side of k + 1; the costs are ratios of medians. Timed apart, as before stop
    35, a slow spell of the machine landed on one part alone: the same draft's c read 0.11 and 0.20 in
    one run, and the share of the ceiling 83-110%."""
    low = int(k)
    widths = sorted({1, low + 1} | ({low + 2} if k > low else set()))
    step = _CachedForward(target, batch_size, context, 1)
    own = {width: _CachedForward(target, batch_size, context, width, packed=packed, verify=True, screened=screened,
                                 copies=copies, in_place=True)
           for width in widths}
    drafting = (_CachedForward(draft, batch_size, context, 1, draft_packed, draft_packed, precision=draft_precision,
                               in_place=True)
                if draft is not None else None)
    runs = max(1, round(k))
    steps, drafts, forwards = [], [], {width: [] for width in own}
    for _ in range(repeats):
        steps.append(step.time())
        if drafting is not None:
            drafts.append(drafting.time(runs))
        for width, forward in own.items():
            forwards[width].append(forward.time())
    one = statistics.median(steps)
    seconds = {width: statistics.median(times) for width, times in forwards.items()}
    c = statistics.median(drafts) / one if drafts else 0.0
    return StepCosts(c, verify_cost(k, seconds, one), seconds[1] / one)


def verify_cost(k: float, own: dict[int, float], step: float) -> float:
    """v at a mean lookahead ``k``: specdec's (k + 1)-token target forward (``own``, width -> seconds)
    over ``generate``'s one-token step (``step`` seconds), linear between the widths either side of
    k + 1."""
    low = int(k)
    share = k - low
    return ((1 - share) * own[low + 1] + (share * own[low + 2] if share else 0.0)) / step


def _new_token_rows(sequences: torch.Tensor, prompt_width: int, eos: list[int]) -> list[list[int]]:
    rows = []
    for row in sequences[:, prompt_width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


@attrs.define
class _Contender:
    """One thing to time: ``run(i)`` decodes the i-th batch of prompts and returns its new-token rows
    and its outputs; a repeat is every batch once (``time_batch`` each, then ``end_repeat``)."""

    label: str
    run: Callable[[int], tuple[list[list[int]], list]]
    samples: list[tuple[float, int]] = attrs.field(factory=list)  # (seconds, new tokens) per repeat
    rows: list[list[int]] = attrs.field(factory=list)  # the last repeat's, all batches
    outputs: list = attrs.field(factory=list)
    # the repeat in progress
    _seconds: float = attrs.field(default=0.0, init=False)
    _rows: list[list[int]] = attrs.field(factory=list, init=False)
    _outputs: list = attrs.field(factory=list, init=False)

    def time_batch(self, batch: int) -> None:
        start = time.perf_counter()
        rows, outputs = self.run(batch)
        self._seconds += time.perf_counter() - start
        self._rows += rows
        self._outputs += outputs

    def end_repeat(self) -> None:
        self.samples.append((self._seconds, sum(len(r) for r in self._rows)))
        self.rows, self.outputs = self._rows, self._outputs
        self._seconds, self._rows, self._outputs = 0.0, [], []

    def rates(self) -> list[float]:
        return [new / seconds for seconds, new in self.samples]


def interleave(contenders: list[_Contender], repeats: int, warmup: int, batches: int = 1,
               on_progress=lambda message: None) -> None:
    """Warm every contender up, then time each over ``batches`` batches per repeat: batch by batch,
    every contender in turn, the order rotated by one at every batch."""
    for _ in range(warmup):
        for contender in contenders:
            on_progress(f"warm-up: {contender.label}")
            for batch in range(batches):
                contender.run(batch)
    for contender in contenders:
        contender.samples.clear()
    turn = 0
    for repeat in range(repeats):
        for batch in range(batches):
            shift = turn % len(contenders)
            turn += 1
            for contender in contenders[shift:] + contenders[:shift]:
                on_progress(f"repeat {repeat + 1}/{repeats}, batch {batch + 1}/{batches}: {contender.label}")
                contender.time_batch(batch)
        for contender in contenders:
            contender.end_repeat()


def _identical(rows: list[list[int]], reference: list[list[int]]) -> float:
    """The share of ``rows`` equal to the target's own."""
    return sum(r == b for r, b in zip(rows, reference)) / len(reference) if reference else 1.0


# A float64 copy of the target explains rows that part from its own; above this size (8 GiB in
# float64) it is not made, and the rows are counted but not explained.
MAX_EXPLAINED_PARAMETERS = 2**30


@attrs.define
class _RowsExplainer:
    """Explains the rows that part from the target's (``exactness.Explainer``: one float64 copy of
    the target, made when the first row needs it)."""

    explain: Explainer
    prompts: list[list[int]]  # each row's prompt tokens, unpadded, in the order of the rows
    eos: list[int]

    def __call__(self, rows: list[list[int]], reference: list[list[int]]) -> dict:
        parted = [(i, divergence) for i, (row, theirs) in enumerate(zip(rows, reference))
                  if (divergence := first_divergence(theirs, row, self.eos)) is not None]
        if not parted:
            return {}
        size = sum(p.numel() for p in self.explain.target.parameters())
        if size > MAX_EXPLAINED_PARAMETERS:
            return dict(unexplained=f"not explained: a float64 copy of the {size / 1e9:.1f}B-parameter target "
                                    f"would take {size * 8 / 2**30:.0f} GiB (specdec.exactness explains a row)")
        near = sum(self.explain(self.prompts[i] + reference[i][:at], theirs, ours).near_tie
                   for i, (at, theirs, ours) in parted)
        return dict(near_ties=near, wrong_tokens=len(parted) - near)


def _spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def run_bench(
    config: SpecdecConfig,
    prompts: list[str],
    batch_sizes: list[int],
    methods: list[tuple[str, str]],
    max_new_tokens: int = 64,
    repeats: int = 3,
    warmup: int = 1,
    assisted: bool = True,
    sampling: dict | None = None,
    on_progress: Callable[[str], None] = lambda message: None,
) -> list[BenchRow]:
    """Measure every (drafter, policy) pair in ``methods`` at every batch size; see the module doc."""
    target, tokenizer = config.load_target()
    eos = token_id_list(target.generation_config.eos_token_id)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    generate_kwargs = dict(config.sampling)
    generate_kwargs.update(do_sample=False, max_new_tokens=max_new_tokens)
    if sampling:
        # Sampled runs verify by rejection sampling; outputs are random, so there is no exactness
        # check (tests/test_rejection.py checks the distribution) and no assisted baseline.
        generate_kwargs.update(do_sample=True, **sampling)
        assisted = False
    results: list[BenchRow] = []
    decoders = {}
    for drafter, policy in methods:
        spec = config.with_choices(drafter=drafter, policy=policy, verifier="rejection" if sampling else None)
        decoders[(drafter, policy)] = SpeculativeDecoder.from_config(spec, target=target)
    draft_model = next((d.drafter.model for d in decoders.values() if getattr(d.drafter, "name", "") == "model"), None)

    for batch_size in batch_sizes:
        batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
        encoded = [tokenizer(b, return_tensors="pt", padding=True) for b in batches]
        singles = [tokenizer([p], return_tensors="pt") for p in prompts]
        explain = _RowsExplainer(Explainer(target), [single["input_ids"][0].tolist() for single in singles], eos)

        def target_alone(i):
            out = target.generate(**encoded[i], pad_token_id=pad, **generate_kwargs)
            return _new_token_rows(out, encoded[i]["input_ids"].shape[1], eos), [out]

        base = _Contender("target alone", target_alone)
        contenders = [base]
        packed_base = None
        if (batch_size > 1 and any(d.packed_weights for d in decoders.values()) and applies_to(target)
                and packs_at(target, batch_size)):
            # specdec's steps of as many rows as this machine packs read packed weights, and a batch's
            # plain steps are such steps: generate on the same packed layers is the baseline that tells
            # the kernel from the speculation.
            def target_packed(i):
                with packed_everywhere(target):
                    return target_alone(i)

            packed_base = _Contender("target alone, packed weights", target_packed)
            contenders.append(packed_base)
        # Transformers' assisted generation for each drafter, in the settings nearest each policy's: a
        # constant k (5 for a policy without one, as cost-aware), the heuristic schedule for heuristic.
        # One contender per distinct setting, labelled with what it runs: cost-aware and constant k = 5
        # share one, which two contenders would only time twice.
        assisted_of: dict[tuple[str, str], _Contender] = {}
        assisted_by_setting: dict[str, _Contender] = {}
        for (drafter, policy), decoder in decoders.items() if assisted else ():
            k = getattr(decoder.policy, "k", getattr(decoder.policy, "initial", 5))
            hf_kwargs = {}
            if drafter == "model" and draft_model is not None:
                hf_kwargs["assistant_model"] = draft_model
                schedule = "heuristic" if policy == "heuristic" else "constant"
                settings = dict(num_assistant_tokens=k, assistant_confidence_threshold=0.0,
                                num_assistant_tokens_schedule=schedule)
                label = f"transformers assisted (model, k={k}, {schedule} schedule)"
            elif drafter == "ngram":
                hf_kwargs["prompt_lookup_num_tokens"] = k
                settings = {}
                label = f"transformers assisted (ngram, k={k})"
            else:
                continue
            if label in assisted_by_setting:
                assisted_of[(drafter, policy)] = assisted_by_setting[label]
                continue

            def assisted_run(i, hf_kwargs=hf_kwargs, settings=settings):
                for name, value in settings.items():  # the draft model's settings are per contender
                    setattr(draft_model.generation_config, name, value)
                rows = singles[i * batch_size : (i + 1) * batch_size]  # the i-th batch's prompts, one by one
                outs = [target.generate(**r, pad_token_id=pad, **generate_kwargs, **hf_kwargs) for r in rows]
                return [_new_token_rows(o, r["input_ids"].shape[1], eos)[0] for o, r in zip(outs, rows)], outs

            assisted_of[(drafter, policy)] = assisted_by_setting[label] = _Contender(label, assisted_run)
        contenders += assisted_by_setting.values()
        specdec_of: dict[tuple[str, str], _Contender] = {}
        for (drafter, policy), decoder in decoders.items():

            def specdec_run(i, decoder=decoder):
                out = decoder.generate(**encoded[i], **generate_kwargs)
                return _new_token_rows(out.sequences, encoded[i]["input_ids"].shape[1], eos), [out]

            specdec_of[(drafter, policy)] = _Contender(f"specdec ({drafter}, {policy})", specdec_run)
        contenders += specdec_of.values()

        on_progress(f"batch {batch_size}")
        interleave(contenders, repeats, warmup, len(encoded), lambda message: on_progress(f"batch {batch_size}: {message}"))

        base_rates = base.rates()

        def summary(contender: _Contender, reference: list[float] | None = None):
            seconds, s_min, s_max = _spread([s for s, _ in contender.samples])
            new = contender.samples[-1][1]
            rates = contender.rates()
            paired = [rate / ref for rate, ref in zip(rates, reference or base_rates)]
            return dict(seconds=seconds, seconds_min=s_min, seconds_max=s_max, new_tokens=new,
                        tokens_per_s=statistics.median(rates), paired=paired, repeats=len(rates))

        b = summary(base)
        results.append(BenchRow(batch_size, base.label, b["seconds"], b["new_tokens"], b["tokens_per_s"], 1.0,
                                seconds_min=b["seconds_min"], seconds_max=b["seconds_max"], repeats=b["repeats"]))
        if packed_base is not None:
            p = summary(packed_base)
            speedup, low, high = _spread(p["paired"])
            identical = None if sampling else _identical(packed_base.rows, base.rows)
            results.append(BenchRow(batch_size, packed_base.label, p["seconds"], p["new_tokens"], p["tokens_per_s"], speedup,
                                    note="generate on specdec's packed layers", seconds_min=p["seconds_min"],
                                    seconds_max=p["seconds_max"], speedup_min=low, speedup_max=high,
                                    identical_rows=identical, exact=None if identical is None else identical == 1.0,
                                    rows=len(packed_base.rows), repeats=p["repeats"],
                                    **({} if sampling else explain(packed_base.rows, base.rows))))
        note = "" if batch_size == 1 else "row by row: transformers refuses batch > 1"
        for contender in assisted_by_setting.values():
            a = summary(contender)
            speedup, low, high = _spread(a["paired"])
            results.append(BenchRow(batch_size, contender.label, a["seconds"], a["new_tokens"], a["tokens_per_s"], speedup,
                                    note=note, seconds_min=a["seconds_min"], seconds_max=a["seconds_max"],
                                    speedup_min=low, speedup_max=high, repeats=a["repeats"]))

        for (drafter, policy), contender in specdec_of.items():
            decoder = decoders[(drafter, policy)]
            s = summary(contender)
            outs = contender.outputs
            new = sum(len(r) for r in contender.rows)
            drafted = sum(o.stats.drafted for o in outs)
            accepted = sum(o.stats.accepted for o in outs)
            row_steps = sum(o.stats.row_steps for o in outs)
            row_slots = sum(o.stats.iterations * o.stats.rows for o in outs)
            tau = new / row_steps if row_steps else 0.0
            k_mean = drafted / row_steps if row_steps else 0.0
            draft = decoder.drafter.model if drafter == "model" else None
            c, v, p = (step_costs(target, draft, batch_size, k_mean, packed=applies_to(target),
                                  copies=decoder.packed_weights,
                                  draft_packed=draft is not None and decoder.packed_weights and applies_to(draft),
                                  draft_precision=getattr(decoder.drafter, "matmul_precision", "highest"),
                                  screened=_screens(decoder, target))
                       if row_steps else (0.0, None, None))
            alpha = solve_alpha(tau, k_mean)
            ideal = tau / (k_mean * c + p) if row_steps else None
            ceiling = ceiling_speedup(tau, k_mean, c, v) if row_steps else None
            speedup, low, high = _spread(s["paired"])
            hf = assisted_of.get((drafter, policy))
            vs_hf = statistics.median([r / h for r, h in zip(contender.rates(), hf.rates())]) if hf else None
            identical = None if sampling else _identical(contender.rows, base.rows)
            results.append(
                BenchRow(
                    batch_size, contender.label, s["seconds"], s["new_tokens"], s["tokens_per_s"],
                    speedup_vs_target=speedup,
                    speedup_vs_assisted=vs_hf,
                    acceptance_rate=accepted / drafted if drafted else 0.0,
                    mean_accepted_length=tau,
                    mean_lookahead=k_mean,
                    alpha=alpha,
                    cost_ratio=c,
                    plain_step_cost=p,
                    ideal_speedup=ideal,
                    ratio_to_ideal=speedup / ideal if ideal else None,
                    verify_cost=v,
                    ceiling_speedup=ceiling,
                    ratio_to_ceiling=speedup / ceiling if ceiling else None,
                    occupancy=row_steps / row_slots if row_slots else None,
                    exact=None if identical is None else identical == 1.0,
                    seconds_min=s["seconds_min"], seconds_max=s["seconds_max"],
                    speedup_min=low, speedup_max=high,
                    identical_rows=identical,
                    rows=len(contender.rows),
                    noise=bool(ideal) and speedup > ideal,
                    repeats=s["repeats"],
                    **({} if sampling else explain(contender.rows, base.rows)),
                )
            )
    return results
