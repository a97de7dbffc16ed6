"""The real CLI through typer's runner, on a tiny pair saved to disk and real TOML files."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specdec.cli import app

from .tinypair import save_pair

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
        assert (1, "transformers assisted (model, constant)") in methods
        specdec_rows = [r for r in payload["results"] if r["method"].startswith("specdec")]
        assert specdec_rows and all(r["exact"] for r in specdec_rows)
        assert all(r["ideal_speedup"] is not None for r in specdec_rows)
        assisted_b2 = [r for r in payload["results"] if r["batch_size"] == 2 and r["method"].startswith("transformers")]
        assert assisted_b2 and all("row by row" in r["note"] for r in assisted_b2)

    def test_sampled_bench_uses_rejection_and_skips_exactness(self, pair, tmp_path):
        out = tmp_path / "bench.json"
        result = runner.invoke(
            app,
            ["bench", "-c", str(pair), "--batch-sizes", "2", "--num-prompts", "2", "--max-new-tokens", "5",
             "--repeats", "1", "--warmup", "0", "--temperature", "0.7", "--top-p", "0.9", "--out", str(out)],
        )
        assert result.exit_code == 0, result.output
        rows = json.loads(out.read_text())["results"]
        assert [r["method"] for r in rows] == ["target alone", "specdec (model, constant)"]
        assert rows[1]["exact"] is None and rows[1]["new_tokens"] > 0

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
