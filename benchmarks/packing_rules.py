"""Earlier rules for where specdec packs a linear layer (``core/packed_linear.py``), for benchmark
contenders that tell on this CPU what each later measurement gained, in the same run:

- ``"packed from 4 rows"``: stop 20's fixed rule (weights of 3 MiB or more, packed from 4 rows, no
  padding, a drafter's one-token steps on torch's path);
- ``"stop 21"``: where packing starts measured per shape, no padding to a faster wider width, a
  drafter's one-token steps on torch's path;
- ``"unpadded"``: today's rule without padding to a faster wider width;
- ``"from a width on"``: stops 22-25's rule, padding and a drafter's packed one-row steps included,
  that packed a layer only from the fewest rows from which packed wins at every wider trial width
  (so never, where sgemm's widest trial beats oneDNN's, as SmolLM2's MLP weights on the Xeon);
- ``"stop 25"``: ``"from a width on"``, and attention over copied key/value heads in a multi-token
  step of a grouped-query model (no ``core/gqa_attention.py``): the step path of stops 22-25.
- ``"stop 34"``: today's rule on shapes timed in a single round (``packing_stop34.json`` holds what
  that timing recorded on the 2-vCPU AMD EPYC of stops 27-34; another machine times them once
  more, in one round), and grouped attention through ``enable_gqa`` instead of folding the query
  groups: the step path of stops 26-34.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.core import gqa_attention, packed_linear

RULES = ("packed from 4 rows", "stop 21", "unpadded", "from a width on", "stop 25", "stop 34")
STOP_34_TIMES = Path(__file__).resolve().parent / "packing_stop34.json"


_ONE_ROUND: dict[tuple[int, ...], dict[int, tuple[float, float]]] = {}


def timed_in_one_round(weight: torch.Tensor) -> dict[int, tuple[float, float]]:
    """Stop 34's timing of ``weight``'s shape: as recorded in ``STOP_34_TIMES`` for this machine,
    else ``time_shape`` in one round (once per process)."""
    shape = tuple(weight.shape)
    if shape in _ONE_ROUND:
        return _ONE_ROUND[shape]
    key = packed_linear._machine_key(shape).rsplit("|", 1)[0]  # stop 34's key: no count of rounds
    entry = json.loads(STOP_34_TIMES.read_text()).get(key)
    if entry is not None:
        _ONE_ROUND[shape] = {int(rows): tuple(pair) for rows, pair in entry.items()}
        return _ONE_ROUND[shape]
    rounds, packed_linear.TIMING_ROUNDS = packed_linear.TIMING_ROUNDS, 1
    try:
        _ONE_ROUND[shape] = packed_linear.time_shape(weight)
    finally:
        packed_linear.TIMING_ROUNDS = rounds
    return _ONE_ROUND[shape]


def enable_gqa(query, key, value, mask, scaling):
    """Stops 26-34's grouped attention: one ``enable_gqa`` call, the query groups not folded."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)


def from_a_width_on(widths: frozenset[int]) -> frozenset[int]:
    """The trial widths from the fewest at which packed wins at every wider one: stops 21-25's rule."""
    start = None
    for rows in sorted((rows for rows in packed_linear.TRIAL_ROWS if rows >= 2), reverse=True):
        if rows not in widths:
            break
        start = rows
    return frozenset() if start is None else frozenset(rows for rows in packed_linear.TRIAL_ROWS if rows >= start)


@contextmanager
def packing_rule(rule: str | None):
    """Within it, layers pack by ``rule`` (None: today's measured rule)."""
    if rule is None:
        yield
        return
    if rule not in RULES:
        raise ValueError(f"unknown packing rule {rule!r}; known: {', '.join(RULES)}")
    saved = (packed_linear.faster_at, packed_linear.padded_widths, packed_linear.one_row_faster,
             dict(packed_linear._LINEARS), gqa_attention.applies_to, gqa_attention._folded, packed_linear.measured)
    measured = packed_linear.faster_at
    if rule == "stop 34":
        packed_linear.measured = timed_in_one_round
        gqa_attention._folded = enable_gqa
    if rule not in ("from a width on", "stop 25", "stop 34"):
        packed_linear.padded_widths = lambda weight: {}
    if rule not in ("unpadded", "from a width on", "stop 25", "stop 34"):
        packed_linear.one_row_faster = lambda times: False
    if rule == "stop 25":
        gqa_attention.applies_to = lambda model: False
    if rule in ("stop 21", "from a width on", "stop 25"):
        packed_linear.faster_at = lambda weight: from_a_width_on(measured(weight))
    if rule == "packed from 4 rows":
        packed_linear.faster_at = lambda weight: (frozenset(rows for rows in packed_linear.TRIAL_ROWS if rows >= 4)
                                                  if weight.numel() >= 3 << 18 else frozenset())
    packed_linear._LINEARS.clear()
    try:
        yield
    finally:
        packed_linear.faster_at, packed_linear.padded_widths, packed_linear.one_row_faster = saved[:3]
        gqa_attention.applies_to, gqa_attention._folded, packed_linear.measured = saved[4:]
        packed_linear._LINEARS.clear()
        packed_linear._LINEARS.update(saved[3])
