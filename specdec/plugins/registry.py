"""The named components plugins register, and how a name plus options becomes a component."""

from __future__ import annotations

from typing import Any

import attrs

from ..errors import ConfigError

KINDS = ("drafter", "policy", "verifier", "observer")
PLURALS = {"drafter": "drafters", "policy": "policies", "verifier": "verifiers", "observer": "observers"}
_MISSING = "(required)"


@attrs.frozen
class Option:
    name: str
    type: str
    default: Any

    @property
    def required(self) -> bool:
        return self.default is _MISSING


@attrs.frozen
class Registration:
    """One name a plugin registered: what it makes, and where it came from."""

    kind: str
    name: str
    factory: type
    plugin: str
    package: str

    @property
    def summary(self) -> str:
        doc = (self.factory.__doc__ or "").strip().splitlines()
        return doc[0] if doc else ""

    def options(self) -> list[Option]:
        if not attrs.has(self.factory):
            return []
        options = []
        for field in attrs.fields(self.factory):
            if not field.init or field.name.startswith("_"):
                continue
            if field.default is attrs.NOTHING:
                default = _MISSING
            elif isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
                default = field.default.factory() if not field.default.takes_self else None
            else:
                default = field.default
            kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
            options.append(Option(field.alias or field.name, str(kind), default))
        return options


class Registry:
    """Where ``specdec_register`` hooks put their components. One per plugin manager."""

    def __init__(self):
        self._entries: dict[tuple[str, str], Registration] = {}
        self._current_plugin = "?"
        self._current_package = "?"
        self.conflicts: list[str] = []

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
        key = (kind, name)
        if key in self._entries:
            previous = self._entries[key]
            self.conflicts.append(
                f"{kind} {name!r} from plugin {self._current_plugin!r} ignored: "
                f"already registered by {previous.plugin!r} ({previous.package})"
            )
            return
        self._entries[key] = Registration(kind, name, factory, self._current_plugin, self._current_package)

    def _from(self, plugin: str, package: str) -> None:
        self._current_plugin, self._current_package = plugin, package

    # Lookups.
    def names(self, kind: str) -> list[str]:
        return sorted(name for k, name in self._entries if k == kind)

    def entries(self, kind: str | None = None) -> list[Registration]:
        return [e for (k, _), e in sorted(self._entries.items()) if kind is None or k == kind]

    def get(self, kind: str, name: str) -> Registration:
        if kind not in KINDS:
            raise ConfigError(f"unknown component kind {kind!r}; kinds are {', '.join(KINDS)}")
        try:
            return self._entries[(kind, name)]
        except KeyError:
            known = ", ".join(self.names(kind)) or "none"
            raise ConfigError(f"unknown {kind} {name!r}; known {PLURALS[kind]}: {known}") from None

    def create(self, kind: str, name: str, options: dict[str, Any] | None = None, *, where: str = ""):
        """Build the component registered as ``name`` with ``options``; errors name the field."""
        entry = self.get(kind, name)
        options = dict(options or {})
        label = f"{kind} {name!r}" + (f" ({where})" if where else "")
        known = {option.name for option in entry.options()}
        if attrs.has(entry.factory):
            unknown = sorted(set(options) - known)
            if unknown:
                listed = ", ".join(sorted(known)) or "none"
                raise ConfigError(f"{label}: unknown option(s) {', '.join(unknown)}; its options are: {listed}")
        try:
            return entry.factory(**options)
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{label}: invalid option: {_describe(exc, options)}") from exc


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
