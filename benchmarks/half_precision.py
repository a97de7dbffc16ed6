"""Greedy exactness in half precision on trained models: each shipped config's rows against the
target's own ``generate`` in the same dtype, at batch 1 and batched, with every difference explained.

Issue 17 asks for half-precision exactness judged against ``generate`` in the same dtype (the share of
rows identical at batch 1 and batched, every difference explained). A GPU is not needed to measure
it: bfloat16 and float16 run on a CPU too (other kernels, the same rounding), and this script runs
on ``--device cuda`` unchanged.

For each config (the bundled pair's ``plugins.toml``, SmolLM2's shipped head, whisper-base's
``whisper.toml``), each dtype and batch size, in one process:

* ``generate`` at that batch size, with its own logits (``output_logits``), is the reference;
* ``generate`` at batch 1 is the control: how often Transformers' own rows change with the batch
  size, i.e. with the shape of its matmuls, with no speculation involved;
* specdec, the config as shipped with only ``[target] dtype`` changed (and with ``--static`` its
  cache: static shapes, whose steps attend over the cache's whole capacity).

At the first token where a specdec row leaves the reference, the script reads the target on the
shared prefix twice more, alone (batch 1, one forward of the whole prefix): in float64 (what the
two tokens score in exact arithmetic) and in the run's dtype (how far that dtype's rounding moves
the two logits, measured there). ``generate``'s own margin between its token and specdec's is
then compared with that rounding error: a margin within it is a near-tie that another shape of the
same computation can reverse, which is what speculative verification is (a (k + 1)-token block
against one-token steps). A margin far outside it would be a wrong acceptance: a bug.

    OMP_NUM_THREADS=2 python benchmarks/half_precision.py --models pair,smollm2,whisper \\
        --dtypes bfloat16,float16 --batch-sizes 1,4 --prompts 16 --json /tmp/half.json

It ends with the Markdown table of docs/benchmarks.md (``--summary F`` prints it again from a
``--json`` file) and exits 1 if a row parted at anything but a near-tie. ``--keep-every-draft`` is
the control: a verifier that keeps every draft, whose rows part beyond the line (how far says how
wide the gap is between a near-tie and a wrong token; docs/benchmarks.md, stop 67).

SmolLM2 needs ``specdec models fetch smollm2-135m-instruct``, whisper-base ``specdec models fetch
whisper-base`` and ``--audio-dir`` (``benchmarks/build_speech_eval.py``); a model that is absent
is skipped with the command that fetches it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import attrs
import torch
import transformers

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from specdec import SpeculativeDecoder  # noqa: E402
from specdec.config import SpecdecConfig  # noqa: E402
from specdec.errors import ConfigError  # noqa: E402
from specdec.exactness import Divergence, Explainer, first_divergence  # noqa: E402
from specdec.core.packed_linear import cpu_name  # noqa: E402

CONFIGS = {
    "pair": ROOT / "plugins.toml",
    "smollm2": ROOT / "models" / "smollm2-135m-instruct-head" / "plugins.toml",
    "whisper": ROOT / "models" / "whisper-base-draft" / "whisper.toml",
}


@attrs.define
class Case:
    """One row's input: what ``generate`` takes for it, batched by ``collate``."""

    name: str
    inputs: dict


