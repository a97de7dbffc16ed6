"""The real CLI through typer's runner, on a tiny pair saved to disk and real TOML files."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from typer.testing import CliRunner

from specdec.cli import app

from .conftest import run_on_a_terminal
from .saved_pair import save_pair
from .test_pair import PAIR, needs_pair

runner = CliRunner()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("pair"))


class TestGenerate:
    """specdec generate"""

    def test_streams_text_and_ends_with_stats(self, pair):
        result = runner.invoke(app, ["generate", "def fibonacci(n):", "--config", str(pair), "-n", "12"])
        assert result.exit_code == 0, result.output
        assert result.output.startswith("def fibonacci(n):")
        assert "tokens per target call" in result.output and "acceptance" in result.output

    def test_the_stats_say_how_often_first_position_alternatives_were_read(self, pair, tmp_path):
        assert "alternatives" not in runner.invoke(app, ["generate", "import os", "-c", str(pair), "-n", "8"]).output
        config = tmp_path / "plugins.toml"
        config.write_text(pair.read_text().replace('model = "draft"', f'model = "{pair.parent / "draft"}"\nalternatives = 3')
                          .replace('model = "target"', f'model = "{pair.parent / "target"}"'))
        result = runner.invoke(app, ["generate", "import os", "-c", str(config), "-n", "8"])
        assert result.exit_code == 0, result.output
        assert "alternatives read in" in result.output and "taken" in result.output
        payload = json.loads(runner.invoke(app, ["generate", "import os", "-c", str(config), "-n", "8", "--json"]).output)
        stats = payload["stats"]
        assert 0 < stats["alternatives_read"] <= stats["iterations"]  # a constant k reads them at every draft
        assert 0 <= stats["alternatives_taken"] <= stats["alternatives_read"]

    def test_json_output_matches_the_target_alone(self, pair):
        from specdec.config import SpecdecConfig

        result = runner.invoke(app, ["generate", "class Stack:", "import os", "--config", str(pair), "-n", "10", "--json"])
        assert result.exit_code == 0, result.output
        payload = json.loads(result.output)
        assert [o["prompt"] for o in payload["outputs"]] == ["class Stack:", "import os"]
        assert payload["stats"]["rows"] == 2 and payload["stats"]["new_tokens"] > 0
        target, tokenizer = SpecdecConfig.from_toml(pair).load_target()
        encoded = tokenizer(["class Stack:", "import os"], return_tensors="pt", padding=True)
        expected = target.generate(**encoded, do_sample=False, max_new_tokens=10)
        texts = tokenizer.batch_decode(expected[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
        assert [o["text"] for o in payload["outputs"]] == texts

    def test_chat_sends_a_user_turn_through_the_template_and_prints_only_the_answer(self, tmp_path):
        from transformers import AutoTokenizer

        from specdec.config import SpecdecConfig

        config = save_pair(tmp_path)
        without = runner.invoke(app, ["generate", "class Stack:", "-c", str(config), "-n", "4", "--chat"])
        assert without.exit_code == 2 and "--chat needs a tokenizer with a chat template" in without.output
        tokenizer = AutoTokenizer.from_pretrained(tmp_path / "target")
        tokenizer.chat_template = ("{% for m in messages %}# {{ m['content'] }}\n{% endfor %}"
                                   "{% if add_generation_prompt %}def {% endif %}")
        tokenizer.save_pretrained(tmp_path / "target")
        result = runner.invoke(app, ["generate", "class Stack:", "-c", str(config), "-n", "10", "--chat", "--json"])
        assert result.exit_code == 0, result.output
        target, tokenizer = SpecdecConfig.from_toml(config).load_target()
        encoded = tokenizer(["# class Stack:\ndef "], return_tensors="pt", add_special_tokens=False)
        expected = target.generate(**encoded, do_sample=False, max_new_tokens=10)
        answer = tokenizer.decode(expected[0, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
        assert json.loads(result.output)["outputs"][0]["text"] == answer
        streamed = runner.invoke(app, ["generate", "class Stack:", "-c", str(config), "-n", "10", "--chat"])
        assert streamed.stdout == answer + "\n"  # the answer alone, not the prompt or the template

    @pytest.mark.parametrize("drafter,policy", [("ngram", "heuristic"), ("model", "constant")])
    def test_drafter_and_policy_flags(self, pair, drafter, policy, tmp_path):
        trace = tmp_path / "trace.jsonl"
        result = runner.invoke(
            app,
            ["generate", "def fibonacci(n):", "-c", str(pair), "-n", "8", "--drafter", drafter, "--policy", policy,
             "--trace", str(trace)],
        )
        assert result.exit_code == 0, result.output
        assert f"drafter {drafter}, policy {policy}" in result.output
        lines = [json.loads(line) for line in trace.read_text().splitlines()]
        assert lines and sum(sum(line["appended"]) for line in lines) == 8

    def test_bad_inputs_exit_2_without_traceback(self, pair, tmp_path):
        cases = [
            (["generate", "x", "-c", str(tmp_path / "nope.toml")], "does not exist"),
            (["generate", "x", "-c", str(pair), "--drafter", "magic"], "unknown drafter 'magic'"),
            (["generate", "", "-c", str(pair)], "empty prompt"),
        ]
        bad_toml = tmp_path / "bad.toml"
        bad_toml.write_text("[target\nmodel = 1\n")
        cases.append((["generate", "x", "-c", str(bad_toml)], "not valid TOML"))
        missing_model = tmp_path / "missing.toml"
        missing_model.write_text('[target]\nmodel = "./no/such/model"\n[drafter]\nuse = "ngram"\n')
        cases.append((["generate", "x", "-c", str(missing_model)], "does not exist"))
        mismatch_root = tmp_path / "mismatch"
        mismatch = save_pair(mismatch_root, draft_vocab=500)
        cases.append((["generate", "x", "-c", str(mismatch)], "vocabulary has 500 tokens"))
        for args, message in cases:
            result = runner.invoke(app, args)
            assert result.exit_code == 2, (args, result.output)
            assert message in result.output, (args, result.output)
            assert "Traceback" not in result.output


class TestPolicyMemory:
    """specdec generate with cost-aware: each call starts from what the calls before it measured."""

    def test_calls_with_one_setting_share_a_file_in_the_cache_and_stay_exact(self, pair, tmp_path, monkeypatch):
        monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
        args = ["generate", "class Stack:", "-c", str(pair), "-n", "10", "--policy", "cost-aware", "--json"]
        first = runner.invoke(app, args)
        assert first.exit_code == 0, first.output
        files = list((tmp_path / "cache" / "policies").glob("cost-aware-*.json"))
        assert len(files) == 1 and json.loads(files[0].read_text())["format"] == 1
        payload = json.loads(first.stdout)
        assert payload["components"]["policy"]["options"]["memory"] == str(files[0])
        written = files[0].read_text()
        second = runner.invoke(app, args)
        assert json.loads(second.stdout)["outputs"] == payload["outputs"]  # greedy: the same text, whatever k
        assert files[0].read_text() != written  # read, then written again with this call's counts
        sampled = runner.invoke(app, [*args, "--temperature", "0.7", "--seed", "1"])
        assert sampled.exit_code == 0, sampled.output
        assert len(list((tmp_path / "cache" / "policies").glob("cost-aware-*.json"))) == 2  # another setting

    def test_memory_none_remembers_nothing_and_a_path_is_used_as_given(self, pair, tmp_path, monkeypatch):
        monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
        base = ["generate", "class Stack:", "-c", str(pair), "-n", "6", "--policy", "cost-aware"]
        result = runner.invoke(app, [*base, "-P", "memory=none"])
        assert result.exit_code == 0, result.output
        assert not (tmp_path / "cache" / "policies").exists()
        mine = tmp_path / "mine.json"
        assert runner.invoke(app, [*base, "-P", f"memory={mine}"]).exit_code == 0
        assert mine.is_file() and not (tmp_path / "cache" / "policies").exists()

    def test_other_policies_write_nothing(self, pair, tmp_path, monkeypatch):
        monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
        assert runner.invoke(app, ["generate", "class Stack:", "-c", str(pair), "-n", "6"]).exit_code == 0
        assert not (tmp_path / "cache" / "policies").exists()


class TestPlugins:
    """specdec plugins"""

    def test_table_and_json(self):
        result = runner.invoke(app, ["plugins"])
        assert result.exit_code == 0 and "ngram" in result.output and "heuristic" in result.output
        payload = json.loads(runner.invoke(app, ["plugins", "--json"]).output)
        ngram = next(c for c in payload["components"] if c["name"] == "ngram")
        assert ngram["kind"] == "drafter" and ngram["package"] == "specdec"
        assert {"name": "max_ngram", "type": "int", "default": 3} in ngram["options"]


class TestBench:
    """specdec bench"""

    def test_tiny_bench_writes_json_and_checks_exactness(self, pair, tmp_path):
        out = tmp_path / "bench.json"
        result = runner.invoke(
            app,
            ["bench", "-c", str(pair), "--batch-sizes", "1,2", "--num-prompts", "2", "--max-new-tokens", "6",
             "--repeats", "1", "--warmup", "0", "--drafters", "model,ngram", "--out", str(out)],
        )
        assert result.exit_code == 0, result.output
        payload = json.loads(out.read_text())
        methods = {(r["batch_size"], r["method"]) for r in payload["results"]}
        assert (1, "target alone") in methods and (2, "specdec (ngram, constant)") in methods
        assert (1, "transformers assisted (model, k=3, constant schedule)") in methods  # the pair's constant k = 3
        assert (1, "transformers assisted (ngram, k=3)") in methods
        specdec_rows = [r for r in payload["results"] if r["method"].startswith("specdec")]
        assert specdec_rows and all(r["exact"] for r in specdec_rows)
        assert all(r["rows"] == 2 for r in specdec_rows)  # at batch 1 both batches of a repeat, not the first alone
        assert all(r["ideal_speedup"] is not None for r in specdec_rows)
        assisted_b2 = [r for r in payload["results"] if r["batch_size"] == 2 and r["method"].startswith("transformers")]
        assert assisted_b2 and all("row by row" in r["note"] for r in assisted_b2)

    def test_bench_fails_a_wrong_acceptance_in_any_dtype(self, pair, tmp_path, monkeypatch):
        """A verifier that keeps every draft parts from the target at tokens it ranks far below its
        own: in float32, where a near-tie would be forgiven, that is reported as a bug and exits 1."""
        from specdec.verifiers import greedy

        from .test_half_precision import keep_every_draft

        monkeypatch.setattr(greedy, "greedy_verdict", keep_every_draft)
        out = tmp_path / "bench.json"
        result = runner.invoke(
            app,
            ["bench", "-c", str(pair), "--batch-sizes", "2", "--num-prompts", "4", "--max-new-tokens", "12",
             "--repeats", "1", "--warmup", "0", "--drafters", "model", "--no-assisted", "--out", str(out)],
        )
        assert result.exit_code == 1, result.output
        assert "a wrong acceptance" in result.stderr
        row = next(r for r in json.loads(out.read_text())["results"] if r["method"].startswith("specdec"))
        assert row["identical_rows"] < 1 and row["wrong_tokens"] >= 1
        assert row["near_ties"] + row["wrong_tokens"] == round((1 - row["identical_rows"]) * row["rows"])

    def test_policies_that_run_the_same_assisted_setting_share_its_contender(self, pair, tmp_path):
        """cost-aware has no k of its own: assisted generation runs at k = 5 for it, as for constant
        k = 5, so one contender, labelled with that setting, is timed once and compared with both."""
        config = pair.with_name("k5.toml")
        config.write_text(pair.read_text().replace("k = 3", "k = 5"))
        out = tmp_path / "bench.json"
        result = runner.invoke(
            app,
            ["bench", "-c", str(config), "--batch-sizes", "1", "--num-prompts", "2", "--max-new-tokens", "6",
             "--repeats", "1", "--warmup", "0", "--drafters", "model", "--policies", "constant,cost-aware",
             "--out", str(out)],
        )
        assert result.exit_code == 0, result.output
        rows = json.loads(out.read_text())["results"]
        assert [r["method"] for r in rows if r["method"].startswith("transformers")] == [
            "transformers assisted (model, k=5, constant schedule)"]
        specdec_rows = [r for r in rows if r["method"].startswith("specdec")]
        assert len(specdec_rows) == 2 and all(r["speedup_vs_assisted"] is not None for r in specdec_rows)

    def test_sampled_bench_uses_rejection_and_skips_exactness(self, pair, tmp_path):
        out = tmp_path / "bench.json"
        result = runner.invoke(
            app,
            ["bench", "-c", str(pair), "--batch-sizes", "2", "--num-prompts", "2", "--max-new-tokens", "5",
             "--repeats", "1", "--warmup", "0", "--temperature", "0.7", "--top-p", "0.9", "--out", str(out)],
        )
        assert result.exit_code == 0, result.output
        payload = json.loads(out.read_text())
        rows = payload["results"]
        assert [r["method"] for r in rows] == ["target alone", "specdec (model, constant)"]
        assert rows[1]["exact"] is None and rows[1]["new_tokens"] > 0
        assert payload["sampling"] == {"temperature": 0.7, "top_p": 0.9}  # top_k left to generate's default

    def test_bench_top_k(self, pair, tmp_path):
        out = tmp_path / "bench.json"
        common = ["bench", "-c", str(pair), "--batch-sizes", "1", "--num-prompts", "1", "--max-new-tokens", "4",
                  "--repeats", "1", "--warmup", "0", "--no-assisted", "--out", str(out)]
        result = runner.invoke(app, [*common, "--temperature", "0.7", "--top-k", "5"])
        assert result.exit_code == 0, result.output
        assert json.loads(out.read_text())["sampling"] == {"temperature": 0.7, "top_p": 1.0, "top_k": 5}
        assert "top-k 5" in result.stdout
        refused = runner.invoke(app, [*common, "--top-k", "5"])
        assert refused.exit_code == 2 and "--top-k needs sampling" in refused.stderr

    def test_bench_shows_generate_on_packed_weights_where_specdec_packs(self, pair, tmp_path, monkeypatch):
        """From batch 4 specdec's plain steps read packed weights too: the bench times generate on
        the same packed layers beside the target alone (every layer of the tiny pair packed here),
        and leaves it out when the config turns packing off."""
        from .conftest import pin_packing

        pin_packing(monkeypatch, smallest=0)
        out = tmp_path / "bench.json"
        common = ["bench", "--batch-sizes", "1,4", "--num-prompts", "4", "--max-new-tokens", "6", "--repeats", "1",
                  "--warmup", "0", "--no-assisted", "--out", str(out)]
        result = runner.invoke(app, [*common, "-c", str(pair)])
        assert result.exit_code == 0, result.output
        rows = json.loads(out.read_text())["results"]
        assert [(r["batch_size"], r["method"]) for r in rows] == [
            (1, "target alone"), (1, "specdec (model, constant)"),
            (4, "target alone"), (4, "target alone, packed weights"), (4, "specdec (model, constant)")]
        assert rows[3]["exact"] and rows[3]["note"] == "generate on specdec's packed layers" and rows[4]["exact"]
        unpacked = pair.parent / "unpacked.toml"
        unpacked.write_text(pair.read_text().replace('dtype = "float32"', 'dtype = "float32"\npacked_weights = false'))
        result = runner.invoke(app, [*common, "-c", str(unpacked)])
        assert result.exit_code == 0, result.output
        assert "packed" not in " ".join(r["method"] for r in json.loads(out.read_text())["results"])

    def test_static_cache_bench_is_exact(self, pair, tmp_path):
        out = tmp_path / "bench.json"
        result = runner.invoke(
            app,
            ["bench", "-c", str(pair), "--batch-sizes", "2", "--num-prompts", "2", "--max-new-tokens", "6",
             "--repeats", "1", "--warmup", "0", "--no-assisted", "--cache", "static", "--out", str(out)],
        )
        assert result.exit_code == 0, result.output
        rows = json.loads(out.read_text())["results"]
        assert rows[1]["method"] == "specdec (model, constant)" and rows[1]["exact"]

    @pytest.mark.parametrize("args, message", [
        (["--cache", "fixed"], "--cache must be one of dynamic, static, got 'fixed'"),
        (["--compile", "draft"], "needs static_cache=True"),
    ])
    def test_bad_cache_options(self, pair, args, message):
        result = runner.invoke(app, ["bench", "-c", str(pair), "--batch-sizes", "1", "--num-prompts", "1", *args])
        assert result.exit_code != 0 and message in " ".join(result.output.split())

    def test_bad_batch_sizes(self, pair):
        for value in ("0", "a,b", ""):
            result = runner.invoke(app, ["bench", "-c", str(pair), "--batch-sizes", value])
            assert result.exit_code == 2 and "batch-sizes" in result.output


def test_ideal_speedup_formula():
    from specdec.bench import ideal_speedup, solve_alpha

    assert ideal_speedup(0.0, 4, 0.0) == pytest.approx(1.0)
    assert ideal_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    alpha = solve_alpha(tau=3.0, k=5)
    assert (1 - alpha**6) / (1 - alpha) == pytest.approx(3.0, rel=1e-6)
    assert ideal_speedup(alpha, 5, 0.1) == pytest.approx(3.0 / 1.5, rel=1e-6)


# --- issue 16: what a user sees ----------------------------------------------------------------

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def reference(pair, prompts, n):
    """The target's own greedy continuations, decoded."""
    from specdec.config import SpecdecConfig

    target, tokenizer = SpecdecConfig.from_toml(pair).load_target()
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    expected = target.generate(**encoded, do_sample=False, max_new_tokens=n)
    return tokenizer.batch_decode(expected[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)


def run_specdec(*args, cwd=None, env=None):
    """The real command in a subprocess, stdout a pipe (as in `specdec ... | cat`)."""
    environment = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "specdec.cli", *map(str, args)], capture_output=True,
                          cwd=cwd, env=environment, timeout=300)


