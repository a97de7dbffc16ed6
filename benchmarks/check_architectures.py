"""Architecture sweep: is specdec's greedy output token-identical to ``target.generate`` everywhere?

For every decoder-only causal-LM architecture of the installed transformers
(``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, encoder-decoder configs left out) this builds a tiny random
float64 model from its config (``tests/architectures.py``: 2-4 layers, width 64, vocabulary 128,
sliding windows and attention chunks of 8 tokens), decodes 24 new tokens with specdec and with
``target.generate(do_sample=False)`` and compares them, on a left-padded batch of three prompts of
different lengths and on each prompt alone, for the ``model`` drafter (a perturbed copy of the
target) and the ``ngram`` drafter, each with ``ConstantLookahead(k=4)`` and ``HeuristicLookahead()``.

Verdicts, worst first:
  CRASH     specdec raised something other than a deliberate refusal (type, message, innermost specdec frame)
  MISMATCH  a token differs from generate (first configuration / row / position), or
            MISMATCH(logits): every token agrees but the scores the verifier saw differ from the
            target's logits on the final sequences (one plain forward, same mask) by more than 1e-6
  REFUSED   specdec raised a SpecdecError before decoding (the message, and where transformers' own
            generate gives rows of the batch other tokens than each row alone, that proof)
  EXACT     every configuration token-identical, and the logits agree
  SKIP      the model cannot be built, or transformers' own generate fails (the reason)

Each architecture runs in a forked child with a time limit, so one hang cannot stall the sweep.

    python benchmarks/check_architectures.py [--only llama,mistral] [--json out.json] [--markdown docs/architectures.md]

``--accelerator-path`` decodes as on a GPU, on the CPU: every forward gets the 4D mask specdec
prepares off the CPU (where ``CausalLMRunner.prepares_masks_off_cpu`` says it would) and drafts run
to their full width with stopped rows masked (``draft_early_exit=False``).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import multiprocessing
import os
import platform
import sys
import time
import traceback
from pathlib import Path

from family_setup import ROOT, arch_lib  # first: the checkout on the path, one thread, quiet warnings

import attrs  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from specdec import PluginError, SpecdecError, SpeculativeDecoder  # noqa: E402
from specdec.core.packed_linear import cpu_name  # noqa: E402
from specdec.core.models import reread_reason  # noqa: E402
from specdec.drafters import ModelDrafter, NGramDrafter  # noqa: E402
from specdec.policies import ConstantLookahead, HeuristicLookahead  # noqa: E402
from specdec.verifiers import GreedyVerifier  # noqa: E402

NEW_TOKENS = 24
LENGTHS = (11, 16, 20)
# Rotary tables are float32 even in float64 models, so positions of a cache with holes and of a
# plain forward round differently: gaps up to ~1e-6 (more where a model scales its logits, as
# Granite does). A wrong mask or position moves logits by orders of magnitude more.
LOGIT_TOLERANCE = 1e-5


def _recurrent(model) -> bool:
    """Whether the model keeps a recurrent state (a linear-attention cache layer: Mamba, gated delta
    nets, short convolutions)."""
    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    try:
        layers = DynamicCache(config=model.config).layers
    except Exception:  # noqa: BLE001
        return False
    return any(isinstance(layer, LinearAttentionCacheLayerMixin) for layer in layers)


ORDER = ["CRASH", "MISMATCH", "REFUSED", "EXACT", "SKIP"]
DRAFTERS = ("model", "ngram")
POLICIES = ("constant", "heuristic")


@attrs.define(eq=False)
class RecordingVerifier(GreedyVerifier):
    """Greedy, and keeps what it saw: ``(rows, committed lengths, scores, accepted)`` per call.

    ``scores`` are the fp32 scores the verifier receives; ``raw`` (when the target's forward hook
    of ``_LogitTap`` is installed) the float64 logits of the same target forward, so the probe can
    compare at float64 precision instead of at fp32 rounding.
    """

    tap: object = None
    records: list = attrs.field(factory=list)

    def verify(self, state, draft, scores):
        verdict = super().verify(state, draft, scores)
        raw = None
        if self.tap is not None and self.tap.parts:
            raw = self.tap.take()
            # A draft's first-position alternatives are read after the chain: the last columns.
            siblings = draft.alternatives.shape[1] if draft.alternatives is not None and \
                self.tap.decoder._reads_alternatives(state) else 0
            raw = raw[:, raw.shape[1] - scores.shape[1] - siblings : raw.shape[1] - siblings].double().cpu()
        self.records.append((
            state.rows_host.clone(),
            state.lengths_host[state.rows_host].clone(),
            scores.detach().double().cpu() if raw is None else raw,
            verdict.accepted.cpu(),
        ))
        return verdict


class _LogitTap:
    """A forward hook on the target that keeps the logits of its forwards since the last verify
    (float64): one forward per verify, or one per column for recurrent models. The model's batch
    may still hold rows that finished (they leave lazily, core/cache.py): ``decoder``'s target cache
    maps its rows back to the active ones."""

    def __init__(self, model):
        self.parts = []
        self.decoder = None
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        logits = getattr(output, "logits", None)
        if logits is not None:
            self.parts.append(logits.detach())

    def take(self):
        logits, self.parts = torch.cat(self.parts, dim=1), []
        return self.decoder._target.slots.to_active(logits)

    def remove(self):
        self.handle.remove()


def _policy(name):
    return ConstantLookahead(k=4) if name == "constant" else HeuristicLookahead()


ALTERNATIVES = 0  # the model drafter's first-position alternatives (--alternatives)
ACCELERATOR_PATH = False  # decode as on a GPU (--accelerator-path)


def _drafter(name, draft_model):
    return ModelDrafter(draft_model, alternatives=ALTERNATIVES) if name == "model" else NGramDrafter(max_ngram=3)


def _innermost_specdec_frame(exc: BaseException) -> str | None:
    """``file:line in function`` of the deepest specdec frame of ``exc`` or of what it wraps."""
    found = None
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        for frame in traceback.extract_tb(exc.__traceback__):
            if f"{os.sep}specdec{os.sep}" in frame.filename and f"{os.sep}tests{os.sep}" not in frame.filename:
                found = f"{Path(frame.filename).relative_to(ROOT) if str(frame.filename).startswith(str(ROOT)) else frame.filename}:{frame.lineno} in {frame.name}"
        exc = exc.__cause__ or exc.__context__
    return found


def _innermost_frame(exc: BaseException) -> str:
    while (exc.__cause__ or exc.__context__) is not None:
        exc = exc.__cause__ or exc.__context__
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    frame = frames[-1]
    name = frame.filename.split("site-packages/")[-1]
    return f"{name}:{frame.lineno} in {frame.name}"


def _message(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text[:300]


def _cache_layers(model) -> str:
    """The cache layer classes transformers' own generate would use for this model."""
    try:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        names = [type(layer).__name__.replace("Dynamic", "").replace("Layer", "") or "Dynamic" for layer in cache.layers]
        if not names:
            return "Dynamic (lazy)"
        counts = {}
        for name in names:
            counts[name] = counts.get(name, 0) + 1
        return ", ".join(f"{name}x{n}" for name, n in counts.items())
    except Exception as exc:  # noqa: BLE001
        return f"? ({type(exc).__name__})"


