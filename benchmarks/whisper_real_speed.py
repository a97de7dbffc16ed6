"""Speed of speculative transcription on the real whisper-base: base alone, Transformers' assisted
generation, specdec with the distilled draft, specdec with base's own decoder quantised to int8.

    python benchmarks/build_speech_eval.py --out /tmp/speech-eval
    specdec models fetch whisper-base
    OMP_NUM_THREADS=1 python benchmarks/whisper_real_speed.py --audio-dir /tmp/speech-eval --batch-sizes 1,4,16

In one process, contenders interleaved per repeat (so a change in the machine's load hits them
all), on the eval split's short English utterances (one 30-second window each; language forced to
English, task transcribe, no timestamps, greedy):

- ``base``: ``WhisperForConditionalGeneration.generate`` (float32).
- ``hf-assisted`` (batch 1; Transformers supports no other): ``generate(assistant_model=...)``
  with the distilled draft's layers under base's FULL output head (a ``WhisperForCausalLM``: the
  reduced head cannot be a Transformers assistant, whose logits must cover the vocabulary). This
  is the Distil-Whisper recipe: a shallow decoder sharing the teacher's encoder, Transformers'
  own loop. Its assistant settings are Transformers' defaults (``num_assistant_tokens`` 20,
  its own schedule), unless ``--hf-assistant-tokens`` is given.
- ``specdec``: ``WhisperSpeculativeDecoder`` with the ``shared-encoder`` drafter and the shipped
  draft (``models/whisper-base-draft``: reduced head), the policy given by ``--policy``.
- ``base-packed``: ``base`` with every call of 4 rows or more (the encoder too) on oneDNN-packed
  weights (``core/packed_linear.py``): the plain baseline that specdec's packed steps are measured
  against where a batch alone makes the linear layers cheaper.
- ``specdec-unpacked``: ``specdec`` with ``packed_weights=False``: no packed copies, the layers'
  multi-row calls on the copy-free routes measured faster (torch's own linear path before stop 65).
- ``specdec-alt1``, ``-alt2``, ``-alt3``: ``specdec`` with the draft's 1, 2 or 3 next best candidates
  for the first position verified too (``alternatives``, a token tree of one level; docs/strategies.md).
- ``specdec-fp32``, ``specdec-alt3-fp32``: ``specdec`` and ``specdec-alt3`` with the draft's linear
  layers in float32 as loaded (``matmul_precision = "highest"``); every ``specdec`` contender else
  runs the default, "auto" (bfloat16 weights where this CPU runs them faster; docs/strategies.md).
- ``specdec-unscreened``: ``specdec`` with base's ``proj_out`` read in float32 at every verify
  (``screened_head=False``); the default screens it in bfloat16 where this CPU runs that faster and
  recomputes in float32 the logits that could be the argmax (``core/screened_head.py``).
- ``specdec-draft2``: ``specdec`` with the shared-encoder draft of ``--draft2`` instead;
  ``specdec-draft2int8`` the same on int8 weights (as ``specdec-draftint8``, the shipped config).
- ``specdec-draftint8``: the shipped config: ``specdec`` with the draft's linear layers on int8
  weights (``matmul_precision = "int8"``: fbgemm's dynamic int8 linear, a scale per output row),
  the draft loaded from ``--draft`` by the drafter, which then keeps only its int8 weights;
  ``specdec-draftint8-unpacked`` the same with ``packed_weights = false`` (copy-free routes, the
  head's bfloat16 screen kept), ``specdec-draftint8-unpacked-unscreened`` with ``screened_head = false``
  too (no copy of any of base's weights).
- ``specdec-allframes``: ``specdec`` with the draft's cross-attention over all 1500 encoder frames
  (``encoder_frames = "all"``, as before stop 60) instead of the audio's.
- ``specdec-head``, ``specdec-head-alt3``: ``WhisperSpeculativeDecoder`` with the ``hidden-state``
  drafter and the head of ``--head`` (EAGLE-style: decoder layers reading base's own decoder
  states, and base's cross-attention keys and values of the layers they started from; ``specdec
  drafter train-whisper``), without and with 3 alternatives. With several heads (``--head A,B``),
  ``specdec-head2``, ``specdec-head2-alt3`` and so on for the second and later.
- ``specdec-stop21``: ``specdec`` packed by stop 21's rule (no padding to a faster wider width, the
  draft's one-token steps on torch's path; ``benchmarks/packing_rules.py``).
- ``specdec-widthon``: ``specdec`` packed by stops 22-25's rule (a weight packed only from the fewest
  rows from which packed wins at every wider trial width; ``benchmarks/packing_rules.py``).
- ``specdec-stop34``: ``specdec`` on stops 26-34's step path: its weights' shapes timed in a single
  round (``benchmarks/packing_rules.py``, rule "stop 34").
- ``base-static``: ``base`` with transformers' static cache (``cache_implementation="static"``: its
  forward compiled, CUDA graphs on CUDA), the strongest plain baseline on a GPU.
- ``specdec-static``, ``specdec-compile``: ``specdec`` on the accelerator's path, every model's cache
  preallocated (``static_cache=True``), and with it every step compiled (``compile="all"``).
- ``specdec-int8``: the same loop with base's whole decoder (its six layers and its full head)
  dynamically quantised to int8 (``torch.ao.quantization.quantize_dynamic`` on every Linear) as a
  shared-encoder draft: self-speculation, no training.

On a GPU (``--device cuda --dtype float16``; the int8 and packed contenders are the CPU's and
refused there): each batch size is warmed up first (so compiling and capturing are not timed),
every clock read waits for the device, and each contender's peak GPU memory is reported.

Per contender and batch size: decoder tokens per second (tokens / (wall - encoder seconds); the
encoder's forward is timed by a hook, so its time is known in every contender), end-to-end RTFx
(audio seconds / wall seconds, feature extraction and encoder included), acceptance and tokens per
target call (specdec's stats), and the share of utterances whose token ids equal base's. Memory
(``--memory``): each contender alone in a fresh process that transcribes ``--memory-utterances``
at batch ``--memory-batch``: its peak RSS while loading, its peak RSS while it transcribes (from
the moment everything is loaded), and its RSS once loaded and at the end with the models alive, also once
glibc has handed the free heap pages back (``malloc_trim``) and of that its anonymous pages
(tensors and heap, without the library pages mapped in); ``--memory-rounds`` processes each,
the contenders in turn. Until stop 63 the RSS at the end was read after the models were freed,
which measured what the allocator kept, not what decoding holds.
"""

