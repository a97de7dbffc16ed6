"""Multi-token steps on a CPU through oneDNN with prepacked weights.

Speculation rests on one premise: a forward over k + 1 tokens costs about what a forward over one
token costs, because a decoding step is bound by reading the weights, not by the arithmetic. On a
CPU, torch computes a float32 linear layer with MKL's sgemm, which keeps that promise up to three
rows and breaks it from four on: it then repacks the whole weight at every call. Measured on this
project's 2-vCPU Xeon (one thread; ``python benchmarks/packed_linear.py``, docs/benchmarks.md stop
20), SmolLM2-135M's 49152 x 576 LM head takes 6.1 ms for 1 row, 13.9 ms for 4 and 22.8 ms for 8,
where oneDNN's matmul over the same weight reordered once into its blocked layout takes 0.57x and
0.42x of that at 4 and 8 rows: what Inductor does for CPU inference with ``freezing`` on, and what
vLLM's CPU backend does for every linear layer.

Which CPU decides where it pays, so it is measured, not assumed: the first time a weight shape
is packed, ``measured`` times it on torch's path and packed at ``TRIAL_ROWS`` and keeps the times
for the process and, in ``measurements_file()``, for the next ones on this machine;
``faster_at`` is the set of trial widths at which packed is at least ``1 / MARGIN`` times as fast,
and a call runs packed where the widest trial width at or below its rows is in that set. It is a
set, not a threshold: on the Xeon above SmolLM2's 1536 x 576 and 576 x 1536 MLP weights run
0.69-0.87x the time packed at 4, 8 and 12 rows and 1.1-1.2x at 16, where sgemm's 16-row kernel
is better than its 4- and 8-row ones; a rule that packed only from a width on which packed wins at
every wider one never packed them, and the 4- and 5-token verifies of SmolLM2 cost 1.48-1.55
plain steps instead of 1.38-1.43 (docs/benchmarks.md, stop 26). A 576 x 576 weight is no faster
packed at any width there (0.99-1.8x: oneDNN's fixed cost per call is more than sgemm's repacking
saves).
On an AMD EPYC (Zen 4, family 25 model 17, 2 vCPUs) MKL's sgemm runs 2
and 3 rows at 2.3x and 3.3x the time of one row (a 49152 x 576 weight: 10.1, 22.9 and 33.2 ms)
and packed wins from 2 rows on every weight measured, small ones included (docs/benchmarks.md,
stop 21). Timing the shapes (three rounds, ``time_shape``) costs 1.0 s for the bundled target and
3.9 s for SmolLM2-135M on the Zen 3 EPYC of stops 27-35, once per machine.

The same timings say where a wider call is cheaper than a narrower one: on that EPYC oneDNN's 2-row
kernel is its slowest (SmolLM2's head: 9.0 ms for 2 rows packed, 5.8 ms for 4; its whole forward
68.6 ms over 2 tokens, 53.9 over 3), so a packed call of a trial width is padded with zero rows to
the wider trial width that takes at most ``MARGIN`` of its time (``padded_widths``), and the
padding's outputs dropped (a row's result may differ in the last bits between kernels of different
widths, as between sgemm's; see Rounding below).

``packed_steps(model, rows)`` runs, for one forward over ``rows`` tokens (batch x block), every
``nn.Linear`` of ``model`` whose weight shape was measured faster packed at that many rows on its
packed weight (each call checks its own rows: an LM head that keeps fewer positions than the block
goes by its own). A target's one-row calls (plain steps) are never packed, whatever the measurement:
specdec's plain steps stay ``generate``'s own. A drafter's are, where measured faster
(``one_row_faster``; ``packed_steps(..., one_row=True)``): on that EPYC a one-row call of SmolLM2's
head takes 0.72x the time packed, of its 1536 x 576 MLP weight 0.76x. The layers are switched for
that forward only (an instance ``forward`` set and removed around it), so the model is unchanged
outside specdec's steps: its ``generate``, the prefill and every plain step run as before. Two first
reads run packed all the same (core/models.py): an encoder-decoder target's that verifies drafts
(Whisper's 4 prompt tokens and the drafts after them), and a decoder-only drafter's of a short
prompt (a shared-encoder draft's); the cross-attention keys and values computed there stay on
torch's path, so a target's are ``generate``'s own, and so are those a shared-encoder draft lends
it. A model's layers are packed as a request begins (``pack``), kept while the weights live, and
packed again at their next packed call if they were changed in place. Each packed weight costs its
size in memory once more (an encoder-decoder model's encoder, which no step runs, is left out, and
so are its decoder's cross-attention keys and values, which a step reads from the cache):
SmolLM2-135M +412 MiB (+80%); whisper-base's decoder layers +84 MiB, its head +101 MiB more where a
verify reads it in float32 (a batched request; at batch 1 its bfloat16 screen, 51 MiB, serves
instead: core/screened_head.py). A model whose packed copy would take more than half of the memory
left is not packed, with a ``PackingWarning``: its steps take the copy-free routes (below). Only
torch builds whose linear layers run on MKL (x86) pack: the step measured above is MKL's.

Without copies (``packed_weights = false``, ``packed_steps(..., copies=False)``): a layer's
multi-row calls take, where measured faster, one of two routes that read the weight as it lies
(``COPY_FREE_ROUTES``, timed once per machine beside the packed times: ``time_shape_copy_free``):
"transposed", sgemm with the weight as the left operand (``(weight @ x.T).T``), which MKL streams
where ``F.linear`` repacks it at every call of a few rows; and "oneDNN", oneDNN's matmul on the
weight in its own layout. One-row calls stay torch's. On the Zen 5 EPYC of stops 59-65 (cold, one
thread, ms for torch's path, packed, transposed and oneDNN) whisper-base's 2048 x 512 ``fc1`` at 4
rows takes 0.34, 0.14, 0.18 and 0.22, its 512 x 2048 ``fc2`` 0.30, 0.13, 0.48 and 0.20, a 512 x 512
projection 0.081, 0.040, 0.046 and 0.070: most of what packing gains at the verify widths, and
whisper-base's decoder took the same 1.98x as with its packed copies, 84 MiB fewer
(docs/benchmarks.md, stop 65). The same rounding note as packed's holds (below).

A drafter may also read its weights in bfloat16 (its ``matmul_precision``: "medium" always, "auto"
where a shape's call is measured faster): the weight packed once more in bfloat16, the call's rows
rounded to bfloat16 on the way in and its result returned in float32; norms, attention and softmax
stay in float32, which torch's CPU kernels run faster there (stop 23 cast a whole draft to bfloat16
and it ran slower). A draft step is bound by reading weights that the target's verify has just
pushed out of the caches, so half the bytes is most of the gain: on the Zen 4 EPYC a one-row call of
SmolLM2's head's 8192 x 576 readout takes 0.19 ms in bfloat16 against 0.51 ms packed in float32
(hot; docs/benchmarks.md, stop 51). Only the draft's numbers change, which never reach the output:
greedy verification compares with the target's own tokens, and rejection sampling corrects with the
q the draft was sampled from, whatever its precision. A target's linear layers are never bfloat16
(its LM head in greedy verifies is screened in bfloat16 with its argmax recomputed in float32:
core/screened_head.py).

A drafter may read int8 weights instead (``matmul_precision = "int8"``): each of its linear layers'
weights quantised once to int8 with a scale per output row, its rows quantised per call, through
fbgemm's dynamic linear (torch's dynamically quantised ``Linear`` runs the same kernel). A quarter of
float32's bytes: on a Zen 5 EPYC one-row calls of whisper-base's 8192 x 512 head took 0.13 ms
against 0.51 ms in bfloat16 and 1.11 ms in float32 (cold; docs/benchmarks.md, stop 60). Only where
torch has fbgemm (x86); elsewhere "int8" steps run as "auto"'s.

Rounding: the packed matmul adds its products in another order than sgemm, as sgemm already does
between a 1-row and a 4-row call; the logits differ in the last bits, as a verify's already differ
from ``generate``'s one-token steps. Greedy outputs are checked identical on the real models
(``docs/benchmarks.md``); float64 models, where exactness is proven bit for bit, are never packed.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import math
import os
import platform
import time
import warnings
import weakref
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import PackingWarning
from .model_cache import cache_root

# The widths (rows: tokens x batch) a weight shape is timed at, torch's path against packed; a call
# goes the way of the widest trial at or below its rows (``trial_width``). One row is a drafter's
# step: a target's one-row calls are never packed. 12 is four rows' 3-token verifies.
TRIAL_ROWS = (1, 2, 3, 4, 8, 12, 16)
# Packed must take at most this share of torch's time to count as faster: a win inside the timer's
# noise would cost the weight's size in memory for nothing.
MARGIN = 0.9
# Weights smaller than this (256 KiB in float32) are not timed or packed: the switch costs more than
# such a layer can save.
MIN_WEIGHT = 1 << 16
TIMING_REPEATS = 3
# Rounds over every trial width, each path in turn; a shape's time per path and width is its fastest
# over the rounds, so that a neighbour's burst during one path's calls cannot decide the shape alone.
TIMING_ROUNDS = 3
# A shape is timed on copies of it filling this much memory, more than a CPU's caches hold (see time_shape).
COLD_BYTES = 64 << 20
TIMING_BUDGET = 1e-3  # seconds per shape, width, path and round: enough repeats for a small weight

# The first time a machine meets a model's weight shapes it times them (a few seconds, once): said on
# this logger at INFO, which the command line shows on stderr, so a first run does not seem to hang.
_log = logging.getLogger(__name__)

# weight shape -> {rows: (torch's seconds, packed seconds)} on this machine (time_shape)
_MEASURED: dict[tuple[int, int], dict[int, tuple[float, float]]] = {}
_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> (its _version when packed, packed weight)
_PACKED_BF16: WeakIdKeyDictionary = WeakIdKeyDictionary()  # the same in bfloat16 (a drafter's "medium" steps)
_PACKED_INT8: WeakIdKeyDictionary = WeakIdKeyDictionary()  # the same in int8 for fbgemm (a drafter's "int8" steps)
# weight shape -> {rows: (bfloat16 packed seconds,)} on this machine (time_shape_bfloat16)
_MEASURED_BF16: dict[tuple[int, int], dict[int, tuple[float]]] = {}
# model -> [_Switch of each nn.Linear worth packing]
_LINEARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model -> [nn.Linear that packing could serve] (_candidates)
_CANDIDATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model -> {(matmul_precision, trial width): [(layer, forward)]}: a drafter's steps with bfloat16 weights
_BF16_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model -> [(layer, forward)]: a drafter's steps with int8 weights
_INT8_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# weight shape -> {rows: (transposed seconds, oneDNN-on-the-weight seconds)} on this machine (time_shape_copy_free)
_MEASURED_COPY_FREE: dict[tuple[int, int], dict[int, tuple[float, float]]] = {}
# model -> [(layer, its routes, forward)]: multi-row steps on the weights as loaded (packed_weights = false)
_COPY_FREE_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# models whose packed copies would not fit in the memory left (_switches): their steps go copy-free
_TOO_BIG_TO_PACK: weakref.WeakSet = weakref.WeakSet()


class _Switch(NamedTuple):
    module: torch.nn.Linear
    packed_at: frozenset[int]  # the trial widths (2 or more) at which its calls are packed (faster_at)
    forward: functools.partial | None  # its packed forward for them
    one_row: functools.partial | None  # its packed forward for a drafter's one-row calls (None: torch's is faster)


def available() -> bool:
    """Whether this torch computes linear layers with MKL (the sgemm measured above) and can run them
    on oneDNN-packed weights instead (x86 CPU builds)."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkl.is_available() and torch.backends.mkldnn.is_available()
            and hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight"))


