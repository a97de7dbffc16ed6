"""Training the ``classifier`` policy: run a pair on prompts, label every draft position with the
greedy oracle's answer, fit a ``StopClassifier`` and score it on held-out positions.

It runs a ``SpeculativeDecoder``, so it sits above the loop; the policy itself
(``specdec/policies/classifier.py``) only loads what this module saves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import attrs
import torch

from ..core.components import LookaheadPolicy
from ..decoding import SpeculativeDecoder
from ..errors import InputError
from ..policies.classifier import UNVERIFIED_CONFIDENCE, StopClassifier, draft_features
from ..verifiers.greedy import GreedyVerifier


@attrs.define(eq=False)
class _OracleRecorder(LookaheadPolicy):
    """Drafts ``max_tokens + 1`` per row and records features plus the greedy oracle's label at
    every position the drafter reports through ``keep_drafting`` (all but each draft's last)."""

    name = "classifier-trainer"

    max_tokens: int
    features: list[torch.Tensor] = attrs.field(factory=list, init=False)  # per step: [n, F]
    labels: list[torch.Tensor] = attrs.field(factory=list, init=False)  # per step: [n] bool
    _confidence: torch.Tensor | None = attrs.field(default=None, init=False)
    _confidence_now: torch.Tensor | None = attrs.field(default=None, init=False)
    _pending: list[torch.Tensor] = attrs.field(factory=list, init=False)

    def begin(self, state, target) -> None:
        self._confidence = torch.full((state.batch_size,), UNVERIFIED_CONFIDENCE)

    def lookahead(self, state) -> torch.Tensor:
        self._confidence_now = self._confidence[state.rows_host].to(state.device)
        self._pending = []
        return torch.full((state.active,), self.max_tokens + 1, dtype=torch.long)

    def continue_drafting(self, state, position, tokens, token_probs, probs):
        self._pending.append(draft_features(position, token_probs, probs, self._confidence_now))
        return None

    def on_step(self, state, step) -> None:
        if self._pending:
            features = torch.stack(self._pending, dim=1).cpu()  # [B, P, F]
            position = torch.arange(features.shape[1])[None, :]  # [1, P]
            accepted, drafted = step.accepted_host[:, None], step.drafted_host[:, None]
            # Up to and including the first rejection: later positions follow a prefix the target refused.
            seen = (position <= accepted) & (position < drafted)  # [B, P]
            self.features.append(features[seen])
            self.labels.append((position < accepted).expand_as(seen)[seen])
        if step.target_probs_host is not None:
            self._confidence[step.rows_host] = step.target_probs_host.float()


@attrs.frozen
class TrainingReport:
    """What ``train_classifier`` fitted and how well it predicts held-out draft positions."""

    classifier: StopClassifier
    samples: int
    train_samples: int
    heldout_samples: int
    heldout_accuracy: float
    majority_accuracy: float  # always answering the commoner label, for comparison
    accept_rate: float  # share of labelled positions the target accepted
    path: Path | None = None

    def summary(self) -> str:
        where = f", saved to {self.path}" if self.path else ""
        return (
            f"trained on {self.train_samples} draft positions, held out {self.heldout_samples}: "
            f"held-out accuracy {self.heldout_accuracy:.3f} (always-the-commoner-answer {self.majority_accuracy:.3f}, "
            f"target accepted {self.accept_rate:.1%} of drafts){where}"
        )


def _as_token_lists(prompts, tokenizer) -> list[list[int]]:
    rows = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise InputError(f"prompt {i} is text; pass a tokenizer (or token ids) to train_classifier")
            prompt = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() == 2 and prompt.shape[0] == 1:
                prompt = prompt[0]
            if prompt.dim() != 1:
                raise InputError(f"prompt {i} must be a 1-D tensor of token ids, got shape {tuple(prompt.shape)}")
            prompt = prompt.tolist()
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise InputError(f"empty prompt: prompt {i} has no tokens")
        rows.append(prompt)
    if not rows:
        raise InputError("no prompts to train on")
    return rows


def train_classifier(
    decoder,
    prompts: Sequence[torch.Tensor | Sequence[int] | str],
    out: str | Path | None = None,
    *,
    tokenizer=None,
    max_new_tokens: int = 64,
    max_tokens: int = 8,
    hidden: int = 0,
    holdout: float = 0.2,
    epochs: int = 500,
    lr: float = 0.05,
    batch_size: int = 8,
    seed: int = 0,
) -> TrainingReport:
    """Run ``decoder``'s drafter and target on ``prompts`` (greedy), label every draft position with
    the oracle answer, fit a ``StopClassifier`` on ``1 - holdout`` of them and score it on the rest.

    ``max_tokens`` is how far each draft runs while collecting; ``hidden`` > 0 adds a hidden layer.
    The classifier is saved to ``out`` when given. Returns a ``TrainingReport``.
    """
    if not 0.0 < holdout < 1.0:
        raise InputError(f"holdout must be between 0 and 1 (exclusive), got {holdout}")
    if max_tokens < 1 or hidden < 0 or batch_size < 1:
        raise InputError("max_tokens and batch_size must be at least 1 and hidden at least 0")
    rows = _as_token_lists(prompts, tokenizer)
    target = decoder.target
    config = target.generation_config
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    recorder = _OracleRecorder(max_tokens=max_tokens)
    collector = SpeculativeDecoder(target=target, drafter=decoder.drafter, policy=recorder, verifier=GreedyVerifier())
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        width = max(len(row) for row in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention_mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, row in enumerate(batch):  # left padding
            input_ids[i, width - len(row) :] = torch.tensor(row)
            attention_mask[i, width - len(row) :] = 1
        collector.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=False)

    if not recorder.features:
        raise InputError(
            "no draft positions to learn from: the drafter must draft token by token and report its "
            "probabilities (the 'model' drafter does), and max_tokens and max_new_tokens must allow drafts"
        )
    features, labels = torch.cat(recorder.features), torch.cat(recorder.labels)
    samples = labels.shape[0]
    heldout = int(round(samples * holdout))
    if heldout < 1 or samples - heldout < 1:
        raise InputError(f"only {samples} draft positions were collected; give more prompts or a larger max_new_tokens")
    order = torch.randperm(samples, generator=torch.Generator().manual_seed(seed))
    test, train = order[:heldout], order[heldout:]
    classifier = StopClassifier.fit(features[train], labels[train], hidden=hidden, epochs=epochs, lr=lr, seed=seed)
    predicted = classifier.accept_probability(features[test]) >= 0.5
    accuracy = float((predicted == labels[test]).float().mean())
    accept_rate = float(labels.float().mean())
    majority = float(max(labels[test].float().mean(), 1 - labels[test].float().mean()))
    path = None
    if out is not None:
        path = classifier.save(
            out,
            metadata={
                "heldout_accuracy": f"{accuracy:.4f}",
                "samples": str(samples),
                "max_tokens": str(max_tokens),
                "target": str(getattr(target.config, "_name_or_path", "") or type(target).__name__),
            },
        )
    return TrainingReport(
        classifier=classifier,
        samples=samples,
        train_samples=samples - heldout,
        heldout_samples=heldout,
        heldout_accuracy=accuracy,
        majority_accuracy=majority,
        accept_rate=accept_rate,
        path=path,
    )