class Model:
    """A config's target in one dtype, its float64 copy (made when a difference needs it), and
    how to batch its inputs, run ``generate`` and read the target on a prefix."""

    def __init__(self, name: str, dtype: torch.dtype, device: torch.device, cases_wanted: int, args):
        config = SpecdecConfig.from_toml(CONFIGS[name])
        changed = {"dtype": str(dtype).removeprefix("torch."), **({"cache": "static"} if args.static else {})}
        self.config = attrs.evolve(config, target={**config.target, **changed})
        self.name, self.dtype, self.device, self.args = name, dtype, device, args
        self.whisper = name == "whisper"
        self.target, self.tokenizer = self.config.load_target()
        self.target.to(device).eval()
        self._explain = Explainer(self.target)
        self.eos = self.target.generation_config.eos_token_id
        decoder = SpeculativeDecoder.from_config(self.config, target=self.target)
        if args.keep_every_draft:
            from tests.test_half_precision import AcceptEverything

            decoder = attrs.evolve(decoder, verifier=AcceptEverything())
        if self.whisper:
            from specdec.whisper import WhisperSpeculativeDecoder

            self.processor = self.config.load_processor()
            self.decoder = WhisperSpeculativeDecoder(decoder)
            self.cases = self._speech_cases(cases_wanted)
        else:
            self.decoder = decoder
            self.cases = self._text_cases(cases_wanted)

    # --- inputs ---------------------------------------------------------------------------------

    def _text_cases(self, count: int) -> list[Case]:
        if self.name == "pair":
            lines = (ROOT / "models" / "python-pair" / "prompts.jsonl").read_text().splitlines()
            texts = [json.loads(line)["prompt"] for line in lines]
        else:
            lines = (HERE / "smollm2_prompts.jsonl").read_text().splitlines()
            texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": json.loads(line)["prompt"]}],
                                                        tokenize=False, add_generation_prompt=True) for line in lines]
        return [Case(f"{self.name}-{i:02d}", {"text": text}) for i, text in enumerate(texts[:count])]

    def _speech_cases(self, count: int) -> list[Case]:
        import soundfile

        audio_dir = self.args.audio_dir
        utterances = json.loads((audio_dir / "utterances.json").read_text())
        short = [u for u in utterances if u["seconds"] <= 30]
        # The languages in turn, so that a few cases cover each.
        by_language: dict[str, list] = {}
        for u in short:
            by_language.setdefault(u["language"], []).append(u)
        ordered = [u for group in zip(*by_language.values()) for u in group]
        cases = []
        for u in ordered[:count]:
            audio, rate = soundfile.read(audio_dir / u["file"], dtype="float32")
            assert rate == 16000, u["file"]
            features = self.processor.feature_extractor(audio, sampling_rate=16000, return_tensors="pt")
            cases.append(Case(u["id"], {"features": features.input_features[0], "language": u["language"]}))
        return cases

    def collate(self, cases: list[Case]) -> dict:
        if self.whisper:
            features = torch.stack([c.inputs["features"] for c in cases]).to(self.device, self.dtype)
            return {"input_features": features, "language": [c.inputs["language"] for c in cases], "task": "transcribe"}
        batch = self.tokenizer([c.inputs["text"] for c in cases], return_tensors="pt", padding=True,
                               add_special_tokens=self.name == "pair")
        return {k: v.to(self.device) for k, v in batch.items()}

    # --- the three contenders -------------------------------------------------------------------

    def reference(self, batch: dict) -> tuple[list[list[int]], list[torch.Tensor], list[list[int]]]:
        """``generate``'s new tokens per row, its logits per step ([rows, vocab] each, float32), and
        what each row's new tokens follow in its sequences (Whisper's decoder prompt included)."""
        out = self.target.generate(**batch, max_new_tokens=self.args.max_new_tokens, do_sample=False,
                                   output_logits=True, return_dict_in_generate=True)
        start = out.sequences.shape[1] - len(out.logits)
        rows = out.sequences.tolist()
        return [row[start:] for row in rows], [step.float() for step in out.logits], [row[:start] for row in rows]

    def speculative(self, batch: dict) -> list[list[int]]:
        """specdec's new tokens per row (Whisper returns them without its decoder prompt, as
        ``generate`` does when not asked for a dict)."""
        if self.whisper:
            out = self.decoder.generate(batch["input_features"], language=batch["language"], task=batch["task"],
                                        max_new_tokens=self.args.max_new_tokens)
            return out.tolist()
        out = self.decoder.generate(**batch, max_new_tokens=self.args.max_new_tokens).sequences
        return out[:, batch["input_ids"].shape[1]:].tolist()

    # --- reading the target on a prefix -----------------------------------------------------------

    def prompt_of(self, case: Case, fed: list[int]) -> list[int]:
        """The prompt a row's new tokens follow, without the batch's left padding: Whisper's decoder
        prompt as ``generate`` fed it, a text's tokens as encoded alone."""
        if self.whisper:
            return fed
        return list(self.tokenizer(case.inputs["text"], add_special_tokens=self.name == "pair")["input_ids"])

    def explain(self, case: Case, prefix: list[int], theirs: int, ours: int, margin: float):
        """``exactness.Explainer``: the float64 copy of the target made once, when a difference
        first needs it: the same (rounded) weights, read in exact arithmetic."""
        inputs = {"input_features": case.inputs["features"][None]} if self.whisper else {}
        return self._explain(prefix, theirs, ours, reference_margin=margin, **inputs)


