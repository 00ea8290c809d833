"""Plugin discovery and lookup.

The registry finds plugins through the ``hyper_parallel`` entry-point group
(the built-ins are found the same way), plus any registered in-process with
:func:`register_plugin`. It calls each plugin's hooks with a ``register``
callback bound to that plugin, so every entry knows which plugin and
distribution it came from and a duplicate name can name both sides.

Loading is lazy (the first lookup), cached, and resettable. Environment:

* ``HYPER_PARALLEL_DISABLE_PLUGINS=a,b`` blocks plugins by name.
* ``HYPER_PARALLEL_STRICT_PLUGINS=1`` makes a plugin that fails to load
  fatal; otherwise it is reported with a warning and the others still load.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pluggy

from hyper_parallel.core.errors import (
    DuplicatePluginError,
    HyperParallelKeyError,
    HyperParallelTypeError,
    HyperParallelValueError,
    PluginLoadError,
    UnknownPluginError,
)
from hyper_parallel.core.options import did_you_mean, env_switch
from hyper_parallel.core.plugin import hookspecs
from hyper_parallel.core.plugin._checks import check_obj
from hyper_parallel.core.plugin._entries import (
    ENTRY_TYPES,
    OPTIMIZER_REQUIREMENTS,
    LoadedPlugin,
    PluginKind,
    RegistryEntry,
    normalize_name,
)
from hyper_parallel.core.plugin._markers import PROJECT_NAME

__all__ = [
    "DISABLE_ENV",
    "ENTRY_POINT_GROUP",
    "STRICT_ENV",
    "Registry",
    "get_registry",
    "register_plugin",
    "unregister_plugin",
]

ENTRY_POINT_GROUP = PROJECT_NAME
DISABLE_ENV = "HYPER_PARALLEL_DISABLE_PLUGINS"
STRICT_ENV = "HYPER_PARALLEL_STRICT_PLUGINS"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclass
class _State:
    entries: dict[PluginKind, dict[str, RegistryEntry]]
    lookup: dict[PluginKind, dict[str, RegistryEntry]]
    plugins: list[LoadedPlugin]
    failures: list[PluginLoadError]
    disabled: list[str]


def _dist_label(dist: importlib.metadata.Distribution) -> str:
    return f"{dist.metadata['Name']} {dist.version}"


def _env_list(var: str) -> list[str]:
    raw = os.environ.get(var, "")
    return [normalize_name(x) for x in raw.split(",") if x.strip()]


class Registry:
    """Discovers plugins and resolves names to registered objects."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._state: _State | None = None
        self._in_process: dict[str, object] = {}

    # -- lifecycle ---------------------------------------------------------

    def reset(self) -> None:
        """Forget what was loaded; the next lookup discovers plugins again.

        Plugins registered in-process stay registered.
        """
        with self._lock:
            self._state = None

    def register_plugin(self, plugin: object, name: str | None = None) -> str:
        """Register a plugin object (a module, class or instance with hookimpls).

        Args:
            plugin: Anything carrying functions marked with ``hookimpl``.
            name: The plugin's name; defaults to the module or class name.

        Returns:
            The name it was registered under (use it to unregister).

        Raises:
            DuplicatePluginError: a plugin of that name is already registered.
        """
        plugin_name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        with self._lock:
            state = self._ensure_loaded()
            taken = {p.name for p in state.plugins} | set(self._in_process)
            if plugin_name in taken:
                raise DuplicatePluginError(
                    f"A plugin named {plugin_name!r} is already registered; pass another "
                    f"name=... or unregister it first."
                )
            self._in_process[plugin_name] = plugin
            try:
                self._state = self._load()
            except BaseException:
                del self._in_process[plugin_name]
                self._state = None
                raise
        return plugin_name

    def unregister_plugin(self, name: str) -> None:
        """Remove a plugin registered with :meth:`register_plugin`."""
        with self._lock:
            if name not in self._in_process:
                raise HyperParallelKeyError(
                    f"No in-process plugin named {name!r}. Registered in-process: "
                    f"{', '.join(sorted(self._in_process)) or '(none)'}."
                )
            del self._in_process[name]
            self._state = None

    # -- lookups -----------------------------------------------------------

    def get(self, kind: PluginKind | str, name: str) -> RegistryEntry:
        """Return the entry registered as ``name`` (or an alias) for ``kind``.

        Raises:
            UnknownPluginError: nothing of that kind has that name; the message
                lists what is available and close matches.
        """
        kind = PluginKind(kind)
        if not isinstance(name, str):
            raise HyperParallelTypeError(
                f"A {kind.label} name must be a str, got {type(name).__name__}."
            )
        state = self._ensure_loaded()
        entry = state.lookup[kind].get(normalize_name(name))
        if entry is not None:
            return entry
        available = sorted(state.entries[kind])
        hint = did_you_mean(normalize_name(name), state.lookup[kind])
        message = (
            f"Unknown {kind.label} {name!r}. Available: {', '.join(available) or '(none)'}."
            f"{hint} (Is the plugin installed?)"
        )
        if state.failures:
            message += (
                " Plugins that failed to load: "
                + "; ".join(f"{f.plugin!r} ({f.distribution})" for f in state.failures)
                + "."
            )
        if state.disabled:
            message += f" Disabled by {DISABLE_ENV}: {', '.join(state.disabled)}."
        raise UnknownPluginError(message, kind=kind.value, name=name, available=available)

    def entries(self, kind: PluginKind | str | None = None) -> list[RegistryEntry]:
        """All entries, sorted by kind then name (one kind if given)."""
        state = self._ensure_loaded()
        kinds = [PluginKind(kind)] if kind is not None else list(PluginKind)
        return [state.entries[k][n] for k in kinds for n in sorted(state.entries[k])]

    def names(self, kind: PluginKind | str) -> list[str]:
        """Sorted canonical names registered for ``kind``."""
        return [e.name for e in self.entries(kind)]

    def plugins(self) -> list[LoadedPlugin]:
        """Every plugin found: loaded, failed or disabled."""
        return list(self._ensure_loaded().plugins)

    def failures(self) -> list[PluginLoadError]:
        """The errors of plugins that failed to load (empty when all loaded)."""
        return list(self._ensure_loaded().failures)

    def __iter__(self) -> Iterator[RegistryEntry]:
        return iter(self.entries())

    # -- loading -----------------------------------------------------------

    def _ensure_loaded(self) -> _State:
        state = self._state
        if state is None:
            with self._lock:
                if self._state is None:
                    self._state = self._load()
                state = self._state
        return state

    def _load(self) -> _State:
        loader = _Loader()
        loader.load_entry_points()
        loader.load_in_process(self._in_process)
        return loader.collect(self._make_register)

    @staticmethod
    def _make_register(
        kind: PluginKind, plugin: str, distribution: str | None, staged: list[RegistryEntry]
    ) -> Callable[..., None]:
        def register(
            name: str,
            obj: Any,
            *,
            description: str = "",
            aliases: Sequence[str] = (),
            requires: Sequence[str] = (),
        ) -> None:
            if not isinstance(name, str) or not _NAME_RE.match(name):
                raise HyperParallelValueError(
                    f"{kind.label} name {name!r} is not valid: use letters, digits, '_', '-' or '.'."
                )
            if isinstance(aliases, str):
                raise HyperParallelTypeError(
                    f"aliases of {kind.label} {name!r} must be a sequence of str, not a str."
                )
            for alias in aliases:
                if not isinstance(alias, str) or not _NAME_RE.match(alias):
                    raise HyperParallelValueError(
                        f"alias {alias!r} of {kind.label} {name!r} is not a valid name."
                    )
            check_obj(kind, name, obj)
            if kind is PluginKind.OPTIMIZER and getattr(obj, "matrix_only", False):
                raise HyperParallelTypeError(
                    f"optimizer {name!r} says matrix_only = True on its class, which is not read; "
                    'register it with requires=("matrices_only",) instead.'
                )
            extra = {"requires": _requirements(kind, name, requires)} if requires else {}
            entry = ENTRY_TYPES[kind](
                kind=kind,
                name=normalize_name(name),
                obj=obj,
                description=description or _first_doc_line(obj),
                aliases=tuple(normalize_name(a) for a in aliases),
                plugin=plugin,
                distribution=distribution,
                **extra,
            )
            # Duplicates within one plugin are caught here; across plugins in _add_entry.
            for other in staged:
                _check_clash({k: other for k in (other.name, *other.aliases)}, entry)
            staged.append(entry)

        return register


