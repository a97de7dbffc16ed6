"""What every verifier is: it reads the target's scores and keeps a prefix of each row's draft."""

from __future__ import annotations

from transformers import GenerationConfig

from ..core.types import Draft, Verdict
from ..plugins.component import Component
from ..plugins.hookspecs import hookimpl


class Verifier(Component):
    """Subclass this and override ``verify``."""

    kind = "verifier"

    def check_generation_config(self, generation_config: GenerationConfig) -> None:
        """Raise ``ConfigError`` if this verifier cannot honour the generation config."""

    def verify(self, state, draft: Draft, scores) -> Verdict:
        raise NotImplementedError

    @hookimpl
    def specdec_verify(self, state, draft, scores):
        with self.blame("verify"):
            return self.verify(state, draft, scores)
