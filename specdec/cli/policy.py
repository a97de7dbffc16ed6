"""``specdec policy train``: fit the ``classifier`` policy on a draft/target pair and a prompts file.

``policy_app`` is a typer sub-app; the main CLI mounts it with
``app.add_typer(policy_app, name="policy")``.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..errors import InputError, SpecdecError

policy_app = typer.Typer(help="Train lookahead policies that learn from a draft/target pair.", no_args_is_help=True)


@policy_app.callback()
def _policy():
    """Train lookahead policies that learn from a draft/target pair."""


def read_prompts(path: Path) -> list[str]:
    """One prompt per line, or JSON Lines with a "prompt" key (chosen by a .jsonl suffix or a first line
    starting with "{"). Blank lines are skipped."""
    if not path.is_file():
        raise InputError(f"prompts file {str(path)!r} does not exist")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise InputError(f"prompts file {str(path)!r} is not UTF-8 text: {exc}") from exc
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise InputError(f"prompts file {str(path)!r} holds no prompts")
    if path.suffix != ".jsonl" and not numbered[0][1].lstrip().startswith("{"):
        return [line for _, line in numbered]
    prompts = []
    for n, line in numbered:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{n}: not a JSON object: {exc}") from exc
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise InputError(f'{path}:{n}: each JSON line needs a non-empty string "prompt"')
        prompts.append(record["prompt"])
    return prompts


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
    from ..config import SpecdecConfig
    from ..decoding import SpeculativeDecoder
    from ..training.classifier import train_classifier

    try:
        texts = read_prompts(prompts)
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
        typer.echo(f"Error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(report.summary())
    typer.echo(f'Use it with:\n[policy]\nuse = "classifier"\nweights = "{report.path}"')