def run(model: Model, batch_size: int, solo: dict[str, list[int]] | None) -> dict:
    """One (config, dtype, batch size): the shares and every difference, per row."""
    result = dict(model=model.name, dtype=str(model.dtype).removeprefix("torch."), batch_size=batch_size,
                  static=model.config.static_cache,
                  rows=0, identical=0, generate_as_alone=0, specdec_as_alone=0, differences=[], seconds={})
    new_tokens: dict[str, list[int]] = {}
    timing = {"generate": 0.0, "specdec": 0.0}
    for first in range(0, len(model.cases) - batch_size + 1, batch_size):
        cases = model.cases[first:first + batch_size]
        batch = model.collate(cases)
        started = time.perf_counter()
        reference, logits, fed = model.reference(batch)
        timing["generate"] += time.perf_counter() - started
        started = time.perf_counter()
        ours = model.speculative(batch)
        timing["specdec"] += time.perf_counter() - started
        for r, case in enumerate(cases):
            divergence = first_divergence(reference[r], ours[r], model.eos)
            new_tokens[case.name] = reference[r]
            result["rows"] += 1
            result["identical"] += divergence is None
            if solo is not None:
                result["generate_as_alone"] += first_divergence(solo[case.name], reference[r], model.eos) is None
                result["specdec_as_alone"] += first_divergence(solo[case.name], ours[r], model.eos) is None
            if divergence is None:
                continue
            at, theirs, mine = divergence
            margin = float(logits[at][r, theirs] - logits[at][r, mine])
            why = model.explain(case, model.prompt_of(case, fed[r]) + reference[r][:at], theirs, mine, margin)
            result["differences"].append(dict(case=case.name, at=at, **attrs.asdict(why), near_tie=why.near_tie,
                                              float64_agrees_with_generate=why.float64_agrees_with_reference))
    result["seconds"] = timing
    result["new_tokens"] = new_tokens
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="pair,smollm2,whisper")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--prompts", type=int, default=16, help="rows per (model, dtype, batch size)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--audio-dir", type=Path, default=Path("/tmp/speech-eval"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--static", action="store_true",
                        help="specdec on static shapes ([target] cache = \"static\"), as an accelerator runs it")
    parser.add_argument("--keep-every-draft", action="store_true",
                        help="the control that the check can fail: specdec with a verifier that keeps every draft "
                             "(tests/test_half_precision.py's AcceptEverything); its rows should part beyond the line")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--summary", type=Path, default=None, help="only print the table of a --json file written before")
    args = parser.parse_args()
    if args.summary:
        return summarise(json.loads(args.summary.read_text()))
    transformers.logging.set_verbosity_error()  # generate's notes on Whisper's flags, once per call
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(f"{where}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    sizes = sorted({1, *(int(b) for b in args.batch_sizes.split(","))})
    results = []
    for name in args.models.split(","):
        if name == "whisper" and not (args.audio_dir / "utterances.json").is_file():
            print(f"whisper: skipped, no eval set in {args.audio_dir} (benchmarks/build_speech_eval.py --out DIR)")
            continue
        for dtype_name in args.dtypes.split(","):
            try:
                model = Model(name, getattr(torch, dtype_name), device, args.prompts, args)
            except ConfigError as exc:  # a model not fetched: the message says how to
                print(f"{name}: skipped: {exc}")
                break
            solo = None
            for batch_size in sizes:
                result = run(model, batch_size, solo)
                if batch_size == 1:
                    solo = result["new_tokens"]
                del result["new_tokens"]
                results.append(result)
                report(result)
                if args.json:
                    args.json.write_text(json.dumps(results, indent=1) + "\n")
    return summarise(results)


def summarise(results: list[dict]) -> int:
    """The Markdown table of docs/benchmarks.md (stop 66), totals per dtype, and whether every row
    that parted did so at a near-tie, judged by the current rule (``Divergence.near_tie``) from the
    numbers kept: 1 if one did not."""
    fields = attrs.fields_dict(Divergence)
    print("\n| model | dtype | batch | specdec = generate | generate = its batch-1 rows | specdec = generate's "
          "batch-1 rows | rows that part | near-ties | generate's margin (ulp) | float64 sides with generate |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
    parted, totals = [], {}
    for r in results:
        found = [Divergence(**{k: d[k] for k in fields}) for d in r["differences"]]
        parted += found
        n, first = r["rows"], r["batch_size"] == 1
        done, rows = totals.get(r["dtype"], (0, 0))
        totals[r["dtype"]] = (done + r["identical"], rows + n)
        margins = ", ".join(str(round(d.reference_margin / d.ulp)) for d in sorted(found, key=lambda d: d.reference_margin / d.ulp))
        alone = ("-", "-") if first else (f"{r['generate_as_alone']}/{n}", f"{r['specdec_as_alone']}/{n}")
        sides = sum(d.float64_agrees_with_reference for d in found) if found else "-"
        print(f"| {r['model']} | {r['dtype']} | {r['batch_size']} | {r['identical']}/{n} | {alone[0]} | {alone[1]} | "
              f"{len(found)} | {sum(d.near_tie for d in found)} | {margins or '-'} | {sides} |")
    print("\n" + "; ".join(f"{dtype}: {done}/{rows} identical" for dtype, (done, rows) in totals.items()))
    if parted:
        def line(d):
            return d.reference_margin / (2 * d.rounding + d.ulp)

        near = [d for d in parted if d.near_tie]
        wrong = [d for d in parted if not d.near_tie]
        print(f"{len(parted)} rows parted, {len(near)} at near-ties"
              + (f" (margins at most {max(map(line, near)):.2f} of the near-tie line)" if near else "")
              + (f", {len(wrong)} beyond it (margins at least {min(map(line, wrong)):.1f} times the line)" if wrong else "")
              + f"; float64 sided with generate in {sum(d.float64_agrees_with_reference for d in parted)}")
        return 1 if wrong else 0
    return 0


def report(result: dict) -> None:
    rows = result["rows"]
    alone = "" if result["batch_size"] == 1 else (
        f"; as at batch 1: generate {result['generate_as_alone']}/{rows}, specdec {result['specdec_as_alone']}/{rows}")
    seconds = result["seconds"]
    print(f"{result['model']:8s} {result['dtype']:9s} batch {result['batch_size']:2d}: specdec = generate in "
          f"{result['identical']}/{rows} rows{alone} (generate {seconds['generate']:.1f} s, specdec {seconds['specdec']:.1f} s)",
          flush=True)
    for d in result["differences"]:
        ulps = d["reference_margin"] / d["ulp"]
        print(f"    {d['case']} at new token {d['at']}: generate chose {d['reference_token']} by {d['reference_margin']:.4f} "
              f"({ulps:.0f} ulp at logit {d['logit']:.2f}) over specdec's {d['other_token']}; the dtype's rounding there "
              f"{d['rounding']:.4f}; float64 margin {d['float64_margin']:+.4f} (prefers "
              f"{'generate' if d['float64_agrees_with_generate'] else 'specdec'}'s) -> "
              f"{'near-tie' if d['near_tie'] else 'NOT A NEAR-TIE'}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
