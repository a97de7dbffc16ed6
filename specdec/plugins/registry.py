"""The named components plugins register, and how a name plus options becomes a component.

Names: ``-`` and ``_`` are the same character in a name (``shared_encoder`` finds
``shared-encoder``); names are listed with ``-``, and the spelling a plugin registered stays
accepted as an alias.

Options: a factory's attrs fields are its options. Before a component is built, the options are
checked against the fields: unknown names, missing required options, and values of the wrong
type (against the field's declared annotation: ``int``, ``float``, ``str``, ``bool``,
``Path``, ``X | None`` ...) are ``ConfigError``s naming the plugin, the option, the expected type
and the value, so nothing fails later inside torch. ``parse_option`` turns the ``key=value``
text of the command line into a value of the declared type. A field with ``metadata={PYTHON_ONLY: True}``
(a test's fake clock) is an argument in Python only: not listed, and unknown in a config.
"""

from __future__ import annotations

import builtins
import re
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any

import attrs

from ..core.hookspecs import PYTHON_ONLY
from ..errors import ConfigError

KINDS = ("drafter", "policy", "verifier", "observer")
PLURALS = {"drafter": "drafters", "policy": "policies", "verifier": "verifiers", "observer": "observers"}
_MISSING = "(required)"
_CHECKED = object()  # a component option's table, checked on its own


def canonical(name: str) -> str:
    """The listed spelling of a component name: ``_`` becomes ``-``."""
    return name.replace("_", "-")


@attrs.frozen
class Option:
    name: str
    type: str
    default: Any
    types: tuple = ()  # the annotation's members: classes, None, or names that could not be resolved (str)

    @property
    def required(self) -> bool:
        return self.default is _MISSING


@attrs.frozen
class Registration:
    """One component a plugin registered: what it makes, and where it came from."""

    kind: str
    name: str
    factory: type
    plugin: str
    package: str
    aliases: tuple[str, ...] = ()

    @property
    def summary(self) -> str:
        doc = (self.factory.__doc__ or "").strip().splitlines()
        return doc[0] if doc else ""

    @property
    def label(self) -> str:
        return f"{self.kind} {self.name!r}"

    def options(self) -> list[Option]:
        if not attrs.has(self.factory):
            return []
        options = []
        for field in attrs.fields(self.factory):
            if not field.init or field.name.startswith("_") or field.metadata.get(PYTHON_ONLY):
                continue
            if field.default is attrs.NOTHING:
                default = _MISSING
            elif isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
                default = field.default.factory() if not field.default.takes_self else None
            else:
                default = field.default
            text = _type_text(field.type)
            options.append(Option(field.alias or field.name, text, default, _type_members(field.type, self.factory)))
        return options

    def option(self, name: str) -> Option:
        for option in self.options():
            if option.name == name:
                return option
        listed = ", ".join(o.name for o in self.options()) or "none"
        raise ConfigError(f"{self.label} has no option {name!r}; its options are: {listed}")

    def check(self, options: dict[str, Any], where: str = "") -> None:
        """Raise ``ConfigError`` for an unknown option, a missing required one, or a value of the wrong type."""
        if not attrs.has(self.factory):
            return
        label = self.label + (f" ({where})" if where else "")
        declared = {o.name: o for o in self.options()}
        unknown = sorted(set(options) - set(declared))
        if unknown:
            listed = ", ".join(sorted(declared)) or "none"
            raise ConfigError(f"{label}: unknown option(s) {', '.join(unknown)}; its options are: {listed}")
        missing = [o for o in declared.values() if o.required and o.name not in options]
        if missing:
            names = ", ".join(f"'{o.name}' ({o.type})" for o in missing)
            raise ConfigError(f"{label}: missing required option {names}")
        for name, value in options.items():
            option = declared[name]
            if not _matches(value, option.types):
                raise ConfigError(
                    f"{label}: option {name!r} must be {option.type}, got {value!r} ({type(value).__name__})"
                )


# --- annotations ---------------------------------------------------------------------------------


def _type_text(annotation) -> str:
    if isinstance(annotation, str):
        return annotation
    if annotation is None:
        return "any"
    return getattr(annotation, "__name__", None) if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def _split_union(text: str) -> list[str]:
    """``"int | None"`` -> ["int", "None"]; ``"Optional[str]"`` -> ["str", "None"]; brackets kept whole."""
    text = text.strip()
    match = re.fullmatch(r"(?:typing\.)?Optional\[(.*)\]", text)
    if match:
        return _split_union(match.group(1)) + ["None"]
    match = re.fullmatch(r"(?:typing\.)?Union\[(.*)\]", text)
    if match:
        text = match.group(1).replace(",", "|")
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char == "["
        depth -= char == "]"
        if char == "|" and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    parts.append(current.strip())
    return [p for p in parts if p]