def applies_to(model: torch.nn.Module) -> bool:
    """Whether packing can serve ``model``: float32 weights on the CPU, a torch that ``available``."""
    parameter = next(model.parameters(), None)
    return (parameter is not None and parameter.device.type == "cpu" and parameter.dtype == torch.float32
            and available())


@contextlib.contextmanager
def packed_steps(model: torch.nn.Module, rows: int, one_row: bool = False, matmul_precision: str = "highest",
                 copies: bool = True):
    """Within it, ``model``'s linear layers measured faster packed at ``rows`` rows read packed weights.
    A one-row call is packed only for ``one_row`` (a drafter's step): a target's plain steps stay
    ``generate``'s own. ``matmul_precision`` "medium" or "auto" (a drafter's, ``one_row`` with it):
    layers read bfloat16 weights where ``bfloat16_at`` says so, float32 packed ones elsewhere as above.
    Without ``copies`` (``packed_weights = false``), or for a model whose copies would not fit in
    memory, no copy of a weight is made or read: the layers measured faster on a copy-free route at
    ``rows`` rows take it (``copy_free_routes``), one-row calls stay torch's."""
    if rows < 2 and not (one_row and copies):
        yield
        return
    if not copies or not one_row and model in _TOO_BIG_TO_PACK:
        trial = trial_width(rows)
        with _switched([(module, forward) for module, routes, forward in copy_free_plan(model) if trial in routes]):
            yield
        return
    if one_row and matmul_precision == "int8" and int8_available():
        switched = _int8_plan(model)
    elif one_row and matmul_precision != "highest" and bfloat16_available():
        matmul_precision = "auto" if matmul_precision == "int8" else matmul_precision
        switched = _bfloat16_plan(model, matmul_precision, trial_width(rows))
    elif rows < 2:
        # Built once per model: switching SmolLM2's 211 layers costs 0.4 ms a step, building their
        # forwards anew each step 2.9 ms.
        switched = [(switch.module, switch.one_row) for switch in _switches(model) if switch.one_row is not None]
    else:
        trial = trial_width(rows)
        switched = [(switch.module, switch.forward) for switch in _switches(model) if trial in switch.packed_at]
    with _switched(switched):
        yield


