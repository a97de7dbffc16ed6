"""Discovery through pluggy entry points, plugins.toml selection, and runtime hooks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specdec
from specdec import ConfigError, SpeculativeDecoder
from specdec.drafters import NGramDrafter
from specdec.observers import Observer
from specdec.plugins import get_registry, load_plugins
from specdec.config import SpecdecConfig
from specdec.core.hookspecs import hookimpl
from specdec.plugins.manager import DEFAULT_PLUGINS

from .conftest import greedy_reference, left_padded_prompts

FIXTURE = Path(__file__).parent / "fixtures" / "specdec-example-plugin"


@pytest.fixture(scope="module")
def installed_example_plugin(tmp_path_factory):
    """pip-install the fixture package (its own pyproject and entry points) into a fresh folder."""
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(FIXTURE)],
        check=True,
        cwd=build,
    )
    sys.path.insert(0, str(target))
    yield target
    sys.path.remove(str(target))
    for name in [m for m in sys.modules if m.startswith("specdec_example_plugin")]:
        del sys.modules[name]
    load_plugins(refresh=True)


class TestDiscovery:
    """Built-ins register through the same hook a third-party package uses."""

    def test_builtins_are_registered_with_their_package(self):
        registry = get_registry(refresh=True)
        assert {"model", "ngram"} <= set(registry.names("drafter"))
        assert {"constant", "heuristic"} <= set(registry.names("policy"))
        assert "greedy" in registry.names("verifier")
        entry = registry.get("drafter", "ngram")
        assert entry.package == "specdec" and entry.plugin == "specdec.drafters.ngram"
        assert [o.name for o in entry.options()] == ["max_ngram", "min_ngram"]

    def test_every_builtin_module_implements_the_register_hook(self):
        plugins = load_plugins(refresh=True)
        registered = {impl.plugin_name for impl in plugins.manager.hook.specdec_register.get_hookimpls()}
        assert set(DEFAULT_PLUGINS) <= registered

    def test_third_party_entry_point_is_found_and_a_broken_one_is_reported(self, installed_example_plugin):
        plugins = load_plugins(refresh=True)
        entry = plugins.registry.get("drafter", "repeat-last")
        assert entry.package == "specdec-example-plugin"
        assert plugins.registry.get("observer", "step-counter").plugin == "example"
        failure = [f for f in plugins.failures if f.plugin == "broken_example"]
        assert failure and "broken on purpose" in failure[0].error
        assert "ngram" in plugins.registry.names("drafter")  # the others still loaded

    def test_third_party_drafter_chosen_by_name_in_toml(self, installed_example_plugin, tmp_path, llama):
        load_plugins(refresh=True)
        toml = tmp_path / "plugins.toml"
        toml.write_text(
            '[target]\nmodel = "unused"\n\n[drafter]\nuse = "repeat-last"\ntimes = 3\n\n'
            '[policy]\nuse = "constant"\nk = 3\n\n[[observers]]\nuse = "step-counter"\n'
        )
        config = SpecdecConfig.from_toml(toml)
        decoder = SpeculativeDecoder.from_config(config, target=llama)
        assert type(decoder.drafter).__module__ == "specdec_example_plugin"
        input_ids, mask = left_padded_prompts([5, 9], seed=2)
        out = decoder.generate(input_ids, attention_mask=mask, max_new_tokens=12)
        assert torch.equal(out.sequences, greedy_reference(llama, input_ids, mask, 12))
        assert decoder.observers[0].steps == out.stats.iterations > 0


class TestRuntimeHooks:
    """Broadcast hooks reach every observer; firstresult hooks have exactly one answer."""

    def test_observer_sees_every_step_and_the_finish(self, llama):
        seen = []

        class Recorder(Observer):
            name = "recorder"

            def on_step(self, state, step):
                seen.append(("step", step.rows_host.tolist(), step.appended_host.tolist()))

            def on_finish(self, state, output):
                seen.append(("finish", output.sequences.shape[0]))

        input_ids, mask = left_padded_prompts([4, 7], seed=1)
        out = SpeculativeDecoder(target=llama, drafter=NGramDrafter(), observers=[Recorder()]).generate(
            input_ids, attention_mask=mask, max_new_tokens=8
        )
        steps = [s for s in seen if s[0] == "step"]
        assert len(steps) == out.stats.iterations
        assert sum(sum(s[2]) for s in steps) == out.stats.new_tokens
        assert seen[-1] == ("finish", 2)

    def test_a_plain_hookimpl_plugin_can_observe(self, llama):
        """A component may also implement hooks directly with @specdec.hookimpl."""
        calls = []

        class Direct(Observer):
            name = "direct"

            @hookimpl
            def specdec_select_rows(self, state, keep, keep_host):
                calls.append(keep_host.tolist())

        input_ids, mask = left_padded_prompts([4, 7, 2], seed=4)
        free = greedy_reference(llama, input_ids, mask, 10, eos_token_id=None)
        eos = int(free[1, input_ids.shape[1] + 2])
        SpeculativeDecoder(target=llama, drafter=NGramDrafter(), observers=[Direct()]).generate(
            input_ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos
        )
        assert calls, "a row finished early, so rows must have left the batch"
        assert specdec.hookimpl is hookimpl

    def test_one_instance_cannot_be_plugged_in_twice(self, llama):
        class Quiet(Observer):
            name = "quiet"

        observer = Quiet()
        with pytest.raises(ConfigError, match="observer 'quiet' .* is passed twice"):
            SpeculativeDecoder(target=llama, drafter=NGramDrafter(), observers=[observer, observer])


class TestNamesAndOptions:
    """Names with '-' or '_' are one name; options are checked against their declared types."""

    def test_shared_encoder_is_listed_with_a_hyphen_and_found_either_way(self):
        registry = get_registry(refresh=True)
        drafters = [e.name for e in registry.entries("drafter")]
        assert "shared-encoder" in drafters and "shared_encoder" not in drafters
        assert registry.get("drafter", "shared_encoder") is registry.get("drafter", "shared-encoder")
        assert registry.get("policy", "draft_confidence").name == "draft-confidence"

    def test_declared_types_are_checked_before_building(self):
        import attrs

        from specdec.plugins.registry import Registry

        @attrs.define
        class Loose:
            """No validators, only annotations."""

            times: int = 2
            scale: float = 1.0
            label: str | None = None
            path: Path | None = None
            anything: object = None

        registry = Registry()
        registry.register_drafter("loose", Loose)
        for options, message in [
            ({"times": "three"}, "option 'times' must be int, got 'three' (str)"),
            ({"times": True}, "option 'times' must be int, got True (bool)"),
            ({"scale": "x"}, "option 'scale' must be float"),
            ({"label": 3}, "option 'label' must be str | None, got 3 (int)"),
        ]:
            with pytest.raises(ConfigError, match=r"drafter 'loose' \(t.toml\): " + message.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")):
                registry.create("drafter", "loose", options, where="t.toml")
        built = registry.create("drafter", "loose", {"times": 3, "scale": 2, "label": None, "path": "a/b", "anything": [1]})
        assert (built.times, built.scale, built.path) == (3, 2, "a/b")

    def test_command_line_values_are_read_as_the_declared_type(self):
        from specdec.config import parse_options

        get_registry(refresh=True)
        assert parse_options("policy", "heuristic", ["initial=3", "max_tokens=9"]) == {"initial": 3, "max_tokens": 9}
        assert parse_options("policy", "target-confidence", ["draft_threshold=none", "threshold=0.25"]) == {
            "draft_threshold": None, "threshold": 0.25}
        assert parse_options("observer", "progress", ["transient=no", "description=a=b"]) == {
            "transient": False, "description": "a=b"}
        with pytest.raises(ConfigError, match=r"policy 'constant': option 'k' must be int, got '2.5'"):
            parse_options("policy", "constant", ["k=2.5"])

    def test_a_missing_required_option_is_named(self):
        with pytest.raises(ConfigError, match=r"policy 'classifier': missing required option 'weights'"):
            get_registry(refresh=True).create("policy", "classifier", {})

    def test_unknown_name_points_at_the_plugin_that_failed(self, installed_example_plugin):
        registry = load_plugins(refresh=True).registry
        with pytest.raises(ConfigError, match=r"drafter 'broken_example' is not available: the plugin 'broken_example' "
                                              r"\(specdec-example-plugin\) failed to load: ImportError: .*broken on purpose"):
            registry.get("drafter", "broken_example")
        with pytest.raises(ConfigError, match=r"unknown drafter 'other'.*failed to load, which may provide it: 'broken_example'"):
            registry.get("drafter", "other")