def _full_mask(mask: torch.Tensor, total: int) -> torch.Tensor:
    return torch.cat([mask, torch.ones(mask.shape[0], total - mask.shape[1], dtype=mask.dtype)], dim=1)


def _plain_forward(model, sequences, mask):
    """One forward over whole left-padded sequences, with the position ids generate would use
    (counting real tokens only) where the model takes them."""
    full = _full_mask(mask, sequences.shape[1])
    kwargs = {}
    if "position_ids" in inspect.signature(model.forward).parameters:
        kwargs["position_ids"] = (full.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=sequences, attention_mask=full, **kwargs).logits


def _logit_gap(model, sequences, mask, records, generated=None) -> float:
    """Largest |score the verifier saw - target logit from one plain forward over the final sequences|
    over every position the verifier scored that lies on the final sequence.

    ``generated`` ([B, new tokens, V], generate's own step logits, fp32) replaces the plain forward
    where one plain forward is not what generate computes (see ``_generate_is_the_reference``)."""
    if generated is None:
        logits = _plain_forward(model, sequences, mask).double()
    else:  # generate's step i scored the token at position prompt width + i
        logits = torch.zeros(sequences.shape[0], sequences.shape[1], generated.shape[-1], dtype=torch.float64)
        start = sequences.shape[1] - generated.shape[1] - 1
        logits[:, start:start + generated.shape[1]] = generated.double()
    worst = 0.0
    for rows, lengths, scores, accepted in records:
        for b in range(rows.shape[0]):
            row, length = int(rows[b]), int(lengths[b])
            for j in range(int(accepted[b]) + 1):  # positions 0..accepted follow committed tokens
                at = length - 1 + j
                if at >= sequences.shape[1] - 1:
                    break
                gap = (scores[b, j] - logits[row, at]).abs().max().item()
                worst = max(worst, gap)
    return worst