@contextlib.contextmanager
def packed_everywhere(model: torch.nn.Module):
    """Every call of each packed layer at a width measured faster packed, the prefill included, for as
    long as it is entered: ``generate`` run on the weights specdec's steps read, the plain baseline
    that tells the kernel's gain from the speculation's (``specdec bench``, the benchmarks)."""
    with _switched([(switch.module, switch.forward) for switch in _switches(model) if switch.packed_at]):
        yield


@contextlib.contextmanager
def _switched(switched: list[tuple[torch.nn.Linear, functools.partial]]):
    for module, forward in switched:
        module.forward = forward
    try:
        yield
    finally:
        for module, _ in switched:
            module.__dict__.pop("forward", None)


def packs_at(model: torch.nn.Module, rows: int) -> bool:
    """Whether any of ``model``'s layers runs packed in a step of ``rows`` rows (2 or more)."""
    trial = trial_width(rows)
    return any(trial in widths for _, widths in packed_layers(model))


@functools.cache
def trial_width(rows: int) -> int:
    """The trial width whose measurement decides a call of ``rows`` rows: the widest at or below it."""
    return max((width for width in TRIAL_ROWS if width <= rows), default=TRIAL_ROWS[0])


def pack(model: torch.nn.Module, matmul_precision: str = "highest", leave: tuple[torch.nn.Module, ...] = ()) -> None:
    """Pack every layer ``packed_steps`` would switch, now (a no-op for layers already packed), in
    bfloat16 too where ``matmul_precision`` reads it. specdec calls it as a request begins: packing
    takes time (0.85 s for SmolLM2-135M), which would otherwise land in the first multi-token step,
    where the cost-aware policies would take it for what a verify costs. ``leave``'s layers are not
    packed here (a screened LM head at batch 1, whose verifies never read its float32 copy, and whose
    rare full reads then stay on torch's path: CachedModel.begin); a packed call makes the copy."""
    if matmul_precision == "int8" and int8_available():
        for module, _ in _int8_plan(model):
            packed_weight_int8(module.weight)
        return
    if matmul_precision == "highest" or not bfloat16_available():
        for switch in _switches(model):
            if not any(switch.module is module for module in leave):
                packed_weight(switch.module.weight)
        return
    matmul_precision = "auto" if matmul_precision == "int8" else matmul_precision  # no fbgemm here
    switches, candidates = _switches(model), _candidates(model)  # float32's timing first, with its own message
    unknown = _untimed(candidates, _MEASURED_BF16, BF16_KEY) if matmul_precision == "auto" else set()
    if unknown:
        started = time.perf_counter()
        _log.info("timing %d weight shape%s of %s in bfloat16 on this CPU (once per machine, kept in %s)",
                  len(unknown), "" if len(unknown) == 1 else "s", _named(model), measurements_file())
    in_bfloat16 = {id(module): bfloat16_at(module.weight, matmul_precision) for module in candidates}
    if unknown:
        _log.info("timed in %.1f s", time.perf_counter() - started)
    for module in candidates:
        if in_bfloat16[id(module)]:
            packed_weight_bfloat16(module.weight)
    # A float32 packed copy only where some width of a drafter's calls still reads one: a layer that
    # reads bfloat16 at every width it packs at keeps no second copy in memory.
    for switch in switches:
        if _drafter_widths(switch) - in_bfloat16[id(switch.module)]:
            packed_weight(switch.module.weight)


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered for oneDNN's matmul; made once, again if the weight changed."""
    known = _PACKED.get(weight)
    if known is not None and known[0] == weight._version:
        return known[1]
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    _PACKED[weight] = (weight._version, packed)
    return packed


def has_packed_copy(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s float32 packed copy exists (``packed_weight`` made it, for these values)."""
    known = _PACKED.get(weight)
    return known is not None and known[0] == weight._version


def packed_weight_bfloat16(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` in bfloat16, reordered for oneDNN's matmul; made once, again if the weight changed."""
    known = _PACKED_BF16.get(weight)
    if known is not None and known[0] == weight._version:
        return known[1]
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16), None)
    _PACKED_BF16[weight] = (weight._version, packed)
    return packed


