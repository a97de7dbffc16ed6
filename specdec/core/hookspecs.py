"""Every hook specdec calls, in one place.

Discovery hook (process-wide manager, entry point group ``specdec``):

- ``specdec_register(registry)``: register named drafters, policies, verifiers and observers.

Runtime hooks (one manager per decoder, holding exactly its chosen components and observers).
``firstresult`` hooks are answered by exactly one component; the others are broadcast to all.
A component subclasses ``Drafter``, ``LookaheadPolicy``, ``Verifier`` or ``Observer``, whose
base classes implement these hooks by calling the plain methods a plugin author overrides
(``propose``, ``lookahead``, ...), and name the plugin in any error it raises.
"""

from __future__ import annotations

import pluggy

PROJECT = "specdec"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --- discovery -------------------------------------------------------------------------------


@hookspec
def specdec_register(registry):
    """Register components: ``registry.register_drafter("name", Factory)`` and likewise for
    ``register_policy``, ``register_verifier`` and ``register_observer``. Factories are attrs
    classes (their fields are the options users set in plugins.toml)."""


# --- runtime ---------------------------------------------------------------------------------


@hookspec
def specdec_begin(state, target):
    """A request starts: reset per-request state (a model drafter reads nothing yet; it catches
    up lazily on its first draft)."""


@hookspec(firstresult=True)
def specdec_lookahead(state):
    """The policy: how many tokens each active row may draft this iteration, as a CPU LongTensor
    ``[B]`` (0 makes the row a plain target step). The loop caps it by the row's token budget."""


@hookspec(firstresult=True)
def specdec_propose(state, max_tokens, keep_drafting):
    """The drafter: propose up to ``max_tokens[b]`` tokens per row (CPU LongTensor ``[B]``) and
    return a ``Draft``. A drafter that drafts token by token calls
    ``keep_drafting(position, tokens, token_probs, probs)`` after each one and stops a row when it
    answers False for it. ``keep_drafting.listening`` is False when no policy decides per position
    (it then answers None): a drafter may skip what it computes only for the question
    (``core/drafting.py``'s ``TokenByToken`` does)."""


@hookspec(firstresult=True)
def specdec_continue_drafting(state, position, tokens, token_probs, probs):
    """The policy, after draft position ``position`` (0-based): bool tensor ``[B]``, which rows
    keep drafting. ``tokens`` ``[B]`` were just drafted with probability ``token_probs`` ``[B]``
    under the draft distribution ``probs`` ``[B, V]`` (None for drafters without one)."""


@hookspec(firstresult=True)
def specdec_verify(state, draft, scores):
    """The verifier: given the draft and the target's processed scores ``[B, K + 1, V]`` (fp32,
    position j scores the token after the row's committed tokens and its first j drafts), return
    a ``Verdict``: accepted drafts per row and the one token appended after them."""


@hookspec
def specdec_on_step(state, step):
    """An iteration was committed (``step`` is a ``Step``). Drafters update their caches,
    policies learn, observers record. Observers must not change the state."""


@hookspec
def specdec_select_rows(state, keep, keep_host):
    """Rows finished and leave the batch: keep only active positions ``keep`` (device) /
    ``keep_host`` (CPU) in any per-active-row state (caches). ``state.rows`` is already updated."""


@hookspec
def specdec_on_finish(state, output):
    """The request is done; ``output`` is the ``DecodeOutput`` about to be returned. A drafter lets
    go of what the request held here (its KV cache), as the loop does of the target's right after."""


# attrs metadata key of a component's field that is an argument in Python only, no option of a
# config or the CLI (a test's fake clock): the registry neither lists nor accepts it.
PYTHON_ONLY = "specdec_python_only"
