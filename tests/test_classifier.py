"""Policy ``classifier``: features and decisions, training end to end, the weights file and its
errors, greedy exactness, and the ``policy train`` command on a real plugins.toml."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
import typer
from safetensors.torch import save_file
from typer.testing import CliRunner

from specdec import ConfigError, SpeculativeDecoder
from specdec.drafters import ModelDrafter
from specdec.plugins import get_registry
from specdec.policies import ClassifierLookahead
from specdec.policies.classifier import FEATURES, StopClassifier, draft_features
from specdec.training.classifier import train_classifier
from specdec.cli.policy import policy_app
from specdec.verifiers import GreedyVerifier

from .conftest import Recorder, drafts_and_budgets, left_padded, perturbed_copy, tiny_llama
from .saved_pair import save_pair

VOCAB = 16
PROMPTS = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 3, 4], [12, 13, 14], [5, 5, 6], [15, 3], [4, 9, 12, 8, 6], [10]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(30, vocab=VOCAB, layers=1, init=0.3)


@pytest.fixture(scope="module")
def decoder(target):
    return SpeculativeDecoder(target=target, drafter=ModelDrafter(perturbed_copy(target, 0.1)))


def by_token_prob(cut: float = 0.5) -> StopClassifier:
    """A hand-made logistic regression: P(accept) > 0.5 exactly when the draft's token_prob > ``cut``."""
    return StopClassifier(
        weights=(torch.tensor([[20.0, 0.0, 0.0, 0.0]]),),
        biases=(torch.tensor([-20.0 * cut]),),
        mean=torch.zeros(len(FEATURES)),
        std=torch.ones(len(FEATURES)),
    )


class TestFeaturesAndDecisions:
    """``draft_features`` and ``ClassifierLookahead.continue_drafting`` on hand-made inputs."""

    def test_features(self):
        probs = torch.tensor([[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0]])
        features = draft_features(3, torch.tensor([0.25, 1.0]), probs, torch.tensor([0.7, 0.2]))
        expected = torch.tensor([[0.25, math.log(4), 3.0, 0.7], [1.0, 0.0, 3.0, 0.2]])
        assert torch.allclose(features, expected)
        one_hot = draft_features(0, None, None, torch.tensor([0.5]))  # a drafter without distributions
        assert one_hot.tolist() == [[1.0, 0.0, 0.0, 0.5]]

    def test_decisions(self):
        policy = ClassifierLookahead(weights=by_token_prob(0.5), threshold=0.5, max_tokens=6)
        state = SimpleNamespace(batch_size=3, active=3, rows_host=torch.arange(3), device=torch.device("cpu"))
        policy.begin(state, None)
        assert policy.lookahead(state).tolist() == [6, 6, 6]
        keep = policy.continue_drafting(state, 1, None, torch.tensor([0.9, 0.2, 0.6]), torch.full((3, 4), 0.25))
        assert keep.tolist() == [True, False, True]

    @pytest.mark.parametrize("options,field", [({"threshold": 2}, "threshold"), ({"max_tokens": 0}, "max_tokens"), ({"weights": 3}, "weights")])
    def test_invalid_options_name_the_field(self, tmp_path, options, field):
        path = by_token_prob().save(tmp_path / "c.safetensors")
        with pytest.raises(ConfigError, match=field):
            get_registry().create("policy", "classifier", {"weights": str(path), **options})


