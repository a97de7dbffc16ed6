"""``cost-aware``: pick the lookahead that maximises expected committed tokens per second.

Goodput-driven speculation (SmartSpec, Liu et al. 2024), measured while decoding, with no extra
forward passes and no host syncs of its own:

* **Cost.** The wall time of an iteration, from its ``lookahead`` to the next one (spanning the
  loop's one per-iteration sync, so on a GPU it includes the device work, and the drafter's cache
  bookkeeping that runs after ``on_step``), is recorded against the batch size B and the
  lookahead k the loop asked for. Per batch-size bucket the policy keeps each k's recency-weighted
  mean (every observation's weight decays by ``decay`` per newer observation in its bucket) and
  fits ``T(B, k) = a_B + b_B k`` through the k >= 1 means by weighted least squares. A k's cost is
  its own mean pulled towards the line by ``CostFit.CELL_PRIOR`` observations' worth, and the
  line's where that k was never run: costs by width are not a line on a CPU (on the Zen 3 EPYC of
  stop 27 a 4-token draft and verify cost 2.13 plain steps and a 5-token one 2.80), and a line
  through them cost the policy 5% (model drafter) and 13% (n-gram) against the best constant k in
  a noise-free replay (``benchmarks/lookahead_replay.py``; 0.4% above and 5.6% below with the cells,
  ``docs/benchmarks.md``, stop 28). T(B, 0), a plain target step, is
  its own measured mean, because drafting at all has a fixed price (the drafter's call and its
  catch-up, the wider verify) that a line through k = 0 would smear over every k. The first iteration of a request (it
  includes the prompt's prefill) is not recorded, nor one in which a model's cache was cut to fewer
  rows (``state.row_cuts``: every staying row's tensors are copied then, whatever k was), nor, off
  the CPU, the first the policy runs at each batch-size bucket and width: there a shape's first run
  pays one-time work (kernels loaded and chosen, memory reserved). On the H200 of stop 33 each
  drafted iteration it timed was its width's first, 165-180 ms where constant k = 5's took 36 ms,
  and it priced drafting out for the rest of the run. On a CPU a first run cost what the next ones
  did (stop 68's Xeon), and setting it apart there cost prompt lookup 1-2% in the batch replays (a
  timing fewer per shape, which a probe then buys again). Nor, where the decoder compiles its steps
  (``compile``), on any device, an iteration in which torch.compile made a graph: on the bundled
  pair on a CPU with ``compile="draft"`` the first drafted iterations took 1.4 s each, and the
  policy that timed them took plain steps for every request after. A timing counts as at most
  ``CostFit.SPIKE`` (1.3) times what its k has cost: a neighbour's burst only ever slows an
  iteration, and a width that one burst made look dear was seldom timed again (stop 70). A bucket
  with too little data borrows the relative slope ``b / a`` of the nearest bucket that has a fit
  (the choice depends only on it).
* **Acceptance.** Each row's per-position acceptance alpha is estimated from what it drafted and
  what the target kept, accounting for truncation: a draft of m that was accepted in full says
  "m successes, no failure" (alpha is high, not m/m), also when m is short of the k asked (prompt
  lookup found only m tokens to copy); a draft cut at its first rejection says "accepted
  successes, one failure". A row that was asked and got no draft at all (prompt lookup found
  nothing to copy) is not counted: it says nothing about what the drafter proposes, and it cost
  nothing beyond a plain step. A row's chance of getting a draft scales the tokens it is expected
  to gain: the share pooled per octave of tokens generated like the acceptance (early in a text
  prompt lookup has less to copy; ``proposal_rate``; each octave on ``PROPOSAL_PRIOR``
  pseudo-counts of the share over every octave, one not asked in yet read as 1), moved in log-odds
  by the row's own request
  (some texts repeat themselves, others never). An iteration in which no row got a draft is timed
  as the plain step it was, and the chance that no row gets one mixes a plain step into the cost
  of asking for each k (``asked_costs``).
  Counted as rejections and timed as k, half the iterations of prompt lookup's sampled batch-1
  texts made drafting look like a loss where constant k = 1 and 2 ran 4-7% ahead of plain steps
  (``docs/benchmarks.md``, stop 42). Two levels of Beta prior: a row's recent counts, decayed
  by ``alpha_decay`` per step so a row follows the text it is in, lean on the row's counts over its
  whole request so far (aged only when it drafts), and those lean on the pooled acceptance of all
  rows (kept across requests) where the row is in its text: the pool is kept per octave of tokens
  generated (0-7, 8-15, 16-31, ...; each octave on ``prior_strength`` pseudo-counts of the whole
  pool, one not counted yet read as the pool, stop 71), and a row's counts are read against what the pool accepted
  where the row drafted, their log-odds above it carried to the pool where the row is now. Prompt
  lookup accepts more the more text there is to copy from (on the bundled pair 0.18 of the drafts
  in a text's first 8 tokens, 0.42 at 16-31, 0.76 at 48-63; the draft model 0.74 to 0.82): read
  against one pool, a row's early failures made it look worse later than it was, and at batch 4
  the policy ran 0.89 of constant k = 1 in the batch replay, 0.96 now (``docs/benchmarks.md``,
  stop 41). So while a batch takes plain steps a row drifts back to what its
  request has shown, not to the pool: with prompt lookup some prompts repeat themselves and others
  never do, and a row that drifted to the pool made the batch go back to drafting at a loss every
  few steps (stop 40). How far the request's counts lean on the pool is measured: finished
  requests' rows give the spread of the rows' rates less its sampling part, and the Beta prior of
  that spread has ``pooled (1 - pooled) / variance - 1`` pseudo-counts (``history_strength``; a
  few for prompt lookup on the bundled pair, where rows differ for good, tens for its draft model,
  where they are alike and the lowest of 16 estimates is mostly noise). The recent counts' prior
  weighs ``prior_strength`` = 12 pseudo-counts, about as much as a row's own decayed counts:
  a batch's choice hangs on its slowest row (``makespan``), and the lowest of 16 noisy estimates
  is far below that row's true acceptance. With 4, replayed on the bundled pair with a clock as
  noisy as a shared host (``benchmarks/batch_replay.py``, model drafter), batch 16 fell into plain
  steps in one seed of six (0.90 of the best constant k; 0.97 on average, against 0.99 with 12)
  and batch 4 ran 0.97 of it (0.98); batch 1 moved by under 1%. In the sampled grid at batch 16
  it ran 0.94x of the target, 1.07x with 12 (``docs/benchmarks.md``, stop 37).
* **Acceptance by position** (``per_position``, off by default). Accepted drafts come in runs: a
  draft whose first token survived is likelier to survive the next (measured on the bundled pair,
  ``benchmarks/conditional_acceptance.py``: prompt lookup's conditional acceptance 0.52 at the
  first position, 0.75-0.94 at the next ones). So the policy also counts, pooled over rows, how
  many drafts reached each position and how many were accepted there, and a row's acceptance at
  position j is that profile shifted in log-odds by as much as the row's alpha differs from the
  pooled one. Without it (or before anything was counted) every position is the row's alpha.
  Off by default: it paid on SmolLM2's greedy summaries behind prompt lookup, lost on them when
  sampling, and lost on the bundled pair's n-gram cells, where it drafted longer and at batch sizes
  where drafting does not pay (``docs/benchmarks.md``, stop 16).
* **Choice.** Expected committed tokens for a row drafting m = min(k, its budget): 1 plus, for
  each j <= m, the probability that drafts 1 .. j are all accepted (with one alpha for every
  position: ``(1 - alpha^(m+1)) / (1 - alpha)``). The verify is one padded target forward (every row pays for
  the widest), and the draft runs batch-wide to the widest row, so a per-row k below the widest
  saves no time and only loses tokens: the policy picks one common k over k in {0} and
  [min_k, max_k]. k = 0 is a plain target step. What it maximises is the ``objective``:

  - ``makespan`` (the default): ``generate`` returns when its last row is done, so a row that
    runs ahead of the others buys nothing until it leaves the batch. With R_b tokens left to row
    b, it is done after n_b = R_b / E_b(k) more iterations at this k; in the order they finish,
    the batch runs n_(1) iterations at T(B, k), then n_(2) - n_(1) at T(B - 1, k), and so on
    (each batch size's own cost model), and the policy maximises ``sum_b R_b`` over that time:
    the tokens left over the time to finish them. On the bundled pair at batch 16 the sum of the
    rows' tokens chose k = 4 (1.5x more tokens per second than a plain step) and the batch ended
    4% behind the target alone: speculation spread the rows apart and the tail of a few slow rows
    ran at 50-60 ms an iteration. Until stop 41 the whole makespan was priced at B rows, which
    overcharged drafting for its tail (where fewer rows cost less): in the batch replay pricing
    the tail moved prompt lookup at batch 16 from 0.995 to 1.020 of the best constant k and the
    draft model from 0.985-0.987 to 0.990-0.994 at batch 4 and 16.
  - ``throughput``: ``sum_b E_b(k) / T(B, k)``, the rows' tokens per second now; right where
    finished rows are replaced at once (a server's continuous batching). The same for one row.

  In a batch of several rows, out of plain steps (and at a request's start), drafting is taken up
  only where it beats them by ``resume_margin`` (5%), and once taken up it is kept while it beats
  them at all. Near break-even a batch's estimate errs towards drafting: each row's acceptance is
  shrunk towards the pooled one, so the slowest row, which decides the makespan, looks better than
  it is (until stop 40 its evidence also aged back to the pool within a few plain steps; now to its
  own request's); and drafting leaves holes in the target's cache that later plain steps pay 3-6%
  for. Without the margin, prompt lookup at batch 16 drafted a k = 1 iteration every 4-6 plain
  steps, each at 1.35 plain steps, and ran 0.91x of constant k = 0; with it, 0.995x
  (``docs/benchmarks.md``, stop 32). A lone row has no slowest row to overrate and never holds holes
  (its rejected drafts are cut off), and the margin cost it: 0.944 of the best constant k against
  0.987 in the n-gram replay (``benchmarks/lookahead_replay.py``).
* **Probing.** A share ``probe_rate`` of iterations tries another k: while speculating, k = 0 (the
  intercept) or a k two away from the best (the slope); while not speculating, the best
  speculative k for two iterations (so acceptance and its cost stay measured and the policy
  notices when drafting pays again). Probes are scheduled deterministically (every
  1 / probe_rate iterations; out of plain steps, once the plain steps since the last probe, times
  probe_rate, are worth what the probe's two drafted iterations cost beyond two plain steps, its
  whole catch-up included, so that a dear probe is a rare one; in a request that has not drafted
  yet, the catch-up is the draft model's first read of the prompt and every token so far, kept
  apart per batch size: at batch 16 on the bundled pair 11 plain steps, where a resume costs 1;
  until a first read has been timed at a batch size, which a request that drafts from its first
  iteration never does, such a probe waits for a request's first iteration, where the draft reads
  the prompt alone);
  each probe that leaves the best k where it was makes the next one
  twice as rare, up to ``probe_backoff`` times, and a probe that moves it restores the rate: where
  speculation keeps not paying, probing (a drafted iteration at a loss) costs less and less. A move
  is watched for ``PROBE_WATCH`` choices: one undone within them (a lucky timing of the probe's
  drafted iteration) counts as the probe confirming the old k. A probe whose iterations went
  untimed (a shape's first run off the CPU, or one that compiled), or whose drafted iteration got
  no draft (prompt lookup found nothing to copy: a plain step), measured nothing and confirms
  nothing: the rate stays where it was.
* **First-position alternatives** (``Draft.alternatives``, greedy decoding) widen the verify by a
  column each, and what a column costs depends on the CPU: on an AMD EPYC SmolLM2's 3-token verify
  and its 5-token one cost about the same, and alternatives ran 1.98x against 1.84x without; on an
  Intel Xeon the 5-token verify costs 1.3 times the 3-token one, and they ran 1.18x against 1.42x
  (``docs/benchmarks.md``, stops 23 to 25). So the policy prices them (``alternatives = "auto"``,
  the default). Where a draft carries alternatives, whether they are read or not, it counts how
  often the target's token was one of them after a rejected first draft (compared on the device,
  read on the host one iteration later: no sync of its own): the tokens they add per such
  iteration. It times those iterations per drafted width with the alternatives read and without
  (alternating until one width has three timings each way): their price. It reads them while the tokens they add are
  worth more than their price at the rate the batch commits tokens now (the goodput of the best k),
  and tries the other choice now and then at ``probe_rate``, backing off like the k probes.
  ``alternatives = "always"`` reads them whenever the draft has them (as every other policy does).
  Priced, a taken alternative is not an accepted draft for the acceptance estimate: its gain is
  counted here, and the k fit is fed the iteration's time less the price. Always read, it counts as
  one accepted draft (the gain of the verify every drafted iteration pays for).
* **Resuming has its own price.** A model drafter that sat out plain steps (or has not read the
  prompt yet) first reads every token committed meanwhile, so an iteration that drafts right after
  one that did not costs more than a drafted iteration in a run of them. It is not recorded as k
  (a probe out of plain steps therefore drafts twice: the first pays the catch-up, the second is
  timed); what it took beyond the fit's k is kept per batch-size bucket as the price of resuming.
  When the iteration before was a plain step, every k >= 1 pays it, spread over the drafted
  iterations in a row that a resume has bought in this bucket (a decayed mean of the stretches that
  began with a resume and ended at a plain step or the request's end; 1 before any: the price
  whole). So the policy leaves plain steps where drafting pays with its catch-up, and keeps
  drafting where it pays without. Charged whole (stops 21-28), a catch-up of a third of a plain
  step held the bundled pair's sampled batch-1 cell in plain steps for whole passes, 13 and 6
  of 40 in two runs; spread, 5 and 1 of 40 (``docs/benchmarks.md``, stop 29). A request's first
  drafted stretch does not count: it paid no catch-up, and on summaries it is long. It
  replaced charging the catch-up to the plain-step cell (stops 12-20), which made plain steps look
  dearer than they are: on SmolLM2 at batch 4, on an AMD EPYC, the fit put a k = 1 iteration at
  1.48 plain steps where it took 1.68, every k = 1 it chose lost, and the policy ran 0.94x of its
  own plain steps; priced apart, 0.99x (``docs/benchmarks.md``, stop 21).

* **Choosing less often where nothing moves.** Out of plain steps the policy chooses again every
  ``replan_every`` iterations (at once when the batch size changes or a probe is due): no draft is
  counted there, the rows' evidence only ages, and choosing took 0.26 ms of a 17.7 ms plain step at
  batch 1 on the bundled pair (1.5%, where prompt lookup never pays under sampling; stop 47).

* **Memory across processes** (``memory``, a JSON file; the CLI keeps one per setting in its cache).
  A policy built for one call, as ``specdec generate`` builds it, started from the 0.5 prior and
  no costs, and a short request spent most of its iterations in plain steps where a policy kept
  across calls drafted (``docs/benchmarks.md``, stop 48). With a memory the policy reads what an
  earlier one learned (``learned()``: the acceptance, and the costs where they were timed on this
  machine) at its first request and writes it back after each (``on_finish``), so each call starts
  where the last one ended.

``clock`` (default ``time.perf_counter``) is injectable so tests drive the policy with a fake clock.
``decisions`` keeps the last choice made (for traces and tests).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Callable

import attrs
import numpy as np
import torch

from ..core.components import LookaheadPolicy
from ..core.hookspecs import PYTHON_ONLY, hookimpl
from ..errors import PolicyMemoryWarning
from .constant import integer


def _fraction(low_open: bool):
    def check(instance, attribute, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ValueError(f"{attribute.name} must be a number, got {value!r}")
        if not ((0.0 < value) if low_open else (0.0 <= value)) or value > 1.0:
            interval = "(0, 1]" if low_open else "[0, 1]"
            raise ValueError(f"{attribute.name} must lie in {interval}, got {value!r}")

    return check


def _open_probability(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ValueError(f"{attribute.name} must be a probability strictly between 0 and 1, got {value!r}")


def _non_negative_number(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{attribute.name} must be a number of at least 0, got {value!r}")


def _max_k(instance, attribute, value):
    if value < instance.min_k:
        raise ValueError(f"max_k ({value}) must not be below min_k ({instance.min_k})")


def _initial_k(instance, attribute, value):
    if value is None:
        return
    for check in integer(1):
        check(instance, attribute, value)
    if not instance.min_k <= value <= instance.max_k:
        raise ValueError(f"initial_k ({value}) must lie between min_k ({instance.min_k}) and max_k ({instance.max_k})")


OBJECTIVES = ("makespan", "throughput")


def _objective(instance, attribute, value):
    if value not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(map(repr, OBJECTIVES))}, got {value!r}")


def _clip(p: float) -> float:
    return min(max(p, 1e-6), 1 - 1e-6)


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _carried(here: float, own: float, reference: float) -> float:
    """``here`` moved in log-odds by as much as ``own`` beats ``reference``: a row's rate measured
    where the pool was at ``reference``, carried to where the pool is ``here``."""
    return _clip(_sigmoid(_logit(_clip(here)) + _logit(_clip(own)) - _logit(_clip(reference))))


def _acceptance_by_position(alpha: float, depth: int, shift: list[float] | None) -> list[float]:
    """A row's acceptance at draft positions 1 .. ``depth``: ``alpha`` itself (the geometric model), or
    the pooled profile's log-odds ``shift`` per position added to alpha's."""
    if shift is None:
        return [alpha] * depth
    row = _logit(alpha)
    return [_sigmoid(s + row) for s in shift[:depth]]


def _memory_file(instance, attribute, value):
    if value is None:
        return
    if not isinstance(value, (str, Path)) or not str(value).strip():
        raise ValueError(f"memory must be the path of a JSON file (or None: remember nothing), got {value!r}")
    if Path(value).expanduser().is_dir():
        raise ValueError(f"memory must be a file, not the folder {str(value)!r}")


def _callable(instance, attribute, value):
    if not callable(value):
        raise ValueError(f"{attribute.name} must be a callable returning seconds, got {value!r}")


def expected_tokens(alpha, k) -> np.ndarray:
    """Tokens a row commits when it drafts ``k`` with per-position acceptance ``alpha``:
    ``(1 - alpha^(k+1)) / (1 - alpha)`` (k + 1 as alpha -> 1). Array-likes (tensors on the host
    too); broadcasts."""
    alpha = np.asarray(alpha, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    near_one = alpha > 1 - 1e-9
    safe = np.where(near_one, 0.0, alpha)
    return np.where(near_one, k + 1, (1 - safe ** (k + 1)) / (1 - safe))


def _add_decayed(weight: dict, mean: dict, key, value: float, decay: float, count: dict | None = None) -> None:
    """One observation into recency-weighted means per key: every key's weight decays by ``decay``,
    then ``key``'s mean moves towards ``value`` by the new observation's share of its weight, or,
    given ``count``, of ``key``'s own observations there, decayed only as ``key`` is observed."""
    for known in weight:
        weight[known] *= decay
    w, m = weight.get(key, 0.0), mean.get(key, 0.0)
    weight[key] = w + 1.0
    if count is not None:
        count[key] = w = count.get(key, 0.0) * decay + 1.0
    else:
        w += 1.0
    mean[key] = m + (value - m) / w