class _Loader:
    """One discovery pass: plugins found, what failed, then the entries they register."""

    def __init__(self) -> None:
        self.strict = env_switch(
            STRICT_ENV, default=False, meaning="a plugin that fails to load is fatal"
        )
        self.disabled = _env_list(DISABLE_ENV)
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[LoadedPlugin] = []
        self.failures: list[PluginLoadError] = []
        self.origin: dict[str, str | None] = {}  # plugin name -> distribution label

    def fail(
        self, plugin: str, what: str, cause: BaseException, entry_point: str | None = None
    ) -> None:
        """Record that ``plugin`` failed ("failed to load", "failed in <hook>"), warning once.

        Fatal under ``HYPER_PARALLEL_STRICT_PLUGINS``; otherwise the plugin is
        listed as failed (replacing any earlier record of it) and the others
        load on.
        """
        source = self.origin.get(plugin)
        where = f"entry point {entry_point!r} of {source}" if entry_point else source
        error = PluginLoadError(
            f"Plugin {plugin!r} ({where or 'registered in-process'}) {what}: "
            f"{type(cause).__name__}: {cause}",
            plugin=plugin,
            distribution=source,
        )
        if self.strict:
            raise error from cause
        warnings.warn(
            f"{error} (set {STRICT_ENV}=1 to make this fatal)", RuntimeWarning, stacklevel=5
        )
        self.failures.append(error)
        self.plugins[:] = [p for p in self.plugins if p.name != plugin]
        self.plugins.append(
            LoadedPlugin(
                name=plugin,
                distribution=source,
                entry_point=entry_point,
                status="failed",
                error=str(error),
            )
        )

    def load_entry_points(self) -> None:
        """Import and register every plugin of the ``hyper_parallel`` entry-point group."""
        for dist in importlib.metadata.distributions():
            for ep in dist.entry_points:
                if ep.group == ENTRY_POINT_GROUP:
                    self._load_entry_point(ep, _dist_label(dist))

    def _load_entry_point(self, ep: importlib.metadata.EntryPoint, label: str) -> None:
        if ep.name in self.origin:
            if self.origin[ep.name] == label:
                return  # the same distribution seen twice on sys.path
            raise DuplicatePluginError(
                f"Two distributions provide a plugin named {ep.name!r}: "
                f"{self.origin[ep.name]} and {label}. Uninstall one of them."
            )
        self.origin[ep.name] = label
        record = functools.partial(
            LoadedPlugin, name=ep.name, distribution=label, entry_point=ep.value
        )
        if normalize_name(ep.name) in self.disabled:
            self.plugins.append(record(status="disabled"))
            return
        try:
            _register_checked(self.pm, ep.load(), ep.name)
        except Exception as exc:
            self.fail(ep.name, "failed to load", exc, entry_point=ep.value)
            return
        self.plugins.append(record(status="loaded"))

    def load_in_process(self, in_process: Mapping[str, object]) -> None:
        """Register the plugins given to :meth:`Registry.register_plugin`."""
        for name, obj in in_process.items():
            record = functools.partial(LoadedPlugin, name=name, distribution=None, entry_point=None)
            if normalize_name(name) in self.disabled:
                self.plugins.append(record(status="disabled"))
                continue
            try:
                _register_checked(self.pm, obj, name)
            except Exception as exc:
                raise PluginLoadError(
                    f"Plugin {name!r} (registered in-process) is not a valid plugin: {exc}",
                    plugin=name,
                    distribution=None,
                ) from exc
            self.origin[name] = None
            self.plugins.append(record(status="loaded"))

    def collect(self, make_register: Callable[..., Callable[..., None]]) -> _State:
        """Call every plugin's hooks, kind by kind, and index what they register."""
        entries: dict[PluginKind, dict[str, RegistryEntry]] = {k: {} for k in PluginKind}
        lookup: dict[PluginKind, dict[str, RegistryEntry]] = {k: {} for k in PluginKind}
        for kind in PluginKind:
            hook = getattr(self.pm.hook, kind.hook_name)
            # Resolve by name, never by call order: each plugin is called on its own,
            # in name order, with a register callback that knows who is registering.
            impls = sorted(
                (i for i in hook.get_hookimpls() if not (i.hookwrapper or i.wrapper)),
                key=lambda i: i.plugin_name,
            )
            for impl in impls:
                for entry in self._call_hook(kind, impl, make_register):
                    _add_entry(entries[kind], lookup[kind], entry)
        return _State(
            entries=entries,
            lookup=lookup,
            plugins=self.plugins,
            failures=self.failures,
            disabled=self.disabled,
        )

    def _call_hook(
        self, kind: PluginKind, impl: Any, make_register: Callable[..., Callable[..., None]]
    ) -> list[RegistryEntry]:
        """What one plugin registers for ``kind``; nothing if its hook fails."""
        staged: list[RegistryEntry] = []
        source = self.origin.get(impl.plugin_name)
        try:
            impl.function(register=make_register(kind, impl.plugin_name, source, staged))
        except DuplicatePluginError:
            raise  # a name clash is never a plugin's private failure
        except Exception as exc:
            self.fail(impl.plugin_name, f"failed in {kind.hook_name}", exc)
            return []
        return staged