from __future__ import annotations

import argparse
import ctypes
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import soundfile
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec import SpeculativeDecoder  # noqa: E402
from specdec.core.model_cache import resolve_model_path  # noqa: E402
from specdec.core.packed_linear import cpu_name, packed_everywhere  # noqa: E402

from packing_rules import packing_rule  # noqa: E402
from specdec.drafters import HiddenStateDrafter, SharedEncoderDrafter  # noqa: E402
from specdec.drafters.shared_encoder_draft import load_shared_encoder_draft  # noqa: E402
from specdec.policies import ConstantLookahead, CostAwareLookahead, DraftConfidenceLookahead, HeuristicLookahead  # noqa: E402
from specdec.whisper import WhisperSpeculativeDecoder  # noqa: E402

DEFAULT_DRAFT = ROOT / "models" / "whisper-base-draft"


def add_pair_arguments(parser) -> None:
    """--audio-dir, --model and --draft: the speech, the target and its draft, as every real-Whisper
    benchmark here takes them."""
    parser.add_argument("--audio-dir", type=Path, required=True, help="benchmarks/build_speech_eval.py's folder")
    parser.add_argument("--model", default="whisper-base", help="a name fetched into the cache, or a folder")
    parser.add_argument("--draft", type=Path, default=DEFAULT_DRAFT)


def load_pair_and_speech(args):
    """One thread, then the target, its shared-encoder draft and the first ``args.limit`` English
    utterances' features, one batch each: (target, draft, features)."""
    from specdec.drafters.shared_encoder_draft import load_shared_encoder_draft

    torch.set_num_threads(1)
    target, processor = load_target(args.model)
    draft = load_shared_encoder_draft(args.draft, target)
    rows = load_utterances(args.audio_dir, args.limit)
    return target, draft, [features_for(processor, [row], args.audio_dir)["input_features"] for row in rows]