def packed_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Linear, frozenset[int]]]:
    """The ``nn.Linear`` layers of ``model`` that its multi-token steps run on packed weights at some
    width, each with the trial widths at which it does (``faster_at``, measured here the first time a
    shape is seen)."""
    return [(switch.module, switch.packed_at) for switch in _switches(model) if switch.packed_at]


def _switches(model: torch.nn.Module) -> list[_Switch]:
    """``model``'s linear layers that run packed at some width, with the forwards they run then."""
    linears = _LINEARS.get(model)
    if linears is None:
        candidates = _candidates(model)
        unknown = _untimed(candidates, _MEASURED, "")
        started = time.perf_counter()
        if unknown:
            _log.info("timing %d weight shape%s of %s on this CPU for packed weights (once per machine, kept in %s)",
                      len(unknown), "" if len(unknown) == 1 else "s", _named(model), measurements_file())
        linears = []
        for module in candidates:
            packed_at, widths = faster_at(module.weight), padded_widths(module.weight)
            one_row = one_row_faster(measured(module.weight))
            if packed_at or one_row:
                linears.append(_Switch(module, packed_at,
                                       functools.partial(_packed_forward, module, packed_at, widths) if packed_at else None,
                                       functools.partial(_packed_forward, module, packed_at | ONE_ROW, widths) if one_row else None))
        if unknown:
            _log.info("timed in %.1f s", time.perf_counter() - started)
        need = sum(switch.module.weight.numel() * switch.module.weight.element_size() for switch in linears)
        free = free_memory()
        if free is not None and need > free // 2:
            warnings.warn(
                f"specdec: {type(model).__name__}'s multi-token steps read its weights as loaded (the copy-free "
                f"routes of packed_weights = false): its packed weights ({need / 2**30:.2f} GiB) would take more "
                f"than half of the {free / 2**30:.2f} GiB of memory left (packed_weights = false silences this)",
                PackingWarning, stacklevel=2)
            linears = []
            _TOO_BIG_TO_PACK.add(model)
        _LINEARS[model] = linears
    return linears


def _untimed(candidates: list[torch.nn.Linear], known: dict, suffix: str) -> set[tuple[int, ...]]:
    """The weight shapes of ``candidates`` neither in ``known`` nor recorded for this machine (their
    key plus ``suffix``): the ones ``_kept`` will time."""
    shapes = {tuple(module.weight.shape) for module in candidates} - known.keys()
    recorded = _recorded() if shapes else {}
    return {shape for shape in shapes if _machine_key(shape) + suffix not in recorded}


# How transformers names a decoder's cross-attention (Whisper, BART, Marian, M2M100, ...; T5;
# BERT-style decoders; T5Gemma and Mllama; SeamlessM4T, NLLB-MoE and Dia; Pix2Struct) and the
# projections in it that read the encoder's output.
CROSS_ATTENTION = frozenset({"encoder_attn", "EncDecAttention", "crossattention", "cross_attn", "cross_attention",
                             "encoder_decoder_attention"})
ENCODER_READS = frozenset({"k_proj", "v_proj", "k", "v", "key", "value"})


def _cross_attention_inputs(model: torch.nn.Module) -> set[int]:
    """The ids of ``model``'s cross-attention key and value projections. They read the encoder's
    output once a request, in a model's first read, and a step's cross-attention reads the cache, so
    no packed, bfloat16 or int8 copy of them would ever be read (12 MiB of float32 on whisper-base).
    They stay on torch's path in a first read that runs packed too (``CausalLMRunner`` and
    ``Seq2SeqRunner``): the target's keys are ``generate``'s own, and so are those a
    shared-encoder draft computes for the layers it shares with the target and lends it."""
    return {id(module) for name, module in model.named_modules()
            if name.rpartition(".")[2] in ENCODER_READS and CROSS_ATTENTION.intersection(name.split(".")[:-1])}


def _named(model: torch.nn.Module) -> str:
    """``model``'s class and, a target and its draft being often the same class, its folder."""
    folder = getattr(getattr(model, "config", None), "name_or_path", "") or ""
    return type(model).__name__ + (f" ({'/'.join(Path(folder).parts[-2:])})" if folder else "")


