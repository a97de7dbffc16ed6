"""Teacher-forced top-1 of hidden-state heads on SmolLM2's own greedy answers to the held-out benchmark prompts.

What a head's drafts meet in the loop, without a clock: the target answers each prompt of
``benchmarks/smollm2_prompts.jsonl`` greedily once (cached in ``--answers``), then each ``--head``
reads those answers as it drafts (step 0 on the target's real hidden state, step s on its own step
s - 1 prediction, ``specdec.training.hidden_state.unrolled_predictions``). Per kind and drafted
position it reports the share of answer tokens where the head's greedy token is the target's
("top-1"), and where every step up to that one is ("chain": about the loop's acceptance at that
position of a draft). Timing-free, so heads can be told apart on a busy machine; the speed is
still for ``smollm2_bench.py`` to measure.

    OMP_NUM_THREADS=1 python benchmarks/head_top1.py --head models/smollm2-135m-instruct-head/head.safetensors \\
        --head /tmp/new_head.safetensors --answers out/smollm2_heldout_answers.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's specdec, not an installed copy

HERE = Path(__file__).resolve().parent
DEFAULT_TARGET = os.path.expanduser(os.path.join(os.environ.get("SPECDEC_CACHE", "~/.cache/specdec"),
                                                 "models", "smollm2-135m-instruct"))


def greedy_answers(target, tokenizer, prompts: list[dict], max_new_tokens: int) -> list[dict]:
    """Each prompt's chat-templated ids and the target's greedy answer ids (one row at a time: no padding)."""
    import torch

    rows = []
    for p in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_new_tokens)
        rows.append({"kind": p["kind"], "prompt": ids[0].tolist(), "answer": out[0, ids.shape[1]:].tolist()})
    return rows


def score(head, target, rows: list[dict], steps: int) -> dict[str, dict[str, list[float]]]:
    """Per kind (and "all"): top-1 and chained top-1 by drafted position (step 0 first)."""
    import torch

    from specdec.drafters.hidden_state import target_parts
    from specdec.training.hidden_state import target_features, unrolled_predictions

    embedding, lm_head, _ = target_parts(target, "head_top1")
    lm_head = lm_head.float()
    counts: dict[str, list[list[int]]] = {}
    with torch.no_grad():
        for row in rows:
            tokens = torch.tensor([row["prompt"] + row["answer"]])
            features = target_features(target, tokens, 1).float()
            truth_all = (features[0] @ lm_head.T).argmax(-1)  # the target's greedy token after each position
            length = tokens.shape[1] - steps
            right_so_far = None
            for kind in (row["kind"], "all"):
                counts.setdefault(kind, [[0] * steps, [0] * steps, [0] * steps])
            for step, predicted in enumerate(unrolled_predictions(head, embedding, tokens, features, steps)):
                guess = head.token_map[head.readout(predicted[0]).argmax(-1)]  # predicts the token after j + 1 + step
                truth = truth_all[1 + step : 1 + step + length]
                right = guess == truth
                right_so_far = right if right_so_far is None else right_so_far & right
                # a draft starts after the verified token j + 1: score the drafts whose first token is an answer token
                first = torch.arange(length) + 1 >= len(row["prompt"]) - 1
                seen = first & (torch.arange(length) + 1 + step < tokens.shape[1] - 1)
                for kind in (row["kind"], "all"):
                    counts[kind][0][step] += int((right & seen).sum())
                    counts[kind][1][step] += int((right_so_far & seen).sum())
                    counts[kind][2][step] += int(seen.sum())
    return {kind: {"top1": [r / max(n, 1) for r, n in zip(c[0], c[2])],
                   "chain": [r / max(n, 1) for r, n in zip(c[1], c[2])]} for kind, c in counts.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--head", type=Path, action="append", required=True, help="a head file (repeatable)")
    parser.add_argument("--prompts", type=Path, default=HERE / "smollm2_prompts.jsonl")
    parser.add_argument("--answers", type=Path, help="keep the target's greedy answers in this JSON file")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="drafted positions to score")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.drafters.hidden_state import target_parts
    from specdec.drafters.hidden_state_head import HiddenStateHead

    torch.set_num_threads(args.threads)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    if args.answers is not None and args.answers.is_file():
        rows = json.loads(args.answers.read_text())
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.target)
        prompts = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
        rows = greedy_answers(target, tokenizer, prompts, args.max_new_tokens)
        if args.answers is not None:
            args.answers.parent.mkdir(parents=True, exist_ok=True)
            args.answers.write_text(json.dumps(rows))
    results = {}
    for path in args.head:
        head = HiddenStateHead.load(path, target).float().eval()
        head.attach(target_parts(target, "head_top1")[1])
        results[str(path)] = score(head, target, rows, args.steps)
        print(f"{path}:")
        for kind, r in results[str(path)].items():
            print(f"  {kind:10s} top-1 " + " ".join(f"{x:.3f}" for x in r["top1"])
                  + "   chain " + " ".join(f"{x:.3f}" for x in r["chain"]))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
