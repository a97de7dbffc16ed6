"""``specdec generate`` called once per prompt, as a user calls it: ``cost-aware`` with its memory (the
CLI's default since stop 50), without it (``-P memory=none``), the shipped constant k = 5, and
specdec's plain steps (constant k = 0: about the target alone).

    python benchmarks/cli_memory.py [--prompts 16] [--max-new-tokens 64] [--drafter model|ngram] [--sampled]

Every call is a new process on the bundled pair, in an order that rotates with each prompt. The
memory starts empty in a folder of this run's own (``SPECDEC_CACHE``; the packed-weight timings are
copied into it first, so that no call times kernels). Each contender's rate is its new tokens over
the decode time that ``--json`` reports (``stats.wall_time_s``: no process start, no model load),
summed over the prompts; printed relative to the plain steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bundled_pair import ROOT

CONTENDERS = {
    "plain steps (k=0)": ["--policy", "constant", "-P", "k=0"],
    "constant k=5": ["--policy", "constant"],
    "cost-aware, remembered": ["--policy", "cost-aware"],
    "cost-aware, cold (memory=none)": ["--policy", "cost-aware", "-P", "memory=none"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--drafter", choices=("model", "ngram"), default="model")
    parser.add_argument("--sampled", action="store_true", help="temperature 0.7, top-p 0.9, a seed per prompt")
    args = parser.parse_args()
    if args.prompts < 1 or args.max_new_tokens < 1:
        parser.error("--prompts and --max-new-tokens must be at least 1")
    prompts = [json.loads(line)["prompt"] for line in (ROOT / "models/python-pair/prompts.jsonl").read_text().splitlines()]
    cache = Path(tempfile.mkdtemp(prefix="cli-memory-"))
    home = Path(os.environ.get("SPECDEC_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec")
    if (home / "packing.json").is_file():
        shutil.copy(home / "packing.json", cache / "packing.json")
    env = dict(os.environ, SPECDEC_CACHE=str(cache), SPECDEC_VERBOSITY="warning")
    tokens = dict.fromkeys(CONTENDERS, 0)
    seconds = dict.fromkeys(CONTENDERS, 0.0)
    names = list(CONTENDERS)
    for number, prompt in enumerate(prompts[: args.prompts]):
        shift = number % len(names)
        for name in names[shift:] + names[:shift]:
            command = [sys.executable, "-m", "specdec.cli", "generate", prompt, "-c", str(ROOT / "plugins.toml"), "--json",
                       "-n", str(args.max_new_tokens), "--drafter", args.drafter, *CONTENDERS[name]]
            if args.sampled:
                command += ["--temperature", "0.7", "--top-p", "0.9", "--seed", str(number)]
            done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
            if done.returncode != 0:
                sys.exit(f"{name}: specdec generate failed ({done.returncode}): {done.stderr.strip()[-400:]}")
            stats = json.loads(done.stdout)["stats"]
            tokens[name] += stats["new_tokens"]
            seconds[name] += stats["wall_time_s"]
        rates = {n: tokens[n] / seconds[n] for n in names}
        print(f"after prompt {number + 1}: " + ", ".join(f"{n} {rates[n] / rates[names[0]]:.3f}" for n in names[1:]),
              flush=True)
    rates = {n: tokens[n] / seconds[n] for n in names}
    print(json.dumps({"drafter": args.drafter, "sampled": args.sampled, "prompts": args.prompts,
                      "tok_s": rates, "vs_plain_steps": {n: rates[n] / rates[names[0]] for n in names}}, indent=1))
    shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
