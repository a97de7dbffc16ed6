"""plugins.toml: which target, drafter, policy, verifier and observers to use, with their options.

```toml
[target]
model = "models/python-pair/target"   # relative paths are relative to this file
dtype = "float32"
cache = "dynamic"   # or "static": preallocated caches and fixed step shapes (SpeculativeDecoder(static_cache=True))
compile = "none"    # or "draft" / "all": torch.compile the models' steps (static cache only)
packed_weights = true   # float32 on a CPU: multi-token steps on oneDNN-packed weights (core/packed_linear.py)
screened_head = true    # with packed_weights, greedy verifies: the LM head in bfloat16, argmax candidates in float32 (core/screened_head.py)

[drafter]
use = "model"
model = "models/python-pair/draft"

[policy]
use = "heuristic"

[verifier]
use = "greedy"

[sampling]          # any transformers GenerationConfig option
max_new_tokens = 128

[[observers]]
use = "trace"
path = "trace.jsonl"
```
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import attrs
import torch

from .core.model_cache import cached_model_dir, is_bare_name, missing_model_hint, resolve_model_path
from .errors import ConfigError
from .plugins.manager import get_registry

_SECTIONS = {"target", "drafter", "policy", "verifier", "sampling", "observers"}
_TARGET_KEYS = {"model", "dtype", "device", "attn_implementation", "tokenizer", "cache", "compile", "packed_weights", "screened_head"}
CACHES = ("dynamic", "static")
# Options that name files: resolved against the TOML file's folder when that path exists there.
_PATH_OPTIONS = {"model", "weights", "path", "tokenizer", "head", "token_map", "memory"}
DTYPES = {
    "auto": "auto",
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "double": torch.float64,
}


@attrs.frozen
class ComponentSpec:
    """``use = "name"`` plus the component's options, as written in one TOML table."""

    kind: str
    use: str
    options: dict[str, Any] = attrs.field(factory=dict)

    def build(self, where: str = ""):
        return get_registry().create(self.kind, self.use, self.options, where=where)


def parse_options(kind: str, name: str, items: list[str] | tuple[str, ...], where: str = "") -> dict[str, Any]:
    """``["k=3", "threshold=0.4"]`` (the CLI's repeatable ``--policy-option``) as typed values,
    read against the options the component ``name`` declares: ``k=three`` for an ``int`` option
    is a ``ConfigError`` naming the plugin, the option, the type and the value."""
    entry = get_registry().get(kind, name)
    label = f"{kind} {entry.name!r}" + (f" ({where})" if where else "")
    options: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"{label}: options are written name=value, got {item!r}")
        declared = {o.name: o for o in entry.options()}
        if key not in declared:
            listed = ", ".join(declared) or "none"
            raise ConfigError(f"{label}: unknown option {key!r}; its options are: {listed}")
        option = declared[key]
        from .plugins.registry import parse_value

        try:
            options[key] = parse_value(text, option)
        except ValueError:
            raise ConfigError(f"{label}: option {key!r} must be {option.type}, got {text!r}") from None
    return options


def parse_dtype(value: str, where: str) -> torch.dtype | str:
    try:
        return DTYPES[str(value).lower()]
    except KeyError:
        raise ConfigError(f"{where}: unknown dtype {value!r}; use one of {', '.join(sorted(DTYPES))}") from None