def _resolve(name: str, factory: type):
    """A member of an annotation as a class (or None), looked up in the factory's module; the name
    itself when it cannot be resolved (names imported only under TYPE_CHECKING)."""
    if name in ("None", "NoneType"):
        return None
    base = name.split("[", 1)[0].strip()
    if base in ("Any", "typing.Any", "object"):
        return object
    namespace = vars(sys.modules.get(factory.__module__, builtins))
    head, *rest = base.split(".")
    value = namespace.get(head, getattr(builtins, head, None))
    for part in rest:
        value = getattr(value, part, None)
    if isinstance(value, type):
        return {"Tuple": tuple, "List": list, "Dict": dict, "Sequence": list}.get(getattr(value, "__name__", ""), value)
    origin = typing.get_origin(value) if value is not None else None
    if isinstance(origin, type):
        return origin
    return name


def _type_members(annotation, factory: type) -> tuple:
    if annotation is None:
        return ()
    if isinstance(annotation, str):
        return tuple(_resolve(part, factory) for part in _split_union(annotation))
    if annotation is type(None):
        return (None,)
    if isinstance(annotation, type):
        return (annotation,)
    origin = typing.get_origin(annotation)
    if origin is typing.Union or (origin is not None and getattr(origin, "__name__", "") == "UnionType"):
        return tuple(m for a in typing.get_args(annotation) for m in _type_members(a, factory))
    if isinstance(origin, type):
        return (origin,)
    if type(annotation).__name__ == "UnionType":
        return tuple(m for a in typing.get_args(annotation) for m in _type_members(a, factory))
    return (str(annotation),)


def _matches(value, members: tuple) -> bool:
    if value is _CHECKED:
        return True
    if not members or any(isinstance(m, str) for m in members) and not _is_plain(value):
        return True  # no annotation, or an unresolvable one and a non-TOML value: the factory decides
    for member in members:
        if member is None:
            if value is None:
                return True
        elif isinstance(member, str):
            continue
        elif member is object:
            return True
        elif member is bool:
            if isinstance(value, bool):
                return True
        elif member is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return True
        elif member is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return True
        elif issubclass(member, Path):
            if isinstance(value, (str, Path)):
                return True
        elif member in (tuple, list):
            if isinstance(value, (tuple, list)):
                return True
        elif isinstance(value, member):
            return True
    # Only unresolvable names are left: they may be a plain type under another name, so accept
    # the value only if every member was unresolvable.
    return all(isinstance(m, str) for m in members)


def _is_plain(value) -> bool:
    """A value TOML or the command line can hold."""
    return value is None or isinstance(value, (str, int, float, bool, list, tuple, dict, Path))


# --- command-line values ---------------------------------------------------------------------


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def parse_value(text: str, option: Option):
    """The value of ``text`` (from ``--drafter-option name=TEXT``) as the option's declared type."""
    members = option.types
    if None in members and text.strip().lower() in ("none", "null"):
        return None
    resolved = [m for m in members if m is not None and not isinstance(m, str)]
    if not resolved or object in resolved:
        # Undeclared type: read it as a TOML value (3, 0.5, true, "x", [1, 2]), else as text.
        try:
            return tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            return text
    stripped = text.strip()
    for member in resolved:
        if member is bool:
            if stripped.lower() in _TRUE | _FALSE:
                return stripped.lower() in _TRUE
        elif member is int:
            try:
                return int(stripped)
            except ValueError:
                pass
        elif member is float:
            try:
                return float(stripped)
            except ValueError:
                pass
        elif member in (list, tuple):
            try:
                value = tomllib.loads(f"v = {text}")["v"]
                if isinstance(value, list):
                    return value
            except tomllib.TOMLDecodeError:
                pass
        elif member is str or issubclass(member, (str, Path)):
            return text
    if any(isinstance(m, str) for m in members):
        return text  # an unresolvable type: hand the text to the factory
    raise ValueError(f"expected {option.type}, got {text!r}")