def _generate_is_the_reference(model) -> bool:
    """Whether the probe compares with generate's own step logits instead of one plain forward over
    the final sequences: for models where the two differ by design. A re-read model's logits may
    depend on later tokens (CPM-Ant's padding count, XLM's appended mask token), a window only
    generate's cache applies (Moshi) is absent from a plain forward, and a recurrent model's plain
    forward reads the whole sequence in one chunked scan that transformers computes in float32
    (Zamba2's Mamba-2 layers: 2.8e-4 from generate's one-token steps, which specdec takes too).
    The step logits are float32, so these gaps are ~1e-7 where the plain forward's are ~1e-15."""
    from specdec.core.masks import EVICTED, AttentionLayout

    return reread_reason(model) is not None or EVICTED in AttentionLayout.of(model).kinds or _recurrent(model)


def _inputs():
    ids, mask = arch_lib.ragged_batch(LENGTHS)
    cases = [("batch", ids, mask)]
    for row in range(ids.shape[0]):
        keep = mask[row].bool()
        cases.append((f"row{row}", ids[row, keep][None], mask[row, keep][None]))
    return cases


_PHASE = None  # a shared multiprocessing.Value in a sweep child: 0 building / generate, 1 specdec


def _enter_specdec_phase():
    if _PHASE is not None:
        _PHASE.value = 1


