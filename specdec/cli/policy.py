"""``specdec policy train``: fit the ``classifier`` policy on a draft/target pair and a prompts file.

``policy_app`` is a typer sub-app; the main CLI mounts it with
``app.add_typer(policy_app, name="policy")``.
"""

from __future__ import annotations

from pathlib import Path

import typer

from .common import fail

policy_app = typer.Typer(help="Train lookahead policies that learn from a draft/target pair.", no_args_is_help=True)


@policy_app.callback()
def _policy():
    """Train lookahead policies that learn from a draft/target pair."""


@policy_app.command("train")
def train(
    config: Path = typer.Option(..., "--config", help="plugins.toml naming the target and the drafter."),
    prompts: Path = typer.Option(..., "--prompts", help='Prompts: one per line, or JSON Lines with a "prompt" key.'),
    out: Path = typer.Option(..., "--out", help="Where to write the classifier (safetensors)."),
    max_new_tokens: int = typer.Option(64, help="Tokens generated per prompt while collecting draft positions."),
    max_tokens: int = typer.Option(8, help="How far each draft runs while collecting."),
    hidden: int = typer.Option(0, help="Hidden units (0: logistic regression)."),
    holdout: float = typer.Option(0.2, help="Share of draft positions held out to measure accuracy."),
    seed: int = typer.Option(0, help="Seed for the split and the initial weights."),
):
    """Label every draft position with the target's answer, fit the classifier, save it to --out."""
    from ..errors import SpecdecError
    from ..prompts import read_prompts

    try:
        texts = read_prompts(prompts)
    except SpecdecError as exc:
        raise fail(str(exc)) from None
    from ..config import SpecdecConfig
    from ..decoding import SpeculativeDecoder
    from ..training.classifier import train_classifier
    from .common import set_up_logging

    set_up_logging()
    try:
        spec = SpecdecConfig.from_toml(config)
        model, tokenizer = spec.load_target()
        decoder = SpeculativeDecoder.from_config(spec, target=model)
        report = train_classifier(
            decoder,
            texts,
            out,
            tokenizer=tokenizer,
            max_new_tokens=max_new_tokens,
            max_tokens=max_tokens,
            hidden=hidden,
            holdout=holdout,
            seed=seed,
        )
    except (SpecdecError, OSError) as exc:
        raise fail(str(exc)) from None
    typer.echo(report.summary())
    typer.echo(f'Use it with:\n[policy]\nuse = "classifier"\nweights = "{report.path}"')
