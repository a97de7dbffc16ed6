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

``packed_steps(model, rows)`` runs, for one forward over ``rows`` tokens (batch x block), every
``nn.Linear`` of ``model`` whose weight has at least ``MIN_WEIGHT`` elements on its packed weight,
when ``rows >= MIN_ROWS``. Smaller weights stay on torch's path: there oneDNN's fixed cost per
call is more than sgemm's repacking saves (a 576 x 576 weight: 1.3-1.4x slower at 4-8 rows). The
layers are switched for that forward only (an instance ``forward`` set and removed around it), so
the model is unchanged outside specdec's steps: its ``generate``, the prefill and every plain
step run as before. A model's layers are packed as a request begins (``pack``), kept while the
weights live, and packed again at their next packed call if they were changed in place. Each
packed weight costs its size in memory once more (an encoder-decoder model's encoder, which no step
runs, is left out): SmolLM2-135M +412 MiB (+80%), whisper-base's decoder +149 MiB (+54% of the
model). A model whose packed copy would take more than half of the memory left is not packed, with
a ``PackingWarning``. Only torch builds whose linear layers run on MKL (x86) pack: the step
measured above is MKL's.

Rounding: the packed matmul adds its products in another order than sgemm, as sgemm already does
between a 1-row and a 4-row call; the logits differ in the last bits, as a verify's already differ
from ``generate``'s one-token steps. Greedy outputs are checked identical on the real models
(``docs/benchmarks.md``); float64 models, where exactness is proven bit for bit, are never packed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import PackingWarning

# From this many rows (tokens x batch) MKL's sgemm repacks the weight at every call (measured above);
# below it torch's own path is as fast as the packed one or faster.
MIN_ROWS = 4
# Weights smaller than this (3 MiB in float32) stay on torch's path: a 1024 x 512 weight gains 1-11% at
# 4-8 rows for its 2 MiB copy, a 576 x 576 one loses (benchmarks/packed_linear.py).
MIN_WEIGHT = 3 << 18

_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> (its _version when packed, packed weight)
_LINEARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the nn.Linear modules worth packing


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
def packed_steps(model: torch.nn.Module, rows: int):
    """Within it, ``model``'s large linear layers read packed weights (a no-op below ``MIN_ROWS``)."""
    if rows < MIN_ROWS:
        yield
        return
    linears = packed_layers(model)
    for module in linears:
        module.forward = functools.partial(_packed_forward, module)
    try:
        yield
    finally:
        for module in linears:
            module.__dict__.pop("forward", None)


def packed_everywhere(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Every call of ``MIN_ROWS`` rows or more on packed weights, the prefill included, for as long as
    it is entered: ``generate`` run on the weights specdec's steps read, the plain baseline that
    tells the kernel's gain from the speculation's (``specdec bench``, the benchmarks)."""
    return packed_steps(model, MIN_ROWS)


def pack(model: torch.nn.Module) -> None:
    """Pack every layer ``packed_steps`` would switch, now (a no-op for layers already packed).
    specdec calls it as a request begins: packing takes time (850 ms for SmolLM2-135M's 91 layers
    here), which would otherwise land in the first multi-token step, where the cost-aware policies
    would take it for what a verify costs."""
    for module in packed_layers(model):
        packed_weight(module.weight)


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] reordered for oneDNN's matmul; made once, again if the weight changed."""
    known = _PACKED.get(weight)
    if known is not None and known[0] == weight._version:
        return known[1]
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    _PACKED[weight] = (weight._version, packed)
    return packed


def packed_layers(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The ``nn.Linear`` layers of ``model`` that its multi-token steps run on packed weights."""
    linears = _LINEARS.get(model)
    if linears is None:
        # Exactly nn.Linear with no forward of its own set by someone else (accelerate's offload hooks
        # replace it): a subclass or a wrapped layer may compute something else.
        encoder = model.get_encoder() if getattr(getattr(model, "config", None), "is_encoder_decoder", False) else None
        skipped = {id(module) for module in encoder.modules()} if encoder is not None else set()
        linears = [module for module in model.modules()
                   if type(module) is torch.nn.Linear and id(module) not in skipped and "forward" not in module.__dict__
                   and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu"
                   and module.weight.numel() >= MIN_WEIGHT]
        need = sum(module.weight.numel() * module.weight.element_size() for module in linears)
        free = free_memory()
        if free is not None and need > free // 2:
            warnings.warn(
                f"specdec: {type(model).__name__}'s multi-token steps stay on torch's linear path: its packed weights "
                f"({need / 2**30:.2f} GiB) would take more than half of the {free / 2**30:.2f} GiB of memory left "
                "(packed_weights = false silences this)", PackingWarning, stacklevel=2)
            linears = []
        _LINEARS[model] = linears
    return linears


def free_memory() -> int | None:
    """Bytes of physical memory available now (None where the system does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _packed_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() < 2 or x.numel() < MIN_ROWS * x.shape[-1] or torch.is_grad_enabled():
        return F.linear(x, module.weight, module.bias)
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed_weight(module.weight), module.bias,
                                             "none", [], "")
    return out.reshape(*x.shape[:-1], module.weight.shape[0])