class TestOutputIsTheText:
    """stdout holds the model's text byte for byte; decoration goes to stderr."""

    def test_a_batch_prints_prompt_and_text_unchanged(self, pair):
        prompts = ["[bold]class Stack:[/]", "\tdef push(self, item):"]  # markup and a tab stay as written
        result = runner.invoke(app, ["generate", *prompts, "-c", str(pair), "-n", "40"])
        assert result.exit_code == 0, result.output
        texts = reference(pair, prompts, 40)
        assert result.stdout == "".join(p + t + "\n" for p, t in zip(prompts, texts))
        assert "tokens per target call" in result.stderr

    def test_a_streamed_prompt_is_the_final_text(self, pair):
        prompt = "def fibonacci(n):"
        result = runner.invoke(app, ["generate", prompt, "-c", str(pair), "-n", "60"])
        assert result.exit_code == 0, result.output
        assert result.stdout == prompt + reference(pair, [prompt], 60)[0] + "\n"

    def test_piped_output_is_not_wrapped(self, pair):
        """A real process with stdout a pipe: no 80-column wrapping, no escape codes."""
        prompts = ["def fibonacci(n):" + " " * 90 + "#", "class Stack:"]
        result = run_specdec("generate", "-c", pair, "-n", "30", *prompts)
        assert result.returncode == 0, result.stderr
        texts = reference(pair, prompts, 30)
        assert result.stdout.decode() == "".join(p + t + "\n" for p, t in zip(prompts, texts))
        assert b"\x1b[" not in result.stdout

    def test_json_names_the_components_and_their_options(self, pair):
        result = runner.invoke(app, ["generate", "x = 1", "-c", str(pair), "-n", "4", "--json",
                                     "--drafter", "ngram", "-D", "max_ngram=2", "--policy-option", "k=2"])
        assert result.exit_code == 0, result.output
        components = json.loads(result.stdout)["components"]
        assert components["drafter"] == {"name": "ngram", "options": {"max_ngram": 2, "min_ngram": 1}}
        assert components["policy"] == {"name": "constant", "options": {"k": 2, "max_batch": None}}
        assert components["verifier"]["name"] == "greedy"