def _register_checked(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    """Register with pluggy, rejecting hookimpls that match no hookspec (a misspelt hook)."""
    pm.register(plugin, name=name)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        pm.unregister(name=name)
        raise pluggy.PluginValidationError(
            plugin, f"{exc}; the hooks are: {', '.join(k.hook_name for k in PluginKind)}"
        ) from None


def _requirements(kind: PluginKind, name: str, requires: Sequence[str]) -> tuple[str, ...]:
    """``requires`` checked: only optimizers have them, and only the known ones."""
    if kind is not PluginKind.OPTIMIZER:
        raise HyperParallelValueError(
            f"requires= is for optimizers; {kind.label} {name!r} cannot have it."
        )
    if isinstance(requires, str):
        raise HyperParallelTypeError(
            f"requires of optimizer {name!r} must be a sequence of str, not a str."
        )
    unknown = sorted(set(requires) - set(OPTIMIZER_REQUIREMENTS))
    if unknown:
        raise HyperParallelValueError(
            f"optimizer {name!r} requires {unknown}, which are not known; use any of "
            f"{sorted(OPTIMIZER_REQUIREMENTS)}."
        )
    return tuple(requires)


def _first_doc_line(obj: Any) -> str:
    doc = getattr(obj, "__doc__", None) or ""
    return doc.strip().splitlines()[0].strip() if doc.strip() else ""


def _check_clash(lookup: dict[str, RegistryEntry], entry: RegistryEntry) -> None:
    for key in (entry.name, *entry.aliases):
        other = lookup.get(key)
        if other is not None:
            raise DuplicatePluginError(
                f"{entry.kind.label} name {key!r} is registered twice: by {other.source} "
                f"and by {entry.source}. Uninstall or disable one of them ({DISABLE_ENV}=...)."
            )


def _add_entry(
    entries: dict[str, RegistryEntry], lookup: dict[str, RegistryEntry], entry: RegistryEntry
) -> None:
    _check_clash(lookup, entry)
    entries[entry.name] = entry
    for key in (entry.name, *entry.aliases):
        lookup[key] = entry


_REGISTRY = Registry()


def get_registry() -> Registry:
    """The process-wide registry every factory looks names up in."""
    return _REGISTRY


def register_plugin(plugin: object, name: str | None = None) -> str:
    """Register a plugin object in this process (notebooks, tests).

    See :meth:`Registry.register_plugin`.
    """
    return _REGISTRY.register_plugin(plugin, name)


def unregister_plugin(name: str) -> None:
    """Remove a plugin registered in-process with :func:`register_plugin`."""
    _REGISTRY.unregister_plugin(name)
