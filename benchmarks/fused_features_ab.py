"""A/B, offline: does a hidden-state head gain from reading intermediate layers of the target too
(EAGLE-3's fused low/mid/high features)?

Both variants start from the shipped SmolLM2 head and train the same steps on the same rows (same
seeds); "fused" widens the head's input projection by the chosen layers' hidden states (each
RMS-normalised per position: SmolLM2's middle layers carry outliers of 10^4), zero-initialised, so
it starts as the shipped head. Drafted positions, which have no target states, read zeros there.
Prints each variant's held-out top-1 per unrolled step before and after (docs/hidden-state.md,
"EAGLE-3's fused features"). The corpus: `benchmarks/chat_corpus.py --self-prompts 0`.

    python benchmarks/chat_corpus.py --target ~/.cache/specdec/models/smollm2-135m-instruct \
        --out /tmp/corpus_text.jsonl --self-prompts 0
    python benchmarks/fused_features_ab.py --corpus /tmp/corpus_text.jsonl --layers 10,20 --steps 400
"""
import argparse, json, time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.training.hidden_state import token_rows, unrolled_mask, _scheduler
from specdec.drafters.hidden_state_head import HiddenStateHead

p = argparse.ArgumentParser()
p.add_argument("--corpus", required=True, help="JSON Lines with a 'text' field (chat_corpus.py's output)")
p.add_argument("--target", default="~/.cache/specdec/models/smollm2-135m-instruct")
p.add_argument("--head", default=str(Path(__file__).resolve().parents[1] / "models/smollm2-135m-instruct-head/head.safetensors"))
p.add_argument("--layers", default="10,20")
p.add_argument("--steps", type=int, default=300)
p.add_argument("--unroll", type=int, default=2)
p.add_argument("--eval-unroll", type=int, default=3)
p.add_argument("--lr", type=float, default=5e-4)
p.add_argument("--max-rows", type=int, default=1200)
p.add_argument("--length", type=int, default=256)
p.add_argument("--variants", default="base,fused")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--features", default="/tmp/fused_features.pt", help="cache of the target's features")
args = p.parse_args()
torch.set_num_threads(args.threads)
folder = str(Path(args.target).expanduser())
target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(folder)
texts = [json.loads(l)["text"] for l in open(args.corpus)]
rows = token_rows(texts, tok, args.length)[: args.max_rows]
extra = [int(x) for x in args.layers.split(",") if x]
H = target.config.hidden_size
t0 = time.time()
try:
    saved = torch.load(args.features)
except (OSError, RuntimeError):
    saved = None
if saved is not None and saved["layers"] == extra and saved["rows"].equal(rows):
    feats = saved["features"]
else:  # none cached, or for other rows or layers
    feats = torch.empty(rows.shape[0], rows.shape[1], H * (1 + len(extra)), dtype=torch.float32)
    with torch.no_grad():
        for s in range(0, rows.shape[0], 8):
            out = target(input_ids=rows[s:s+8], output_hidden_states=True, use_cache=False)
            hs = [out.hidden_states[-1]] + [out.hidden_states[i] for i in extra]
            feats[s:s+8] = torch.cat(hs, -1)
    torch.save({"layers": extra, "rows": rows, "features": feats}, args.features)
print(f"rows {tuple(rows.shape)} features {time.time()-t0:.0f}s", flush=True)
scale = float(feats[..., :H].pow(2).mean().sqrt())
for i in range(len(extra)):  # per-position RMS normalisation of the intermediate layers (massive activations)
    part = feats[..., H * (i + 1): H * (i + 2)]
    part.mul_(scale / part.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt())
