"""What the decoding loop does on the host besides the models' forwards, counted, not timed: the
tensor ops it dispatches (``iteration_ops``) and, on a CUDA device, the syncs it makes outside the
commit (``syncs_outside_commit``).

Tensor ops:

On a CPU each op costs 5-10 us of dispatch and Python, and on an accelerator each is a launch, so
on a small model they decide how close the loop comes to the models' own time (docs/design.md,
"Tensor ops on the host side count too"). A count is the same on every run, unlike a timing on a
shared machine: ``tests/test_hot_path.py`` holds budgets on it and ``benchmarks/profile_loop.py
--ops`` lists the call sites.
"""

from __future__ import annotations

import collections
import contextlib
import traceback
from pathlib import Path

import attrs


@attrs.define
class OpCount:
    """Ops counted so far: ``total``, and per ``(file:line, op)`` when sites are asked for."""

    total: int = 0
    sites: collections.Counter = attrs.field(factory=collections.Counter)


@contextlib.contextmanager
def iteration_ops(models, sites: bool = False):
    """While the block runs, count the tensor ops of every ``SpeculativeDecoder`` iteration that are
    not inside a forward of one of ``models`` (the request's set-up is not counted either). With
    ``sites``, each op is also attributed to the innermost line of specdec that dispatched it (slow:
    a stack walk per op). Yields an ``OpCount``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from .loop import SpeculativeDecoder

    count, inside = OpCount(), {"iteration": False, "forwards": 0}
    package = str(Path(__file__).resolve().parent.parent)

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if inside["iteration"] and not inside["forwards"]:
                count.total += 1
                if sites:
                    frames = [frame for frame in traceback.extract_stack()
                              if frame.filename.startswith(package) and frame.filename != __file__]
                    where = f"{frames[-1].filename[len(package) + 1:]}:{frames[-1].lineno}" if frames else "?"
                    count.sites[where, str(func)] += 1
            return func(*args, **(kwargs or {}))

    def entering(step):
        return lambda *_: inside.__setitem__("forwards", inside["forwards"] + step)

    iterate = SpeculativeDecoder._iterate

    def counted(self, state):
        inside["iteration"] = True
        try:
            iterate(self, state)
        finally:
            inside["iteration"] = False

    unique = {id(model): model for model in models}.values()
    hooks = [model.register_forward_pre_hook(entering(1)) for model in unique]
    hooks += [model.register_forward_hook(entering(-1)) for model in unique]
    SpeculativeDecoder._iterate = counted
    try:
        with Counting():
            yield count
    finally:
        SpeculativeDecoder._iterate = iterate
        for hook in hooks:
            hook.remove()


@contextlib.contextmanager
def syncs_outside_commit(mode: str = "error"):
    """While the block runs, CUDA's sync debug mode is ``mode`` ("error" raises at a sync, "warn"
    warns) everywhere but inside ``DecodeState.commit``, the iteration's one allowed sync. Yields a
    list with one entry per commit. Used by ``tests/test_hot_path.py`` (the first sync fails it) and
    ``benchmarks/sync_sites.py`` (every sync listed); without CUDA it only counts the commits."""
    import torch

    from ..core.state import DecodeState

    def set_mode(value: str) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(value)

    commits, commit = [], DecodeState.commit

    def commit_allowed_to_sync(self, *args, **kwargs):
        commits.append(1)
        set_mode("default")
        try:
            return commit(self, *args, **kwargs)
        finally:
            set_mode(mode)

    DecodeState.commit = commit_allowed_to_sync
    set_mode(mode)
    try:
        yield commits
    finally:
        set_mode("default")
        DecodeState.commit = commit
