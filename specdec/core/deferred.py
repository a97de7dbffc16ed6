"""torch without paying for its import until it is used.

``specdec plugins`` lists every strategy's options by importing the strategy modules; each imports
torch, which alone takes over a second, though listing never touches a tensor. Strategy modules
therefore use torch only inside functions (``no_grad`` below replaces ``@torch.no_grad()``, which
would touch torch when the module is imported), and the listing imports them under
``deferred_torch()``, where ``import torch`` returns a stand-in that imports torch on first use.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import types


def no_grad(function):
    """``@torch.no_grad()`` that imports torch when the function runs, not when it is defined."""

    @functools.wraps(function)
    def without_gradients(*args, **kwargs):
        import torch

        with torch.no_grad():
            return function(*args, **kwargs)

    return without_gradients


class _DeferredTorch(types.ModuleType):
    """Stands in for torch in ``sys.modules`` until an attribute is asked for; then imports torch,
    takes its namespace (so later lookups are direct) and answers."""

    def __getattr__(self, name):
        if sys.modules.get("torch") is self:
            del sys.modules["torch"]
        real = importlib.import_module("torch")
        self.__dict__.update(real.__dict__)
        return getattr(real, name)


@contextlib.contextmanager
def deferred_torch():
    """Within this block, a first ``import torch`` gives a stand-in that imports torch on first
    attribute use. Only for a process that may never need torch (``specdec plugins``): the modules
    that imported the stand-in keep it, a module object other than torch's own."""
    if "torch" in sys.modules or importlib.util.find_spec("torch") is None:
        yield
        return
    stand_in = _DeferredTorch("torch")
    stand_in.__spec__ = importlib.util.find_spec("torch")
    sys.modules["torch"] = stand_in
    yield