print("scale", scale, [float(feats[..., H*(i+1):H*(i+2)].abs().max()) for i in range(len(extra))])
g = torch.Generator().manual_seed(0)
order = torch.randperm(rows.shape[0], generator=g)
nh = max(8, rows.shape[0] // 20)
test, train = order[:nh], order[nh:]
embedding = target.get_input_embeddings()
weight = target.get_output_embeddings().weight
lm = weight.float()

def predictions(head, tokens, f, steps, fused, noise=0.0):
    length = tokens.shape[1] - steps
    width = f.shape[-1] if fused else H
    before = f[:, :length, :width]
    if noise:
        before = before + noise * torch.randn_like(before)
    positions = torch.arange(length)[None].expand(tokens.shape[0], -1)
    from transformers import DynamicCache
    cache = DynamicCache(config=head.config) if steps > 1 else None
    out_list = []
    for step in range(steps):
        with torch.no_grad():
            e = embedding(tokens[:, 1 + step: 1 + step + length])
        inp = torch.cat([e, before], -1)
        mask = unrolled_mask(length, step, torch.float32) if steps > 1 else None
        out = head(inputs_embeds=inp, position_ids=positions + step, attention_mask=mask, past_key_values=cache, use_cache=steps > 1)
        pred = out.hidden_states[-1]
        out_list.append(pred)
        before = torch.cat([pred, pred.new_zeros(*pred.shape[:-1], width - H)], -1) if width > H else pred
    return out_list

def loss_fn(head, tokens, f, steps, fused, noise):
    length = tokens.shape[1] - steps
    total = ws = 0.0
    for step, pred in enumerate(predictions(head, tokens, f, steps, fused, noise)):
        truth = f[:, 1 + step: 1 + step + length, :H]
        with torch.no_grad():
            wanted = torch.softmax(head.readout(truth), -1)
        hl = torch.nn.functional.smooth_l1_loss(pred, truth)
        tl = (wanted * (torch.log(wanted.clamp(min=1e-12)) - torch.log_softmax(head.readout(pred), -1))).sum(-1).mean()
        w = 0.8 ** step
        total = total + w * (hl + tl); ws += w
    return total / ws

@torch.no_grad()
def top1(head, fused, steps):
    right = [0] * steps; seen = [0] * steps
    for s in range(0, len(test), 8):
        idx = test[s:s+8]
        tokens, f = rows[idx], feats[idx]
        length = tokens.shape[1] - steps
        for step, pred in enumerate(predictions(head, tokens, f, steps, fused)):
            guess = head.token_map[head.readout(pred).argmax(-1)]
            truth = (f[:, 1 + step: 1 + step + length, :H] @ lm.T).argmax(-1)
            right[step] += int((guess == truth).sum()); seen[step] += guess.numel()
    return [r / n for r, n in zip(right, seen)]

spread = float(feats[..., :H].std())
results = {}
for variant in args.variants.split(","):
    fused = variant == "fused"
    head = HiddenStateHead.load(args.head, target).float()
    head.attach(weight.float())
    if fused:
        old = head.fc.weight.data
        fc = torch.nn.Linear(old.shape[1] + H * len(extra), H, bias=False)
        fc.weight.data.zero_(); fc.weight.data[:, : old.shape[1]] = old
        head.fc = fc
    before = top1(head, fused, args.eval_unroll)
    head.train()
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=args.lr)
    sched = _scheduler(opt, "cosine", args.steps)
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    t0 = time.time()
    for step in range(args.steps):
        pick = train[torch.randint(0, len(train), (8,), generator=gen)]
        loss = loss_fn(head, rows[pick], feats[pick], args.unroll, fused, 0.05 * spread)
        opt.zero_grad(); loss.backward(); opt.step(); sched.step()
        if step % 50 == 0:
            print(variant, step, f"{float(loss.detach()):.3f}", f"{time.time()-t0:.0f}s", flush=True)
    head.eval()
    after = top1(head, fused, args.eval_unroll)
    results[variant] = {"before": before, "after": after, "seconds": time.time() - t0}
    print(variant, "top1 before", [f"{x:.3f}" for x in before], "after", [f"{x:.3f}" for x in after], f"{time.time()-t0:.0f}s", flush=True)
print(json.dumps(results))