@attrs.frozen
class SpecdecConfig:
    """A parsed plugins.toml. ``from_toml`` reads one; ``SpeculativeDecoder.from_config`` builds the decoder it describes."""

    target: dict[str, Any]
    drafter: ComponentSpec
    policy: ComponentSpec
    verifier: ComponentSpec
    observers: list[ComponentSpec] = attrs.field(factory=list)
    sampling: dict[str, Any] = attrs.field(factory=dict)
    source: str = "<dict>"

    @classmethod
    def from_toml(cls, path: str | Path) -> SpecdecConfig:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not a UTF-8 text file: {exc}") from exc
        return cls.from_dict(data, base_dir=path.parent, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], base_dir: str | Path = ".", source: str = "<dict>") -> SpecdecConfig:
        base_dir = Path(base_dir)
        unknown = sorted(set(data) - _SECTIONS)
        if unknown:
            raise ConfigError(f"{source}: unknown section(s) [{'], ['.join(unknown)}]; sections are {', '.join(sorted(_SECTIONS))}")

        target = _table(data, "target", source)
        if "model" not in target:
            raise ConfigError(f"{source}: [target] needs a 'model' key (a path or hub id)")
        bad = sorted(set(target) - _TARGET_KEYS)
        if bad:
            raise ConfigError(f"{source}: [target] has unknown key(s) {', '.join(bad)}; keys are {', '.join(sorted(_TARGET_KEYS))}")
        target = _resolve_paths(target, base_dir)
        for key in ("packed_weights", "screened_head"):
            if not isinstance(target.get(key, True), bool):
                raise ConfigError(f"{source}: [target] {key} must be true or false, got {target[key]!r}")
        if target.get("cache", "dynamic") not in CACHES:
            raise ConfigError(f"{source}: [target] cache must be one of {', '.join(repr(c) for c in CACHES)}, "
                              f"got {target['cache']!r}")

        def component(kind: str, default: str | None) -> ComponentSpec:
            table = _table(data, kind, source)
            use = table.pop("use", default)
            if use is None:
                raise ConfigError(f"{source}: [{kind}] needs 'use = \"<name>\"'")
            if not isinstance(use, str):
                raise ConfigError(f"{source}: [{kind}] 'use' must be a string, got {use!r}")
            return ComponentSpec(kind, use, _resolve_paths(table, base_dir))

        observers_data = data.get("observers", [])
        if isinstance(observers_data, dict):
            observers_data = [observers_data]
        if not isinstance(observers_data, list) or not all(isinstance(o, dict) for o in observers_data):
            raise ConfigError(f"{source}: 'observers' must be an array of tables ([[observers]] with use = ...)")
        observers = []
        for table in observers_data:
            table = dict(table)
            if "use" not in table:
                raise ConfigError(f"{source}: every [[observers]] entry needs 'use = \"<name>\"'")
            use = table.pop("use")
            observers.append(ComponentSpec("observer", use, _resolve_paths(table, base_dir)))

        sampling = _table(data, "sampling", source)
        return cls(
            target=target,
            drafter=component("drafter", None),
            policy=component("policy", "cost-aware"),
            verifier=component("verifier", "greedy"),
            observers=observers,
            sampling=sampling,
            source=source,
        )

    def with_choices(
        self,
        drafter: str | None = None,
        policy: str | None = None,
        verifier: str | None = None,
        *,
        drafter_options: dict[str, Any] | None = None,
        policy_options: dict[str, Any] | None = None,
        verifier_options: dict[str, Any] | None = None,
    ) -> SpecdecConfig:
        """Swap a component by name (the CLI's --drafter / --policy / --verifier), keeping its
        options only if the name is unchanged (a drafter that loads a model keeps ``model``), then
        set ``*_options`` on top (the CLI's --drafter-option and friends, already parsed: see
        ``parse_options``)."""
        from .plugins.registry import canonical

        changes = {}
        for kind, name, extra in (
            ("drafter", drafter, drafter_options),
            ("policy", policy, policy_options),
            ("verifier", verifier, verifier_options),
        ):
            current: ComponentSpec = getattr(self, kind)
            spec = current
            if name is not None and canonical(name) != canonical(current.use):
                options = {}
                if kind == "drafter" and canonical(name) in ("model", "shared-encoder") and "model" in current.options:
                    options = {"model": current.options["model"]}
                spec = ComponentSpec(kind, name, options)
            if extra:
                spec = ComponentSpec(kind, spec.use, {**spec.options, **extra})
            if spec is not current:
                changes[kind] = spec
        return attrs.evolve(self, **changes)

    # --- building -------------------------------------------------------------------------------

    @property
    def dtype(self):
        return parse_dtype(self.target.get("dtype", "float32"), f"{self.source}: [target] dtype")

    @property
    def target_is_encoder_decoder(self) -> bool:
        """Whether the target's config.json describes an encoder-decoder model (Whisper, T5, ...)."""
        from transformers import AutoConfig

        model = str(self.target["model"])
        if is_bare_name(model) and not Path(model).expanduser().exists():
            # Neither a folder nor a fetched model (from_dict resolves those): not worth asking a hub.
            raise ConfigError(f"{self.source}: [target] model {model!r} {missing_model_hint(model)}")
        try:
            return bool(AutoConfig.from_pretrained(model).is_encoder_decoder)
        except (OSError, ValueError):
            return False  # load_target reports the unreadable model

    @property
    def static_cache(self) -> bool:
        """``[target] cache = "static"``: see ``SpeculativeDecoder(static_cache=...)``."""
        return self.target.get("cache", "dynamic") == "static"

    @property
    def compile(self) -> str:
        """``[target] compile``: see ``SpeculativeDecoder(compile=...)`` (checked there)."""
        return str(self.target.get("compile", "none"))

    @property
    def packed_weights(self) -> bool:
        """``[target] packed_weights``: see ``SpeculativeDecoder(packed_weights=...)``."""
        return self.target.get("packed_weights", True)

    @property
    def screened_head(self) -> bool:
        """``[target] screened_head``: see ``SpeculativeDecoder(screened_head=...)``."""
        return self.target.get("screened_head", True)

    def load_target(self):
        """The target model and its tokenizer (offline when the paths are local).

        An encoder-decoder target (its config says ``is_encoder_decoder``) is loaded with
        ``AutoModelForSpeechSeq2Seq`` (then ``AutoModelForSeq2SeqLM``); use ``load_processor``
        for its feature extractor.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from .core.models import load_pretrained, load_seq2seq

        who = f"{self.source}: [target]"
        if self.target_is_encoder_decoder:
            model = load_seq2seq(self.target["model"], dtype=self.dtype, who=who)
        else:
            model = load_pretrained(AutoModelForCausalLM, self.target["model"], dtype=self.dtype, who=who)
        device = self.target.get("device")
        if device:
            try:
                model.to(device)
            except (RuntimeError, AssertionError) as exc:
                raise ConfigError(f"{self.source}: [target] device {device!r} is not usable: {exc}") from exc
        tokenizer_path = self.target.get("tokenizer", self.target["model"])
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{self.source}: cannot load the tokenizer from {str(tokenizer_path)!r}: {exc}") from exc
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        return model, tokenizer

    def load_processor(self):
        """The target's processor (feature extractor plus tokenizer, for speech targets), from the
        ``tokenizer`` path or the model folder."""
        from transformers import AutoProcessor

        path = self.target.get("tokenizer", self.target["model"])
        try:
            return AutoProcessor.from_pretrained(str(path))
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"{self.source}: cannot load the processor from {str(path)!r}: {exc}") from exc

    def build_components(self, extra_observers=()):
        drafter = self.drafter.build(self.source)
        policy = self.policy.build(self.source)
        verifier = self.verifier.build(self.source)
        observers = [spec.build(self.source) for spec in self.observers] + list(extra_observers)
        return drafter, policy, verifier, observers


def resolve_model(value: str | Path, who: str) -> Path:
    """A model folder from a path or from the name of a model ``specdec models fetch`` converted."""
    return resolve_model_path(value, who)


def _table(data: dict[str, Any], name: str, source: str) -> dict[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: '{name}' must be a table ([{name}]), got {type(value).__name__}")
    return dict(value)


def _resolve_paths(options: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    resolved = dict(options)
    for key, value in options.items():
        if isinstance(value, dict):  # a component's own table ([drafter.then] of 'fallback')
            resolved[key] = _resolve_paths(value, base_dir)
    for key, value in options.items():
        if key in _PATH_OPTIONS and isinstance(value, str):
            candidate = Path(value).expanduser()
            if not candidate.is_absolute():
                candidate = base_dir / candidate
            if candidate.exists() or value.startswith((".", "/")) or "/" in value and len(Path(value).parts) != 2:
                resolved[key] = str(candidate)
            elif key == "model" and cached_model_dir(value) is not None:
                resolved[key] = str(cached_model_dir(value))  # a name `specdec models fetch` converted
    return resolved