class TestGenerateOptions:
    """--verifier, --temperature, --top-p, --seed and the per-strategy --*-option flags."""

    def test_sampling_with_a_seed_is_reproducible_and_uses_rejection(self, pair):
        args = ["generate", "import os", "-c", str(pair), "-n", "12", "--temperature", "0.8", "--top-p", "0.9",
                "--seed", "3", "--json", "--policy", "constant"]
        first, second = runner.invoke(app, args), runner.invoke(app, args)
        assert first.exit_code == 0, first.output
        assert "note:" not in first.stderr
        one, two = json.loads(first.stdout), json.loads(second.stdout)
        assert one["outputs"] == two["outputs"]
        assert one["components"]["verifier"]["name"] == "rejection"
        assert one["sampling"] == {"do_sample": True, "temperature": 0.8, "top_p": 0.9} and one["seed"] == 3

    def test_a_seed_with_the_default_policy_says_what_it_fixes(self, pair):
        """cost-aware (the default) chooses k from timings, and a row's draws depend on k: the seeded
        run is a valid sample, but not the same text every time, and the user is told so."""
        default = pair.with_name("default-policy.toml")  # the pair's config without its [policy] table
        default.write_text(pair.read_text().split("[policy]")[0])
        result = runner.invoke(app, ["generate", "import os", "-c", str(default), "-n", "6", "--temperature", "0.8",
                                     "--seed", "3", "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["components"]["policy"]["name"] == "cost-aware"
        assert "note: cost-aware chooses k from measured times" in result.stderr
        assert "--policy constant reproduces it exactly" in result.stderr
        greedy = runner.invoke(app, ["generate", "import os", "-c", str(default), "-n", "6", "--seed", "3"])
        assert greedy.exit_code == 0 and "note:" not in greedy.stderr  # greedy output does not depend on k

    def test_top_k_reaches_the_request(self, pair):
        """--top-k 1 leaves one token to sample: the text is the greedy one, whatever the seed."""
        greedy = runner.invoke(app, ["generate", "import os", "-c", str(pair), "-n", "12", "--json"])
        args = ["generate", "import os", "-c", str(pair), "-n", "12", "--temperature", "1.5", "--top-k", "1", "--json"]
        sampled = [runner.invoke(app, [*args, "--seed", str(seed)]) for seed in (1, 2)]
        assert greedy.exit_code == 0 and all(r.exit_code == 0 for r in sampled), sampled[0].output
        outputs = [json.loads(r.stdout) for r in sampled]
        assert outputs[0]["sampling"]["top_k"] == 1
        assert all(o["outputs"] == json.loads(greedy.stdout)["outputs"] for o in outputs)

    def test_explicit_verifier(self, pair):
        result = runner.invoke(app, ["generate", "import os", "-c", str(pair), "-n", "6", "--verifier", "rejection"])
        assert result.exit_code == 0, result.output
        assert "verifier rejection" in result.stderr

    @pytest.mark.parametrize(
        "args, message",
        [
            (["-P", "k=three"], "policy 'constant' (--policy-option): option 'k' must be int, got 'three'"),
            (["-P", "window=2"], "unknown option 'window'; its options are: k"),
            (["-P", "k"], "options are written name=value"),
            (["--top-p", "0.5"], "--top-p needs sampling"),
            (["--top-k", "5"], "--top-k needs sampling"),
            (["--verifier", "maybe"], "unknown verifier 'maybe'; known verifiers: greedy, rejection"),
        ],
    )
    def test_option_mistakes_exit_2_before_loading_a_model(self, pair, args, message):
        result = runner.invoke(app, ["generate", "x", "-c", str(pair), *args])
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith("Error: ") and message in result.stderr
        assert result.stdout == ""

    def test_a_missing_required_option_names_plugin_option_and_bundled_weights(self, pair):
        result = runner.invoke(app, ["generate", "x", "-c", str(pair), "--policy", "classifier"])
        assert result.exit_code == 2, result.output
        assert "policy 'classifier'" in result.stderr and "missing required option 'weights'" in result.stderr
        assert "--policy-option" in result.stderr and "python-pair/classifier.safetensors" in result.stderr
        assert "positional argument" not in result.output

    def test_the_bundled_pair_gets_its_classifier_by_default(self):
        result = runner.invoke(app, ["generate", "def f(x):", "-c", str(REPO / "plugins.toml"), "-n", "4",
                                     "--policy", "classifier", "--json"])
        assert result.exit_code == 0, result.output
        weights = json.loads(result.stdout)["components"]["policy"]["options"]["weights"]
        assert Path(weights) == REPO / "models" / "python-pair" / "classifier.safetensors"


README_PLUGIN = '''
import attrs, specdec
from specdec import Draft
from specdec.drafters import Drafter

@attrs.define(eq=False)
class RepeatLast(Drafter):
    """Propose the row's last token again."""
    name = "repeat-last"
    times: int = 2

    def propose(self, state, max_tokens, keep_drafting):
        last = state.sequences[state.rows].gather(1, (state.lengths[state.rows] - 1)[:, None])
        width = int(max_tokens.max())
        return Draft(tokens=last.expand(-1, width).clone(), lengths=max_tokens.clamp(max=self.times))

@specdec.hookimpl
def specdec_register(registry):
    registry.register_drafter("repeat-last", RepeatLast)
'''


@pytest.fixture
def local_plugins(tmp_path, monkeypatch):
    """Two plugins installed as entry points: the README's (no validators) and one that fails to import."""
    from specdec.plugins import load_plugins

    site = tmp_path / "site"
    site.mkdir()
    (site / "readme_plugin.py").write_text(README_PLUGIN)
    (site / "exploding_plugin.py").write_text("raise RuntimeError('needs a GPU driver that is not here')\n")
    info = site / "local_plugins-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: local-plugins\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[specdec]\nreadme = readme_plugin\nexploding = exploding_plugin\n")
    monkeypatch.syspath_prepend(str(site))
    load_plugins(refresh=True)
    yield site
    monkeypatch.undo()
    for name in ("readme_plugin", "exploding_plugin"):
        sys.modules.pop(name, None)
    load_plugins(refresh=True)


class TestPluginProblems:
    """A plugin that fails to load, and plugin options of the wrong type."""

    def test_a_plugin_that_failed_to_load_is_named_with_its_error(self, pair, local_plugins):
        result = runner.invoke(app, ["generate", "x", "-c", str(pair), "--drafter", "exploding"])
        assert result.exit_code == 2, result.output
        assert "the plugin 'exploding' (local-plugins) failed to load: RuntimeError: needs a GPU driver" in result.stderr
        listing = runner.invoke(app, ["plugins"])
        assert "plugin 'exploding' (local-plugins) failed to load" in listing.stderr
        assert "repeat-last" in listing.stdout

    def test_an_option_of_the_wrong_type_fails_before_decoding(self, pair, local_plugins, tmp_path):
        config = tmp_path / "plugins.toml"
        config.write_text(pair.read_text().replace('use = "model"\nmodel = "draft"', 'use = "repeat-last"\ntimes = "three"')
                          .replace('"target"', f'"{pair.parent / "target"}"'))
        result = runner.invoke(app, ["generate", "def f():", "-c", str(config), "-n", "4"])
        assert result.exit_code == 2, result.output
        assert "drafter 'repeat-last'" in result.stderr
        assert "option 'times' must be int, got 'three' (str)" in result.stderr
        assert result.stdout == "" and "Traceback" not in result.output
        ok = runner.invoke(app, ["generate", "def f():", "-c", str(config), "-n", "4", "-D", "times=3"])
        assert ok.exit_code == 0, ok.output


class TestPluginListing:
    """specdec plugins: nothing cut short, plain rows when piped."""

    def test_piped_listing_is_plain_rows_with_whole_names(self):
        result = run_specdec("plugins", env={"COLUMNS": "40"})
        assert result.returncode == 0, result.stderr
        out = result.stdout.decode()
        assert "…" not in out and "─" not in out and "│" not in out
        rows = {tuple(line.split()[:2]) for line in out.splitlines()[1:]}
        assert {("policy", "target-confidence"), ("policy", "draft-confidence"), ("drafter", "shared-encoder")} <= rows
        assert "heuristic  " in out and "initial=5, increase=2, decrease=1, min_tokens=1, max_tokens=32" in out

    def test_shared_encoder_is_listed_once(self):
        payload = json.loads(runner.invoke(app, ["plugins", "--json"]).stdout)
        names = [c["name"] for c in payload["components"] if c["kind"] == "drafter"]
        assert names.count("shared-encoder") == 1 and "shared_encoder" not in names


class TestStartUp:
    """--help, --version, argument errors and plugins import neither torch nor transformers."""

    def test_help_and_version_stay_light(self):
        code = textwrap.dedent("""
            import sys
            from specdec.cli import app
            for args in (["--help"], ["--version"], ["generate", "--help"], ["generate"], ["bench", "--repeats", "x"]):
                try:
                    app(args, prog_name="specdec")
                except SystemExit:
                    pass
            heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
            print("HEAVY", heavy)
        """)
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
        assert "HEAVY []" in result.stdout, result.stdout + result.stderr
        assert "specdec 0.1.0" in result.stdout

    def test_plugins_lists_without_loading_torch(self):
        """Listing reads the strategies' options; torch is only a stand-in that is never asked for anything."""
        code = textwrap.dedent("""
            import sys
            from specdec.cli import app
            try:
                app(["plugins"], prog_name="specdec")
            except SystemExit:
                pass
            from specdec.core.deferred import _DeferredTorch
            print("TORCH", type(sys.modules.get("torch")).__name__, "transformers" in sys.modules)
        """)
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
        assert "TORCH _DeferredTorch False" in result.stdout, result.stdout + result.stderr
        assert "hidden-state" in result.stdout and "cost-aware" in result.stdout  # the listing itself

    def test_version(self):
        result = runner.invoke(app, ["--version"])
        assert result.exit_code == 0 and result.stdout == "specdec 0.1.0\n"


class TestBenchMeasures:
    """bench: interleaved repeats, the spread, noise flagged, identical rows counted, no file unasked."""

    def test_interleaving_rotates_the_order(self):
        from specdec.bench import _Contender, interleave

        order = []
        contenders = [_Contender(name, lambda batch, name=name: (order.append(name), ([[1]], []))[1]) for name in "abc"]
        interleave(contenders, repeats=3, warmup=1)
        assert order == list("abc") + list("abc") + list("bca") + list("cab")
        assert all(len(c.samples) == 3 for c in contenders)

    def test_contenders_take_turns_batch_by_batch(self):
        """A repeat is every batch of prompts once per contender, and every contender decodes a batch
        before any decodes the next: a slow spell of the host lands on all of them alike."""
        from specdec.bench import _Contender, interleave

        order = []

        def run(batch, name):
            order.append(f"{name}{batch}")
            return [[7] * (batch + 1)], [f"out {name}{batch}"]  # batch i writes i + 1 tokens

        contenders = [_Contender(name, lambda batch, name=name: run(batch, name)) for name in "ab"]
        interleave(contenders, repeats=2, warmup=1, batches=3)
        assert order == ["a0", "a1", "a2", "b0", "b1", "b2",  # warm-up: each contender's batches
                         "a0", "b0", "b1", "a1", "a2", "b2",  # repeat 1: batch by batch, rotating
                         "b0", "a0", "a1", "b1", "b2", "a2"]  # repeat 2
        for contender in contenders:
            assert [tokens for _, tokens in contender.samples] == [6, 6]  # all three batches in each repeat
            assert contender.outputs == [f"out {contender.label}{batch}" for batch in range(3)]

    def test_no_file_unless_asked_and_the_spread_in_json(self, pair, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        args = ["bench", "-c", str(pair), "--batch-sizes", "2", "--num-prompts", "2", "--max-new-tokens", "5",
                "--repeats", "2", "--warmup", "0", "--drafters", "ngram"]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert list(tmp_path.iterdir()) == []
        assert "identical rows" in result.stdout and "100% (2/2)" in result.stdout
        assert "warn" not in result.output.lower()  # transformers' deprecation warnings stay quiet
        result = runner.invoke(app, [*args, "--out", "b.json"])
        rows = json.loads((tmp_path / "b.json").read_text())["results"]
        ngram = next(r for r in rows if r["method"] == "specdec (ngram, constant)")
        assert ngram["identical_rows"] == 1.0 and ngram["rows"] == 2 and ngram["repeats"] == 2
        assert ngram["speedup_min"] <= ngram["speedup_vs_target"] <= ngram["speedup_max"]

    def test_above_the_ideal_is_flagged_as_noise(self, pair, tmp_path, monkeypatch):
        import specdec.bench

        # the draft "costs" 1000 target forwards: the ideal is far below 1
        monkeypatch.setattr(specdec.bench, "step_costs", lambda *a, **k: specdec.bench.StepCosts(1000.0, 1.0, 1.0))
        out = tmp_path / "b.json"
        result = runner.invoke(app, ["bench", "-c", str(pair), "--batch-sizes", "1", "--num-prompts", "1",
                                     "--max-new-tokens", "4", "--repeats", "1", "--warmup", "0", "--no-assisted",
                                     "--out", str(out)])
        assert result.exit_code == 0, result.output
        row = json.loads(out.read_text())["results"][-1]
        assert row["noise"] is True and row["ratio_to_ideal"] > 1
        assert "noise" in result.stdout and "timing noise" in result.stderr

    def test_occupancy_is_the_share_of_a_batchs_rows_still_decoding(self, pair, tmp_path):
        """A batch decodes until its slowest row ends: at batch 16 on the bundled pair, constant k = 5
        left a third of its row slots idle, which is what its ceiling did not count."""
        out = tmp_path / "b.json"
        result = runner.invoke(app, ["bench", "-c", str(pair), "--batch-sizes", "1,4", "--num-prompts", "4",
                                     "--max-new-tokens", "6", "--repeats", "1", "--warmup", "0", "--no-assisted",
                                     "--out", str(out)])
        assert result.exit_code == 0, result.output
        assert "occupancy" in result.stdout
        rows = {r["batch_size"]: r for r in json.loads(out.read_text())["results"] if r["method"].startswith("specdec")}
        assert rows[1]["occupancy"] == 1.0  # a lone row is the whole batch at every iteration
        assert 0 < rows[4]["occupancy"] <= 1

    def test_the_ideal_counts_specdecs_own_plain_step(self, pair, tmp_path, monkeypatch):
        """Leviathan's target step is specdec's own plain step, p of generate's: at batch 64 on the
        bundled pair its in-place cache made it 0.70-0.80 of generate's, and plain-step rows at 1.2x
        read "noise"."""
        import specdec.bench

        monkeypatch.setattr(specdec.bench, "step_costs", lambda *a, **k: specdec.bench.StepCosts(0.0, 0.25, 0.25))
        out = tmp_path / "b.json"
        config = tmp_path / "plain.toml"
        config.write_text(pair.read_text().replace('use = "constant"\nk = 3', 'use = "constant"\nk = 0')
                          .replace('model = "target"', f'model = "{pair.parent / "target"}"'))
        result = runner.invoke(app, ["bench", "-c", str(config), "--batch-sizes", "2", "--num-prompts", "2",
                                     "--max-new-tokens", "4", "--repeats", "1", "--warmup", "0", "--no-assisted",
                                     "--drafters", "ngram", "--out", str(out)])
        assert result.exit_code == 0, result.output
        row = json.loads(out.read_text())["results"][-1]
        assert row["mean_lookahead"] == 0 and row["plain_step_cost"] == 0.25
        assert row["ideal_speedup"] == pytest.approx(4.0) and row["ceiling_speedup"] == pytest.approx(4.0)
        assert row["noise"] is False and "timing noise" not in result.stderr


class TestReadmeSnippet:
    """The README's Python example runs from any folder."""

    def test_runs_outside_the_repository(self, tmp_path):
        readme = (REPO / "README.md").read_text()
        snippet = readme.split("## From Python\n\n```python\n", 1)[1].split("```", 1)[0]
        snippet = snippet.replace("max_new_tokens=64", "max_new_tokens=4") + "\nprint('ROWS', out.sequences.shape[0])\n"
        result = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, cwd=tmp_path,
                                env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
        assert "ROWS 2" in result.stdout, result.stderr


@needs_pair
def test_the_ceilings_costs_are_timed_in_turn_as_the_loop_runs_them(monkeypatch):
    """c, v and p come from one interleaved timing: each repeat generate's step, round(k) draft steps
    in a row, then specdec's plain step and the verify widths either side of k + 1; timed apart, a
    slow spell hit one part alone."""
    from transformers import AutoModelForCausalLM

    import specdec.bench
    from specdec.core.cache import GrowingLayer

    target = AutoModelForCausalLM.from_pretrained(PAIR / "target", dtype=torch.float32, local_files_only=True).eval()
    draft = AutoModelForCausalLM.from_pretrained(PAIR / "draft", dtype=torch.float32, local_files_only=True).eval()
    calls = []
    for name, model in (("target", target), ("draft", draft)):
        original = model.forward

        @functools.wraps(original)  # its signature kept: the cache argument's name is read from it
        def counted(*args, name=name, original=original, **kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            in_place = getattr(cache, "layer_class_to_replicate", None) is GrowingLayer
            calls.append((name, kwargs["input_ids"].shape[1], kwargs.get("attention_mask") is not None, in_place))
            return original(*args, **kwargs)

        monkeypatch.setattr(model, "forward", counted)
    c, v, p = specdec.bench.step_costs(target, draft, 2, 2.5, context=16, repeats=2)
    assert c > 0 and v > 0 and p > 0
    # generate's step through its own concatenating cache; round(2.5) = 2 drafts, then specdec's plain
    # step and the verify blocks (with a mask), all three through specdec's cache, appending in place
    one_repeat = [("target", 1, False, False), ("draft", 1, False, True), ("draft", 1, False, True),
                  ("target", 1, False, True), ("target", 3, True, True), ("target", 4, True, True)]
    prefills = [("target", 16, False, False)] + [("target", 16, False, True)] * 3 + [("draft", 16, False, True)]
    assert calls == prefills + one_repeat * 2
    calls.clear()
    c, v, p = specdec.bench.step_costs(target, None, 1, 0.0, context=16, repeats=1)  # n-gram: no draft
    assert c == 0.0 and v == p  # k = 0: the verify is specdec's plain step
    assert calls == [("target", 16, False, False), ("target", 16, False, True), ("target", 1, False, False),
                     ("target", 1, False, True)]


def test_ceiling_counts_the_verify_cost():
    from specdec.bench import ceiling_speedup, ideal_speedup, verify_cost

    assert ceiling_speedup(3.0, 4, 0.1, 1.0) == pytest.approx(3.0 / 1.4)  # v = 1: Leviathan's ideal
    assert ideal_speedup(1.0, 2, 0.0) == pytest.approx(3.0)
    assert ceiling_speedup(3.0, 4, 0.1, 2.0) == pytest.approx(3.0 / 2.4)
    # v interpolates between specdec's forwards either side of k + 1, over generate's one-token step
    own = {1: 0.9, 2: 1.0, 3: 1.2, 4: 1.3}
    assert verify_cost(2.0, own, step=1.0) == pytest.approx(1.2)
    assert verify_cost(2.5, own, step=1.0) == pytest.approx(1.25)
    assert verify_cost(0.5, own, step=2.0) == pytest.approx(0.475)
    assert verify_cost(0.0, own, step=1.0) == pytest.approx(0.9)  # k = 0: specdec's plain step


@pytest.fixture
def specdec_logger():
    """The ``specdec`` logger as the command line leaves it (a handler and a level), restored after."""
    import logging

    logger = logging.getLogger("specdec")
    handlers, level = list(logger.handlers), logger.level
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)


@needs_pair
def test_a_first_run_on_a_machine_says_that_it_times_the_packed_weights(monkeypatch, specdec_logger):
    """The first run on a new machine times the weight shapes for packing (seconds, once): the command
    says so on stderr instead of seeming to hang, and says nothing once they are known."""
    from specdec.core import packed_linear

    config = str(REPO / "plugins.toml")
    first = runner.invoke(app, ["generate", "def f():", "-c", config, "-n", "2", "--json"])
    assert first.exit_code == 0, first.output
    assert json.loads(first.stdout)["outputs"]  # stdout stays the JSON alone
    assert ("specdec: timing 5 weight shapes of LlamaForCausalLM (python-pair/target) on this CPU for packed weights"
            in first.stderr)
    assert str(packed_linear.measurements_file()) in first.stderr.replace("\n", "") and "timed in" in first.stderr
    again = runner.invoke(app, ["generate", "def f():", "-c", config, "-n", "2"])  # the shapes known now
    assert again.exit_code == 0 and "specdec: timing" not in again.stderr
    monkeypatch.setattr(packed_linear, "_MEASURED", {})
    monkeypatch.setenv("SPECDEC_VERBOSITY", "warning")
    quiet = runner.invoke(app, ["generate", "def f():", "-c", config, "-n", "2"])
    assert quiet.exit_code == 0 and "specdec: timing" not in quiet.stderr
    monkeypatch.setenv("SPECDEC_VERBOSITY", "loud")
    wrong = runner.invoke(app, ["generate", "def f():", "-c", config, "-n", "2"])
    assert wrong.exit_code == 2 and "SPECDEC_VERBOSITY='loud' is not a level" in wrong.stderr


def test_a_notice_prints_above_a_live_progress_bar_on_a_terminal():
    """A first run's packing notice comes while the ``progress`` observer's bar is drawn (the draft
    model's first step): on a terminal it must print on a line of its own above the bar, not run
    into the bar's line and leave a stale copy of the bar behind. A real pseudo-terminal, a real bar."""
    import textwrap

    script = textwrap.dedent("""
        import logging, time
        from types import SimpleNamespace
        from specdec.cli.common import set_up_logging
        from specdec.observers.progress import ProgressObserver
        set_up_logging()
        bar = ProgressObserver(description="decoding", transient=False)
        bar.begin(SimpleNamespace(batch_size=1, max_new_tokens=10), None)
        time.sleep(0.4)  # rich has drawn the bar
        logging.getLogger("specdec.core.packed_linear").info("timing 5 weight shapes")
        time.sleep(0.4)
        bar.on_finish(None, None)
    """)
    code, text = run_on_a_terminal(script, SPECDEC_VERBOSITY="info")
    assert code == 0, text
    assert "specdec: timing 5 weight shapes" in text, text
    before = text[: text.index("specdec: timing")]
    line = before[max(before.rfind("\r"), before.rfind("\n")) + 1 :]  # what the notice's line already held
    assert "decoding" not in line and "0:00" not in line, repr(line)