def check_architecture(arch: str, quick: bool = False) -> dict:
    """Run every configuration on one architecture; return its result record."""
    result = {"arch": arch, "verdict": None, "detail": "", "configs": [], "class": None}
    started = time.perf_counter()
    try:
        result["class"] = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[arch]
        target = arch_lib.tiny_model(arch)
        draft = arch_lib.tiny_model(arch, draft=True)
    except Exception as exc:  # noqa: BLE001
        result.update(verdict="SKIP", detail=f"cannot build: {_message(exc)}")
        return result
    result["params"] = sum(p.numel() for p in target.parameters())
    result["cache_layers"] = _cache_layers(target)
    result["attn"] = target.config._attn_implementation

    cases = _inputs()
    references = {}
    generated = {}  # generate's own step logits, where they are the probe's reference
    own_logits = _generate_is_the_reference(target)
    for name, ids, mask in cases:
        try:
            with torch.no_grad():
                ref = arch_lib.reference_generate(target, ids, mask, max_new_tokens=NEW_TOKENS,
                                                  output_logits=own_logits, return_dict_in_generate=own_logits)
                if own_logits:
                    generated[name] = torch.stack(ref.logits, dim=1)  # [B, new tokens, V]
                    ref = ref.sequences
                logits = _plain_forward(target, ref, mask)
        except Exception as exc:  # noqa: BLE001
            result.update(verdict="SKIP", detail=f"generate fails ({name}): {_message(exc)} at {_innermost_frame(exc)}")
            return result
        if not torch.isfinite(logits).all():
            result.update(verdict="SKIP", detail=f"the target's logits are not finite ({name})")
            return result
        references[name] = ref
    # Rows on which transformers' generate itself gives the batch another output than the row alone:
    # where specdec refuses a request, this is the proof that there is no one output to match.
    batch = references["batch"]
    result["generate_differs"] = [row for row in range(batch.shape[0]) if not torch.equal(
        batch[row, -NEW_TOKENS:], references[f"row{row}"][0, -NEW_TOKENS:])]
    # A re-read model (no cache) runs whole sequences, rows of one length at a time: its forwards are
    # not the verification block, so the probe compares the verifier's (fp32) scores instead.
    reread = reread_reason(target) is not None
    result["reread"] = reread

    _enter_specdec_phase()
    drafted = accepted = 0
    configs = [(d, p) for d in DRAFTERS for p in POLICIES]
    for drafter_name, policy_name in configs:
        for name, ids, mask in cases:
            if quick and name != "batch" and (drafter_name, policy_name) != ("model", "constant"):
                continue
            label = f"{drafter_name}/{policy_name}/{name}"
            record = {"config": label}
            tap = None if reread else _LogitTap(target)
            verifier = RecordingVerifier(tap=tap)
            try:
                decoder = SpeculativeDecoder(
                    target=target, drafter=_drafter(drafter_name, draft), policy=_policy(policy_name), verifier=verifier,
                    draft_early_exit=False if ACCELERATOR_PATH else None,
                )
                if tap is not None:
                    tap.decoder = decoder
                out = decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
            except Exception as exc:  # noqa: BLE001
                if tap is not None:
                    tap.remove()
                refused = isinstance(exc, SpecdecError) and not isinstance(exc, PluginError) and not verifier.records
                record.update(
                    status="REFUSED" if refused else "CRASH",
                    error=_message(exc.__cause__ if isinstance(exc, PluginError) and exc.__cause__ else exc),
                    wrapper=_message(exc) if isinstance(exc, PluginError) else None,
                    specdec_frame=_innermost_specdec_frame(exc),
                    frame=_innermost_frame(exc),
                    verify_calls=len(verifier.records),
                )
                result["configs"].append(record)
                continue
            if tap is not None:
                tap.remove()
            ref = references[name]
            got = out.sequences
            if got.shape != ref.shape or not torch.equal(got, ref):
                width = min(got.shape[1], ref.shape[1])
                diff = (got[:, :width] != ref[:, :width]).nonzero()
                if diff.numel():
                    row, col = (int(v) for v in diff[0])
                    where = f"row {row}, new token {col - ids.shape[1]}: specdec {int(got[row, col])}, generate {int(ref[row, col])}"
                else:
                    where = f"lengths differ: specdec {tuple(got.shape)}, generate {tuple(ref.shape)}"
                record.update(status="MISMATCH", where=where)
            else:
                gap = _logit_gap(target, got, mask, verifier.records, generated.get(name))
                record.update(status="EXACT" if gap <= LOGIT_TOLERANCE else "MISMATCH(logits)", logit_gap=gap)
            stats = out.stats
            if drafter_name == "model":
                drafted += stats.drafted
                accepted += stats.accepted
            result["configs"].append(record)

    result["acceptance"] = accepted / drafted if drafted else None
    statuses = [c["status"] for c in result["configs"]]
    gaps = [c["logit_gap"] for c in result["configs"] if "logit_gap" in c]
    result["max_logit_gap"] = max(gaps) if gaps else None
    for verdict in ("CRASH", "MISMATCH", "MISMATCH(logits)", "REFUSED"):
        if verdict in statuses:
            first = result["configs"][statuses.index(verdict)]
            bad = sum(s == verdict for s in statuses)
            if verdict == "MISMATCH":
                detail = f"{first['config']}: {first['where']}"
            elif verdict == "MISMATCH(logits)":
                detail = f"{first['config']}: tokens agree, logits off by {first['logit_gap']:.2e}"
            elif verdict == "CRASH":
                detail = f"{first['config']}: {first['error']} [specdec: {first['specdec_frame']}; raised at {first['frame']}]"
            else:
                detail = f"{first['config']}: {first['error']}"
                if result["generate_differs"]:
                    detail += (f" [proof: transformers' generate gives batch rows {result['generate_differs']} other "
                               "tokens than each row alone]")
            others = sorted({s for s in statuses if s != verdict})
            result.update(verdict=verdict, detail=f"{detail} ({bad}/{len(statuses)} configs {verdict}"
                          + (f"; others {', '.join(others)}" if others else "") + ")")
            break
    else:
        result.update(verdict="EXACT", detail=f"{len(statuses)} configs; max logit gap {result['max_logit_gap']:.1e}")
    result["seconds"] = round(time.perf_counter() - started, 2)
    return result


