"""``fallback``: two drafters in one. Each row takes the ``first`` drafter's proposal when it has one,
and the ``then`` drafter's when it does not.

The usual pair is prompt lookup first and a model after it (``ngram`` then ``hidden-state`` or
``model``): where the answer quotes its prompt (a summary, an edit of code), the lookup's long drafts
cost nothing; everywhere else the model drafts. ``then`` is asked only for the rows ``first`` left
empty (the others get a budget of 0), and not at all when ``first`` covered every row, so at batch 1
a lookup hit costs no draft forward.

Both drafters see every ``begin``, ``on_step`` and ``select_rows``, so a model drafter's cache stays
in step whichever of the two drafted: at its next draft it catches up on the committed tokens it
has not read, as it always does.

In plugins.toml the two are tables of their own:

```toml
[drafter]
use = "fallback"
[drafter.first]
use = "ngram"
min_ngram = 2
[drafter.then]
use = "hidden-state"
head = "head.safetensors"
```

with ``then_max_tokens = 2`` in ``[drafter]`` when the policy's k suits the lookup (say 6) but the
model pays only for its first two guesses.
"""

from __future__ import annotations

import attrs

from ..core.components import Drafter
from ..core.hookspecs import hookimpl
from ..core.types import Draft
from ..errors import ConfigError


def _drafter(instance, attribute, value):
    if not isinstance(value, Drafter):
        raise ConfigError(
            f"drafter 'fallback': {attribute.name!r} must be a drafter (a table with use = \"<name>\" in "
            f"plugins.toml), got {type(value).__name__}"
        )


def _at_least_one(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"drafter 'fallback': {attribute.name!r} must be an integer of at least 1, got {value!r}")


@attrs.define(eq=False)
class FallbackDrafter(Drafter):
    """Each row drafts with ``first`` when it proposes something for it, else with ``then``.

    ``then_max_tokens`` caps the drafts of ``then`` below the policy's lookahead: a lookup's drafts
    cost nothing to make and may run long, a model's are paid for token by token.
    """

    name = "fallback"

    first: Drafter = attrs.field(validator=_drafter)
    then: Drafter = attrs.field(validator=_drafter)
    then_max_tokens: int | None = attrs.field(default=None, validator=attrs.validators.optional(_at_least_one))

    def __attrs_post_init__(self):
        if self.first is self.then:
            raise ConfigError("drafter 'fallback': 'first' and 'then' are the same object; give each its own drafter")

    @property
    def wants_hidden_states(self) -> bool:  # type: ignore[override]
        return self.first.wants_hidden_states or self.then.wants_hidden_states

    def _both(self):
        return (self.first, self.then)

    def check_target(self, target) -> None:
        for drafter in self._both():
            drafter.check_target(target)

    def begin(self, state, target) -> None:
        for drafter in self._both():
            with drafter.blame("begin"):
                drafter.begin(state, target)

    def propose(self, state, max_tokens, keep_drafting) -> Draft:
        import torch

        with self.first.blame("propose"):
            first = self.first.propose(state, max_tokens, keep_drafting)
        # Prompt lookup, and a model drafter that no policy stops per position (TokenByToken's lean
        # path), hand their lengths over on the host; otherwise reading them here is a sync.
        covered_host = first.lengths_host if first.lengths_host is not None else first.lengths.cpu()
        rest = torch.where(covered_host > 0, 0, max_tokens)  # [B] CPU: budgets of the rows first left empty
        if self.then_max_tokens is not None:
            rest = rest.clamp(max=self.then_max_tokens)
        if int(rest.max()) == 0:
            return first
        with self.then.blame("propose"):
            then = self.then.propose(state, rest, keep_drafting)
        return _merge(first, then, covered_host > 0)

    def on_step(self, state, step) -> None:
        for drafter in self._both():
            with drafter.blame("on_step"):
                drafter.on_step(state, step)

    def select_rows(self, state, keep, keep_host) -> None:
        for drafter in self._both():
            with drafter.blame("select_rows"):
                drafter.select_rows(state, keep, keep_host)

    def on_finish(self, state, output) -> None:
        for drafter in self._both():
            with drafter.blame("on_finish"):
                drafter.on_finish(state, output)


def _merge(first: Draft, then: Draft, use_first_host) -> Draft:
    """Row b of ``first`` where ``use_first_host[b]``, else row b of ``then``, padded to the wider one."""
    import torch

    width = max(first.width, then.width)
    device = first.tokens.device
    use_first = use_first_host.to(device, non_blocking=True)

    def padded(tensor, fill):
        return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]), value=fill)

    def token_probs(draft):
        if draft.token_probs is not None:
            return padded(draft.token_probs, 0.0)
        return torch.ones(draft.tokens.shape[0], width, dtype=torch.float32, device=device)

    probs = None
    if first.probs is not None or then.probs is not None:
        vocab = (first.probs if first.probs is not None else then.probs).shape[-1]

        def full(draft):
            if draft.probs is not None:
                return torch.nn.functional.pad(draft.probs, (0, 0, 0, width - draft.width))
            # A drafter without distributions (prompt lookup) drafts from a one-hot q.
            return torch.nn.functional.one_hot(padded(draft.tokens, 0), vocab).float()

        probs = torch.where(use_first[:, None, None], full(first), full(then))
    lengths_host = None
    if first.lengths_host is not None and then.lengths_host is not None:
        lengths_host = torch.where(use_first_host, first.lengths_host, then.lengths_host)
    alternatives = None
    if first.alternatives is not None or then.alternatives is not None:
        count = max(d.alternatives.shape[1] for d in (first, then) if d.alternatives is not None)

        def candidates(draft):
            if draft.alternatives is None:
                return torch.full((draft.tokens.shape[0], count), -1, dtype=torch.long, device=device)
            return torch.nn.functional.pad(draft.alternatives, (0, count - draft.alternatives.shape[1]), value=-1)

        alternatives = torch.where(use_first[:, None], candidates(first), candidates(then))
    return Draft(
        tokens=torch.where(use_first[:, None], padded(first.tokens, 0), padded(then.tokens, 0)),
        lengths=torch.where(use_first, first.lengths, then.lengths),
        probs=probs,
        token_probs=torch.where(use_first[:, None], token_probs(first), token_probs(then)),
        lengths_host=lengths_host,
        alternatives=alternatives,
    )


@hookimpl
def specdec_register(registry):
    registry.register_drafter("fallback", FallbackDrafter)