def load_target(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    path = resolve_model_path(name, "--model")
    model = WhisperForConditionalGeneration.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, WhisperProcessor.from_pretrained(path)


def on_device(x: dict, target) -> dict:
    """``generate``'s inputs (``features_for``) where the target is: the features in its dtype."""
    moved = {name: value.to(target.device) if isinstance(value, torch.Tensor) else value for name, value in x.items()}
    moved["input_features"] = moved["input_features"].to(target.dtype)
    return moved


def synchronizer(device: torch.device):
    """What makes a host clock read after the device's queued work: on CUDA its synchronize."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def full_head_assistant(draft, target):
    """The distilled draft's layers under the target's full output head: a Transformers assistant."""
    from transformers import WhisperForCausalLM

    config = copy.deepcopy(draft.config)
    config.tie_word_embeddings = True
    with torch.device("meta"):
        assistant = WhisperForCausalLM(config)
    assistant.model.decoder.embed_tokens = target.model.decoder.embed_tokens
    assistant.model.decoder.embed_positions = target.model.decoder.embed_positions
    assistant.model.decoder.layers = draft.model.decoder.layers
    assistant.model.decoder.layer_norm = draft.model.decoder.layer_norm
    assistant.proj_out = target.proj_out  # tied to the embeddings, as base's is
    assistant.generation_config = copy.deepcopy(target.generation_config)
    return assistant.eval()


def int8_decoder(target):
    """Base's decoder (all layers, full head) as a WhisperForCausalLM, every Linear dynamically int8."""
    from torch.ao.quantization import quantize_dynamic
    from transformers import WhisperForCausalLM

    decoder = WhisperForCausalLM(copy.deepcopy(target.config))
    decoder.model.decoder.load_state_dict(target.model.decoder.state_dict())
    decoder.proj_out.weight = torch.nn.Parameter(target.proj_out.weight.detach().clone())
    decoder.generation_config = copy.deepcopy(target.generation_config)
    return quantize_dynamic(decoder.eval(), {torch.nn.Linear}, dtype=torch.qint8)


def make_policy(text: str):
    kind, _, value = text.partition(":")
    if kind == "constant":
        return ConstantLookahead(k=int(value or 4))
    if kind == "heuristic":
        return HeuristicLookahead(initial=int(value or 4))
    if kind == "cost-aware":
        return CostAwareLookahead(max_k=int(value or 8))
    if kind == "cost-aware-positions":  # acceptance by draft position (per_position = true)
        return CostAwareLookahead(max_k=int(value or 8), per_position=True)
    if kind == "draft-confidence":  # threshold "auto": plain steps where no draft pays, the draft's q stops it
        return DraftConfidenceLookahead(threshold="auto", max_tokens=int(value or 8))
    raise SystemExit(f"--policy {text!r}: constant:K, heuristic:K, cost-aware:MAXK, cost-aware-positions:MAXK "
                     "or draft-confidence:MAXK")


class EncoderClock:
    """Seconds spent in the target's encoder forward (a hook), reset per call. On a GPU each read
    waits for the device (two syncs per encoder call, none in the decoding loop)."""

    def __init__(self, target):
        self.seconds, self._start = 0.0, None
        self._sync = synchronizer(target.device)
        encoder = target.model.encoder
        encoder.register_forward_pre_hook(self._pre)
        encoder.register_forward_hook(self._post)

    def _pre(self, *args):
        self._sync()
        self._start = time.perf_counter()

    def _post(self, *args):
        self._sync()
        self.seconds += time.perf_counter() - self._start


def new_tokens(ids: torch.Tensor, eot: int) -> int:
    return int((ids != eot).sum())


def contenders(target, draft, policy: str, int8, assistant, hf_tokens: int | None, heads: list[Path] = (),
               other_draft=None, draft_path: Path | None = None, wanted: set[str] | None = None):
    """name -> (batch sizes it runs at, fn(features) -> (ids, stats or None)). ``draft_path``: the
    draft's folder, which the shipped config's contenders (``specdec-draftint8``, ``-unpacked``) load
    themselves, each its own copy: only those in ``wanted`` are built."""

    # x: generate's inputs (features_for): the features, and for long-form audio its attention mask
    # and timestamps on, as transformers' sequential long-form transcription needs them.
    def base(x):
        return target.generate(**x, language="en", task="transcribe"), None

    def base_static(x):  # transformers' static cache, its forward compiled (CUDA graphs on CUDA)
        return target.generate(**x, language="en", task="transcribe", cache_implementation="static"), None

    def base_packed(x):  # every call of 4 rows or more on oneDNN-packed weights (core/packed_linear.py)
        with packed_everywhere(target):
            return target.generate(**x, language="en", task="transcribe"), None

    def assisted(x):
        kwargs = {} if hf_tokens is None else {"num_assistant_tokens": hf_tokens, "num_assistant_tokens_schedule": "constant"}
        return target.generate(**x, language="en", task="transcribe", assistant_model=assistant, **kwargs), None

    def speculative(model, choice, packed=True, rule=None, alternatives=0, precision="auto", screened=True,
                    frames="audio", **static):
        # One decoder for every call, as `specdec transcribe` keeps one over its files: a policy
        # that measures (cost-aware) keeps what it learnt. ``static``: static_cache and compile.
        options = dict(alternatives=alternatives, matmul_precision=precision)
        drafter = (HiddenStateDrafter(head=str(model), **options) if isinstance(model, Path) and model not in drafts
                   else SharedEncoderDrafter(model=model, encoder_frames=frames, **options))
        decoder = SpeculativeDecoder(target=target, drafter=drafter, policy=make_policy(choice), packed_weights=packed,
                                     screened_head=screened, **static)
        whisper = WhisperSpeculativeDecoder(decoder)

        def run(x):
            with packing_rule(rule):
                return whisper.generate(**x, language="en", task="transcribe"), whisper.stats

        return run

    drafts = {draft_path} if draft_path is not None else set()  # folders of shared-encoder drafts, not heads
    choices = policy.split(",")

    def named(name: str, choice: str) -> str:  # one policy keeps the plain names
        return name if len(choices) == 1 else f"{name} {choice}"

    out = {"base": (None, base), "base-static": (None, base_static), "base-packed": (None, base_packed)}
    for choice in choices if draft_path is not None else ():
        # The draft's linear layers on int8 weights (matmul_precision "int8", stop 60), the draft
        # loaded from its folder by the drafter, as whisper.toml has it: it then keeps only its int8
        # weights (stop 63).
        if wanted is None or "specdec-draftint8" in wanted:
            out[named("specdec-draftint8", choice)] = (None, speculative(draft_path, choice, precision="int8"))
        if wanted is None or "specdec-draftint8-unpacked" in wanted:  # packed_weights = false: copy-free routes
            out[named("specdec-draftint8-unpacked", choice)] = (None, speculative(draft_path, choice, packed=False,
                                                                                   precision="int8"))
        if wanted is None or "specdec-draftint8-unpacked-unscreened" in wanted:  # and screened_head = false
            out[named("specdec-draftint8-unpacked-unscreened", choice)] = (
                None, speculative(draft_path, choice, packed=False, precision="int8", screened=False))
    for choice in choices if draft is not None else ():
        out[named("specdec", choice)] = (None, speculative(draft, choice))
        out[named("specdec-unpacked", choice)] = (None, speculative(draft, choice, packed=False))
        out[named("specdec-stop21", choice)] = (None, speculative(draft, choice, rule="stop 21"))
        out[named("specdec-widthon", choice)] = (None, speculative(draft, choice, rule="from a width on"))
        out[named("specdec-stop34", choice)] = (None, speculative(draft, choice, rule="stop 34"))
        for count in (1, 2, 3):
            out[named(f"specdec-alt{count}", choice)] = (None, speculative(draft, choice, alternatives=count))
        # The draft's linear layers in float32 as loaded (matmul_precision "highest"), as before stop 51.
        out[named("specdec-fp32", choice)] = (None, speculative(draft, choice, precision="highest"))
        # base's proj_out read in float32 at every verify, as before stop 52 (greedy verifies now
        # screen it in bfloat16 where this CPU runs that faster; core/screened_head.py).
        out[named("specdec-unscreened", choice)] = (None, speculative(draft, choice, screened=False))
        out[named("specdec-alt3-fp32", choice)] = (None, speculative(draft, choice, alternatives=3, precision="highest"))
        # The draft's cross-attention over all 1500 encoder frames, as before stop 60.
        out[named("specdec-allframes", choice)] = (None, speculative(draft, choice, frames="all"))
        # The accelerator's path: every model's cache preallocated, and with it every step compiled.
        out[named("specdec-static", choice)] = (None, speculative(draft, choice, static_cache=True))
        out[named("specdec-compile", choice)] = (None, speculative(draft, choice, static_cache=True, compile="all"))
    for choice in choices if other_draft is not None else ():
        out[named("specdec-draft2", choice)] = (None, speculative(other_draft, choice))
        out[named("specdec-draft2int8", choice)] = (None, speculative(other_draft, choice, precision="int8"))
    for number, head in enumerate(heads, 1):
        label = "specdec-head" if number == 1 else f"specdec-head{number}"
        for choice in choices:
            out[named(label, choice)] = (None, speculative(head, choice))
            out[named(f"{label}-alt3", choice)] = (None, speculative(head, choice, alternatives=3))
    if assistant is not None:
        out["hf-assisted"] = ({1}, assisted)
    if int8 is not None:
        for choice in choices:
            out[named("specdec-int8", choice)] = (None, speculative(int8, choice))
    return out


def load_utterances(audio_dir: Path, limit: int, long_form: bool = False):
    """The eval split's English utterances: the short ones (one 30-second window each), or with
    ``long_form`` those over 30 seconds."""
    rows = json.loads((audio_dir / "utterances.json").read_text())
    rows = [r for r in rows if r["language"] == "en" and (r["seconds"] > 30.0) == long_form]
    return rows[:limit] if limit else rows


def features_for(processor, rows, audio_dir) -> dict:
    """``generate``'s inputs for ``rows``: their features, padded to one 30-second window each; for
    long-form audio (a row over 30 s) all of it, with the attention mask and timestamps that
    transformers' sequential long-form transcription needs."""
    audio = [soundfile.read(str(audio_dir / r["file"]), dtype="float32")[0] for r in rows]
    if not any(r["seconds"] > 30.0 for r in rows):
        return {"input_features": processor.feature_extractor(audio, sampling_rate=16000, return_tensors="pt").input_features}
    batch = processor.feature_extractor(audio, sampling_rate=16000, return_tensors="pt", truncation=False,
                                        padding="longest", return_attention_mask=True)
    return {"input_features": batch.input_features, "attention_mask": batch.attention_mask, "return_timestamps": True}


CPU_ONLY = {"base-packed", "specdec-int8", "specdec-draftint8", "specdec-draftint8-unpacked",
            "specdec-draftint8-unpacked-unscreened", "specdec-draft2int8", "specdec-stop21", "specdec-widthon", "specdec-stop34"}


def measure(args) -> dict:
    torch.set_num_threads(args.threads)
    wanted = set(args.contenders.split(","))
    if args.device != "cpu" and wanted & CPU_ONLY:
        raise SystemExit(f"--contenders {','.join(sorted(wanted & CPU_ONLY))}: CPU only (int8 weights through fbgemm, "
                         f"oneDNN packing); on --device {args.device} leave them out")
    target, processor = load_target(args.model, getattr(torch, args.dtype), args.device)
    sync = synchronizer(target.device)
    # Only contenders that draft with it load the draft: base's peak memory (--memory) must not hold it.
    draft = load_shared_encoder_draft(args.draft, target) if wanted & {"specdec", "specdec-unpacked", "specdec-stop21", "specdec-widthon", "specdec-stop34", "specdec-alt1", "specdec-alt2", "specdec-alt3",
                                                                   "specdec-fp32", "specdec-alt3-fp32", "specdec-unscreened", "specdec-allframes",
                                                                   "specdec-static", "specdec-compile", "hf-assisted"} else None
    # The shipped config's contender loads the draft itself (and keeps it in int8 only).
    draft_path = args.draft if wanted & {"specdec-draftint8", "specdec-draftint8-unpacked", "specdec-draftint8-unpacked-unscreened"} else None
    eot = target.generation_config.eos_token_id
    clock = EncoderClock(target)
    assistant = full_head_assistant(draft, target) if "hf-assisted" in wanted else None
    int8 = int8_decoder(target) if "specdec-int8" in wanted else None
    heads = [Path(path) for path in args.head.split(",")] if args.head else []
    other = load_shared_encoder_draft(args.draft2, target) if wanted & {"specdec-draft2", "specdec-draft2int8"} else None
    runs = {name: value for name, value in contenders(target, draft, args.policy, int8, assistant,
                                                      args.hf_assistant_tokens, heads, other, draft_path, wanted).items()
            if name.split()[0] in wanted}
    if args.peak_rss:  # what decoding adds is measured from here, everything loaded
        loading_peak, loaded = peak_mib(), trimmed_mib()
        loaded_anonymous = resident_mib("RssAnon")
        reset_peak()
    rows = load_utterances(args.audio_dir, args.limit, args.long_form)
    audio_seconds = [r["seconds"] for r in rows]
    results = {}
    gpu = target.device.type == "cuda"

    def warm_up(chunk):
        # Untimed: what a process pays once (packing the decoder's weights; on a GPU, kernels loaded
        # and each batch size's graphs compiled and captured) would otherwise land on whichever
        # contender runs first.
        x = on_device(features_for(processor, [rows[i] for i in chunk], args.audio_dir), target)
        for name, (sizes, run) in runs.items():
            if sizes is None or len(chunk) in sizes:
                with torch.no_grad():
                    run(x)
        sync()

    if args.warmup and rows and not gpu:
        warm_up([0])
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        chunks = [list(range(i, min(i + batch, len(rows)))) for i in range(0, len(rows), batch)]
        if args.warmup and chunks and gpu:  # each batch size its shapes (and the last chunk's, if smaller)
            for chunk in {len(c): c for c in chunks}.values():
                warm_up(chunk)
        names = [n for n, (sizes, _) in runs.items() if sizes is None or batch in sizes]
        table = {n: dict(wall=[], encoder=[], tokens=0, same=0, drafted=0, accepted=0, row_steps=0, peak_gib=0.0) for n in names}
        reference = {}
        for repeat in range(args.repeats):
            for chunk in chunks:
                started = time.perf_counter()
                x = on_device(features_for(processor, [rows[i] for i in chunk], args.audio_dir), target)
                sync()
                extract = time.perf_counter() - started
                order = names if repeat % 2 == 0 else names[::-1]  # interleaved, alternating order
                for name in order:
                    clock.seconds = 0.0
                    if gpu:
                        torch.cuda.reset_peak_memory_stats()
                    started = time.perf_counter()
                    with torch.no_grad():
                        ids, stats = runs[name][1](x)
                    sync()
                    wall = time.perf_counter() - started + extract
                    entry = table[name]
                    if gpu:
                        entry["peak_gib"] = max(entry["peak_gib"], torch.cuda.max_memory_allocated() / 2**30)
                    entry["wall"].append(wall)
                    entry["encoder"].append(clock.seconds + extract)
                    if repeat == 0:
                        entry["tokens"] += new_tokens(ids, eot)
                        for row, i in enumerate(chunk):
                            tokens = [t for t in ids[row].tolist() if t != eot]
                            if name == "base":
                                reference[i] = tokens
                            entry.setdefault("ids", {})[i] = tokens
                        if stats is not None:
                            entry["drafted"] += stats.decode.drafted
                            entry["accepted"] += stats.decode.accepted
                            entry["row_steps"] += stats.decode.row_steps
                            entry["new"] = entry.get("new", 0) + stats.decode.new_tokens
        summary = {}
        for name, entry in table.items():
            per_repeat = len(chunks)
            walls = [sum(entry["wall"][r * per_repeat:(r + 1) * per_repeat]) for r in range(args.repeats)]
            encs = [sum(entry["encoder"][r * per_repeat:(r + 1) * per_repeat]) for r in range(args.repeats)]
            wall, enc = statistics.median(walls), statistics.median(encs)
            same = sum(entry["ids"][i] == reference[i] for i in reference)
            summary[name] = dict(
                wall_s=wall, encoder_s=enc, decoder_s=wall - enc, tokens=entry["tokens"],
                decoder_tokens_per_s=entry["tokens"] / max(wall - enc, 1e-9),
                rtfx=sum(audio_seconds) / wall, identical=f"{same}/{len(reference)}",
                acceptance=entry["accepted"] / entry["drafted"] if entry["drafted"] else None,
                tokens_per_target_call=entry["new"] / entry["row_steps"] if entry.get("row_steps") else None,
                walls=walls, **({"gpu_peak_gib": entry["peak_gib"]} if gpu else {}),
            )
        base = summary.get("base")
        for name, s in summary.items():
            if base:
                s["decoder_speedup"] = base["decoder_s"] / s["decoder_s"]
                s["end_to_end_speedup"] = base["wall_s"] / s["wall_s"]
        results[batch] = summary
        print(json.dumps({"batch": batch, **{n: {k: v for k, v in s.items() if k != "walls"} for n, s in summary.items()}},
                         indent=1), flush=True)
    if args.peak_rss:  # the models still alive: what a process that goes on transcribing holds
        print(loading_peak, peak_mib(), loaded, loaded_anonymous, resident_mib(), trimmed_mib(), resident_mib("RssAnon"),
              flush=True)
    return results


MEMORY_FIELDS = ("loading_peak_mib", "decoding_peak_mib", "loaded_mib", "loaded_anonymous_mib", "end_mib",
                 "end_trimmed_mib", "end_anonymous_mib")


def memory_of(args, name: str) -> dict[str, float]:
    """A fresh process that loads everything ``name`` needs and transcribes ``--memory-utterances``
    utterances at batch ``--memory-batch`` (after one untimed), in MiB: its peak RSS over the whole process (loading
    the checkpoint sets it); its peak RSS from the moment everything was loaded (``reset_peak``) to
    the end of transcribing; and its RSS once loaded, at the end, and at the end once the C
    allocator has handed its free pages back (``trimmed_mib``), the latter all with the models
    alive, and of the trimmed ones the anonymous pages (``RssAnon``: tensors and the heap; the
    rest is files mapped in, mostly the pages of torch's libraries that its kernels touched)."""
    command = [sys.executable, __file__, "--audio-dir", str(args.audio_dir), "--model", args.model, "--draft",
               str(args.draft), *(["--head", str(args.head)] if args.head else []),
               *(["--draft2", str(args.draft2)] if args.draft2 else []), "--batch-sizes", str(args.memory_batch), "--repeats", "1",
               "--limit", str(args.memory_utterances), *(["--long-form"] if args.long_form else []), "--contenders", name, "--policy", args.policy,
               "--threads", str(args.threads), "--peak-rss"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return dict(zip(MEMORY_FIELDS, (float(value) for value in out.strip().splitlines()[-1].split())))


def reset_peak() -> None:
    """Linux (4.0 on): set this process's peak resident set (VmHWM) to its resident set now."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass


def peak_mib() -> float:
    """This process's peak resident set since ``reset_peak`` (Linux: VmHWM; elsewhere since it began)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def trimmed_mib() -> float:
    """The resident set after glibc's ``malloc_trim(0)`` hands the heap's free pages back: what the
    process holds, without the freed blocks the allocator keeps, which moved the resident set of
    identical runs by up to 190 MiB (docs/benchmarks.md, stop 61); elsewhere the resident set."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return resident_mib()


def resident_mib(field: str = "VmRSS") -> float:
    """This process's resident set now, or the part of it that ``field`` of /proc/self/status names
    (Linux; elsewhere its peak)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(field + ":")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--draft2", type=Path, help="another shared-encoder draft: the specdec-draft2 and specdec-draft2int8 contenders")
    parser.add_argument("--head", help="hidden-state heads for base (specdec drafter train-whisper), "
                        "comma-separated: the specdec-head contenders")
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1, help="1: run each contender once, untimed, before timing")
    parser.add_argument("--limit", type=int, default=0, help="only the first N English utterances")
    parser.add_argument("--long-form", action="store_true",
                        help="the English utterances over 30 s (sequential long-form: 30-second windows, timestamps)")
    parser.add_argument("--policy", default="constant:4",
                        help="constant:K | heuristic:K | cost-aware:MAXK | cost-aware-positions:MAXK (per_position) | "
                             "draft-confidence:MAXK (threshold auto); "
                             "comma-separated: one specdec contender each")
    parser.add_argument("--contenders", default="base,hf-assisted,specdec,specdec-int8")
    parser.add_argument("--hf-assistant-tokens", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (each batch size warmed up there, every timing "
                        "synchronised, peak GPU memory per contender)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the models' dtype as loaded (the draft follows the target)")
    parser.add_argument("--memory", action="store_true",
                        help="also each contender's peak RSS and final RSS in a fresh process, --memory-rounds times")
    parser.add_argument("--memory-rounds", type=int, default=1, help="fresh processes per contender, contenders in turn")
    parser.add_argument("--memory-utterances", type=int, default=4, help="utterances each fresh process transcribes")
    parser.add_argument("--memory-batch", type=int, default=1, help="the batch size each fresh process transcribes at")
    parser.add_argument("--peak-rss", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    results = measure(args)
    if args.peak_rss:  # measure() printed the process's memory
        return 0
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_name(), "device": args.device,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "dtype": args.dtype,
            "load": os.getloadavg(), "threads": args.threads, "policy": args.policy, "long_form": args.long_form, "results": results}
    if args.memory:
        names = args.contenders.split(",")
        rounds = [{name: memory_of(args, name) for name in names} for _ in range(args.memory_rounds)]
        info["memory"] = {field: {name: [r[name][field] for r in rounds] for name in names} for field in MEMORY_FIELDS}
        print(json.dumps(info["memory"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