def _add_to_cell(cell: list[float], value: float, decay: float) -> None:
    """One observation into ``cell`` = [decayed weight, weighted mean]."""
    cell[0] = cell[0] * decay + 1.0
    cell[1] += (value - cell[1]) / cell[0]


@attrs.define
class CostFit:
    """The iteration times of one batch-size bucket, kept per k (the cells): a mean over the k's own
    recent timings, and a weight that ages with every timing of the bucket. A line is fitted by
    weighted least squares on (k, mean time) with those weights, so that cells seen lately count
    more, and a k's cost is its cell shrunk towards that line."""

    log_batch: float
    weight: dict[int, float] = attrs.field(factory=dict)  # k -> sum of decayed weights: how recent the cell is
    mean: dict[int, float] = attrs.field(factory=dict)  # k -> mean seconds (at load 1) over its recent own timings
    count: dict[int, float] = attrs.field(factory=dict)  # k -> its own timings, decayed per own timing: the mean's memory
    load: float = 1.0  # how much slower than the cells every iteration runs now (shared machines)
    changes: int = 0  # iterations added: what the policy's cache of predicted costs is stamped with
    _lines: tuple | None = attrs.field(default=None, eq=False, repr=False)  # (changes, floor, costs' lines)
    _costs: tuple | None = attrs.field(default=None, eq=False, repr=False)  # ((changes, floor, ks), costs' answer)

    # A k's own cell weighs against the line's prediction for it as if the line were this many
    # observations of k.
    CELL_PRIOR = 2.0
    # A timing counts as at most this many times its k's own mean at the current load. A shared
    # host's noise is one-sided (a neighbour's burst makes an iteration 1.5-3x slower, never
    # faster), and a width that looks dear is seldom run again, so one burst could price it out for
    # good: at batch 4 on the bundled pair (``benchmarks/batch_replay.py``, 2% of iterations 1.5-3x
    # slow) the draft model ran 0.961 of the best constant k, one seed in eight 0.885; clipped,
    # 0.987. A real change of one k's cost is still followed (twelve timings at twice the cost move
    # its cell 94% as far as taken whole), and one common to every k moves ``load``, by up to
    # ``load_rate`` x 0.3 a timing, leaving the cells' ratios, which the choice reads, alone
    # (docs/benchmarks.md, stop 70).
    SPIKE = 1.3

    def add(self, k: int, seconds: float, decay: float, load_rate: float = 0.0) -> None:
        """Record an iteration of lookahead ``k`` that took ``seconds``.

        With ``load_rate`` > 0, a slowdown common to every k (another process on the cores, a
        clock change) is tracked apart from the cells: the load moves by ``load_rate`` towards the
        ratio of this time to the cells' prediction for k, and the cell records the time divided by
        it. Cells of different k are then comparable though measured at different moments (k = 0
        is mostly seen in probes).

        A cell's weight ages at every timing of the bucket (what the fit leans on, and when a k not
        seen for long is explored again), but its mean moves by this timing's share of the k's own
        timings, aged only as the k is timed. A cell is at load 1, so it does not go stale while
        other k run; with the share of the aged weight, a k's first timings after a run of another
        replaced its mean, whatever the host's speed was then. On a Zen 3 EPYC whose iteration times
        drift by a fifth over a second, a fast start of a batch-16 pass put a k = 1 iteration at
        0.85-0.92 of a plain step, where it cost 1.06, and the policy drafted k = 1 through most of
        the pass; the same timings replayed with this share kept it at 1.00-1.07 (docs/benchmarks.md,
        stop 48).

        A timing above ``SPIKE`` times what its k has cost (its cell's mean at the current load)
        counts as that much: a neighbour's burst, not the k's cost. A k's first timing has nothing
        to be judged against and counts whole."""
        if self.weight.get(k, 0.0) > 1e-3:
            seconds = min(seconds, self.SPIKE * self.mean[k] * self.load)
        if load_rate > 0:
            predicted = self._predicted(k)
            if predicted is not None and predicted > 0:
                self.load += load_rate * (seconds / predicted - self.load)
            seconds = seconds / self.load
        _add_decayed(self.weight, self.mean, k, seconds, decay, self.count)
        self.changes += 1

    def _predicted(self, k: int, floor: float = 1e-3) -> float | None:
        """``costs([k])[k]``; for a plain step with a cell of its own, that cell's mean, without
        fitting the lines (the policy times a plain step at every one out of plain steps)."""
        if k == 0 and self.weight.get(0, 0.0) > floor and sum(w > floor for w in self.weight.values()) >= 2:
            return self.mean[0]
        costs = self.costs([k], floor)
        return None if costs is None else costs[k]

    def _cells(self, floor: float, speculative_only: bool = False):
        return [(k, self.weight[k], self.mean[k]) for k in self.weight
                if self.weight[k] > floor and (k > 0 or not speculative_only)]

    @staticmethod
    def _line(cells) -> tuple[float, float] | None:
        """Weighted least squares (a, b) of T = a + b k through ``cells`` [(k, weight, mean)]."""
        if len({k for k, _, _ in cells}) < 2:
            return None
        total = sw_k = sw_t = sw_kk = sw_kt = 0.0  # one pass: the policy refits at every timing
        for k, w, t in cells:
            total += w
            sw_k += w * k
            sw_t += w * t
            sw_kk += w * k * k
            sw_kt += w * k * t
        k_bar, t_bar = sw_k / total, sw_t / total
        sxx, sxy = sw_kk - sw_k * k_bar, sw_kt - sw_k * t_bar
        b = max(sxy / sxx, 0.0) if sxx > 0 else 0.0  # drafting more never costs less; noise can say otherwise
        a = t_bar - b * k_bar
        if a <= 0:  # noise: keep the fit through the weighted mean with a positive intercept
            a = max(t_bar * 1e-3, 1e-9)
            b = max((t_bar - a) / k_bar, 0.0) if k_bar > 0 else 0.0
        return a, b

    def costs(self, ks, floor: float = 1e-3) -> dict[int, float] | None:
        """k -> predicted seconds per iteration, or None without two distinct k observed.

        Drafting at all has a fixed price (the drafter's call and its catch-up on the committed
        tokens, the wider verify), so T(0) is the k = 0 cell's own mean when it was observed and
        the line ``a + b k`` is fitted on the k >= 1 cells when two of them were; otherwise one
        line through every cell. A k >= 1 with a cell of weight w costs ``(w mean + CELL_PRIOR
        line) / (w + CELL_PRIOR)``; one without, the line's ``a + b k``. The answer is kept until the
        next timing (the makespan reads every bucket's at each iteration): callers must not change it."""
        key = (self.changes, floor, tuple(ks))
        if self._costs is not None and self._costs[0] == key:
            return self._costs[1]
        if self._lines is None or self._lines[:2] != (self.changes, floor):  # once per timing, not per call
            everything = self._line(self._cells(floor))
            speculative = everything and (self._line(self._cells(floor, speculative_only=True)) or everything)
            self._lines = (self.changes, floor, everything, speculative)
        everything, speculative = self._lines[2:]
        if everything is None:
            self._costs = (key, None)
            return None
        plain = self.mean[0] if self.weight.get(0, 0.0) > floor else everything[0]
        a, b = speculative
        out = {}
        for k in ks:
            line, weight = a + b * k, self.weight.get(k, 0.0)
            if k == 0:
                out[k] = plain
            elif weight > floor:
                out[k] = (weight * self.mean[k] + self.CELL_PRIOR * line) / (weight + self.CELL_PRIOR)
            else:
                out[k] = line
        self._costs = (key, out)
        return out

    def speculative_widths(self, floor: float = 1e-3) -> list[int]:
        """The k >= 1 with a cell (weight above ``floor``): two or more give the drafting line a slope."""
        return [k for k, _, _ in self._cells(floor, speculative_only=True)]

    def single(self) -> tuple[int, float] | None:
        """The one k observed (weight above zero) and its mean time, when there is exactly one."""
        cells = [k for k in self.weight if self.weight[k] > 1e-3]
        return (cells[0], self.mean[cells[0]]) if len(cells) == 1 else None