class Registry:
    """Where ``specdec_register`` hooks put their components. One per plugin manager."""

    def __init__(self):
        self._entries: dict[tuple[str, str], Registration] = {}
        self._current_plugin = "?"
        self._current_package = "?"
        self.conflicts: list[str] = []
        self.failures: list = []  # the manager's PluginFailure records: plugins that did not load

    # The four calls plugins make.
    def register_drafter(self, name: str, factory: type) -> None:
        self._register("drafter", name, factory)

    def register_policy(self, name: str, factory: type) -> None:
        self._register("policy", name, factory)

    def register_verifier(self, name: str, factory: type) -> None:
        self._register("verifier", name, factory)

    def register_observer(self, name: str, factory: type) -> None:
        self._register("observer", name, factory)

    def _register(self, kind: str, name: str, factory: type) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"plugin {self._current_plugin!r} registered a {kind} with an invalid name {name!r}")
        if not callable(factory):
            raise ConfigError(f"plugin {self._current_plugin!r} registered {kind} {name!r} with a non-callable factory")
        key = (kind, canonical(name))
        if key in self._entries:
            previous = self._entries[key]
            self.conflicts.append(
                f"{kind} {name!r} from plugin {self._current_plugin!r} ignored: "
                f"already registered by {previous.plugin!r} ({previous.package})"
            )
            return
        aliases = (name,) if name != canonical(name) else ()
        self._entries[key] = Registration(kind, canonical(name), factory, self._current_plugin, self._current_package, aliases)

    def _from(self, plugin: str, package: str) -> None:
        self._current_plugin, self._current_package = plugin, package

    # Lookups.
    def names(self, kind: str) -> list[str]:
        """Every name ``get`` accepts for ``kind``: listed names and the spellings plugins registered."""
        return sorted({n for (k, _), e in self._entries.items() if k == kind for n in (e.name, *e.aliases)})

    def entries(self, kind: str | None = None) -> list[Registration]:
        return [e for (k, _), e in sorted(self._entries.items()) if kind is None or k == kind]

    def get(self, kind: str, name: str) -> Registration:
        if kind not in KINDS:
            raise ConfigError(f"unknown component kind {kind!r}; kinds are {', '.join(KINDS)}")
        entry = self._entries.get((kind, canonical(name))) if isinstance(name, str) else None
        if entry is not None:
            return entry
        known = ", ".join(e.name for e in self.entries(kind)) or "none"
        message = f"unknown {kind} {name!r}; known {PLURALS[kind]}: {known}"
        same = [f for f in self.failures if isinstance(name, str) and canonical(f.plugin) == canonical(name)]
        if same:
            failure = same[0]
            message = (
                f"{kind} {name!r} is not available: the plugin {failure.plugin!r} ({failure.package}) failed to load: "
                f"{failure.error}; known {PLURALS[kind]}: {known}"
            )
        elif self.failures:
            broken = "; ".join(f"{f.plugin!r} ({f.package}): {f.error}" for f in self.failures)
            message += f". Plugin(s) that failed to load, which may provide it: {broken}"
        raise ConfigError(message)

    def check(self, kind: str, name: str, options: dict[str, Any] | None = None, *, where: str = "") -> Registration:
        """Check ``options`` against the component's declared options without building it (tables
        for component options are checked against their own component)."""
        entry = self.get(kind, name)
        entry.check(self._nested(entry, dict(options or {}), where, build=False), where)
        return entry

    def create(self, kind: str, name: str, options: dict[str, Any] | None = None, *, where: str = ""):
        """Build the component registered as ``name`` with ``options``; errors name the field.

        An option declared as a component (``first: Drafter``) takes a table with ``use = "<name>"``
        and that component's own options, built here the same way."""
        entry = self.get(kind, name)
        options = self._nested(entry, dict(options or {}), where, build=True)
        entry.check(options, where)
        label = f"{kind} {entry.name!r}" + (f" ({where})" if where else "")
        try:
            return entry.factory(**options)
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{label}: invalid option: {_describe(exc, options)}") from exc


    def _nested(self, entry: Registration, options: dict[str, Any], where: str, build: bool) -> dict[str, Any]:
        """``options`` with each table given to a component option built (or, unbuilt, only checked
        and left out of the type check)."""
        from ..core.components import Component

        declared = {o.name: o for o in entry.options()}
        for key, value in options.items():
            option = declared.get(key)
            kinds = [m.kind for m in (option.types if option else ()) if isinstance(m, type) and issubclass(m, Component)]
            if not kinds or not isinstance(value, dict):
                continue
            table = dict(value)
            inner = f"{entry.label}, option {key!r}" + (f" ({where})" if where else "")
            use = table.pop("use", None)
            if not isinstance(use, str):
                raise ConfigError(f"{inner}: the table needs use = \"<{kinds[0]} name>\"")
            if build:
                options[key] = self.create(kinds[0], use, table, where=inner)
            else:
                self.check(kinds[0], use, table, where=inner)
                options[key] = _CHECKED
        return options


def _describe(exc: Exception, options: dict[str, Any]) -> str:
    # attrs' instance_of validator raises TypeError(msg, attribute, type, value): say it plainly.
    if isinstance(exc, TypeError) and len(exc.args) == 4 and hasattr(exc.args[1], "name"):
        attribute, expected, value = exc.args[1], exc.args[2], exc.args[3]
        expected_name = getattr(expected, "__name__", str(expected))
        return f"'{attribute.name}' must be {expected_name}, got {value!r} ({type(value).__name__})"
    message = str(exc)
    for name, value in options.items():
        if name in message:
            return f"'{name}' = {value!r}: {message}"
    return message