def _candidates(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """``model``'s layers that packing could serve, found once per model: exactly ``nn.Linear`` with
    no forward of its own set by someone else (accelerate's offload hooks replace it; a subclass or a
    wrapped layer may compute something else), float32 on the CPU, ``MIN_WEIGHT`` or larger, outside
    an encoder-decoder model's encoder (which no step runs) and its decoder's cross-attention keys and
    values (``_cross_attention_inputs``)."""
    candidates = _CANDIDATES.get(model)
    if candidates is None:
        encoder = model.get_encoder() if getattr(getattr(model, "config", None), "is_encoder_decoder", False) else None
        skipped = {id(module) for module in encoder.modules()} if encoder is not None else set()
        skipped |= _cross_attention_inputs(model)
        candidates = [module for module in model.modules()
                      if type(module) is torch.nn.Linear and id(module) not in skipped and "forward" not in module.__dict__
                      and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu"
                      and module.weight.numel() >= MIN_WEIGHT]
        _CANDIDATES[model] = candidates
    return candidates


def _bfloat16_plan(model: torch.nn.Module, matmul_precision: str, trial: int) -> list[tuple[torch.nn.Linear, functools.partial]]:
    """The layers a drafter's step of ``trial`` rows switches under ``matmul_precision``, each with a
    forward that reads bfloat16 weights at the widths ``bfloat16_at`` gives it and float32 packed ones
    where packing wins at the others (a drafter's: one row included); built once per model and width."""
    plans = _BF16_PLANS.get(model)
    if plans is None:
        plans = _BF16_PLANS[model] = {}
    plan = plans.get((matmul_precision, trial))
    if plan is None:
        switches = {id(switch.module): switch for switch in _switches(model)}
        plan = []
        for module in _candidates(model):
            switch = switches.get(id(module))
            packed_at = frozenset() if switch is None else _drafter_widths(switch)
            in_bfloat16 = bfloat16_at(module.weight, matmul_precision)
            if trial in in_bfloat16 or trial in packed_at:
                plan.append((module, functools.partial(_mixed_forward, module, in_bfloat16, packed_at,
                                                       padded_widths(module.weight))))
        plans[(matmul_precision, trial)] = plan
    return plan


def _drafter_widths(switch: _Switch) -> frozenset[int]:
    """The trial widths at which a drafter's calls of ``switch``'s layer run packed in float32: its
    multi-row ones, and one row where that is faster packed."""
    return switch.packed_at | (ONE_ROW if switch.one_row else frozenset())


@functools.cache
def int8_available() -> bool:
    """Whether this torch runs fbgemm's dynamic int8 linear layer (x86 CPU builds). Asked at every
    drafter step: the build does not change in a process."""
    # torch marks its quantised tensors deprecated: a torch without them runs "int8" as "auto"
    return ("fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch, "quantize_per_channel")
            and hasattr(torch.ops.quantized, "linear_dynamic") and hasattr(torch.ops.quantized, "linear_prepack"))


def packed_weight_int8(weight: torch.Tensor):
    """``weight`` [out, in] in int8 with a scale per output row (symmetric: the row's largest
    magnitude is 127.5 steps), packed for fbgemm's dynamic linear; made once, again if the weight
    changed. A drafter's "int8" steps read it with their rows quantised per call (``_int8_forward``)."""
    known = _PACKED_INT8.get(weight)
    if known is not None and known[0] == weight._version:
        return known[1]
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.5).clamp(min=1e-12).double()
    with warnings.catch_warnings():  # torch marks its quantised tensors deprecated; fbgemm's kernels need them
        warnings.simplefilter("ignore")
        quantised = torch.quantize_per_channel(w, scales, torch.zeros_like(scales, dtype=torch.long), 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(quantised, None)
    _PACKED_INT8[weight] = (weight._version, packed)
    return packed


def _int8_plan(model: torch.nn.Module) -> list[tuple[torch.nn.Linear, functools.partial]]:
    """Every layer packing could serve (``_candidates``), each with ``_int8_forward``: a drafter's
    steps under matmul_precision "int8" read int8 weights at every width; built once per model."""
    plan = _INT8_PLANS.get(model)
    if plan is None:
        plan = _INT8_PLANS[model] = [(module, functools.partial(_int8_forward, module)) for module in _candidates(model)]
    return plan


@functools.cache
def bfloat16_available() -> bool:
    """Whether this torch runs oneDNN's matmul on bfloat16 weights here (x86 CPUs with AVX-512; fast
    where the CPU has AVX-512 BF16 or AMX, which "auto" finds out by timing). Asked at every drafter
    step: the build and the CPU do not change in a process."""
    return available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def bfloat16_at(weight: torch.Tensor, matmul_precision: str) -> frozenset[int]:
    """The trial widths at which a drafter's call of ``weight``'s shape reads bfloat16 weights: every
    one for "medium", none for "highest", and for "auto" those at which this machine runs it in at
    most ``MARGIN`` of the faster float32 path's time (``bfloat16_wins``)."""
    if matmul_precision == "medium":
        return frozenset(TRIAL_ROWS)
    if matmul_precision == "auto":
        return bfloat16_wins(measured(weight), measured_bfloat16(weight))
    return frozenset()


def bfloat16_wins(times: dict[int, tuple[float, float]], bfloat16: dict[int, tuple[float]]) -> frozenset[int]:
    """From float32's ``{rows: (torch's seconds, packed seconds)}`` and bfloat16's ``{rows:
    (seconds,)}``: the trial widths at which bfloat16 takes at most ``MARGIN`` of float32's faster
    path (packed padded where that is how packed runs)."""
    widths = pad_widths(times)
    return frozenset(rows for rows in TRIAL_ROWS
                     if bfloat16[rows][0] <= MARGIN * min(times[rows][0], times[widths.get(rows, rows)][1]))


def measured_bfloat16(weight: torch.Tensor) -> dict[int, tuple[float]]:
    """``time_shape_bfloat16`` of ``weight``'s shape on this machine, timed once and kept as
    ``measured`` keeps float32's."""
    return _kept(_MEASURED_BF16, BF16_KEY, weight, lambda: time_shape_bfloat16(weight))


BF16_KEY = "|bfloat16"  # the suffix of a bfloat16 timing's key in measurements_file(): one time per width
COPY_FREE_KEY = "|copy-free"  # the suffix of a copy-free timing's key: a time per route and width


def faster_at(weight: torch.Tensor) -> frozenset[int]:
    """The trial widths (2 or more) at which a weight of ``weight``'s shape runs faster packed on this
    machine (``widths_faster`` of its ``measured`` times)."""
    return widths_faster(measured(weight))


def padded_widths(weight: torch.Tensor) -> dict[int, int]:
    """``{rows: wider rows}``: the packed calls of ``weight``'s shape that run faster padded to a wider
    width on this machine (``pad_widths`` of its ``measured`` times)."""
    return pad_widths(measured(weight))


def measured(weight: torch.Tensor) -> dict[int, tuple[float, float]]:
    """``time_shape`` of ``weight``'s shape on this machine, timed the first time the shape is asked
    for and kept for the process, and in ``measurements_file()`` for the next ones on this machine
    (the bundled target's five shapes take 1.0 s to time on the Zen 3 EPYC)."""
    return _kept(_MEASURED, "", weight, lambda: time_shape(weight))


def _kept(known: dict, suffix: str, weight: torch.Tensor, timed) -> dict:
    """``known[shape]`` of ``weight``'s shape: from ``measurements_file()`` (its key plus ``suffix``)
    where this machine recorded it, else ``timed()`` and recorded there."""
    shape = tuple(weight.shape)
    if shape not in known:
        key = _machine_key(shape) + suffix
        recorded = _recorded()
        if key in recorded:
            known[shape] = recorded[key]
        else:
            known[shape] = timed()
            _record(key, known[shape])
    return known[shape]


def measurements_file() -> Path:
    """Where the measured rows are kept between processes: ``packing.json`` beside the model cache
    (``$SPECDEC_CACHE``, else ``~/.cache/specdec``). Delete it to measure again."""
    return cache_root().parent / "packing.json"


def _machine_key(shape: tuple[int, ...]) -> str:
    """A measurement holds for this CPU, this torch and this many threads, timed this way (entries of
    a single round, written before stop 35, are timed again)."""
    return (f"{cpu_name()}|torch {torch.__version__}|{torch.get_num_threads()} threads|{shape[0]}x{shape[1]}"
            f"|{TIMING_ROUNDS} rounds")


@functools.cache
def cpu_name() -> str:
    """This CPU's model name (``/proc/cpuinfo``), which keys the measurements and names benchmark
    tables, with its family and model numbers: a virtual machine's name can be as generic as "AMD
    EPYC" for a Zen 3 (family 25, model 1) and a Zen 4 (model 17), whose small matmuls differ."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return _cpu_name(cpuinfo.read())
    except OSError:  # not Linux: the platform's own name
        return _cpu_name("")


def _cpu_name(cpuinfo: str) -> str:
    fields = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break  # the first processor's block is enough
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    family, model = fields.get("cpu family"), fields.get("model")
    return f"{name} (family {family}, model {model})" if family and model else name


def _recorded() -> dict[str, dict[int, tuple[float, ...]]]:
    """What ``measurements_file()`` holds; an entry that is not a time pair for each trial width (one
    time for a bfloat16 entry: a file edited by hand, damaged, or written for other trial widths) is
    left out, so that shape is timed again."""
    try:
        data = json.loads(measurements_file().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    recorded = {}
    for key, entry in data.items():
        if not isinstance(entry, dict) or sorted(entry) != sorted(str(rows) for rows in TRIAL_ROWS):
            continue
        pairs, size = list(entry.values()), 1 if key.endswith(BF16_KEY) else 2
        if all(isinstance(pair, list) and len(pair) == size and all(isinstance(t, (int, float)) and 0 < t < math.inf
                                                                  for t in pair) for pair in pairs):
            recorded[key] = {int(rows): tuple(pair) for rows, pair in entry.items()}
    return recorded


def _record(key: str, times: dict[int, tuple[float, ...]]) -> None:
    """Add one shape's times to the file; where the cache cannot be written, the process keeps them alone."""
    path = measurements_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {known: {str(rows): list(pair) for rows, pair in entry.items()} for known, entry in _recorded().items()}
        data[key] = {str(rows): list(pair) for rows, pair in times.items()}
        scratch = path.with_name(f".{path.name}.{os.getpid()}")
        scratch.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(scratch, path)
    except OSError:
        pass


def widths_faster(times: dict[int, tuple[float, float]]) -> frozenset[int]:
    """From ``{rows: (torch's seconds, packed seconds)}``: the trial widths of 2 or more rows at which
    packed is faster (``_wins``)."""
    widths = pad_widths(times)
    return frozenset(rows for rows in times if rows >= 2 and _wins(times, widths, rows))


def one_row_faster(times: dict[int, tuple[float, float]]) -> bool:
    """Whether a one-row call (a drafter's step) is faster packed (``_wins``)."""
    return _wins(times, pad_widths(times), 1)


def _wins(times: dict[int, tuple[float, float]], widths: dict[int, int], rows: int) -> bool:
    """Whether a call of ``rows`` rows packed (padded where ``widths`` says so) takes at most ``MARGIN``
    of torch's time."""
    return times[widths.get(rows, rows)][1] <= MARGIN * times[rows][0]


def pad_widths(times: dict[int, tuple[float, float]]) -> dict[int, int]:
    """From ``{rows: (torch's seconds, packed seconds)}``: each trial width whose packed call is
    faster padded to a wider trial width, mapped to the fastest such width, where that takes at most
    ``MARGIN`` of its own time. Only a width where packed wins at its own rows is padded to: where
    torch's path is as fast there, the gain is the width's, not packing's, and it did not hold in a
    forward (on the Xeon a cold 576 x 576 weight timed 0.10 ms for 2 rows and 0.08 for 4 on either
    path; packed and padded to 4, SmolLM2's 2-token forward ran 1.25 plain steps instead of 1.11)."""
    widths = {}
    winning = [width for width, (plain, packed) in times.items() if packed <= MARGIN * plain]
    for rows in sorted(times):
        _, own = times[rows]
        wider = min((width for width in winning if width > rows), key=lambda width: times[width][1], default=None)
        if wider is not None and times[wider][1] <= MARGIN * own:
            widths[rows] = wider
    return widths


@torch.no_grad()
def time_shape(weight: torch.Tensor) -> dict[int, tuple[float, float]]:
    """``{rows: (torch's seconds, packed seconds)}`` for a linear layer of ``weight``'s shape at
    ``TRIAL_ROWS``, the fastest of a few calls each (the least disturbed by a neighbour), over
    ``TIMING_ROUNDS`` rounds of every width and both paths. One round alone was not enough on a
    noisy host: a 576 x 576 weight recorded 3 rows at 302 us packed against 170 us on torch's path,
    and so SmolLM2's query and output projections ran unpacked in its 3-token verifies, where four
    rounds of the same timing a day later all put packed at 0.56-0.73 of torch's time
    (docs/benchmarks.md, stop 35).

    Timed as a model runs it: the weight read from memory, not from a cache that the previous call
    left it in. A forward reads dozens of weights in turn, so a small one is never hot when its layer
    comes: a 512 x 512 weight's one-row matmul takes 24 us called again and again, 113-140 us cold,
    as in the bundled target's forward (its matmuls averaged 139 us there). Timed hot, the small
    shapes' few-microsecond calls made the choice between 2, 3 and 16 rows flip from run to run. Each
    call takes the next of as many copies of the shape as fill ``COLD_BYTES``; the copies are dropped
    afterwards, so a shape that loses costs no memory."""
    plain = _cold_copies(weight)
    count = len(plain)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in plain]
    return _in_rounds(weight, count, [lambda x, copy: F.linear(x, plain[copy]),
                                      lambda x, copy: torch.ops.mkldnn._linear_pointwise(x, packed[copy], None, "none", [], "")])


