"""Reduced-vocabulary drafting: a draft whose output head covers only a subset of the target's tokens.

On small targets the output projection is much of a draft's cost (whisper-base: the 51865 x 512
head is 0.36 of a decoder step, more than a draft layer), so a draft may score only the tokens the
target actually says (EAGLE-3 and FR-Spec do the same). ``TokenMap`` holds that subset (reduced id
-> full id) and expands the draft's logits to the target's vocabulary with ``-inf`` everywhere
else, *before* the target's logits processors run. The draft's q is then exactly zero outside the
map: greedy drafting never picks such a token, rejection sampling divides by the q it drew from,
and verification still reads the target's full distribution, so the output stays exact.

One piece of code for every drafter with a model: ``model`` and ``shared-encoder`` (a draft model
whose ``token_map`` buffer or option says its head is reduced) and ``hidden-state`` (whose head is
the target's LM head rows of the map).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import torch

from ..errors import ConfigError, IncompatibleModelsError


@attrs.frozen(eq=False)
class TokenMap:
    """``ids[r]`` is the full-vocabulary id of the draft's reduced id ``r``; ``vocab`` the target's size.

    Build one with ``TokenMap.checked``, which refuses a map that does not fit the target.
    """

    ids: torch.Tensor  # [V'] long, distinct ids in [0, vocab)
    vocab: int

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    @classmethod
    def checked(cls, ids, vocab: int, who: str, source: str = "the token map") -> TokenMap:
        """``ids`` as a ``TokenMap`` over a target of ``vocab`` tokens, or an ``IncompatibleModelsError``
        naming ``who`` and ``source`` (the file it came from) and what does not fit."""
        ids = torch.as_tensor(ids)
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise IncompatibleModelsError(f"{who}: {source} must be a non-empty 1-D list of token ids, "
                                          f"got {tuple(ids.shape)} {ids.dtype}")
        ids = ids.long()
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise IncompatibleModelsError(
                f"{who}: {source} holds token id {bad}, outside the target's vocabulary of {vocab} tokens "
                "(a draft trained for another target?)"
            )
        if torch.unique(ids).numel() != ids.numel():
            raise IncompatibleModelsError(f"{who}: {source} lists a token id twice")
        return cls(ids=ids, vocab=int(vocab))

    def to(self, device) -> TokenMap:
        return self if self.ids.device == torch.device(device) else attrs.evolve(self, ids=self.ids.to(device))

    def expand(self, logits: torch.Tensor) -> torch.Tensor:  # [..., V'] -> [..., V] float32
        """The draft's reduced logits as full-vocabulary scores, ``-inf`` outside the map (fp32, as the
        processors and the softmax of the draft's q want them)."""
        if logits.shape[-1] != self.size:
            raise IncompatibleModelsError(
                f"the draft's head scores {logits.shape[-1]} tokens but its token map holds {self.size}"
            )
        full = torch.full((*logits.shape[:-1], self.vocab), float("-inf"), dtype=torch.float32, device=logits.device)
        return full.index_copy_(-1, self.ids.to(logits.device), logits.float())


def read_token_map(path: str | Path, who: str) -> torch.Tensor:
    """Token ids from a file: a JSON list (or ``{"token_map": [...]}``), or a safetensors / torch file
    holding a ``token_map`` tensor."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"{who}: token map file {str(path)!r} does not exist")
    try:
        if path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            return torch.tensor(data["token_map"] if isinstance(data, dict) else data)
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                return handle.get_tensor("token_map")
        return torch.load(path, map_location="cpu", weights_only=True)["token_map"]
    except Exception as exc:  # noqa: BLE001 - json, safetensors and torch raise several kinds
        raise ConfigError(f"{who}: cannot read a token map from {path}: {exc}") from None


def model_token_map(model) -> torch.Tensor | None:
    """The ``token_map`` buffer a reduced-head draft model carries (see ``drafters/shared_encoder_draft.py``), if any."""
    value = getattr(model, "token_map", None)
    return value if isinstance(value, torch.Tensor) else None
