"""The ``specdec`` command line: generate, plugins, bench (typer + rich)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import attrs
import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from transformers.utils import logging as transformers_logging

from ..config import SpecdecConfig
from ..core.components import Observer
from ..decoding import SpeculativeDecoder
from ..errors import SpecdecError

# Model loading bars are noise on a command whose output is the generated text.
transformers_logging.disable_progress_bar()

app = typer.Typer(
    help="Speculative decoding for Hugging Face Transformers models: same output, less time.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
errors = Console(stderr=True)

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_HELP = "plugins.toml to use (default: ./plugins.toml, else the bundled one)"


def fail(message: str) -> typer.Exit:
    errors.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code=2)


def find_config(path: Optional[Path]) -> Path:
    if path is not None:
        return path
    for candidate in (Path.cwd() / "plugins.toml", REPO_ROOT / "plugins.toml"):
        if candidate.is_file():
            return candidate
    raise fail("no plugins.toml here and no bundled one found; pass --config FILE")


def load_config(path: Optional[Path], drafter: Optional[str] = None, policy: Optional[str] = None) -> SpecdecConfig:
    try:
        return SpecdecConfig.from_toml(find_config(path)).with_choices(drafter=drafter, policy=policy)
    except SpecdecError as exc:
        raise fail(str(exc)) from None


class _Stream(Observer):
    """Print row 0's text as it is committed (the decode of all new tokens, minus what is printed)."""

    name = "stream"

    def __init__(self, tokenizer, out: Console):
        self.tokenizer, self.out, self.printed = tokenizer, out, ""

    def begin(self, state, target):
        self.printed = ""

    def on_step(self, state, step):
        if 0 not in step.rows_host.tolist():
            return
        new = state.sequences_host[0, state.prompt_width : int(state.lengths_host[0])]
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        if text.startswith(self.printed):
            self.out.print(text[len(self.printed) :], end="", markup=False, highlight=False, soft_wrap=True)
            self.printed = text