def _in_rounds(weight: torch.Tensor, count: int, paths) -> dict[int, tuple[float, ...]]:
    """``{rows: (seconds of each path,)}``: each ``path(x, copy)`` at every trial width, the paths in
    turn within a width, over ``TIMING_ROUNDS`` rounds, each its fastest (``_fastest``); every call
    takes the next of ``count`` copies of the weight, so that none is read from a cache."""
    generator = torch.Generator().manual_seed(0)
    inputs = {rows: torch.randn(rows, weight.shape[1], generator=generator, dtype=weight.dtype) for rows in TRIAL_ROWS}
    turn = itertools.count()
    times = {rows: [math.inf] * len(paths) for rows in TRIAL_ROWS}
    for _ in range(TIMING_ROUNDS):
        for rows, x in inputs.items():
            for which, path in enumerate(paths):
                times[rows][which] = min(times[rows][which], _fastest(lambda: path(x, next(turn) % count)))
    return {rows: tuple(seconds) for rows, seconds in times.items()}


@torch.no_grad()
def time_shape_copy_free(weight: torch.Tensor) -> dict[int, tuple[float, float]]:
    """``{rows: (transposed seconds, oneDNN seconds)}``: a linear layer of ``weight``'s shape at
    ``TRIAL_ROWS`` on each copy-free route (``COPY_FREE_ROUTES``), timed cold and in rounds as
    ``time_shape`` times torch's path and packed."""
    plain = _cold_copies(weight)
    return _in_rounds(weight, len(plain), [lambda x, copy: _transposed(x, plain[copy]),
                                           lambda x, copy: _onednn(x, plain[copy])])