def _child(arch, quick, connection, phase):
    global _PHASE
    _PHASE = phase
    try:
        result = check_architecture(arch, quick)
    except BaseException as exc:  # noqa: BLE001
        result = {"arch": arch, "verdict": "CRASH", "detail": f"sweep harness: {_message(exc)}", "configs": []}
    connection.send(result)
    connection.close()


def run_isolated(arch: str, timeout: float, quick: bool) -> dict:
    """``check_architecture`` in a forked child, killed after ``timeout`` seconds."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    phase = context.Value("i", 0)
    process = context.Process(target=_child, args=(arch, quick, send, phase), daemon=True)
    started = time.perf_counter()
    process.start()
    send.close()
    result = None
    if receive.poll(timeout):
        try:
            result = receive.recv()
        except EOFError:
            result = None
    process.join(5)
    if process.is_alive():
        process.kill()
        process.join()
    if result is None:
        elapsed = time.perf_counter() - started
        reason = f"timed out after {timeout:.0f} s" if elapsed >= timeout else f"worker died (exit code {process.exitcode})"
        # A hang while building the model or in transformers' own generate is no verdict on specdec.
        where = "in specdec" if phase.value else "building the model or in generate"
        verdict = "CRASH" if phase.value else "SKIP"
        result = {"arch": arch, "verdict": verdict, "detail": f"sweep harness: {reason} {where}", "configs": []}
    result.setdefault("seconds", round(time.perf_counter() - started, 2))
    return result


def architectures() -> tuple[list[str], list[tuple[str, str]]]:
    """Decoder-only causal-LM architectures, and those left out (with why)."""
    kept, left_out = [], []
    for arch in sorted(transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = arch_lib.config_class(arch)()
        except Exception:  # noqa: BLE001
            kept.append(arch)  # the default config does not build: the sweep reports it as SKIP
            continue
        if config.is_encoder_decoder:
            left_out.append((arch, "encoder-decoder config"))
        else:
            kept.append(arch)
    return kept, left_out


def summary_lines(results: list[dict]) -> list[str]:
    counts = {}
    for result in results:
        key = "MISMATCH" if result["verdict"].startswith("MISMATCH") else result["verdict"]
        counts[key] = counts.get(key, 0) + 1
    return [", ".join(f"{verdict} {counts[verdict]}" for verdict in ORDER if verdict in counts)]


def _sort_key(result):
    verdict = "MISMATCH" if result["verdict"].startswith("MISMATCH") else result["verdict"]
    return ORDER.index(verdict), result["arch"]


def family_of(arch: str) -> str:
    return next((family for family, name in arch_lib.FAMILIES.items() if name == arch), "")


def markdown_table(results: list[dict]) -> str:
    lines = [
        "| architecture | family | verdict | cache layers (transformers) | model-draft acceptance | max logit gap | detail |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in sorted(results, key=_sort_key):
        acceptance = result.get("acceptance")
        gap = result.get("max_logit_gap")
        detail = result["detail"].replace("|", "\\|")
        lines.append(
            f"| {result['arch']} | {family_of(result['arch'])} | {result['verdict']} | {result.get('cache_layers', '')} | "
            f"{'' if acceptance is None else f'{acceptance:.0%}'} | {'' if gap is None else f'{gap:.1e}'} | {detail} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="comma-separated architectures (model_type names), e.g. llama,mistral")
    parser.add_argument("--families", action="store_true", help="only the representative of each family")
    parser.add_argument("--json", help="write every result (all configurations) to this file")
    parser.add_argument("--markdown", help="write the summary table to this markdown file")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per architecture (default 60)")
    parser.add_argument("--alternatives", type=int, default=0,
                        help="the model drafter verifies this many first-position alternatives too (a token tree)")
    parser.add_argument("--quick", action="store_true",
                        help="single-prompt runs only for model/constant (the batch runs for every combination)")
    parser.add_argument("--accelerator-path", action="store_true",
                        help="decode as on a GPU: prepared 4D masks, drafts to full width (see above)")
    args = parser.parse_args(argv)
    global ALTERNATIVES, ACCELERATOR_PATH
    ALTERNATIVES = args.alternatives
    ACCELERATOR_PATH = args.accelerator_path
    if ACCELERATOR_PATH:  # before the children fork: they inherit it
        from specdec.core import models

        models.PREPARE_MASKS_ON_CPU = True

    kept, left_out = architectures()
    if args.only:
        wanted = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in kept and name not in dict(left_out)]
        if unknown:
            parser.error(f"unknown architectures: {', '.join(unknown)}")
        kept = [name for name in wanted if name in kept]
    elif args.families:
        kept = list(arch_lib.FAMILIES.values())

    started = time.perf_counter()
    results = []
    for i, arch in enumerate(kept):
        result = run_isolated(arch, args.timeout, args.quick)
        results.append(result)
        print(f"[{i + 1:3d}/{len(kept)}] {arch:28s} {result['verdict']:17s} {result.get('seconds', 0):6.1f}s  "
              f"{result['detail'][:160]}", flush=True)
    elapsed = time.perf_counter() - started

    print()
    print(f"{len(results)} architectures in {elapsed:.0f} s ({len(left_out)} encoder-decoder left out): "
          + summary_lines(results)[0])
    for result in sorted(results, key=_sort_key):
        print(f"  {result['arch']:28s} {result['verdict']:17s} {result['detail'][:200]}")

    meta = {
        "date": datetime.date.today().isoformat(),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "seconds": round(elapsed, 1),
        "left_out": left_out,
        "new_tokens": NEW_TOKENS,
        "prompt_lengths": LENGTHS,
        "quick": args.quick,
        "alternatives": args.alternatives,
        "accelerator_path": args.accelerator_path,
        "summary": summary_lines(results)[0],
    }
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str))
    if args.markdown:
        text = (f"<!-- generated by benchmarks/check_architectures.py on {meta['date']}, transformers "
                f"{meta['transformers']}, torch {meta['torch']}, {meta['cpu']}, {meta['seconds']} s -->\n\n"
                f"{meta['summary']}\n\n{markdown_table(results)}\n")
        write_markdown(Path(args.markdown), text)
    return 0


BEGIN, END = "<!-- sweep:begin -->", "<!-- sweep:end -->"


def write_markdown(path: Path, table: str) -> None:
    """Write the table; in a file that has sweep markers, replace only what lies between them."""
    block = f"{BEGIN}\n{table}{END}"
    if path.exists():
        old = path.read_text()
        if BEGIN in old and END in old:
            path.write_text(old[: old.index(BEGIN)] + block + old[old.index(END) + len(END):])
            return
    path.write_text(block + "\n")


if __name__ == "__main__":
    sys.exit(main())
