"""``specdec generate``: prompts in, the target's own continuation out.

stdout carries only the text: each row's prompt followed by its continuation and a newline, byte
for byte what the tokenizer decodes (no wrapping, no markup, no tab expansion). On a terminal the
prompt is bold (an escape code around it, the characters unchanged); stats, progress and row
separators go to stderr.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from .common import (CONFIG_HELP, colour, fail, is_terminal, load_config, set_up_logging, stderr_console,
                     with_policy_memory, write_stdout)

OPTION_HELP = "A {kind} option, typed as the plugin declares it (repeatable; `specdec plugins` lists them)"


def _stream_observer(tokenizer, bold: bool):
    from ..core.components import Observer

    class Stream(Observer):
        """Write row 0's text as it is committed. Text whose decoding may still change (a partial
        UTF-8 character, the last word and the space before it) is held back until the next
        step or the end, so what is written is always a prefix of the final text."""

        name = "stream"

        def __init__(self):
            self.printed = ""

        def begin(self, state, target):
            self.printed = ""
            self.prompt_width = state.prompt_width

        def on_step(self, state, step):
            if 0 not in step.rows_host.tolist():
                return
            new = state.sequences_host[0, state.prompt_width : int(state.lengths_host[0])]
            text = tokenizer.decode(new, skip_special_tokens=True)
            stable = text.rstrip("\ufffd")
            cut = max(stable.rfind(" "), stable.rfind("\n"), stable.rfind("\t"))
            stable = stable[:cut] if cut > 0 else ""
            if stable.startswith(self.printed) and len(stable) > len(self.printed):
                write_stdout(stable[len(self.printed) :])
                self.printed = stable

        def finish(self, text: str) -> bool:
            """Write the rest of the final text; False if what was streamed is not its prefix."""
            if not text.startswith(self.printed):
                return False
            write_stdout(text[len(self.printed) :] + "\n")
            return True

    return Stream()


def _effective_options(registry, spec) -> dict[str, Any]:
    """The component's name (as listed) and every option it ran with (defaults included), as JSON."""
    entry = registry.get(spec.kind, spec.use)
    options = {o.name: spec.options.get(o.name, None if o.required else o.default) for o in entry.options()}
    return {"name": entry.name, "options": {k: _jsonable(v) for k, v in options.items()}}


def _jsonable(value):
    if isinstance(value, Path):
        return str(value)
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def _bundled_classifier(spec) -> Optional[Path]:
    """The bundled pair's classifier, when the target is the bundled pair's target."""
    from .. import bundled_pair_path

    try:
        pair = bundled_pair_path()
    except FileNotFoundError:
        return None
    target = Path(str(spec.target["model"])).expanduser()
    if target.exists() and target.resolve() == (pair / "target").resolve() and (pair / "classifier.safetensors").is_file():
        return pair / "classifier.safetensors"
    return None


def _missing_option_hint(kind: str, spec, config) -> str:
    from ..plugins.registry import canonical

    if kind == "drafter" and canonical(spec.use) == "fallback":
        return (f"; add the tables [drafter.first] and [drafter.then] to {config.source}, each with "
                'use = "<drafter>" and its options (docs/strategies.md)')
    hint = f"; set it in the [{kind}] table of {config.source} or pass --{kind}-option NAME=VALUE"

    if kind == "policy" and canonical(spec.use) == "classifier":
        hint += " (weights: a file written by `specdec policy train`"
        try:
            from .. import bundled_pair_path

            bundled = bundled_pair_path() / "classifier.safetensors"
            relative = os.path.relpath(bundled, Path(config.source).resolve().parent)
            hint += f"; the bundled pair's is weights = \"{relative}\", relative to {config.source}"
        except (FileNotFoundError, ValueError):
            pass
        hint += ")"
    return hint