def _cold_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """As many tensors of ``weight``'s shape as fill ``COLD_BYTES`` (``weight`` itself where it alone
    does), for timings that read a weight from memory as a forward does (``time_shape``)."""
    count = -(-COLD_BYTES // (weight.numel() * weight.element_size()))
    return [weight.detach()] if count == 1 else [torch.full(tuple(weight.shape), 0.01, dtype=weight.dtype)
                                                 for _ in range(count)]


@torch.no_grad()
def time_shape_bfloat16(weight: torch.Tensor) -> dict[int, tuple[float]]:
    """``{rows: (seconds,)}`` of a drafter's call of ``weight``'s shape on a packed bfloat16 weight at
    ``TRIAL_ROWS``, float32 rows in and out as ``_mixed_forward`` takes and returns them, timed cold
    and in rounds as ``time_shape`` times float32."""
    count = -(-COLD_BYTES // (weight.numel() * 2))
    packed = [torch.ops.mkldnn._reorder_linear_weight(torch.full(tuple(weight.shape), 0.01, dtype=torch.bfloat16), None)
              for _ in range(count)]
    return _in_rounds(weight, count, [lambda x, copy: torch.ops.mkldnn._linear_pointwise(
        x.to(torch.bfloat16), packed[copy], None, "none", [], "").float()])


def _fastest(call) -> float:
    """The fastest of a few calls: at least ``TIMING_REPEATS``, more for a quick call (up to 50, about
    ``TIMING_BUDGET`` seconds in all), whose time a single interruption distorts the most."""
    call()  # warm: first-call allocations
    best = math.inf
    repeats = TIMING_REPEATS
    done = 0
    while done < repeats:
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
        done += 1
        if done == 1:
            repeats = max(TIMING_REPEATS, min(50, int(TIMING_BUDGET / max(best, 1e-9))))
    return best


def free_memory() -> int | None:
    """Bytes of physical memory available now (None where the system does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


ONE_ROW = frozenset({1})  # added to a layer's widths in a drafter's one-row steps (packed_steps(one_row=True))


TRANSPOSED, ONEDNN = "transposed", "oneDNN"  # the copy-free routes (COPY_FREE_ROUTES), in time_shape_copy_free's order
COPY_FREE_ROUTES = (TRANSPOSED, ONEDNN)


def copy_free_plan(model: torch.nn.Module) -> list[tuple[torch.nn.Linear, dict[int, str], functools.partial]]:
    """``model``'s layers that some width of a multi-row step runs on a copy-free route, each with
    its routes (``copy_free_routes``) and its forward for them; built once per model."""
    plan = _COPY_FREE_PLANS.get(model)
    if plan is None:
        candidates = [module for module in _candidates(model) if module.weight.is_contiguous()]
        unknown = _untimed(candidates, _MEASURED, "") | _untimed(candidates, _MEASURED_COPY_FREE, COPY_FREE_KEY)
        if unknown:
            started = time.perf_counter()
            _log.info("timing %d weight shape%s of %s on this CPU for copy-free steps (once per machine, kept in %s)",
                      len(unknown), "" if len(unknown) == 1 else "s", _named(model), measurements_file())
        routes = {id(module): copy_free_routes(module.weight) for module in candidates}
        if unknown:
            _log.info("timed in %.1f s", time.perf_counter() - started)
        plan = _COPY_FREE_PLANS[model] = [
            (module, routes[id(module)], functools.partial(_copy_free_forward, module, routes[id(module)]))
            for module in candidates if routes[id(module)]]
    return plan


def copy_free_routes(weight: torch.Tensor) -> dict[int, str]:
    """``{trial width: route}``: where a multi-row call of ``weight``'s shape runs faster on a route
    that reads the weight as loaded (``copy_free_wins`` of its ``measured`` and
    ``measured_copy_free`` times on this machine)."""
    return copy_free_wins(measured(weight), measured_copy_free(weight))


def copy_free_wins(torch_times: dict[int, tuple[float, ...]],
                   copy_free: dict[int, tuple[float, float]]) -> dict[int, str]:
    """From ``{rows: (torch's seconds, ...)}`` and ``{rows: (transposed seconds, oneDNN seconds)}``:
    each trial width of 2 or more rows whose faster copy-free route takes at most ``MARGIN`` of
    torch's time, with that route."""
    routes = {}
    for rows, times in copy_free.items():
        fastest = min(range(len(COPY_FREE_ROUTES)), key=lambda which: times[which])
        if rows >= 2 and times[fastest] <= MARGIN * torch_times[rows][0]:
            routes[rows] = COPY_FREE_ROUTES[fastest]
    return routes


def measured_copy_free(weight: torch.Tensor) -> dict[int, tuple[float, float]]:
    """``time_shape_copy_free`` of ``weight``'s shape on this machine, kept as ``measured`` keeps its times."""
    return _kept(_MEASURED_COPY_FREE, COPY_FREE_KEY, weight, lambda: time_shape_copy_free(weight))


def _transposed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # sgemm with the weight as the left operand: MKL then streams it as it lies, where F.linear's
    # x @ weight.T repacks all of it at every call of more than a few rows (see the module docstring).
    return (weight @ x.t()).t().contiguous()


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _copy_free_forward(module: torch.nn.Linear, routes: dict[int, str], x: torch.Tensor) -> torch.Tensor:
    parameters = module._parameters
    weight, bias = parameters["weight"], parameters["bias"]
    features = x.shape[-1]
    rows = x.numel() // features
    route = routes.get(trial_width(rows)) if rows else None
    if route is None or x.dtype != torch.float32 or x.dim() < 2 or torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, features)
    if route == TRANSPOSED:
        out = _transposed(flat, weight)
        if bias is not None:
            out += bias
    else:
        out = _onednn(flat, weight, bias)
    return out.view(*x.shape[:-1], out.shape[-1])


def too_big_to_pack(model: torch.nn.Module) -> bool:
    """Whether ``model``'s packed copies were found not to fit in the memory left (a ``PackingWarning``
    said so): its multi-token steps take the copy-free routes."""
    return model in _TOO_BIG_TO_PACK


def is_copy_free(forward) -> bool:
    """Whether ``forward`` (a layer's switched forward) is a copy-free one: it never makes a copy."""
    return isinstance(forward, functools.partial) and forward.func is _copy_free_forward


def _packed_forward(module: torch.nn.Linear, packed_at: frozenset[int], widths: dict[int, int],
                    x: torch.Tensor) -> torch.Tensor:
    # Runs for every layer of every packed step (211 calls a SmolLM2 forward): the parameters are
    # read from _parameters, not through nn.Module.__getattr__, and a view where one serves.
    parameters = module._parameters
    weight, bias = parameters["weight"], parameters["bias"]
    features = x.shape[-1]
    rows = x.numel() // features
    if (x.dtype != torch.float32 or x.dim() < 2 or rows == 0 or trial_width(rows) not in packed_at
            or torch.is_grad_enabled()):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, features)
    wide = widths.get(rows)
    if wide is not None:
        flat = F.pad(flat, (0, 0, 0, wide - rows))
    out = torch.ops.mkldnn._linear_pointwise(flat, packed_weight(weight), bias, "none", [], "")
    if wide is not None:
        out = out[:rows]
    return out.view(*x.shape[:-1], out.shape[-1])


def _mixed_forward(module: torch.nn.Linear, in_bfloat16: frozenset[int], packed_at: frozenset[int],
                   widths: dict[int, int], x: torch.Tensor) -> torch.Tensor:
    # A drafter's layer under matmul_precision "medium" or "auto": its own rows decide (an LM head
    # that keeps fewer positions than the block goes by its own), as in _packed_forward.
    features = x.shape[-1]
    rows = x.numel() // features
    if (x.dtype != torch.float32 or x.dim() < 2 or rows == 0 or trial_width(rows) not in in_bfloat16
            or torch.is_grad_enabled()):
        return _packed_forward(module, packed_at, widths, x)
    weight, bias = module._parameters["weight"], module._parameters["bias"]
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, features).to(torch.bfloat16), packed_weight_bfloat16(weight),
                                             None, "none", [], "").float()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], out.shape[-1])


