"""``classifier``: a tiny learned model decides, after each drafted token, whether to keep drafting.

DISCO (Mamou et al. 2024, "Dynamic speculation lookahead accelerates speculative decoding of
large language models"). After draft token j the classifier reads four features,

- ``token_prob``: the draft's probability of the token it just drafted,
- ``entropy``: the entropy (nats) of the draft's distribution at that position,
- ``position``: j, the token's 0-based position in this draft,
- ``target_confidence``: the target's probability of the token the row committed at the last
  verification (1.0 before the first one),

and estimates the probability that the target accepts token j; a row stops drafting (after
proposing token j) when that estimate falls below ``threshold``. The model is a logistic
regression, or an MLP with one hidden layer, on standardised features.

``specdec.training.classifier.train_classifier`` (and ``specdec policy train``) runs a draft/target pair on prompts, labels each
draft position with the oracle answer (does the draft token equal the target's greedy token,
given the accepted prefix), fits the model, reports held-out accuracy and saves it as safetensors
with the feature names and the standardisation in the file, so a file made for other features
is refused with a clear error instead of silently mis-steering the decoder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import torch

from ..errors import ConfigError
from ..core.hookspecs import hookimpl
from ..core.components import LookaheadPolicy
from .constant import integer
from .draft_confidence import AUTO, CostStop, probability

FEATURES = ("token_prob", "entropy", "position", "target_confidence")
FORMAT = "specdec-classifier"
FORMAT_VERSION = "1"
UNVERIFIED_CONFIDENCE = 1.0  # the target_confidence feature of a row the target has not verified yet


def draft_features(
    position: int,
    token_probs: torch.Tensor | None,  # [B] draft's q of each drafted token
    probs: torch.Tensor | None,  # [B, V] draft distribution, None for drafters without one
    target_confidence: torch.Tensor,  # [B]
) -> torch.Tensor:  # [B, F] fp32, columns in FEATURES order
    """The classifier's input at draft position ``position``; training and decoding both use this."""
    confidence = target_confidence.float()
    token_prob = torch.ones_like(confidence) if token_probs is None else token_probs.float()
    if probs is None:
        entropy = torch.zeros_like(confidence)  # a deterministic draft: q is one-hot
    else:
        entropy = torch.special.entr(probs.float()).sum(-1)
    return torch.stack([token_prob, entropy, torch.full_like(confidence, float(position)), confidence], dim=-1)


# --- the model -------------------------------------------------------------------------------------


@attrs.frozen
class StopClassifier:
    """P(the target accepts this draft token) from ``draft_features``: standardise, then
    ``len(weights)`` linear layers with ReLU between them (one layer: logistic regression)."""

    weights: tuple[torch.Tensor, ...]  # layer i: [out_i, in_i]; the last has out = 1
    biases: tuple[torch.Tensor, ...]  # layer i: [out_i]
    mean: torch.Tensor  # [F]
    std: torch.Tensor  # [F]
    features: tuple[str, ...] = FEATURES

    def to(self, device) -> StopClassifier:
        def move(tensors):
            return tuple(t.to(device=device, dtype=torch.float32) for t in tensors)

        return attrs.evolve(
            self, weights=move(self.weights), biases=move(self.biases), mean=self.mean.to(device), std=self.std.to(device)
        )

    def logits(self, features: torch.Tensor) -> torch.Tensor:  # [N, F] -> [N]
        x = (features.float() - self.mean) / self.std
        for i, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            if i:
                x = torch.relu(x)
            x = x @ weight.T + bias
        return x[:, 0]

    def accept_probability(self, features: torch.Tensor) -> torch.Tensor:  # [N, F] -> [N] fp32
        return torch.sigmoid(self.logits(features))

    # --- files ------------------------------------------------------------------------------------

    def save(self, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
        from ..core.weights_file import write_weights

        tensors = {"mean": self.mean, "std": self.std}
        for i, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            tensors[f"layers.{i}.weight"] = weight
            tensors[f"layers.{i}.bias"] = bias
        info = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "features": json.dumps(list(self.features)),
            "normalisation": "standardise: (x - mean) / std, tensors 'mean' and 'std'",
            "layers": str(len(self.weights)),
            **(metadata or {}),
        }
        return write_weights(Path(path), {k: v.float() for k, v in tensors.items()}, info)

    @classmethod
    def load(cls, path: str | Path, who: str = "policy 'classifier'") -> StopClassifier:
        """Read a file written by ``save``; anything else is a ``ConfigError`` naming the file."""
        from ..core.weights_file import read_weights

        path = Path(path).expanduser()
        where = f"{who}: weights file {str(path)!r}"
        metadata, tensors = read_weights(path, FORMAT, "specdec classifier", who,
                                         missing_hint="; train one with `specdec policy train`")
        if metadata.get("format_version") != FORMAT_VERSION:
            raise ConfigError(
                f"{where} has classifier format version {metadata.get('format_version')!r}; this specdec reads "
                f"version {FORMAT_VERSION}"
            )
        try:
            features = tuple(json.loads(metadata["features"]))
            layers = int(metadata["layers"])
            weights = tuple(tensors[f"layers.{i}.weight"].float() for i in range(layers))
            biases = tuple(tensors[f"layers.{i}.bias"].float() for i in range(layers))
            mean, std = tensors["mean"].float(), tensors["std"].float()
        except (KeyError, ValueError, TypeError) as exc:
            raise ConfigError(f"{where} is malformed: missing or invalid entry {exc}") from exc
        if features != FEATURES:
            raise ConfigError(
                f"{where} was trained for features {list(features)}, but policy 'classifier' computes "
                f"{list(FEATURES)}; retrain it with `specdec policy train`"
            )
        width = len(FEATURES)
        shapes_ok = layers >= 1 and mean.shape == (width,) and std.shape == (width,) and bool((std > 0).all())
        for weight, bias in zip(weights, biases):
            shapes_ok = shapes_ok and weight.dim() == 2 and weight.shape[1] == width and bias.shape == (weight.shape[0],)
            width = weight.shape[0] if weight.dim() == 2 else -1
        if not shapes_ok or width != 1:
            raise ConfigError(f"{where} is malformed: its layer shapes or standardisation do not fit {len(FEATURES)} features")
        return cls(weights=weights, biases=biases, mean=mean, std=std, features=features)

    # --- fitting ----------------------------------------------------------------------------------

    @classmethod
    def fit(
        cls,
        features: torch.Tensor,  # [N, F]
        labels: torch.Tensor,  # [N] bool: accepted
        hidden: int = 0,
        epochs: int = 500,
        lr: float = 0.05,
        seed: int = 0,
    ) -> StopClassifier:
        """Fit by full-batch Adam on the logistic loss (fp32, CPU: the data is small)."""
        x = features.detach().float().cpu()
        y = labels.detach().float().cpu()
        mean = x.mean(0)
        std = x.std(0, correction=0).clamp(min=1e-6)
        generator = torch.Generator().manual_seed(seed)
        sizes = [x.shape[1], *([hidden] if hidden else []), 1]
        params = []
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            bound = 1.0 / math.sqrt(fan_in)
            weight = (torch.rand(fan_out, fan_in, generator=generator) * 2 - 1) * bound
            params += [weight.requires_grad_(), torch.zeros(fan_out, requires_grad=True)]
        optimiser = torch.optim.Adam(params, lr=lr)
        with torch.enable_grad():
            for _ in range(epochs):
                model = cls(weights=tuple(params[0::2]), biases=tuple(params[1::2]), mean=mean, std=std)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(model.logits(x), y)
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
        return cls(
            weights=tuple(p.detach().clone() for p in params[0::2]),
            biases=tuple(p.detach().clone() for p in params[1::2]),
            mean=mean,
            std=std,
        )


