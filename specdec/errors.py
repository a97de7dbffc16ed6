"""The errors specdec raises for mistakes a user can make.

Every one is a ``ValueError`` subclass, so code that already guards ``model.generate`` with
``except ValueError`` keeps working, and every message names what was wrong (the plugin, field,
file or argument) so nobody has to read a torch traceback to find out.
"""

from __future__ import annotations


class SpecdecError(ValueError):
    """Base class of every error specdec raises on purpose."""


class InputError(SpecdecError):
    """The prompts or generation arguments handed to ``generate`` cannot be decoded."""


class ConfigError(SpecdecError):
    """A plugins.toml, a plugin option or a component combination is invalid."""


class PluginError(SpecdecError):
    """A plugin raised while decoding; the message names the plugin and the hook it was in."""

    def __init__(self, message: str, *, plugin: str, hook: str):
        super().__init__(message)
        self.plugin = plugin
        self.hook = hook


class IncompatibleModelsError(ConfigError):
    """The draft and the target cannot be paired (vocabulary, hidden size, architecture)."""


class RereadWarning(UserWarning):
    """A model is decoded exactly but slowly: its cache cannot hold the holes of rejected drafts,
    so specdec re-reads each row's whole sequence at every forward."""


class DraftDtypeWarning(UserWarning):
    """A draft model in half precision beside a wider target on a CPU: exact, but its steps run
    several times slower than they would in the target's dtype (``drafters/model.py``)."""


class PackingWarning(UserWarning):
    """A model's multi-token steps read its weights as loaded (the copy-free routes), not packed
    copies, because the packed copies would not fit in the memory left (``core/packed_linear.py``)."""


class PolicyMemoryWarning(UserWarning):
    """A policy's memory file (``cost-aware``'s ``memory``) could not be read or written: the policy
    starts from nothing, or what it learned is not kept (``policies/cost_aware.py``)."""