ALTERNATIVES = ("auto", "always")


def _alternatives(instance, attribute, value):
    if value not in ALTERNATIVES:
        raise ValueError(f"alternatives must be one of {', '.join(map(repr, ALTERNATIVES))}, got {value!r}")


@attrs.define
class AlternativesLedger:
    """What reading a draft's first-position alternatives costs and buys at one batch-size bucket.

    Times (seconds at load 1) are kept per drafted width, with the alternatives read and without, as
    recency-weighted means; the price is the mean difference over the widths seen both ways. The gain
    is the target's tokens found among them after a rejected first draft, per iteration that had them."""

    weight: dict[tuple[int, bool], float] = attrs.field(factory=dict)  # (width, read) -> decayed weight
    mean: dict[tuple[int, bool], float] = attrs.field(factory=dict)  # (width, read) -> mean seconds
    timings: dict[tuple[int, bool], int] = attrs.field(factory=dict)  # (width, read) -> iterations timed
    hits: float = 0.0  # decayed tokens the alternatives were right about
    seen: float = 0.0  # decayed iterations whose draft had alternatives

    # Timings each way before a width prices them. Counted, not decayed: a decayed weight fell back
    # under the bar a few iterations after the policy stopped reading them, and while unpriced it
    # alternates, so SmolLM2 at batch 4 read them in 7% of its iterations at a loss (stop 26).
    TIMINGS = 3

    def add_time(self, width: int, read: bool, seconds: float, decay: float) -> None:
        _add_decayed(self.weight, self.mean, (width, read), seconds, decay)
        self.timings[(width, read)] = self.timings.get((width, read), 0) + 1

    def add_hits(self, hits: float, decay: float) -> None:
        self.hits = self.hits * decay + hits
        self.seen = self.seen * decay + 1.0

    def price(self) -> float | None:
        """Seconds reading them adds to an iteration, or None before a width was timed both ways
        ``TIMINGS`` times (a single timing each way can be off by more than the price: the first
        forwards at a new width also set up the CPU kernels for it)."""
        pairs = [(min(self.weight[(width, True)], self.weight[(width, False)]),
                  self.mean[(width, True)] - self.mean[(width, False)])
                 for width, read in self.weight if read and (width, False) in self.weight
                 and min(self.timings[(width, True)], self.timings[(width, False)]) >= self.TIMINGS]
        if not pairs:
            return None
        total = sum(w for w, _ in pairs)  # 0 only where every weight decayed below float's range
        return sum(w * d for w, d in pairs) / total if total > 0 else sum(d for _, d in pairs) / len(pairs)

    def gain(self) -> float:
        """Tokens they add per iteration that has them (0 before any was seen)."""
        return self.hits / self.seen if self.seen > 0 else 0.0


# Set a shape's first run apart on the CPU too, as off it (``CostAwareLookahead._record``): for the
# tests of that rule. On the CPU a first run costs what the next do (stop 68's Xeon), and each timing
# set apart is one the batch replays missed (prompt lookup 1-2% behind at batch 4 and 16).
FIRST_RUNS_APART_ON_CPU = False


_compile_work = 0  # compile work torch has begun in this process, as dynamo's callbacks tell it


def _count_compile_work(args) -> None:
    global _compile_work
    _compile_work += 1


def compile_work_begun() -> int:
    """How many times torch has begun compile work in this process since this was first asked:
    dynamo tracing a frame (a new graph or a recompile) and, on a GPU with
    ``mode="reduce-overhead"``, inductor recording a CUDA graph (a compiled step's second run, and
    again wherever the order of the graphs run changes), which no dynamo counter shows. Counted by
    dynamo's compile callbacks; ``torch._dynamo.reset()`` clears those, so each call registers the
    count again where it is gone."""
    from torch._dynamo import callback_handler  # only a compiling decoder has imported dynamo

    if _count_compile_work not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_count_compile_work)
    return _compile_work


def bucket_of(batch: int) -> int:
    """Batch sizes 1-4 exactly, then half-octaves (5-6, 7-9, 10-13, 14-19, ...)."""
    return batch if batch <= 4 else 100 + round(2 * math.log2(batch))


def generated_bucket(generated: int) -> int:
    """Tokens a row has generated, in octaves: 0-7, 8-15, 16-31, 32-63, ..."""
    return 0 if generated < 8 else generated.bit_length() - 3


def _read_profile(profile: list[float], bucket: int) -> float:
    """The pooled acceptance at ``bucket`` of ``_generated_profile``; past its last octave counted,
    the pool (its last entry)."""
    return profile[min(bucket, len(profile) - 1)]


@attrs.frozen
class Decision:
    """What the policy chose at one lookahead, and why."""

    k: int
    best_k: int
    probing: bool
    batch: int
    costs: dict[int, float] | None = None  # k -> predicted seconds; None while exploring
    goodput: dict[int, float] = attrs.field(factory=dict)  # k -> expected committed tokens per second
    alternatives: bool = True  # whether the verify reads the draft's first-position alternatives