# --- the policy -----------------------------------------------------------------------------------


def _weights(instance, attribute, value):
    if not isinstance(value, (str, Path, StopClassifier)):
        raise ConfigError(
            f"policy 'classifier': 'weights' must be the path of a trained classifier file (or a StopClassifier), "
            f"got {type(value).__name__}"
        )


@attrs.define(eq=False)
class ClassifierLookahead(LookaheadPolicy):
    """DISCO: a trained classifier stops each row's draft when the next token looks unlikely to be accepted.

    ``weights``: the file ``specdec policy train`` wrote. ``threshold``: keep drafting while the
    estimated acceptance probability is at least this. ``max_tokens``: drafts per row at most.
    """

    name = "classifier"
    allows_auto = True

    weights: str | Path | StopClassifier = attrs.field(validator=_weights)
    threshold: float | str = attrs.field(default=0.5, validator=probability)
    max_tokens: int = attrs.field(default=20, validator=integer(1))
    _model: StopClassifier = attrs.field(init=False, repr=False)
    _confidence: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)
    _confidence_now: torch.Tensor | None = attrs.field(default=None, init=False, repr=False)
    _stop: CostStop | None = attrs.field(default=None, init=False, repr=False)
    _predicted: list = attrs.field(factory=list, init=False, repr=False)

    def __attrs_post_init__(self):
        model = self.weights if isinstance(self.weights, StopClassifier) else StopClassifier.load(self.weights)
        self._model = model

    def begin(self, state, target) -> None:
        self._model = self._model.to(state.device)
        self._confidence = torch.full((state.batch_size,), UNVERIFIED_CONFIDENCE)  # [R] CPU, by original row
        if self.threshold == AUTO:
            if self._stop is None:
                self._stop = CostStop(self.max_tokens)
            self._stop.begin(state, target)

    def lookahead(self, state) -> torch.Tensor:
        self._confidence_now = self._confidence[state.rows_host].to(state.device, non_blocking=True)  # [B]
        self._predicted = []
        if self._stop is not None:
            return self._stop.lookahead(state)
        return torch.full((state.active,), self.max_tokens, dtype=torch.long)

    def continue_drafting(self, state, position, tokens, token_probs, probs) -> torch.Tensor:
        features = draft_features(position, token_probs, probs, self._confidence_now)  # [B, F]
        predicted = self._model.accept_probability(features)  # [B]
        if self._stop is None:
            return predicted >= self.threshold
        self._predicted.append(predicted)
        return self._stop.keep(state, position, predicted)

    def on_step(self, state, step) -> None:
        if self._stop is not None:  # positions the classifier judged (all but each draft's last)
            self._stop.on_step(state, step, torch.stack(self._predicted, dim=1) if self._predicted else None)
        if step.target_probs_host is not None:
            self._confidence[step.rows_host] = step.target_probs_host.float()


@hookimpl
def specdec_register(registry):
    registry.register_policy("classifier", ClassifierLookahead)