class TestWeightsFile:
    """The safetensors file: round trip, and a ConfigError naming the file for anything else."""

    def test_round_trip(self, tmp_path):
        path = by_token_prob(0.3).save(tmp_path / "c.safetensors")
        policy = get_registry().create("policy", "classifier", {"weights": str(path)})
        x = torch.rand(5, len(FEATURES))
        assert torch.equal(policy._model.logits(x), by_token_prob(0.3).logits(x))

    def test_missing(self, tmp_path):
        path = tmp_path / "nothing.safetensors"
        with pytest.raises(ConfigError, match="nothing.safetensors.*does not exist"):
            ClassifierLookahead(weights=str(path))

    def test_not_safetensors(self, tmp_path):
        path = tmp_path / "junk.safetensors"
        path.write_bytes(b"\x00\x01 this is not a safetensors file")
        with pytest.raises(ConfigError, match="junk.safetensors"):
            ClassifierLookahead(weights=str(path))

    def test_safetensors_without_classifier_metadata(self, tmp_path):
        path = tmp_path / "plain.safetensors"
        save_file({"w": torch.zeros(2)}, str(path))
        with pytest.raises(ConfigError, match="plain.safetensors.*not a specdec classifier"):
            ClassifierLookahead(weights=str(path))

    def test_trained_for_other_features(self, tmp_path):
        other = StopClassifier(
            weights=(torch.zeros(1, 4),), biases=(torch.zeros(1),), mean=torch.zeros(4), std=torch.ones(4),
            features=("token_prob", "entropy", "position", "draft_logit_margin"),
        )
        path = other.save(tmp_path / "other.safetensors")
        with pytest.raises(ConfigError, match="other.safetensors.*draft_logit_margin"):
            ClassifierLookahead(weights=str(path))

    def test_wrong_shapes(self, tmp_path):
        path = tmp_path / "shapes.safetensors"
        metadata = {"format": "specdec-classifier", "format_version": "1", "features": json.dumps(list(FEATURES)), "layers": "1"}
        tensors = {"mean": torch.zeros(4), "std": torch.ones(4), "layers.0.weight": torch.zeros(1, 3), "layers.0.bias": torch.zeros(1)}
        save_file(tensors, str(path), metadata=metadata)
        with pytest.raises(ConfigError, match="shapes.safetensors.*malformed"):
            ClassifierLookahead(weights=str(path))

    def test_config_file_resolves_weights_next_to_it(self, tmp_path):
        from specdec.config import SpecdecConfig

        by_token_prob().save(tmp_path / "c.safetensors")
        data = {"target": {"model": "t"}, "drafter": {"use": "ngram"}, "policy": {"use": "classifier", "weights": "c.safetensors"}}
        policy = SpecdecConfig.from_dict(data, base_dir=tmp_path).policy.build()
        assert isinstance(policy, ClassifierLookahead)
        data["policy"]["weights"] = "./missing.safetensors"
        with pytest.raises(ConfigError, match="missing.safetensors"):
            SpecdecConfig.from_dict(data, base_dir=tmp_path).policy.build()


class TestTraining:
    """``train_classifier`` on a tiny pair."""

    def test_end_to_end(self, decoder, tmp_path):
        out = tmp_path / "trained.safetensors"
        report = train_classifier(decoder, PROMPTS, out, max_new_tokens=12, max_tokens=4, hidden=4)
        assert report.path == out and out.is_file()
        assert report.samples == report.train_samples + report.heldout_samples > 20
        assert 0.0 < report.accept_rate < 1.0
        assert report.heldout_accuracy >= report.majority_accuracy - 0.1
        assert "held-out accuracy" in report.summary()
        policy = ClassifierLookahead(weights=str(out))
        x = torch.rand(7, len(FEATURES))
        assert torch.allclose(policy._model.logits(x), report.classifier.logits(x))

    def test_labels_are_the_greedy_oracle(self, target):
        """A draft equal to the target is always right: every label says accepted."""
        same = SpeculativeDecoder(target=target, drafter=ModelDrafter(copy.deepcopy(target)))
        report = train_classifier(same, PROMPTS[:4], max_new_tokens=8, max_tokens=3)
        assert report.accept_rate == 1.0 and report.path is None

    def test_bad_input(self, decoder):
        with pytest.raises(ValueError, match="prompt 1"):
            train_classifier(decoder, [[3, 4], []])
        with pytest.raises(ValueError, match="tokenizer"):
            train_classifier(decoder, ["a b"])
        with pytest.raises(ValueError, match="holdout"):
            train_classifier(decoder, PROMPTS, holdout=1.0)



