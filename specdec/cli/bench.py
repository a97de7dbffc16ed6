"""``specdec bench``: the command around ``specdec.bench.run_bench`` (a table; JSON with --out)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .common import CONFIG_HELP, fail, is_terminal, load_config, set_up_logging, status_progress, stderr_console


def _parse_list(value: str, what: str, cast=str) -> list:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise fail(f"--{what} needs at least one value")
    try:
        return [cast(v) for v in items]
    except ValueError:
        raise fail(f"--{what} must be a comma-separated list, got {value!r}") from None


def bench(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts", help="Prompts (.txt one per line, or .jsonl); default: the held-out prompts beside the target model"),
    batch_sizes: str = typer.Option("1,4,16", help="Comma-separated batch sizes"),
    drafters: Optional[str] = typer.Option(None, help="Comma-separated drafters (default: the config's)"),
    policies: Optional[str] = typer.Option(None, help="Comma-separated policies (default: the config's)"),
    num_prompts: int = typer.Option(16, min=1, help="How many prompts to run at every batch size"),
    max_new_tokens: int = typer.Option(64, min=1),
    repeats: int = typer.Option(3, min=1, help="Timed repeats, interleaved across contenders; the median and the spread are reported"),
    warmup: int = typer.Option(1, min=0),
    assisted: bool = typer.Option(True, help="Also time Transformers' assisted generation"),
    temperature: float = typer.Option(0.0, min=0.0, help="Sample at this temperature (0: greedy) with the rejection verifier"),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0, help="Nucleus sampling threshold when sampling"),
    top_k: Optional[int] = typer.Option(None, "--top-k", min=0, help="Top-k cut when sampling (0: none; unset: the model's or transformers' default, 50)"),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the results as JSON to this file"),
    cache: Optional[str] = typer.Option(None, help="specdec's KV caches: 'dynamic' or 'static' (default: the config's [target] cache)"),
    compile_steps: Optional[str] = typer.Option(None, "--compile", help="With --cache static: torch.compile 'draft' or 'all' models' steps"),
):
    """Time specdec against the target alone and Transformers' assisted generation, interleaved."""
    from ..errors import SpecdecError
    from ..prompts import read_prompts

    sizes = _parse_list(batch_sizes, "batch-sizes", int)
    sampling = None
    if temperature > 0:
        sampling = {"temperature": temperature, "top_p": top_p, **({} if top_k is None else {"top_k": top_k})}
    elif top_k is not None:
        raise fail("--top-k needs sampling: add --temperature T (T > 0)")
    if any(size < 1 for size in sizes):
        raise fail(f"--batch-sizes must be positive integers, got {batch_sizes!r}")
    spec = load_config(config)
    overrides = {key: value for key, value in (("cache", cache), ("compile", compile_steps)) if value is not None}
    if overrides:
        import attrs

        from ..config import CACHES

        if cache is not None and cache not in CACHES:
            raise fail(f"--cache must be one of {', '.join(CACHES)}, got {cache!r}")
        spec = attrs.evolve(spec, target={**spec.target, **overrides})  # --compile is checked by the decoder
    drafter_names = _parse_list(drafters, "drafters") if drafters else [spec.drafter.use]
    policy_names = _parse_list(policies, "policies") if policies else [spec.policy.use]
    if prompts_file is None:
        prompts_file = Path(spec.target["model"]).parent / "prompts.jsonl"
    try:
        prompts = read_prompts(prompts_file)[:num_prompts]
    except SpecdecError as exc:
        raise fail(str(exc)) from None
    methods = [(d, p) for d in drafter_names for p in policy_names]

    set_up_logging()
    import attrs
    import torch
    from rich.console import Console
    from rich.table import Table

    from ..bench import run_bench

    errors = stderr_console()
    try:
        with status_progress("loading models") as on_status:
            rows = run_bench(
                spec, prompts, sizes, methods, max_new_tokens=max_new_tokens, repeats=repeats, warmup=warmup,
                assisted=assisted, sampling=sampling, on_progress=on_status,
            )
    except SpecdecError as exc:
        raise fail(str(exc)) from None

    mode = "greedy" if sampling is None else (
        f"sampled (temperature {temperature}, top-p {top_p}, top-k {'default' if top_k is None else top_k})")
    dtype = str(spec.target.get("dtype", "float32"))
    table = Table(
        title=f"specdec bench · {len(prompts)} prompts · {max_new_tokens} new tokens · {mode} · {dtype} · "
        f"{repeats} interleaved repeat(s): median [min-max]"
    )
    for column in ("batch", "method", "tok/s", "vs target", "vs assisted", "accept", "tokens/call", "c", "p", "v", "ideal", "of ideal", "ceiling", "of ceiling", "occupancy", "identical rows"):
        table.add_column(column, justify="left" if column == "method" else "right")

    def fmt(value, pattern="{:.2f}"):
        return "-" if value is None else pattern.format(value)

    noisy = False
    for row in rows:
        if row.identical_rows is None:
            identical = "-"
        else:
            identical = f"{row.identical_rows:.0%}" + (f" ({round(row.identical_rows * row.rows)}/{row.rows})" if row.rows else "")
            if row.wrong_tokens:
                identical = f"[red]{identical}, {row.wrong_tokens} wrong[/]"
            elif row.identical_rows < 1:
                identical = f"[yellow]{identical}[/]" + (f", {row.near_ties} near-tie(s)" if row.near_ties else "")
        speed = fmt(row.speedup_vs_target, "{:.2f}x")
        if row.speedup_min is not None and row.repeats > 1:
            speed += f" [dim]\\[{row.speedup_min:.2f}-{row.speedup_max:.2f}][/]"
        of_ideal = fmt(row.ratio_to_ideal, "{:.0%}")
        if row.noise:
            noisy = True
            speed = f"[yellow]noise[/] [dim]({row.speedup_vs_target:.2f}x)[/]"
            of_ideal = "[yellow]>100%: noise[/]"
        method = row.method + (f" [dim]({row.note})[/]" if row.note else "")
        table.add_row(
            str(row.batch_size), method, fmt(row.tokens_per_s, "{:.1f}"), speed,
            fmt(row.speedup_vs_assisted, "{:.2f}x"), fmt(row.acceptance_rate, "{:.0%}"), fmt(row.mean_accepted_length),
            fmt(row.cost_ratio, "{:.3f}"), fmt(row.plain_step_cost), fmt(row.verify_cost, "{:.2f}"), fmt(row.ideal_speedup, "{:.2f}x"), of_ideal,
            fmt(row.ceiling_speedup, "{:.2f}x"), fmt(row.ratio_to_ceiling, "{:.0%}"),
            fmt(row.occupancy, "{:.0%}"), identical,
        )
    # Piped, the table keeps its columns readable rather than wrapping at 80.
    (Console() if is_terminal(sys.stdout) else Console(width=240)).print(table)
    if noisy:
        errors.print("[yellow]A speedup above the ideal is timing noise (or a mis-measured cost c or p), not a result: "
                     "rerun with more --repeats on a quieter machine.[/]")
    inexact = [row for row in rows if row.identical_rows is not None and row.identical_rows < 1]
    wrong = [row for row in inexact if row.wrong_tokens]
    if inexact:
        parted = sum(round((1 - row.identical_rows) * row.rows) for row in inexact)
        near = sum(row.near_ties or 0 for row in inexact)
        errors.print(
            f"[yellow]{parted} row(s) differ from the target's own greedy output ({dtype}); {near} part at a near-tie, "
            "where the target's top two tokens are within its dtype's rounding and a (k+1)-token verification "
            "and a one-token step can choose differently (README: \"What exact means\"). In float64 any "
            "difference is a bug.[/]"
        )
        for row in inexact:
            if row.unexplained:
                errors.print(f"[yellow]batch {row.batch_size}, {row.method}: {row.unexplained}[/]")
    for row in wrong:
        errors.print(
            f"[red]batch {row.batch_size}, {row.method}: {row.wrong_tokens} row(s) part where the target ranks the "
            "chosen token clearly below its own, beyond its dtype's rounding: a wrong acceptance (a bug in the "
            "verifier or the loop, not rounding).[/]"
        )
    if out is not None:
        out.write_text(
            json.dumps(
                {
                    "config": spec.source,
                    "prompts": str(prompts_file),
                    "num_prompts": len(prompts),
                    "max_new_tokens": max_new_tokens,
                    "sampling": sampling,
                    "repeats": repeats,
                    "interleaved": True,
                    "dtype": dtype,
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "results": [attrs.asdict(r) for r in rows],
                },
                indent=2,
            )
        )
        errors.print(f"[dim]results written to {out}[/]")
    if (dtype.lower() in ("float64", "double") and inexact) or wrong:
        raise typer.Exit(code=1)  # a difference in float64, or a wrong acceptance in any dtype, is a failure