def generate(
    prompts: list[str] = typer.Argument(..., help="One or more prompts (several run as one batch)"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", min=1, help="Tokens to generate per prompt"),
    drafter: Optional[str] = typer.Option(None, "--drafter", help="Drafter name, overriding the config's"),
    policy: Optional[str] = typer.Option(None, "--policy", help="Lookahead policy name, overriding the config's"),
    verifier: Optional[str] = typer.Option(None, "--verifier", help="Verifier name (greedy, rejection), overriding the config's"),
    drafter_options: list[str] = typer.Option([], "--drafter-option", "-D", metavar="NAME=VALUE", help=OPTION_HELP.format(kind="drafter")),
    policy_options: list[str] = typer.Option([], "--policy-option", "-P", metavar="NAME=VALUE", help=OPTION_HELP.format(kind="policy")),
    verifier_options: list[str] = typer.Option([], "--verifier-option", "-V", metavar="NAME=VALUE", help=OPTION_HELP.format(kind="verifier")),
    temperature: Optional[float] = typer.Option(None, "--temperature", "-t", min=0.0, help="Sample at this temperature (0: greedy); picks the rejection verifier unless --verifier is given"),
    top_p: Optional[float] = typer.Option(None, "--top-p", min=0.0, max=1.0, help="Nucleus sampling threshold (needs sampling)"),
    top_k: Optional[int] = typer.Option(None, "--top-k", min=0, help="Sample among the K most likely tokens (needs sampling; 0: no cut; unset: the model's or transformers' default, 50)"),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling: a reproducible run with a policy whose k does not follow timings (--policy constant)"),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Write a JSONL trace of every iteration to this file"),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON (texts, stats, components) instead of text"),
    chat: bool = typer.Option(False, "--chat", help="Send each prompt as a user turn through the tokenizer's chat template; print only the answer"),
    progress: Optional[bool] = typer.Option(None, "--progress/--no-progress", help="Progress bar on stderr (default: when stderr is a terminal and the text is not streamed there)"),
):
    """Generate text with speculative decoding: stdout gets each prompt and its continuation, unchanged.

    One prompt streams as it is committed; several run as one batch, with a progress bar on stderr, and are written when it ends. Stats go to stderr; --json gives texts, stats and the components with their options.
    """
    if any(not p for p in prompts):
        raise fail("empty prompt: every prompt needs some text")
    from ..config import parse_options
    from ..errors import SpecdecError
    from ..plugins.manager import get_registry
    from ..plugins.registry import canonical

    spec = load_config(config)
    sampling: dict[str, Any] = {k: v for k, v in spec.sampling.items() if k != "max_new_tokens"}
    if temperature is not None:
        if temperature == 0:
            sampling["do_sample"] = False
            for key in ("temperature", "top_p", "top_k"):
                sampling.pop(key, None)
        else:
            sampling.update(do_sample=True, temperature=temperature)
            if verifier is None and canonical(spec.verifier.use) == "greedy":
                verifier = "rejection"  # greedy verification cannot sample
    for flag, key, value in (("--top-p", "top_p", top_p), ("--top-k", "top_k", top_k)):
        if value is not None:
            if not sampling.get("do_sample"):
                raise fail(f"{flag} needs sampling: add --temperature T (T > 0), or set do_sample = true in [sampling]")
            sampling[key] = value

    try:
        registry = get_registry()
        spec = spec.with_choices(drafter=drafter, policy=policy, verifier=verifier)
        spec = spec.with_choices(
            drafter_options=parse_options("drafter", spec.drafter.use, drafter_options, "--drafter-option"),
            policy_options=parse_options("policy", spec.policy.use, policy_options, "--policy-option"),
            verifier_options=parse_options("verifier", spec.verifier.use, verifier_options, "--verifier-option"),
        )
        if canonical(spec.policy.use) == "classifier" and "weights" not in spec.policy.options:
            bundled = _bundled_classifier(spec)
            if bundled is not None:
                spec = spec.with_choices(policy_options={"weights": str(bundled)})
                stderr_console().print(f"[dim]policy classifier: the bundled pair's weights, {bundled}[/]")
        spec = with_policy_memory(spec, sampling)
        if seed is not None and sampling.get("do_sample") and canonical(spec.policy.use) == "cost-aware":
            # The draws a row takes depend on the k of each iteration, and cost-aware chooses k from
            # timings: the seed fixes the sampler, not the text (its distribution is the same).
            stderr_console().print("[dim]note: cost-aware chooses k from measured times, so a seeded sampled run can "
                                   "differ between runs; --policy constant reproduces it exactly[/]")
        # Every option is checked before a model is loaded: a mistake costs no waiting.
        for component in (spec.drafter, spec.policy, spec.verifier, *spec.observers):
            try:
                registry.check(component.kind, component.use, component.options, where=spec.source)
            except SpecdecError as exc:
                if "missing required option" in str(exc):
                    raise fail(str(exc) + _missing_option_hint(component.kind, component, spec)) from None
                raise
    except SpecdecError as exc:
        raise fail(str(exc)) from None

    set_up_logging()
    import torch

    from ..decoding import SpeculativeDecoder

    stream = len(prompts) == 1 and not as_json
    if progress is None:
        progress = is_terminal(sys.stderr) and not (stream and is_terminal(sys.stdout))
    bold = colour(sys.stdout)
    try:
        target, tokenizer = spec.load_target()
        extra = []
        if trace is not None:
            from ..observers.trace import TraceObserver

            extra.append(TraceObserver(path=str(trace)))
        streamer = _stream_observer(tokenizer, bold) if stream else None
        if streamer is not None:
            extra.append(streamer)
        if progress:
            from ..observers.progress import ProgressObserver

            extra.append(ProgressObserver(description=f"{len(prompts)} prompt(s)"))
        decoder = SpeculativeDecoder.from_config(spec, target=target, extra_observers=extra)
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise fail(f"--chat needs a tokenizer with a chat template; {spec.target.get('tokenizer', spec.target['model'])} "
                           "has none (drop --chat to send the prompts as plain text)")
            turns = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                   add_generation_prompt=True) for p in prompts]
            encoded = tokenizer(turns, return_tensors="pt", padding=True, add_special_tokens=False)
        else:
            encoded = tokenizer(prompts, return_tensors="pt", padding=True)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=target.device).manual_seed(seed)
        if streamer is not None and not chat:
            write_stdout(f"\x1b[1m{prompts[0]}\x1b[22m" if bold else prompts[0])
        out = decoder.generate(**encoded, max_new_tokens=max_new_tokens, generator=generator, **sampling)
    except SpecdecError as exc:
        if stream:
            write_stdout("\n")
        raise fail(str(exc)) from None
    width = encoded["input_ids"].shape[1]
    texts = tokenizer.batch_decode(out.sequences[:, width:], skip_special_tokens=True)
    stats = out.stats
    components = {kind: _effective_options(registry, getattr(spec, kind)) for kind in ("drafter", "policy", "verifier")}
    if as_json:
        payload = {
            "outputs": [{"prompt": p, "text": t} for p, t in zip(prompts, texts)],
            "stats": stats.as_dict(),
            "components": components,
            "sampling": {k: _jsonable(v) for k, v in sampling.items()},
            "seed": seed,
            "config": spec.source,
        }
        write_stdout(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
        return
    errors = stderr_console()
    if streamer is not None:
        if not streamer.finish(texts[0]):  # pragma: no cover - a tokenizer that rewrote held-back text
            write_stdout("\n")
            errors.print("[yellow]Warning:[/] the streamed text differs from the final decode; the final text:")
            write_stdout(("" if chat else prompts[0]) + texts[0] + "\n")
    else:
        separate = len(prompts) > 1 and is_terminal(sys.stderr) and is_terminal(sys.stdout)
        for number, (prompt, text) in enumerate(zip(prompts, texts), 1):
            if separate:
                errors.rule(f"[dim]{number}/{len(prompts)}[/]", style="dim")
            shown = "" if chat else (f"\x1b[1m{prompt}\x1b[22m" if bold else prompt)
            write_stdout(shown + text + "\n")
    names = {kind: value["name"] for kind, value in components.items()}
    alternatives = (f"alternatives read in {stats.alternatives_read} of {stats.iterations} verifies, "
                    f"{stats.alternatives_taken} taken · ") if stats.alternatives_read else ""
    errors.print(
        f"[dim]{stats.new_tokens} tokens in {stats.wall_time_s:.2f}s ({stats.tokens_per_second:.1f} tok/s) · "
        f"acceptance {stats.acceptance_rate:.0%} · {stats.mean_accepted_length:.2f} tokens per target call · "
        f"{alternatives}drafter {names['drafter']}, policy {names['policy']}, verifier {names['verifier']}[/]"
    )