@app.command()
def generate(
    prompts: list[str] = typer.Argument(..., help="One or more prompts (several run as one batch)"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", min=1, help="Tokens to generate per prompt"),
    drafter: Optional[str] = typer.Option(None, help="Drafter name, overriding the config's"),
    policy: Optional[str] = typer.Option(None, help="Lookahead policy name, overriding the config's"),
    trace: Optional[Path] = typer.Option(None, help="Write a JSONL trace of every iteration to this file"),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON instead of text"),
):
    """Generate text with speculative decoding, streaming it as it is committed."""
    spec = load_config(config, drafter, policy)
    if any(not p for p in prompts):
        raise fail("empty prompt: every prompt needs some text")
    try:
        target, tokenizer = spec.load_target()
        extra = []
        if trace is not None:
            from ..observers.trace import TraceObserver

            extra.append(TraceObserver(path=str(trace)))
        stream = len(prompts) == 1 and not as_json
        if stream:
            extra.append(_Stream(tokenizer, console))
        decoder = SpeculativeDecoder.from_config(spec, target=target, extra_observers=extra)
        encoded = tokenizer(prompts, return_tensors="pt", padding=True)
        if stream:
            console.print(prompts[0], end="", markup=False, highlight=False, style="bold")
        options = {k: v for k, v in spec.sampling.items() if k != "max_new_tokens"}
        out = decoder.generate(**encoded, max_new_tokens=max_new_tokens, **options)
    except SpecdecError as exc:
        raise fail(str(exc)) from None
    width = encoded["input_ids"].shape[1]
    texts = tokenizer.batch_decode(out.sequences[:, width:], skip_special_tokens=True)
    stats = out.stats
    if as_json:
        payload = {"outputs": [{"prompt": p, "text": t} for p, t in zip(prompts, texts)], "stats": stats.as_dict()}
        print(json.dumps(payload, indent=2))
        return
    if stream:
        console.print()
    else:
        for prompt, text in zip(prompts, texts):
            console.print(f"[bold]{prompt}[/]{text}", markup=False, highlight=False)
    errors.print(
        f"[dim]{stats.new_tokens} tokens in {stats.wall_time_s:.2f}s ({stats.tokens_per_second:.1f} tok/s) · "
        f"acceptance {stats.acceptance_rate:.0%} · {stats.mean_accepted_length:.2f} tokens per target call · "
        f"drafter {decoder.drafter.name}, policy {decoder.policy.name}[/]",
        soft_wrap=True,
    )


@app.command()
def plugins(as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON")):
    """List every registered drafter, policy, verifier and observer, with options and package."""
    from ..plugins.manager import load_plugins

    loaded = load_plugins(refresh=True)
    entries = loaded.registry.entries()
    if as_json:
        print(
            json.dumps(
                {
                    "components": [
                        {
                            "kind": e.kind,
                            "name": e.name,
                            "package": e.package,
                            "plugin": e.plugin,
                            "summary": e.summary,
                            "options": [{"name": o.name, "type": o.type, "default": _jsonable(o.default)} for o in e.options()],
                        }
                        for e in entries
                    ],
                    "failures": [attrs.asdict(f) for f in loaded.failures],
                    "conflicts": loaded.registry.conflicts,
                },
                indent=2,
            )
        )
        return
    table = Table(title="specdec plugins")
    for column in ("kind", "name", "options (default)", "package", "summary"):
        table.add_column(column)
    for e in entries:
        options = ", ".join(f"{o.name}={o.default!r}" if not o.required else f"{o.name} (required)" for o in e.options())
        table.add_row(e.kind, e.name, options or "-", e.package, e.summary)
    console.print(table)
    for failure in loaded.failures:
        errors.print(
            f"[red]plugin {escape(repr(failure.plugin))} ({escape(failure.package)}) failed to load:[/] {escape(failure.error)}",
            highlight=False,
        )
    for conflict in loaded.registry.conflicts:
        errors.print(f"[yellow]{escape(conflict)}[/]", highlight=False)


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def _parse_list(value: str, what: str, cast=str) -> list:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise fail(f"--{what} needs at least one value")
    try:
        return [cast(v) for v in items]
    except ValueError:
        raise fail(f"--{what} must be a comma-separated list, got {value!r}") from None


def read_prompts(path: Path) -> list[str]:
    """One prompt per line, or JSON Lines with a "prompt" key."""
    if not path.is_file():
        raise fail(f"prompts file {str(path)!r} does not exist")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                prompts.append(json.loads(line)["prompt"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise fail(f"{path}:{number}: expected a JSON object with a \"prompt\" key") from None
        else:
            prompts.append(line)
    if not prompts:
        raise fail(f"prompts file {str(path)!r} holds no prompts")
    return prompts


@app.command()
def bench(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts", help="Prompts (.txt one per line, or .jsonl); default: the bundled held-out prompts"),
    batch_sizes: str = typer.Option("1,4,16", help="Comma-separated batch sizes"),
    drafters: Optional[str] = typer.Option(None, help="Comma-separated drafters (default: the config's)"),
    policies: Optional[str] = typer.Option(None, help="Comma-separated policies (default: the config's)"),
    num_prompts: int = typer.Option(16, min=1, help="How many prompts to run at every batch size"),
    max_new_tokens: int = typer.Option(64, min=1),
    repeats: int = typer.Option(3, min=1, help="Timed repeats; the median is reported"),
    warmup: int = typer.Option(1, min=0),
    assisted: bool = typer.Option(True, help="Also time Transformers' assisted generation"),
    temperature: float = typer.Option(0.0, min=0.0, help="Sample at this temperature (0: greedy) with the rejection verifier"),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0, help="Nucleus sampling threshold when sampling"),
    out: Path = typer.Option(Path("bench.json"), help="Where to write the results as JSON"),
):
    """Time specdec against the target alone and Transformers' assisted generation."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from ..bench import run_bench

    sizes = _parse_list(batch_sizes, "batch-sizes", int)
    if any(size < 1 for size in sizes):
        raise fail(f"--batch-sizes must be positive integers, got {batch_sizes!r}")
    spec = load_config(config)
    drafter_names = _parse_list(drafters, "drafters") if drafters else [spec.drafter.use]
    policy_names = _parse_list(policies, "policies") if policies else [spec.policy.use]
    if prompts_file is None:
        prompts_file = Path(spec.target["model"]).parent / "prompts.jsonl"
    prompts = read_prompts(prompts_file)[:num_prompts]
    methods = [(d, p) for d in drafter_names for p in policy_names]
    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=errors, transient=True) as progress:
            task = progress.add_task("loading models")
            rows = run_bench(
                spec, prompts, sizes, methods, max_new_tokens=max_new_tokens, repeats=repeats, warmup=warmup,
                assisted=assisted, sampling={"temperature": temperature, "top_p": top_p} if temperature > 0 else None,
                on_progress=lambda message: progress.update(task, description=message),
            )
    except SpecdecError as exc:
        raise fail(str(exc)) from None

    mode = f"sampled (temperature {temperature}, top-p {top_p})" if temperature > 0 else "greedy"
    table = Table(title=f"specdec bench · {len(prompts)} prompts · {max_new_tokens} new tokens · {mode} · median of {repeats}")
    for column in ("batch", "method", "tok/s", "vs target", "vs assisted", "accept", "tokens/call", "c", "ideal", "of ideal", "exact"):
        table.add_column(column, justify="right" if column not in ("method",) else "left")

    def fmt(value, pattern="{:.2f}"):
        return "-" if value is None else pattern.format(value)

    for row in rows:
        exact = "-" if row.exact is None else ("yes" if row.exact else "[red]NO[/]")
        method = row.method + (f" [dim]({row.note})[/]" if row.note else "")
        table.add_row(
            str(row.batch_size), method, fmt(row.tokens_per_s, "{:.1f}"), fmt(row.speedup_vs_target, "{:.2f}x"),
            fmt(row.speedup_vs_assisted, "{:.2f}x"), fmt(row.acceptance_rate, "{:.0%}"), fmt(row.mean_accepted_length),
            fmt(row.cost_ratio, "{:.3f}"), fmt(row.ideal_speedup, "{:.2f}x"), fmt(row.ratio_to_ideal, "{:.0%}"), exact,
        )
    # A piped table keeps its columns readable rather than wrapping at 80.
    (console if console.is_terminal else Console(width=220)).print(table)
    out.write_text(
        json.dumps(
            {
                "config": spec.source,
                "prompts": str(prompts_file),
                "num_prompts": len(prompts),
                "max_new_tokens": max_new_tokens,
                "repeats": repeats,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "results": [attrs.asdict(r) for r in rows],
            },
            indent=2,
        )
    )
    errors.print(f"[dim]results written to {out}[/]")
    if any(row.exact is False for row in rows):
        raise typer.Exit(code=1)


def _mount_subcommands() -> None:
    # Both modules import their heavy dependencies (audio, training) inside the commands.
    from .policy import policy_app
    from .transcribe import transcribe_command

    app.add_typer(policy_app, name="policy")
    app.command("transcribe")(transcribe_command)


_mount_subcommands()


def main():  # pragma: no cover - console script entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