def test_greedy_output_with_classifier_equals_target_generate():
    """float64, left padding: rows stop where the classifier says, output stays the target's."""
    target = tiny_llama(31, vocab=32, layers=2, dtype=torch.float64, init=0.3)
    recorder = Recorder()
    decoder = SpeculativeDecoder(
        target=target,
        drafter=ModelDrafter(perturbed_copy(target, 0.1)),
        policy=ClassifierLookahead(weights=by_token_prob(0.4), max_tokens=5),
        verifier=GreedyVerifier(),
        observers=[recorder],
    )
    input_ids, mask = left_padded([[1, 2, 3, 1, 2], [4, 5], [6, 7, 8, 9, 10, 11, 6, 7], [12]])
    out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    assert torch.equal(out.sequences, expected)
    assert 0 < out.stats.accepted < out.stats.drafted
    stopped = 0
    for step, b, allowed in drafts_and_budgets(recorder.steps, max_tokens=5, new_tokens=16):
        probs = step.draft.token_probs[b, : int(step.drafted_host[b])]
        assert bool((probs[:-1] > 0.4).all()), "a row kept drafting after a token the classifier doubted"
        if len(probs) < allowed:
            stopped += 1
            assert float(probs[-1]) <= 0.4, "a row stopped after a token the classifier trusted"
    assert stopped


# --- the command ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    """The saved tiny pair with its tokenizer and plugins.toml (``my.toml``), plus both prompt formats."""
    root = tmp_path_factory.mktemp("pair")
    save_pair(root).rename(root / "my.toml")
    prompts = [json.loads(line)["prompt"] for line in (root / "prompts.jsonl").read_text().splitlines()]
    (root / "prompts.txt").write_text("\n".join(prompts) + "\n", encoding="utf-8")
    return root


def invoke(app, *args):
    return CliRunner().invoke(app, [str(a) for a in args])


class TestPolicyTrainCommand:
    """``specdec policy train`` through typer's CliRunner."""

    @pytest.mark.parametrize("prompts", ["prompts.txt", "prompts.jsonl"])
    def test_trains_and_saves(self, pair_dir, tmp_path, prompts):
        out = tmp_path / "clf.safetensors"
        result = invoke(
            policy_app, "train", "--config", pair_dir / "my.toml", "--prompts", pair_dir / prompts, "--out", out,
            "--max-new-tokens", 10, "--max-tokens", 3,
        )
        assert result.exit_code == 0, result.output
        assert "held-out accuracy" in result.output and out.is_file()
        assert isinstance(ClassifierLookahead(weights=str(out)), ClassifierLookahead)

    def test_mounted_as_policy_subcommand(self, pair_dir, tmp_path):
        app = typer.Typer()

        @app.command()
        def generate():  # a second command, as the real CLI has
            pass

        app.add_typer(policy_app, name="policy")
        out = tmp_path / "clf.safetensors"
        result = invoke(
            app, "policy", "train", "--config", pair_dir / "my.toml", "--prompts", pair_dir / "prompts.txt",
            "--out", out, "--max-new-tokens", 6, "--max-tokens", 2,
        )
        assert result.exit_code == 0, result.output
        assert out.is_file()

    @pytest.mark.parametrize(
        "setup,message",
        [
            (lambda d: ("missing.txt", "my.toml"), "missing.txt"),
            (lambda d: ("empty.txt", "my.toml"), "no prompts"),
            (lambda d: ("bad.jsonl", "my.toml"), "bad.jsonl:2"),
            (lambda d: ("prompts.txt", "nope.toml"), "nope.toml"),
        ],
        ids=["missing prompts", "empty prompts", "malformed jsonl", "missing config"],
    )
    def test_errors_exit_2_with_a_message(self, pair_dir, tmp_path, setup, message):
        (tmp_path / "empty.txt").write_text("\n\n", encoding="utf-8")
        (tmp_path / "bad.jsonl").write_text('{"prompt": "a b"}\n{"text": "a"}\n', encoding="utf-8")
        prompts, config = setup(tmp_path)
        prompts_path = pair_dir / prompts if prompts == "prompts.txt" else tmp_path / prompts
        config_path = pair_dir / config if config == "my.toml" else tmp_path / config
        result = invoke(policy_app, "train", "--config", config_path, "--prompts", prompts_path, "--out", tmp_path / "o")
        assert result.exit_code == 2
        assert message in result.output and "Traceback" not in result.output
