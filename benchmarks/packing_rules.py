"""Earlier rules for where specdec packs a linear layer (``core/packed_linear.py``), for benchmark
contenders that tell on this CPU what each later measurement gained, in the same run:

- ``"packed from 4 rows"``: stop 20's fixed rule (weights of 3 MiB or more, packed from 4 rows, no
  padding, a drafter's one-token steps on torch's path);
- ``"stop 21"``: where packing starts measured per shape, no padding to a faster wider width, a
  drafter's one-token steps on torch's path;
- ``"unpadded"``: today's rule without padding to a faster wider width.
"""

from __future__ import annotations

from contextlib import contextmanager

from specdec.core import packed_linear

RULES = ("packed from 4 rows", "stop 21", "unpadded")


@contextmanager
def packing_rule(rule: str | None):
    """Within it, layers pack by ``rule`` (None: today's measured rule)."""
    if rule is None:
        yield
        return
    if rule not in RULES:
        raise ValueError(f"unknown packing rule {rule!r}; known: {', '.join(RULES)}")
    saved = (packed_linear.from_rows, packed_linear.padded_widths, packed_linear.one_row_faster,
             dict(packed_linear._LINEARS))
    packed_linear.padded_widths = lambda weight: {}
    if rule != "unpadded":
        packed_linear.one_row_faster = lambda times: False
    if rule == "packed from 4 rows":
        packed_linear.from_rows = lambda weight: 4 if weight.numel() >= 3 << 18 else None
    packed_linear._LINEARS.clear()
    try:
        yield
    finally:
        packed_linear.from_rows, packed_linear.padded_widths, packed_linear.one_row_faster = saved[:3]
        packed_linear._LINEARS.clear()
        packed_linear._LINEARS.update(saved[3])