def _int8_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # A drafter's layer under matmul_precision "int8"; float32 where it trains or reads other dtypes.
    weight, bias = module._parameters["weight"], module._parameters["bias"]
    if x.dtype != torch.float32 or x.dim() < 2 or x.numel() == 0 or torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    return _int8_linear(x, packed_weight_int8(weight), bias)


def _int8_linear(x: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
    # fbgemm quantises the rows per call (7 bits, ``reduce_range``, as torch's dynamically quantised
    # Linear does on x86) against the weight's int8 rows, and returns float32.
    features = x.shape[-1]
    out = torch.ops.quantized.linear_dynamic(x.reshape(-1, features), packed, True)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], out.shape[-1])


class Int8Linear(torch.nn.Module):
    """An ``nn.Linear`` kept only as its int8 weight (``packed_weight_int8``) and its float32 bias: a
    drafter's layer under matmul_precision "int8" once its float32 weight is let go
    (``keep_int8_only``). It computes what ``_int8_forward`` computes, at every width."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = packed_weight_int8(linear.weight)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:  # the draft cast to another dtype: its rows read in float32
            return _int8_linear(x.float(), self.packed, self.bias).to(x.dtype)
        return _int8_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def keep_int8_only(model: torch.nn.Module) -> None:
    """Replace every layer of ``model`` that its "int8" steps would read in int8 (``_int8_plan``) by an
    ``Int8Linear``, so that its float32 weight can be freed. Only for a drafter's model that nothing
    else holds (one specdec loaded itself): its steps then read int8 at every width, its first read of a
    long prompt included, and no float32 copy remains for anything else to use. The cross-attention keys
    and values stay float32 (``_candidates``)."""
    if not int8_available():
        return
    parents = {id(child): (parent, name) for parent in model.modules() for name, child in parent.named_children()}
    with torch.no_grad():
        for module in _candidates(model):
            parent, name = parents[id(module)]
            setattr(parent, name, Int8Linear(module))
    for plans in (_CANDIDATES, _LINEARS, _BF16_PLANS, _INT8_PLANS, _COPY_FREE_PLANS):
        plans.pop(model, None)  # they hold the float32 layers