@attrs.define(eq=False)
class CostAwareLookahead(LookaheadPolicy):
    """Each iteration, the common k (0 allowed) that maximises expected committed tokens per second,
    from measured iteration times and measured per-row acceptance; see the module docstring."""

    name = "cost-aware"
    MAX_HISTORY_STRENGTH = 100.0
    # Choices after a probe that moved the best k during which a return to the old one counts as
    # the probe confirming it. One lucky timing of a probe's drafted iteration moved it for two or
    # three iterations at a time, and each such move reset the backoff: at batch 16 on a Zen 3 EPYC,
    # where no k paid (with the benchmarks' float16 draft, stop 46), probes came at the full rate and
    # the policy ran 0.931 of plain steps (docs/benchmarks.md, stop 45).
    PROBE_WATCH = 8
    # Pseudo-counts of the share of rows that got a draft over every octave in one octave's share.
    # Taken alone, an octave prompt lookup had been asked in twice and found nothing to copy read as
    # one where it never does (0 where the bundled pair's texts propose 0.89 of the time at 32-63),
    # and the run took plain steps there for good. 2, 4 and 12 ran alike in the batch-1 replay
    # (0.972, 0.973, 0.970 of the best constant k); 4 ran best at batch 4 (docs/benchmarks.md, stop 71).
    PROPOSAL_PRIOR = 4.0
    SPREAD_DECAY = 0.9  # per finished request

    min_k: int = attrs.field(default=1, validator=integer(1))
    max_k: int = attrs.field(default=8, validator=[*integer(1), _max_k])
    initial_k: int | None = attrs.field(default=None, validator=_initial_k)  # None: 4, within [min_k, max_k]
    probe_rate: float = attrs.field(default=1 / 32, validator=_fraction(low_open=False))
    # 0.995, not 0.98 (until stop 57): the goodput is flat within a few percent across the best
    # widths, so noise in the per-k cells moved k between them, and a k that moves loses to the
    # constant of its mean width (stop 55). The host's speed is followed by ``load_rate``, not by
    # the cells, so a slower decay costs no tracking of load (docs/benchmarks.md, stops 56-57).
    decay: float = attrs.field(default=0.995, validator=_fraction(low_open=True))
    load_rate: float = attrs.field(default=0.1, validator=_fraction(low_open=False))
    alpha_decay: float = attrs.field(default=0.9, validator=_fraction(low_open=True))
    prior_alpha: float = attrs.field(default=0.5, validator=_open_probability)
    prior_strength: float = attrs.field(default=12.0, validator=_non_negative_number)
    probe_backoff: int = attrs.field(default=8, validator=integer(1))
    objective: str = attrs.field(default="makespan", validator=_objective)
    resume_margin: float = attrs.field(default=0.05, validator=_non_negative_number)
    per_position: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    alternatives: str = attrs.field(default="auto", validator=_alternatives)
    replan_every: int = attrs.field(default=8, validator=integer(1))
    memory: str | None = attrs.field(default=None, validator=_memory_file)
    clock: Callable[[], float] = attrs.field(default=time.perf_counter, validator=_callable, repr=False,
                                             metadata={PYTHON_ONLY: True})

    decision: Decision | None = attrs.field(default=None, init=False, repr=False)
    requested: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)  # [B] last asked per row
    _fits: dict[int, CostFit] = attrs.field(factory=dict, init=False, repr=False)
    _costs_cache: dict[int, dict[int, float] | None] = attrs.field(factory=dict, init=False, repr=False)  # cost_model's
    _costs_stamp: int = attrs.field(default=-1, init=False, repr=False)  # the fits' changes it was computed at
    # [R] decayed accepted drafts and rejections per request row. Plain floats: the policy runs on the
    # host every iteration, where a handful of Python numbers cost less than a tensor op each.
    _success: list[float] | None = attrs.field(default=None, init=False, repr=False)
    _failure: list[float] | None = attrs.field(default=None, init=False, repr=False)
    # [R] the same counts' expected accepted drafts, had the row accepted at the pooled rate of where
    # it was in its text (``_by_generated``) when it drafted: what its counts are measured against.
    _expected: list[float] | None = attrs.field(default=None, init=False, repr=False)
    # [R] [accepted, rejections, expected accepted] of each row over its whole request, aged only when
    # it drafts (at the pool's pace): what the recent counts above age back to while it does not draft.
    _row_history: list[list[float]] | None = attrs.field(default=None, init=False, repr=False)
    _generated: list[int] | None = attrs.field(default=None, init=False, repr=False)  # [R] at the last lookahead
    # [R] [asked, drafts expected, got] of each row over its request, expected at the pooled share where
    # it was in its text (proposal_rate): some texts repeat themselves, others never
    _row_proposals: list[list[float]] | None = attrs.field(default=None, init=False, repr=False)
    # How much rows really differ, from finished requests' rows: decayed [weight, sum of the squared
    # deviation of a row's rate from the pool less its sampling variance]. It sets how far a row's
    # history leans on the pool (few pseudo-counts where rows differ, many where they are alike).
    _spread: list[float] = attrs.field(factory=lambda: [0.0, 0.0], init=False, repr=False)
    _pool: list = attrs.field(factory=lambda: [0.0, 0.0], init=False, repr=False)  # decayed [accepted, rejections]
    # generated_bucket -> decayed [accepted, rejections] of rows that drafted with that many tokens
    # generated (kept across requests; each bucket ages only as it gets newer counts)
    _by_generated: dict[int, list[float]] = attrs.field(factory=dict, init=False, repr=False)
    # [max_k] decayed drafts (per row and step, pooled like _pool) that reached position j + 1, every
    # draft before them accepted, and those accepted there: the conditional acceptance profile.
    _reached: np.ndarray = attrs.field(default=attrs.Factory(lambda self: np.zeros(self.max_k), takes_self=True),
                                       init=False, repr=False)
    _kept: np.ndarray = attrs.field(default=attrs.Factory(lambda self: np.zeros(self.max_k), takes_self=True),
                                    init=False, repr=False)
    _probe_credit: float = attrs.field(default=0.0, init=False, repr=False)
    # Out of plain steps: the credit the next probe waits for, and plain steps left before choosing again
    _plain_price: float = attrs.field(default=math.inf, init=False, repr=False)
    _plain_left: int = attrs.field(default=0, init=False, repr=False)
    _probes: int = attrs.field(default=0, init=False, repr=False)
    _backoff: int = attrs.field(default=1, init=False, repr=False)  # probing is this many times rarer now
    _probe_best: int | None = attrs.field(default=None, init=False, repr=False)  # the best k when the last probe began
    _probe_untimed: bool = attrs.field(default=False, init=False, repr=False)  # an iteration of that probe went untimed
    _probe_next: int | None = attrs.field(default=None, init=False, repr=False)  # a probe's timed second iteration
    # (the best k before a probe that moved it, choices left to watch whether the move holds)
    _probe_moved: tuple[int, int] | None = attrs.field(default=None, init=False, repr=False)
    _pending: tuple | None = attrs.field(default=None, init=False, repr=False)
    _row_cuts: int = attrs.field(default=0, init=False, repr=False)  # state.row_cuts at the last lookahead
    _drafted: bool = attrs.field(default=False, init=False, repr=False)  # the last planned iteration drafted
    _drafted_in_request: bool = attrs.field(default=False, init=False, repr=False)  # some iteration of this request did
    _iteration: int = attrs.field(default=0, init=False, repr=False)  # of the request, at the lookahead being chosen
    # bucket -> [decayed weight, mean seconds] an iteration that drafts after a plain one takes beyond
    # the fit's k: the drafter's catch-up, the price of resuming (kept across requests, like the fits)
    _resume: dict[int, list[float]] = attrs.field(factory=dict, init=False, repr=False)
    # bucket -> [decayed weight, mean seconds] the same for a request's first drafting iteration after
    # plain ones: the draft model reads the prompt and every token committed so far (at batch 16 on the
    # bundled pair 11 plain steps, against a resume's 1)
    _first_read: dict[int, list[float]] = attrs.field(factory=dict, init=False, repr=False)
    # bucket -> [decayed weight, mean] drafted iterations in a row that a resume bought, up to the next
    # plain step or the request's end: what one resume's price is spread over. Only stretches that
    # began with a resume count; a request's first, which pays no catch-up, would make it look cheap.
    _stretch: dict[int, list[float]] = attrs.field(factory=dict, init=False, repr=False)
    _run: tuple[int, int] | None = attrs.field(default=None, init=False, repr=False)  # (bucket, iterations) since a resume
    # generated_bucket -> [decayed weight, share] of the rows asked for drafts that got none, with that
    # many tokens generated (kept across requests): early in a text prompt lookup has less to copy
    _unproposed_by_generated: dict[int, list[float]] = attrs.field(factory=dict, init=False, repr=False)
    # bucket -> what first-position alternatives cost and buy there (kept across requests)
    _ledgers: dict[int, AlternativesLedger] = attrs.field(factory=dict, init=False, repr=False)
    _alt_pending: tuple | None = attrs.field(default=None, init=False, repr=False)  # (width, read) of the step in flight
    _alt_hits: tuple | None = attrs.field(default=None, init=False, repr=False)  # (bucket, hits on the host, lagged)
    _alt_read: bool = attrs.field(default=True, init=False, repr=False)  # the last iteration with alternatives read them
    _alt_credit: float = attrs.field(default=0.0, init=False, repr=False)
    _alt_backoff: int = attrs.field(default=1, init=False, repr=False)
    _alt_probe: bool | None = attrs.field(default=None, init=False, repr=False)  # the choice a probe flipped
    _recalled: bool = attrs.field(default=False, init=False, repr=False)  # memory was read (at the first request)
    # (batch-size bucket, width, after a drafted iteration, alternatives read) of the iterations run
    # once already: off the CPU the first of each is not timed (_record)
    _warmed: set[tuple] = attrs.field(factory=set, init=False, repr=False)
    _first_runs_apart: bool = attrs.field(default=False, init=False, repr=False)  # the request's device is not the CPU
    _compile_work: int = attrs.field(default=0, init=False, repr=False)  # compile_work_begun() at the last lookahead

    # --- the estimates ---------------------------------------------------------------------------

    def pooled_alpha(self) -> float:
        """Acceptance over all rows seen (decayed), shrunk towards ``prior_alpha``."""
        success, failure = self._pool
        strength = self.prior_strength
        return (success + strength * self.prior_alpha) / (success + failure + strength) if success + failure + strength else self.prior_alpha

    def pooled_at(self, generated: int) -> float:
        """The pooled acceptance of rows that had generated about ``generated`` tokens."""
        return _read_profile(self._generated_profile(), generated_bucket(generated))

    def _generated_profile(self) -> list[float]:
        """The pooled acceptance per octave of tokens generated (``generated_bucket``), up to the last
        octave counted: each octave's counts on ``prior_strength`` pseudo-counts of ``pooled_alpha``,
        so an octave not counted yet reads as the pool (``_read_profile``: past the last octave
        too). Until stop 71 an octave leaned on the one before it, and one that prompt lookup had
        drafted in once or twice read as the octaves before it, where a text has least to copy: on
        the bundled pair it accepts 0.32 of the first draft in a text's first 8 tokens and 0.81 at
        32-63, and a run that never drafted at 32-63 read it at 0.33 and took plain steps there for
        good (docs/benchmarks.md, stop 71)."""
        pooled, strength = self.pooled_alpha(), self.prior_strength
        profile = []
        for bucket in range(max(self._by_generated, default=-1) + 1):
            success, failure = self._by_generated.get(bucket, (0.0, 0.0))
            total = success + failure + strength
            profile.append(_clip((success + strength * pooled) / total if total > 0 else pooled))
        return profile + [_clip(pooled)]

    def row_alpha(self, rows: torch.Tensor) -> torch.Tensor:
        """[B] float64: each row's acceptance, its own counts on a prior of ``prior_strength`` pooled pseudo-counts."""
        return torch.tensor(self._row_alphas(rows.tolist()), dtype=torch.float64)

    def _row_alphas(self, rows: list[int]) -> list[float]:
        """Each row's acceptance where it is now. A row's counts are read against what the pool
        accepted where the row drafted (its expected accepted drafts): their log-odds above that
        are the row's own, carried to the pooled acceptance where it is now. Prompt lookup accepts
        more the more text a row has generated (on the bundled pair 0.18 of its first 8 tokens'
        drafts, 0.42 at 16-31, 0.76 at 48-63): read against the pool as a whole, a row's early
        failures made it look worse than it then was, and at batch 4 the policy ran 0.89 of
        constant k = 1 (``docs/benchmarks.md``, stop 41). Where acceptance does not move along the
        text, this is each row's counts on a Beta prior of the pooled rate, as before."""
        strength = max(self.prior_strength, 1e-6)
        lean = self.history_strength()
        success, failure, expected, history = self._success, self._failure, self._expected, self._row_history
        profile = self._generated_profile()
        alphas = []
        for r in rows:
            here = _read_profile(profile, generated_bucket(self._generated[r]))
            kept, missed, kept_expected = history[r]
            seen = kept + missed
            reference = _clip(kept_expected / seen) if seen > 0 else here
            # the log-odds by which the row's request so far beat the pool where it drafted
            above = _logit(_clip((kept + lean * reference) / (seen + lean))) - _logit(reference)
            seen = success[r] + failure[r]
            reference = _clip(expected[r] / seen) if seen > 1e-9 else here
            recent = (success[r] + strength * _sigmoid(_logit(reference) + above)) / (seen + strength)
            alphas.append(_carried(here, recent, reference))
        return alphas

    def history_strength(self) -> float:
        """Pseudo-counts of the pooled acceptance in a row's whole-request estimate: the Beta prior
        whose spread is the rows' measured one (method of moments, ``pooled (1 - pooled) / variance - 1``),
        ``prior_strength`` until a request has finished, at most ``MAX_HISTORY_STRENGTH``."""
        weight, excess = self._spread
        if weight <= 0:
            return max(self.prior_strength, 1e-6)
        pooled = _clip(self.pooled_alpha())
        variance = excess / weight
        if variance <= pooled * (1 - pooled) / (self.MAX_HISTORY_STRENGTH + 1):
            return self.MAX_HISTORY_STRENGTH
        return max(pooled * (1 - pooled) / variance - 1, 1.0)

    def _fold_spread(self) -> None:
        """Adds the finished request's rows (those with a few drafts' evidence) to ``_spread``, once."""
        if not self._row_history:
            return
        rows, self._row_history = self._row_history, None
        weight, excess = self._spread
        weight, excess = weight * self.SPREAD_DECAY, excess * self.SPREAD_DECAY
        for kept, missed, kept_expected in rows:
            seen = kept + missed
            if seen >= 4:  # against what the pool accepted where the row drafted
                reference = _clip(kept_expected / seen)
                weight += 1.0
                excess += (kept / seen - reference) ** 2 - reference * (1 - reference) / seen
        self._spread = [weight, excess]

    def _position_shift(self) -> list[float] | None:
        """Per draft position, the log-odds of the pooled conditional acceptance there less those of
        the pooled alpha (each position's own counts on ``prior_strength`` pseudo-counts of the
        pooled alpha); None without ``per_position`` or before any position was counted: then
        every position is the row's alpha, the geometric model."""
        if not self.per_position or not self._reached.any():
            return None
        pooled = _clip(self.pooled_alpha())
        strength = max(self.prior_strength, 1e-6)
        return [_logit(_clip((kept + strength * pooled) / (reached + strength))) - _logit(pooled)
                for kept, reached in zip(self._kept.tolist(), self._reached.tolist())]

    def _tokens_by_depth(self, alpha: float, depth: int, shift: list[float] | None,
                         proposes: float = 1.0) -> list[float]:
        """The tokens a row of acceptance ``alpha`` is expected to commit when it drafts m = 0 ..
        ``depth``: 1 + the sum over j <= m of P(drafts 1 .. j all accepted), times ``proposes``,
        the chance that the drafter proposes anything (``proposal_rate``). Python floats: the
        policy runs on the host between two forwards, where a handful of float operations per
        row cost less than numpy's or torch's calls (measured in the loop: 15 against 96 us at
        batch 1, 48 against 179 us at batch 16)."""
        tokens, reach, total = [1.0], proposes, 1.0
        for acceptance in _acceptance_by_position(_clip(alpha), depth, shift):
            reach *= acceptance
            total += reach
            tokens.append(total)
        return tokens

    def proposal_rate(self, generated: int, pool: float | None = None) -> float:
        """The share of rows with about ``generated`` tokens generated that got a draft when asked
        (1 for a model drafter): that octave's share on ``PROPOSAL_PRIOR`` pseudo-counts of the
        share over every octave (``pool``, ``proposal_pool()`` unless given). An octave not counted
        yet reads as 1: read as the octave before it, where prompt lookup finds little to copy, a
        lone row took plain steps and never counted it (0.975 of the best constant k in the batch-1
        replay, 0.997 with 1; stop 42)."""
        cell = self._unproposed_by_generated.get(generated_bucket(generated))
        if cell is None:
            return 1.0
        weight, unproposed = cell
        pool = self.proposal_pool() if pool is None else pool
        return (weight * (1.0 - unproposed) + self.PROPOSAL_PRIOR * pool) / (weight + self.PROPOSAL_PRIOR)

    def proposal_pool(self) -> float:
        """The share of rows asked for drafts that got one, over every octave counted (1 before any)."""
        cells = self._unproposed_by_generated.values()
        weight = sum(w for w, _ in cells)
        return sum(w * (1.0 - unproposed) for w, unproposed in cells) / weight if weight > 0 else 1.0

    def _row_proposal_rates(self, rows: list[int]) -> list[float]:
        """Each row's chance of getting a draft when asked: ``proposal_rate`` where it is in its text,
        moved in log-odds by as much as its request's share (on ``prior_strength`` pseudo-counts)
        beat the pool's where it was asked, as ``_row_alphas`` reads acceptance. Pooled alone, a
        text that never repeats itself read as one that does, and at batch 16 the batch drafted for
        rows that got nothing (stop 42)."""
        strength, pool = max(self.prior_strength, 1e-6), self.proposal_pool()
        rates = []
        for row in rows:
            asked, expected, got = self._row_proposals[row]
            here = self.proposal_rate(self._generated[row], pool)
            if asked > 0 and got != expected:  # where it got what the pool expected there is nothing to carry
                reference = _clip(expected / asked)
                here = _carried(here, (got + strength * reference) / (asked + strength), reference)
            rates.append(here)
        return rates

    def position_acceptance(self, alpha) -> np.ndarray:
        """[B, max_k]: the acceptance of each row's j-th draft, given that the drafts before it were
        accepted. The pooled per-position profile shifted in log-odds by as much as the row's
        ``alpha`` [B] differs from the pooled one; without ``per_position``, or before any position
        was counted, every position is the row's alpha: the geometric model."""
        shift = self._position_shift()
        rows = [_acceptance_by_position(_clip(float(a)), self.max_k, shift) for a in alpha]
        return np.array(rows).reshape(len(rows), self.max_k)

    def row_tokens(self, alpha, proposes=None) -> np.ndarray:
        """[B, max_k + 1]: the tokens each row is expected to commit when it drafts m = 0 .. max_k;
        ``proposes`` [B], each row's ``proposal_rate`` (default 1)."""
        shift, proposes = self._position_shift(), [1.0] * len(alpha) if proposes is None else list(proposes)
        rows = [self._tokens_by_depth(float(a), self.max_k, shift, p) for a, p in zip(alpha, proposes)]
        return np.array(rows).reshape(len(rows), self.max_k + 1)

    def cost_model(self, batch: int) -> dict[int, float] | None:
        """Width -> predicted seconds of an iteration of ``batch`` rows that drafts that wide (0..max_k),
        from this bucket's fit, or the nearest fitted bucket's scaled to this one's own point if it has one.
        Kept until a fit changes: the makespan asks for every smaller batch's at each iteration."""
        stamp = sum(fit.changes + 1 for fit in self._fits.values())  # grows with every iteration timed
        if self._costs_stamp != stamp:
            self._costs_stamp, self._costs_cache = stamp, {}
        bucket = bucket_of(batch)
        if bucket not in self._costs_cache:
            self._costs_cache[bucket] = self._fitted_costs(batch)
        return self._costs_cache[bucket]

    @staticmethod
    def none_proposed(proposes) -> float:
        """The chance that no row gets a draft when asked, from each row's (``proposes``; None: 1)."""
        return math.prod(1.0 - p for p in proposes) if proposes is not None else 0.0

    @staticmethod
    def asked_costs(costs: dict[int, float] | None, none: float) -> dict[int, float] | None:
        """k -> predicted seconds of an iteration that asks the drafter for k, from ``costs`` by width
        and the chance that no row gets a draft (``none_proposed``): then (prompt lookup finding
        nothing to copy; ``_count_unproposed``) it is a plain step."""
        if costs is None or none < 1e-9:  # a model drafter's rows always get one: 0
            return costs
        return {k: c if k == 0 else none * costs[0] + (1 - none) * c for k, c in costs.items()}

    def _fitted_costs(self, batch: int) -> dict[int, float] | None:
        ks = list(range(self.max_k + 1))  # every width a capped row may end at
        fit = self._fits.get(bucket_of(batch))
        costs = fit.costs(ks) if fit is not None else None
        if costs is not None:
            return costs
        here = math.log2(batch)
        fitted = [(abs(f.log_batch - here), f.costs(ks)) for f in self._fits.values()]
        fitted = [(distance, c) for distance, c in fitted if c is not None]
        if not fitted:
            return None
        costs = min(fitted, key=lambda item: item[0])[1]
        single = fit.single() if fit is not None else None
        if single is not None and single[0] in costs:  # the neighbour's shape through this bucket's point
            k, seconds = single
            scale = seconds / costs[k]
            costs = {kk: c * scale for kk, c in costs.items()}
        return costs

    def goodput(self, alpha, budget, costs: dict[int, float],
                fewer: Callable[[int], dict[int, float] | None] | None = None, proposes=None) -> dict[int, float]:
        """k -> expected committed tokens per second for the batch. ``alpha`` and ``budget`` are [B]
        sequences (lists, tensors): each row's acceptance and the drafts it may still make;
        ``costs`` the seconds of an iteration of these B rows by k, ``fewer(b)`` those of b < B rows
        (None, or returning None: as B's); ``proposes`` [B] the chance that each row gets a draft
        when asked (``proposal_rate``; default 1).

        ``throughput``: the rows' expected tokens per iteration over its time. ``makespan``: the
        batch's remaining tokens over the time to finish them all at this k. Row b is done after
        (remaining tokens / expected tokens per iteration) iterations; the batch runs at B rows until
        the first row is done, then at B - 1 until the next, and so on: a row that runs ahead of the
        others buys nothing until it leaves, and then every iteration of the rest is cheaper. Both
        agree on a single row."""
        alphas = alpha.tolist() if hasattr(alpha, "tolist") else list(alpha)
        budgets = [int(b) for b in (budget.tolist() if hasattr(budget, "tolist") else budget)]
        shift = self._position_shift()
        proposes = [1.0] * len(budgets) if proposes is None else list(proposes)
        by_depth = [self._tokens_by_depth(a, min(b, self.max_k), shift, p) for a, b, p in zip(alphas, budgets, proposes)]
        widest = max(budgets, default=0)
        makespan = self.objective == "makespan" and len(by_depth) > 1  # for one row the two agree
        remaining = sum(budgets) + len(budgets)  # tokens the rows may still commit, this iteration's included
        rows, least = len(budgets), min(budgets, default=0)
        # stretch i of the makespan runs with rows - i rows
        stretches = [costs, *((fewer(rows - i) or costs) if fewer is not None else costs
                              for i in range(1, rows if makespan else 1))]
        gains = {}
        for k in [0, *range(self.min_k, self.max_k + 1)]:
            tokens = [row[min(k, len(row) - 1)] for row in by_depth]
            if makespan:  # a row commits at most what remains: at least one iteration
                done = sorted(zip([(b + 1) / t for b, t in zip(budgets, tokens)], budgets))
                widths = [k] * rows  # the verify and the draft run to the widest row still decoding
                if k > least:
                    widest_left = 0
                    for i in range(rows - 1, -1, -1):
                        widest_left = widths[i] = max(min(k, done[i][1]), widest_left)
                seconds = before = 0.0
                for (iterations, _), width, at in zip(done, widths, stretches):
                    seconds += (iterations - before) * at[width]
                    before = iterations
                gains[k] = remaining / seconds
            else:
                gains[k] = sum(tokens) / costs[min(k, widest)]  # the verify and the draft run to the widest row
        return gains

    # --- the hooks -------------------------------------------------------------------------------

    def begin(self, state, target) -> None:
        if self.memory is not None and not self._recalled:
            self._recalled = True
            self._recall(_machine(state))
        self._end_stretch()
        self._fold_spread()
        device = getattr(state, "device", None)
        self._first_runs_apart = FIRST_RUNS_APART_ON_CPU or (device is not None and device.type != "cpu")
        self._success = [0.0] * state.batch_size
        self._failure = [0.0] * state.batch_size
        self._expected = [0.0] * state.batch_size
        self._row_history = [[0.0, 0.0, 0.0] for _ in range(state.batch_size)]
        self._generated = [0] * state.batch_size
        self._row_proposals = [[0.0, 0.0, 0.0] for _ in range(state.batch_size)]
        self._pending = None
        self._row_cuts = 0
        self._drafted = self._drafted_in_request = False
        self._plain_left = 0
        self._probe_next = None
        self._alt_pending = None
        self.requested = None

    def choose(self, batch: int, alpha, budget, proposes=None) -> Decision:
        """The k for this iteration; ``alpha`` [B] is each row's acceptance, ``budget`` [B] how many
        drafts it may still make (lists or tensors) and ``proposes`` [B] the chance that it gets
        one when asked (default 1)."""
        fit = self._fits.get(bucket_of(batch))
        single = fit.single() if fit is not None else None  # one k seen here: no fit of its own yet
        none = self.none_proposed(proposes)
        costs = self.asked_costs(self.cost_model(batch), none)
        if costs is None or single is not None:
            # Explore: the initial k, then one plain step (in whichever order the bucket met them),
            # so that every batch size measures its own shape; a neighbour's can be far off (on a
            # CPU a batch of 16 pays for drafting much more than a batch of 4). A bucket that has
            # timed only plain steps drafts too: on an H200 a batch of 64 that took a batch of 16's
            # fit (drafting dear there) ran 384 plain steps without a probe (docs/benchmarks.md,
            # stop 33). A drafted k's cells decay out after ~1,400 plain steps (~340 at decay 0.98),
            # and then it explores again, as a batch size with no neighbour always did.
            k = 0 if single is not None and single[0] > 0 else self.first_k
            return Decision(k=k, best_k=k, probing=True, batch=batch)
        warm = costs
        resume = self._catch_up(bucket_of(batch), first_read=False)
        price = resume / self._stretch_length(bucket_of(batch)) if resume else 0.0  # once for the stretch it buys

        def priced(seconds: dict[int, float] | None) -> dict[int, float] | None:
            """Drafting now first pays the drafter's catch-up."""
            return seconds if not price or seconds is None else \
                {k: c + price if k > 0 else c for k, c in seconds.items()}

        costs = priced(costs)
        tail: dict[int, dict[int, float] | None] = {}  # bucket -> costs: 15 batch sizes at batch 16, 8 buckets

        def fewer(rows: int) -> dict[int, float] | None:
            """The tail's fewer rows: as if the ones left were as likely to get no draft as this batch's."""
            bucket = bucket_of(rows)
            if bucket not in tail:
                tail[bucket] = priced(self.asked_costs(self.cost_model(rows), none))
            return tail[bucket]

        gains = self.goodput(alpha, budget, costs, fewer, proposes)
        best = max(gains, key=lambda k: (gains[k], -k))
        if best > 0 and batch > 1 and not self._drafted and gains[best] < gains[0] * (1 + self.resume_margin):
            best = 0
        if self._probe_next is not None:  # the timed half of a probe out of plain steps
            k, self._probe_next = self._probe_next, None
            return Decision(k=k, best_k=best, probing=True, batch=batch, costs=costs, goodput=gains)
        if self._probe_best is not None:  # the first choice after a probe: did it move the best k?
            if self._probe_untimed:  # it measured nothing, so it confirmed nothing
                self._probe_untimed = False
            elif best == self._probe_best:
                self._backoff = min(2 * self._backoff, self.probe_backoff)
            else:
                self._probe_moved = (self._probe_best, self.PROBE_WATCH)
            self._probe_best = None
        elif self._probe_moved is not None:  # did the move hold?
            before, left = self._probe_moved
            if best == before:  # undone: the probe confirmed the old choice after all
                self._backoff, self._probe_moved = min(2 * self._backoff, self.probe_backoff), None
            elif left <= 1:  # it held: drafting changed, probe at the full rate again
                self._backoff, self._probe_moved = 1, None
            else:
                self._probe_moved = (before, left - 1)
        k, probing = best, False
        self._probe_credit += self.probe_rate / self._backoff
        drafting = max((kk for kk in gains if kk > 0), key=lambda kk: gains[kk])  # the best speculative k
        price = 1.0  # in plain steps: a probe while speculating replaces one iteration by another
        if best == 0:
            timed, drafting = drafting, self._untimed_width(batch, drafting)
            # A width probed in place of the lone timed one is priced at no more than that one:
            # its own cost is the line's guess, which through one drafted cell and the plain step
            # reads drafting's fixed price as a price per token. At batch 4 with compiled draft
            # steps, k = 1's one timing (54 ms, two plain steps; later runs 26 ms) put k = 4 at
            # 140 ms, its probe at 9 plain steps, and none came in 512 iterations (stop 70).
            probed = min(warm[drafting], warm[timed])
            # Out of plain steps a probe drafts twice, the first time with the catch-up: it waits
            # for credit worth what both take beyond the plain steps they replace, so that probing
            # takes at most probe_rate of the time. At batch 16 on the bundled pair a probe took
            # 0.3-0.55 s, 10-17 plain steps (the draft model reading 16 prompts and what followed);
            # probed at the iteration rate, cost-aware ran 0.99x of the target where its own plain
            # steps ran 1.20x (docs/benchmarks.md, stops 21 and 22).
            # It pays the whole catch-up, for two drafted iterations, not a stretch; in a request
            # that has not drafted yet, the draft model's first read: at batch 16 on the bundled pair
            # 0.48 s, 11 plain steps, priced as a resume's 2 (docs/benchmarks.md, stop 32).
            catch_up = self._catch_up(bucket_of(batch))
            price = max(price, (2 * probed + catch_up - 2 * costs[0]) / costs[0])
            if not self._drafted_in_request and bucket_of(batch) not in self._first_read and self._iteration > 0:
                # The draft model's first read is not priced here yet (a request that drafts from its
                # first iteration never times it): a probe waits for a request's first iteration,
                # where the draft reads the prompt alone, not the prompt and every token since. At
                # batch 16 on the bundled pair the one probe priced as a resume came 11 plain steps
                # dear and cost its pass 14% (docs/benchmarks.md, stop 32).
                price = math.inf
            self._plain_price = price
        if self._probe_credit >= price:
            self._probe_credit -= price
            probing = True
            self._probes += 1
            self._probe_best = best
            if best == 0:
                k = self._probe_next = drafting
            elif self._probes % 2:
                k = 0
            else:
                k = self._two_away(best)
                k = k if k != best else 0
        return Decision(k=k, best_k=best, probing=probing, batch=batch, costs=costs, goodput=gains)

    @property
    def first_k(self) -> int:
        """The k a batch size explores first: ``initial_k``, or 4 within [min_k, max_k]."""
        return self.initial_k if self.initial_k is not None else min(max(4, self.min_k), self.max_k)

    def _untimed_width(self, batch: int, drafting: int) -> int:
        """The k a probe out of plain steps drafts: ``drafting``, the best speculative k, unless it is
        the only width this bucket has timed; then another, the initial k first. With a single
        speculative cell the drafting line runs through it and the plain step's cell, so the fixed
        price of drafting at all reads as a price per drafted token, and the cheapest width always
        looks best: the probes timed that width again and again and the line never changed. Prompt
        lookup under sampling at batch 1 on a Zen 4 EPYC timed only width 1, at 1.3 plain steps,
        and took plain steps throughout (1.00x of the target) where drafting 5 cost 1.04 plain steps
        and constant k = 5 ran 1.13x (docs/benchmarks.md, stop 54). ``choose`` prices such a probe
        at the lone width's cost, not at the line's guess for the width it drafts (stop 70)."""
        fit = self._fits.get(bucket_of(batch))
        if fit is None or fit.speculative_widths() != [drafting]:
            return drafting
        return self.first_k if self.first_k != drafting else self._two_away(drafting)

    def _two_away(self, k: int) -> int:
        """The other width a probe tries from ``k``: two wider, or two narrower at ``max_k`` (at
        least ``min_k``; ``k`` itself where neither fits)."""
        return k + 2 if k + 2 <= self.max_k else max(self.min_k, k - 2)

    def lookahead(self, state) -> torch.Tensor:
        return self.plan(state)

    def plan(self, state, alpha: torch.Tensor | None = None) -> torch.Tensor:
        """The lookahead for this iteration, from each row's acceptance ``alpha`` [B] (default: its
        own history); other policies reuse the cost model through this."""
        now = self.clock()
        if state.row_cuts != self._row_cuts:
            # A cache was cut to fewer rows since the last lookahead (a copy of every staying row,
            # whatever k was: with an encoder's cross-attention, a large one): not a cost of k.
            self._row_cuts, self._pending = state.row_cuts, None
        if self._compiled_since(state):
            self._left_untimed()
        self._record(state.iteration, now)  # the previous iteration ends here
        rows = state.rows_host.tolist()
        batch = len(rows)
        generated, remaining = state.progress_host()
        budget = [max(left - 1, 0) for left in remaining]  # drafts each row may still make
        for row, done in zip(rows, generated):
            self._generated[row] = done
        self._iteration = state.iteration
        if alpha is None and self._stays_plain(batch):
            self._plain_left -= 1
            self._probe_credit += self.probe_rate / self._backoff
            if self.alternatives == "auto":
                state.verify_alternatives = self.decision.alternatives
        else:
            proposes = self._row_proposal_rates(rows)
            self.decision = decision = self.choose(batch, self._row_alphas(rows) if alpha is None else alpha, budget, proposes)
            plain = decision.k == 0 and decision.best_k == 0 and not decision.probing
            self._plain_left = self.replan_every - 1 if plain else 0
            if self.alternatives == "auto":
                read = self._read_alternatives(batch, self.decision)
                self.decision = attrs.evolve(self.decision, alternatives=read)
                state.verify_alternatives = read
        k = self.decision.k
        requested = [min(b, k) for b in budget]
        wish = torch.zeros(batch, dtype=torch.long) if k == 0 else None  # one tensor for both: neither is changed
        self.requested = wish if wish is not None else torch.tensor(requested, dtype=torch.long)
        width = max(requested, default=0)
        # The request's first drafting iteration is the draft model's first read: the whole prompt, and
        # for Whisper's draft its cross-attention keys (45 ms at batch 1, two plain steps). Once per
        # request, whatever the policy does: not the price of resuming after plain steps, which it
        # would make look dear for the rest of the run (docs/benchmarks.md, stop 23).
        first = width > 0 and not self._drafted_in_request
        self._pending = (state.iteration, batch, width, now, self._drafted, first)
        if width == 0:
            self._end_stretch()
        elif not self._drafted and self._drafted_in_request:  # a resume (the first drafting iteration reads the prompt)
            self._run = (bucket_of(batch), 1)
        elif self._run is not None:
            self._run = (self._run[0], self._run[1] + 1)
        self._drafted = width > 0
        self._drafted_in_request = self._drafted_in_request or self._drafted
        return wish if wish is not None else torch.full((batch,), k, dtype=torch.long)

    def _compiled_since(self, state) -> bool:
        """Whether torch began compile work since the last lookahead, where the decoder compiles its
        steps: a graph made, or on a GPU a CUDA graph recorded (the step's second run). The iteration
        then took compiling's seconds, not what k costs. On the bundled pair with ``compile="draft"``
        (stop 68, a CPU) the first drafted iterations took 1.4 s each, and the policy, timing them,
        took plain steps for every request after."""
        if not getattr(state, "compile", None):
            return False
        work = compile_work_begun()
        compiled, self._compile_work = work != self._compile_work, work
        return compiled

    def _left_untimed(self) -> None:
        """The iteration that just ended is not timed (it compiled, or was its shape's first run off
        the CPU). Where it was a probe's, the probe measured nothing: judged as one that confirmed
        the best k, it made probing twice as rare, and a probe's width is often one not run yet
        (on a GPU its first run, with compiled steps a compile). ``self.decision`` is still the
        ended iteration's: an untimed iteration after the probe (rows leaving the batch can delay
        its judgement) does not make the probe one that measured nothing."""
        self._pending = None
        probe = self._probe_best is not None and self.decision is not None and self.decision.probing
        self._probe_untimed = self._probe_untimed or probe

    def _stays_plain(self, batch: int) -> bool:
        """Whether this iteration takes a plain step without choosing again: out of plain steps, for
        ``replan_every`` iterations after a choice of k = 0, while the batch keeps its size and no
        probe is due or under way. Nothing that decides the choice moves fast there: no draft is
        counted, the rows' evidence only ages, and the costs take one more plain step each. Choosing
        took 0.26 ms of a 17.7 ms plain step at batch 1 on the bundled pair (a Zen 3 EPYC, stop 47),
        where prompt lookup never pays under sampling: 1.5% of the time for the same answer."""
        decision = self.decision
        return (self._plain_left > 0 and decision is not None and decision.batch == batch
                and decision.k == 0 and decision.best_k == 0 and not decision.probing
                and self._probe_next is None and self._probe_best is None and self._probe_moved is None
                and self._probe_credit + self.probe_rate / self._backoff < self._plain_price)

    def _catch_up(self, bucket: int, first_read: bool = True) -> float:
        """Seconds a drafted iteration now takes beyond the fit's k: 0 right after a drafted one; out
        of plain steps the price of resuming, or, where this request has not drafted yet and
        ``first_read``, that of the draft model's first read (the price of resuming until one was
        measured). The k choice asks without ``first_read``: the read is the request's once, and
        charged to its first stretch it would hold short requests on plain steps."""
        if self._drafted:
            return 0.0
        cell = self._first_read.get(bucket) if first_read and not self._drafted_in_request else None
        cell = cell or self._resume.get(bucket)
        return cell[1] if cell is not None else 0.0

    def _stretch_length(self, bucket: int) -> float:
        """Drafted iterations in a row a resume has bought in this bucket (1 before any)."""
        cell = self._stretch.get(bucket)
        return max(cell[1], 1.0) if cell is not None else 1.0

    def _end_stretch(self) -> None:
        """A stretch that began with a resume ends (a plain step, or the request's end)."""
        if self._run is not None:
            bucket, length = self._run
            _add_to_cell(self._stretch.setdefault(bucket, [0.0, 0.0]), length, self.decay)
            self._run = None

    def _read_alternatives(self, batch: int, decision: Decision) -> bool:
        """Whether this iteration's verify reads the draft's first-position alternatives: while their
        price is unknown, the other way than the last iteration that had them; then while the tokens
        they add are worth their time at the best k's goodput, but for a probe of the other way now
        and then (see the module docstring)."""
        ledger = self._ledgers.get(bucket_of(batch))
        if ledger is None:  # no draft had any here yet: read them when one does, as other policies do
            return True
        price = ledger.price()
        if price is None:
            return not self._alt_read
        rate = decision.goodput.get(decision.best_k) if decision.goodput else None
        if rate is None or decision.k == 0:
            return self._alt_read
        pays = ledger.gain() > price * rate  # their tokens per iteration against what their time is worth
        if self._alt_probe is not None:  # the first choice after a probe: did it change the choice?
            self._alt_backoff = min(2 * self._alt_backoff, self.probe_backoff) if pays == self._alt_probe else 1
            self._alt_probe = None
        if self._alt_credit >= 1.0:
            self._alt_credit -= 1.0
            self._alt_probe = pays
            return not pays
        return pays

    def time_at_width(self, width: int) -> None:
        """Record the iteration in flight as one that drafted ``width`` columns, not the lookahead it
        asked for: for a policy whose lookahead is only a cap (a confidence stop decides the width,
        and the width is what the iteration cost). Call it before ``on_step``."""
        if self._pending is not None:
            iteration, batch, _, started, warm, first = self._pending
            self._pending = (iteration, batch, width, started, warm, first)
        if width == 0 and self._run is not None:  # a plain step after all: the stretch ended before it
            bucket, length = self._run
            self._run = (bucket, length - 1) if length > 1 else None
            self._end_stretch()
        self._drafted = width > 0

    @staticmethod
    def _shape(batch: int, width: int, warm: bool, alternatives: tuple | None) -> tuple:
        """What an iteration's first run is set apart by: its bucket, width, whether it followed a
        drafted one (not a resume) and whether it read first-position alternatives."""
        return (bucket_of(batch), width, warm and width > 0, alternatives[1] if alternatives is not None else None)

    def _first_run(self, batch: int, width: int, warm: bool, first: bool, alternatives: tuple | None) -> bool:
        """Whether a timed iteration is one left untimed as its shape's first run (off the CPU; a
        request's first read is new every time and never is)."""
        return (self._first_runs_apart and not first
                and self._shape(batch, width, warm, alternatives) not in self._warmed)

    def _record(self, iteration: int, now: float) -> None:
        """The previous iteration took from its lookahead to this one: everything it caused
        (the draft, the verify and the loop's sync, the drafter's cache bookkeeping after
        ``on_step``, rows leaving the batch) is inside. Not recorded: the first iteration of a
        request (it also reads the prompt) and the last (no lookahead follows it). Not recorded as
        k: one that drafted after one that did not. What it took beyond the fit's k (the drafter's
        catch-up on the tokens it sat out) is the price of resuming, kept apart (probes' included:
        resuming costs that, whoever chose it), or, where it was the request's first to draft, the
        price of the draft model's first read of the prompt and every token so far, kept apart
        from both."""
        alternatives, self._alt_pending = self._alt_pending, None  # an untimed iteration's too
        if self._pending is None:
            return
        previous, batch, width, started, warm, first = self._pending
        self._pending = None
        if not (previous > 0 and iteration == previous + 1):
            return
        bucket = bucket_of(batch)
        # Off the CPU a shape's first run pays one-time work (kernels loaded and chosen, memory
        # reserved), not what k costs: on the H200 of stop 33 every drafted iteration cost-aware
        # timed was the first at its width, 165-180 ms where constant k = 5's took 36, and it never
        # drafted again. Per bucket, not per batch size: rows leaving a batch would discard a timing
        # at every size. A first read's shape is new every time, so its first is not set apart.
        if self._first_run(batch, width, warm, first, alternatives):
            self._warmed.add(self._shape(batch, width, warm, alternatives))
            self._left_untimed()
            return
        fit = self._fits.get(bucket) or self._fits.setdefault(bucket, CostFit(log_batch=math.log2(batch)))
        seconds = now - started
        if alternatives is not None and width > 0:
            drafted, read = alternatives
            ledger = self._ledgers[bucket]  # on_step made it for this iteration's batch
            if warm:  # a resume's time holds the catch-up too
                ledger.add_time(drafted, read, seconds / fit.load, self.decay)
            if read:  # the k fit and the price of resuming are the costs without them
                price = ledger.price()
                if price is None:
                    return
                seconds -= price * fit.load
        if width == 0 or warm:
            fit.add(width, seconds, self.decay, self.load_rate)
            return
        costs = fit.costs([width])
        if costs is not None:
            # Not clipped at 0: a noisy negative excess cancels a noisy positive one.
            excess = seconds / fit.load - costs[width]
            cells = self._first_read if first else self._resume
            _add_to_cell(cells.setdefault(bucket, [0.0, 0.0]), excess, self.decay)

    def on_step(self, state, step) -> None:
        requested = self.requested
        if requested is None or requested.shape[0] != step.rows_host.shape[0]:
            return
        # Acceptance, counted against what each row was asked for (truncation-aware). Every row's
        # recent evidence ages each step, drafting or not, so a row that stopped drafting after a bad
        # patch drifts back to what its whole request has shown (its history, aged only when it
        # drafts) instead of staying at k = 0 until a probe; a row bad throughout stays bad.
        proposals = self._count_unproposed(step)
        self._count_alternatives(step)
        decay, success, failure, history = self.alpha_decay, self._success, self._failure, self._row_history
        expected, profile = self._expected, None  # the profile only where a row drafted
        share = None  # proposal_pool(), where a row was asked
        pool_decay = self.alpha_decay ** (1 / 16)  # the pooled estimate moves slower than a row's
        counted: list[tuple[int, float]] = []  # (accepted, rejected) of each row asked to draft
        by_generated: dict[int, list[float]] = {}  # generated_bucket -> [accepted, rejected, rows] this step
        credit = self.alternatives == "always"
        for row, asked, drafted, accepted, appended in zip(step.rows_host.tolist(), requested.tolist(),
                                                           step.drafted_host.tolist(), step.accepted_host.tolist(),
                                                           step.appended_host.tolist()):
            success[row] *= decay
            failure[row] *= decay
            expected[row] *= decay
            if asked > 0 and proposals:  # see _count_unproposed
                counts = self._row_proposals[row]
                counts[0] += 1.0
                share = self.proposal_pool() if share is None else share
                counts[1] += self.proposal_rate(self._generated[row], share)
                counts[2] += 1.0 if drafted else 0.0
                _add_to_cell(self._unproposed_by_generated.setdefault(generated_bucket(self._generated[row]), [0.0, 0.0]),
                             0.0 if drafted else 1.0, pool_decay)
                if not drafted:
                    continue
            if asked > 0:
                # Read at every draft ("always"), a taken first-position alternative (0 drafts kept, 2
                # tokens appended) gains what an accepted first draft gains: counted as one, the
                # acceptance is what the verify the policy pays for buys. Priced ("auto"), their gain
                # is counted apart (_count_alternatives) and the acceptance is the chain's own.
                if credit and drafted:
                    accepted = max(accepted, appended - 1)
                # A draft accepted whole, also one shorter than asked (prompt lookup found only so
                # much to copy), was not wrong about any token; a row whose draft a policy stopped
                # before its first token (draft-confidence), or had a token rejected, failed.
                rejected = 1.0 if drafted == 0 or accepted < drafted else 0.0
                bucket = generated_bucket(self._generated[row])
                profile = profile or self._generated_profile()
                here = _read_profile(profile, bucket) * (accepted + rejected)  # the pool's accepted
                success[row] += accepted
                failure[row] += rejected
                expected[row] += here
                own = history[row]
                own[0] = own[0] * pool_decay + accepted
                own[1] = own[1] * pool_decay + rejected
                own[2] = own[2] * pool_decay + here
                counted.append((accepted, rejected))
                tally = by_generated.setdefault(bucket, [0.0, 0.0, 0])
                tally[0], tally[1], tally[2] = tally[0] + accepted, tally[1] + rejected, tally[2] + 1
        if not counted:
            return
        asked_rows = len(counted)
        self._pool[0] = self._pool[0] * pool_decay + sum(a for a, _ in counted) / asked_rows
        self._pool[1] = self._pool[1] * pool_decay + sum(r for _, r in counted) / asked_rows
        for bucket, (accepted, rejected, rows) in by_generated.items():
            pool = self._by_generated.setdefault(bucket, [0.0, 0.0])
            pool[0] = pool[0] * pool_decay + accepted / rows
            pool[1] = pool[1] * pool_decay + rejected / rows
        if not self.per_position:  # positions are counted only for the model that reads them
            return
        # Position j + 1 was reached by a row that accepted more than j drafts, or exactly j and
        # then had one rejected (or drafted nothing); kept by the first kind.
        accepted, rejected = np.array(counted).T  # [asked_rows] each
        position = np.arange(self.max_k)
        kept = (accepted[:, None] > position).sum(0)
        reached = kept + ((accepted[:, None] == position) & (rejected[:, None] > 0)).sum(0)
        self._kept = self._kept * pool_decay + kept / asked_rows
        self._reached = self._reached * pool_decay + reached / asked_rows

    def _count_unproposed(self, step) -> bool:
        """Has an iteration that asked for drafts in which no row got one (prompt lookup finding
        nothing to copy; a model drafter always proposes what it is asked) timed as the plain step
        it was (see the module docstring, Acceptance). Returns whether this iteration's empty drafts
        are the drafter's, not a policy's stop (``time_at_width``), which the acceptance counts as
        rejections."""
        pending = self._pending
        if pending is None or pending[2] == 0:  # a plain step, or a policy's stop (time_at_width(0))
            return False
        none = not any(drafted for asked, drafted in zip(self.requested.tolist(), step.drafted_host.tolist()) if asked)
        if none:
            self._pending = (*pending[:2], 0, *pending[3:])
            if self._probe_best is not None and self.decision.probing and self._probe_next is None:
                # The probe's last drafted iteration timed a plain step: it measured no width, so it
                # confirms nothing (as one left untimed), and probing does not grow rarer for it.
                # Prompt lookup's probes out of plain steps come at a text's first iterations,
                # where it mostly has nothing to copy (docs/benchmarks.md, stop 71).
                self._probe_untimed = True
        return True

    def _count_alternatives(self, step) -> None:
        """Where the draft had first-position alternatives: how many rows' rejected first draft had the
        target's token among them (on the device; read on the host at the next such step, after the
        loop's sync), and whether the verify read them, for the timing of this iteration."""
        alternatives = step.draft.alternatives
        if self.alternatives != "auto" or alternatives is None or step.draft.width == 0:
            return
        if self._alt_hits is not None:
            bucket, hits = self._alt_hits
            self._ledgers[bucket].add_hits(float(hits), self.decay)
        verdict = step.verdict
        right = (alternatives == verdict.next_token[:, None]).any(1) & (verdict.accepted == 0) & (step.draft.lengths > 0)
        bucket = bucket_of(step.rows_host.shape[0])
        self._ledgers.setdefault(bucket, AlternativesLedger())
        hits = right.sum()
        if hits.device.type != "cpu":  # a pinned buffer: the copy runs behind the queue, done by the next sync
            hits = torch.empty((), dtype=hits.dtype, pin_memory=True).copy_(hits, non_blocking=True)
        self._alt_hits = (bucket, hits)
        self._alt_pending = (step.draft.width, step.siblings > 0)
        self._alt_read = step.siblings > 0
        self._alt_credit += self.probe_rate / self._alt_backoff

    # --- memory: what the policy learned, kept across processes ------------------------------------

    def on_finish(self, state, output) -> None:
        if self.memory is None:
            return
        self._end_stretch()
        self._fold_spread()
        self._remember(_machine(state))

    def learned(self, machine: str = "") -> dict:
        """What this policy carries from one request to the next, as JSON data (``memory``'s file):
        the iteration times and what they imply (the cost fits, the prices of resuming and of a first
        read, the first-position alternatives' ledgers, the probes' schedule), kept for ``machine``
        alone, and the acceptance (pooled, per octave of tokens generated, by position, the rows'
        spread, how often a row gets no draft), which does not depend on the machine."""
        def cells(table):
            return {str(key): list(cell) for key, cell in table.items()}

        return {
            "format": MEMORY_FORMAT,
            "max_k": self.max_k,
            "machine": machine,
            "costs": {
                "fits": {str(bucket): {"log_batch": fit.log_batch, "load": fit.load, "changes": fit.changes,
                                       "cells": [[k, fit.weight[k], fit.mean[k], fit.count.get(k, 0.0)] for k in fit.weight]}
                         for bucket, fit in self._fits.items()},
                "resume": cells(self._resume),
                "first_read": cells(self._first_read),
                "stretch": cells(self._stretch),
                "alternatives": {str(bucket): {"hits": ledger.hits, "seen": ledger.seen,
                                               "cells": [[width, read, ledger.weight[(width, read)], ledger.mean[(width, read)],
                                                          ledger.timings.get((width, read), 0)]
                                                         for width, read in ledger.weight]}
                                 for bucket, ledger in self._ledgers.items()},
                # the probes' schedule: a call too short to earn a probe's credit carries it to the next
                "probing": {"credit": self._probe_credit, "probes": self._probes, "backoff": self._backoff,
                            "best_before": self._probe_best, "moved": self._probe_moved,
                            "plain_price": self._plain_price if math.isfinite(self._plain_price) else None,
                            "alternatives_credit": self._alt_credit, "alternatives_backoff": self._alt_backoff},
                "drafted": self._drafted,
            },
            "acceptance": {
                "pool": list(self._pool),
                "spread": list(self._spread),
                "by_generated": cells(self._by_generated),
                "unproposed_by_generated": cells(self._unproposed_by_generated),
                "reached": self._reached.tolist(),
                "kept": self._kept.tolist(),
            },
        }

    def restore(self, learned: dict, machine: str = "") -> bool:
        """Take up what ``learned`` (another policy's ``learned()``) holds: the acceptance always, the
        costs only where it was learned on ``machine`` (an iteration's seconds on another CPU, thread
        count or device say nothing here). Returns whether the costs were taken. A ``ValueError``
        says what is wrong with data that is not such a record, and changes nothing."""
        try:
            taken = _parse_learned(learned, self.max_k)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise ValueError(f"not a cost-aware memory: {type(exc).__name__}: {exc}") from None
        acceptance, costs = taken
        (self._pool, self._spread, self._by_generated, self._unproposed_by_generated,
         self._reached, self._kept) = acceptance
        same = learned.get("machine") == machine
        if same:
            (self._fits, self._resume, self._first_read, self._stretch, self._ledgers,
             (self._probe_credit, self._probes, self._backoff, self._probe_best, self._probe_moved, self._plain_price,
              self._alt_credit, self._alt_backoff), self._drafted) = costs
            self._costs_cache, self._costs_stamp = {}, -1
        return same

    def _recall(self, machine: str) -> None:
        """Read ``memory`` where the file exists; one that cannot be read is warned of and replaced
        at the end of the request."""
        path = Path(self.memory).expanduser()
        try:
            text = path.read_text()
        except (FileNotFoundError, NotADirectoryError):  # nothing learned yet (an unwritable path warns once written)
            return
        except OSError as exc:
            warnings.warn(f"policy 'cost-aware': cannot read its memory {str(path)!r} ({exc}); starting from nothing",
                          PolicyMemoryWarning, stacklevel=2)
            return
        try:
            self.restore(json.loads(text), machine)
        except ValueError as exc:
            warnings.warn(f"policy 'cost-aware': ignoring its memory {str(path)!r}: {exc}; starting from nothing "
                          "and writing it anew after this request", PolicyMemoryWarning, stacklevel=2)

    def _remember(self, machine: str) -> None:
        """Write ``learned()`` to ``memory`` whole or not at all (a scratch file renamed into place),
        so that a process that stops mid-write or writes beside another leaves a readable file."""
        path = Path(self.memory).expanduser()
        scratch = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            scratch.write_text(json.dumps(self.learned(machine)))
            os.replace(scratch, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                scratch.unlink(missing_ok=True)
            warnings.warn(f"policy 'cost-aware': cannot write its memory {str(path)!r} ({exc}); what this process "
                          "learned is not kept", PolicyMemoryWarning, stacklevel=2)


# The layout of ``CostAwareLookahead.learned()``; a file of another is read as no memory.
MEMORY_FORMAT = 1


def _machine(state) -> str:
    """What an iteration's seconds hold for: this CPU (or accelerator), torch and its thread count."""
    from ..core.packed_linear import cpu_name  # not at import: it imports torch's submodules (core/deferred.py)

    device = state.device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    machine = f"{where}|{device.type}|torch {torch.__version__}|{torch.get_num_threads()} threads"
    # Off the CPU a shape's first run is untimed since stop 68: costs remembered from before hold
    # one-time work (the H200's 165-180 ms drafted iterations) and must not be taken up.
    return machine if device.type == "cpu" else machine + "|first runs untimed"


def _number(value, low: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low:
        raise ValueError(f"{value!r} is not a finite number >= {low}")
    return float(value)


def _parse_cells(table: dict, name: str) -> dict[int, list[float]]:
    """``{"bucket": [weight, mean]}`` as the policy keeps it; the mean may be negative (an excess time)."""
    if not isinstance(table, dict):
        raise TypeError(f"{name} is not a table")
    out = {}
    for key, cell in table.items():
        if not isinstance(cell, list) or len(cell) != 2:
            raise ValueError(f"{name}[{key}] is not a [weight, mean] pair")
        out[int(key)] = [_number(cell[0]), _number(cell[1], -math.inf)]
    return out


def _parse_learned(data: dict, max_k: int):
    """``learned()``'s record as the policy's state: (acceptance, costs), each a tuple in the order
    ``restore`` assigns them. Raises on anything that is not such a record for this ``max_k``."""
    if not isinstance(data, dict) or data.get("format") != MEMORY_FORMAT:
        raise ValueError(f"format {data.get('format') if isinstance(data, dict) else None!r}, expected {MEMORY_FORMAT}")
    if data["max_k"] != max_k:
        raise ValueError(f"written by a policy with max_k = {data['max_k']!r}, this one has {max_k}")
    accepted = data["acceptance"]
    pool = [_number(x) for x in accepted["pool"]]
    spread = [_number(x, -math.inf) for x in accepted["spread"]]
    if len(pool) != 2 or len(spread) != 2:
        raise ValueError("pool and spread are pairs")
    by_position = [np.array([_number(x) for x in accepted[key]], dtype=np.float64) for key in ("reached", "kept")]
    if any(len(counts) != max_k for counts in by_position):
        raise ValueError(f"reached and kept need {max_k} positions")
    acceptance = (pool, spread, _parse_cells(accepted["by_generated"], "by_generated"),
                  _parse_cells(accepted["unproposed_by_generated"], "unproposed_by_generated"), *by_position)
    timed = data["costs"]
    fits = {}
    for bucket, fit in timed["fits"].items():
        cells = {}
        for k, weight, mean, count in fit["cells"]:
            if not isinstance(k, int) or not 0 <= k <= max_k:
                raise ValueError(f"fit {bucket}: k = {k!r} is outside 0..{max_k}")
            cells[k] = (_number(weight), _number(mean), _number(count))
        fits[int(bucket)] = CostFit(log_batch=_number(fit["log_batch"]), load=_number(fit["load"], 1e-9),
                                    changes=int(_number(fit["changes"])),
                                    weight={k: c[0] for k, c in cells.items()}, mean={k: c[1] for k, c in cells.items()},
                                    count={k: c[2] for k, c in cells.items()})
    ledgers = {}
    for bucket, ledger in timed["alternatives"].items():
        made = AlternativesLedger(hits=_number(ledger["hits"]), seen=_number(ledger["seen"]))
        for width, read, weight, mean, timings in ledger["cells"]:
            if not isinstance(width, int) or not isinstance(read, bool) or not isinstance(timings, int):
                raise ValueError(f"alternatives {bucket}: a cell is not [width, read, weight, mean, timings]")
            made.weight[(width, read)], made.mean[(width, read)] = _number(weight), _number(mean)
            made.timings[(width, read)] = timings
        ledgers[int(bucket)] = made
    probing = timed["probing"]
    best, moved, price = probing["best_before"], probing["moved"], probing["plain_price"]
    if best is not None and not (isinstance(best, int) and 0 <= best <= max_k):
        raise ValueError(f"probing: best_before = {best!r} is outside 0..{max_k}")
    if moved is not None:
        if not (isinstance(moved, (list, tuple)) and len(moved) == 2 and all(isinstance(x, int) and 0 <= x for x in moved)):
            raise ValueError(f"probing: moved = {moved!r} is not [k, choices left]")
        moved = tuple(moved)
    schedule = (_number(probing["credit"]), int(_number(probing["probes"])), int(_number(probing["backoff"], 1)),
                best, moved, math.inf if price is None else _number(price),
                _number(probing["alternatives_credit"]), int(_number(probing["alternatives_backoff"], 1)))
    if not isinstance(timed["drafted"], bool):
        raise ValueError(f"drafted = {timed['drafted']!r} is not true or false")
    costs = (fits, _parse_cells(timed["resume"], "resume"), _parse_cells(timed["first_read"], "first_read"),
             _parse_cells(timed["stretch"], "stretch"), ledgers, schedule, timed["drafted"])
    return acceptance, costs


@hookimpl
def specdec_register(registry):
    registry.register_policy("cost-aware", CostAwareLookahead)


# --- pieces the confidence policies share ------------------------------------------------------


@attrs.define(eq=False)
class Calibration:
    """An online reliability table: observed acceptance per bin of a predicted probability.

    ``add`` takes per-position labels (accepted or not) on the device, without a host sync; the
    estimate of a bin is its acceptance shrunk towards the pooled one with ``strength`` pseudo-counts.
    Kept across requests: the pair's calibration does not change between them.
    """

    edges: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
    strength: float = 4.0
    prior: float = 0.5
    accepted: torch.Tensor | None = None  # [bins] float32
    seen: torch.Tensor | None = None  # [bins] float32
    _edges: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)

    def to(self, device) -> None:
        if self.accepted is None:
            self.accepted = torch.zeros(len(self.edges) + 1, device=device)
            self.seen = torch.zeros(len(self.edges) + 1, device=device)
        else:
            self.accepted, self.seen = self.accepted.to(device, non_blocking=True), self.seen.to(device, non_blocking=True)
        self._edges = torch.tensor(self.edges).to(device, non_blocking=True)  # torch.tensor(device=) copies blocking

    def bins(self, predicted: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(predicted.float().nan_to_num(1.0).contiguous(), self._edges, right=True)

    def pooled(self) -> torch.Tensor:  # 0-dim
        return (self.accepted.sum() + self.strength * self.prior) / (self.seen.sum() + self.strength)

    def estimate(self, predicted: torch.Tensor) -> torch.Tensor:
        """Observed acceptance of ``predicted``'s bins, same shape, float32."""
        index = self.bins(predicted)
        return ((self.accepted + self.strength * self.pooled()) / (self.seen + self.strength))[index]

    def add(self, predicted: torch.Tensor, accepted: torch.Tensor, seen: torch.Tensor) -> None:
        """``accepted`` / ``seen`` (bool, shape of ``predicted``): was the position accepted / looked at."""
        # Weights, not boolean indexing: a boolean index is a nonzero(), a device sync.
        index = self.bins(predicted).flatten()
        self.accepted.index_add_(0, index, (accepted & seen).flatten().float())
        self.seen.index_add_(0, index, seen.flatten().float())
