"""The four roles a plugin can fill: drafter, lookahead policy, verifier, observer.

A plugin author subclasses one of these and overrides plain methods (``propose``, ``lookahead``,
``verify``, ``on_step`` ...). Each role's pluggy hookimpls are one line per hook: ``relay`` turns a
method into the hookimpl that calls the subclass's override and names the plugin in any error.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, ClassVar

from ..errors import PluginError
from .hookspecs import hookimpl
from .types import Draft, Verdict

if TYPE_CHECKING:  # annotations only: plugin discovery must not import transformers
    import torch
    from transformers import GenerationConfig

KeepDrafting = Callable[..., "torch.Tensor | None"]


def relay(method: Callable, after: Callable | None = None):
    """The hookimpl that calls ``method`` as the component overrides it, under ``blame``.

    Hook arguments are passed by the names of ``method``'s parameters (pluggy reads them through
    ``__wrapped__``), so a method's parameters are named like its hook's. ``after(component,
    result)`` post-processes the answer inside the same blame.
    """
    name = method.__name__

    def hook(self, *args):
        try:  # what ``blame`` does, inline: a context manager per hook call is measurable in the loop
            result = getattr(self, name)(*args)
            return result if after is None else after(self, args, result)
        except PluginError:
            raise
        except Exception as exc:
            raise self.plugin_error(name, exc) from exc

    hook.__wrapped__ = method
    hook.__name__ = hook.__qualname__ = f"specdec_{name}"
    return hookimpl(hook)


class Component:
    """Base of drafters, policies, verifiers and observers.

    ``name`` is the name the component is registered under (``ngram``, ``heuristic``, ...);
    ``kind`` is what it is. Both appear in every error the component raises while decoding.
    """

    kind: ClassVar[str] = "component"
    name: ClassVar[str] = ""

    @property
    def plugin_label(self) -> str:
        name = self.name or type(self).__name__
        return f"{self.kind} '{name}' ({type(self).__module__}.{type(self).__qualname__})"

    @contextlib.contextmanager
    def blame(self, hook: str):
        """Re-raise anything that escapes as a ``PluginError`` naming this plugin and the hook."""
        try:
            yield
        except PluginError:
            raise
        except Exception as exc:
            raise self.plugin_error(hook, exc) from exc

    def plugin_error(self, hook: str, exc: Exception) -> PluginError:
        """The ``PluginError`` naming this plugin and ``hook`` for ``exc``."""
        return PluginError(
            f"{self.plugin_label} failed in {hook}: {type(exc).__name__}: {exc}",
            plugin=self.name or type(self).__name__,
            hook=hook,
        )

    def begin(self, state, target) -> None:
        """A new request starts: reset per-request state (per-row state indexed by original row id)."""

    def on_step(self, state, step) -> None:
        """An iteration was verified and committed (``step`` is a ``Step``)."""


class Drafter(Component):
    """Subclass this and override ``propose`` (and ``check_target`` / ``begin`` / ``on_step`` /
    ``select_rows`` when the drafter keeps state such as a KV cache).

    A drafter that sets ``wants_hidden_states = True`` receives the target's last hidden states of
    the positions it just verified in ``on_step`` (``step.hidden_states``, ``step.hidden_positions``);
    the target computes them in the same forward, and drafters that do not ask cost nothing.
    """

    kind = "drafter"
    wants_hidden_states: ClassVar[bool] = False

    def check_target(self, target) -> None:
        """Raise ``IncompatibleModelsError`` if this drafter cannot draft for ``target``."""

    def propose(self, state, max_tokens: torch.Tensor, keep_drafting: KeepDrafting) -> Draft:
        raise NotImplementedError

    def select_rows(self, state, keep: torch.Tensor, keep_host: torch.Tensor) -> None:
        """Finished rows leave the batch."""

    def on_finish(self, state, output) -> None:
        """The request is done (``output`` is the ``DecodeOutput`` about to be returned): let go of
        what it held (a KV cache), which would otherwise live on until the next request."""

    specdec_begin = relay(Component.begin)
    specdec_propose = relay(propose)
    specdec_on_step = relay(Component.on_step)
    specdec_select_rows = relay(select_rows)
    specdec_on_finish = relay(on_finish)


def _as_row_lengths(policy, args, k) -> torch.Tensor:
    import torch

    (state,) = args
    if isinstance(k, torch.Tensor) and k.dtype == torch.long and k.shape == (state.active,) and k.device.type == "cpu":
        return k  # already what the loop wants (it never writes into it)
    return torch.as_tensor(k, dtype=torch.long).expand(state.active).clone()


class LookaheadPolicy(Component):
    """Subclass this and override ``lookahead``; override ``continue_drafting`` to stop rows
    mid-draft (and ``on_step`` to learn from what the target accepted).

    ``continue_drafting`` returning None means "no opinion": every row drafts its full lookahead
    and the draft loop needs no host sync. Returning a tensor lets the drafter stop as soon as no
    row wants to continue, at the price of one tiny sync per drafted position.
    """

    kind = "policy"

    def lookahead(self, state) -> torch.Tensor:
        """CPU LongTensor [B] (or an int for every row): how many tokens each active row may draft."""
        raise NotImplementedError

    def continue_drafting(self, state, position, tokens, token_probs, probs) -> torch.Tensor | None:
        return None

    def on_finish(self, state, output) -> None:
        """The request is done (``output`` is the ``DecodeOutput`` about to be returned): where a
        policy keeps what it learned beyond the process (``cost-aware``'s ``memory``)."""

    specdec_begin = relay(Component.begin)
    specdec_lookahead = relay(lookahead, after=_as_row_lengths)
    specdec_continue_drafting = relay(continue_drafting)
    specdec_on_step = relay(Component.on_step)
    specdec_on_finish = relay(on_finish)


class Verifier(Component):
    """Subclass this and override ``verify``."""

    kind = "verifier"
    # Whether ``verify`` reads the scores only for each position's argmax (and the target's
    # probability of the token it appends, which may then be off by about 1%): the loop may then
    # screen the target's LM head in bfloat16 (core/screened_head.py). Leave it False otherwise.
    argmax_only = False

    def check_generation_config(self, generation_config: GenerationConfig) -> None:
        """Raise ``ConfigError`` if this verifier cannot honour the generation config."""

    def verify(self, state, draft: Draft, scores) -> Verdict:
        raise NotImplementedError

    specdec_verify = relay(verify)


class Observer(Component):
    """Subclass this and override any of ``begin``, ``on_step`` and ``on_finish``; observers watch
    the loop and never steer it."""

    kind = "observer"

    def on_finish(self, state, output) -> None:
        """The request is done; ``output`` is the ``DecodeOutput`` about to be returned."""

    specdec_begin = relay(Component.begin)
    specdec_on_step = relay(Component.on_step)
    specdec_on_finish = relay(on_finish)
