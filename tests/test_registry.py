"""Plugin discovery, lookup and error reporting."""

from __future__ import annotations

import importlib.metadata
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from installing import pip_install_into

import hyper_parallel
from hyper_parallel import (
    DuplicatePluginError,
    PluginLoadError,
    UnknownPluginError,
    get_registry,
    hookimpl,
    register_plugin,
    unregister_plugin,
)
from hyper_parallel.core.optimizer import get_hyper_lr_scheduler, get_hyper_optimizer
from hyper_parallel.testing import plugin_registered

pytestmark = pytest.mark.usefixtures("fresh_registry")

BUILTIN_PLUGINS = {
    "muon",
    "adamw",
    "torch_optimizers",
    "schedules",
    "partitioners",
    "local_backend",
}


class _FakeDist:
    """Just enough of importlib.metadata.Distribution for discovery."""

    def __init__(self, name: str, version: str, entry_points: dict[str, str]) -> None:
        self.metadata = {"Name": name}
        self.version = version
        self.entry_points = [
            importlib.metadata.EntryPoint(ep, value, "hyper_parallel")
            for ep, value in entry_points.items()
        ]


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def _optimizer_plugin(*names: str) -> types.ModuleType:
    @hookimpl
    def hyper_parallel_register_optimizers(register: Any) -> None:
        for name in names:
            register(name, torch.optim.SGD, description=f"fake {name}")

    return _module("fake", hyper_parallel_register_optimizers=hyper_parallel_register_optimizers)


def _install_fakes(
    monkeypatch: pytest.MonkeyPatch, *dists: tuple[_FakeDist, dict[str, types.ModuleType]]
) -> None:
    real = list(importlib.metadata.distributions())
    for _, modules in dists:
        for mod_name, module in modules.items():
            monkeypatch.setitem(sys.modules, mod_name, module)
    monkeypatch.setattr(
        importlib.metadata, "distributions", lambda: [*real, *(d for d, _ in dists)]
    )
    get_registry().reset()


def test_builtins_are_found_through_entry_points() -> None:
    plugins = {p.name: p for p in get_registry().plugins()}
    assert set(plugins) >= BUILTIN_PLUGINS
    for name in BUILTIN_PLUGINS:
        assert plugins[name].status == "loaded", plugins[name].error
        assert plugins[name].distribution == f"hyper-parallel {hyper_parallel.__version__}"
        assert plugins[name].entry_point == f"hyper_parallel_builtins.{name}"
    registry = get_registry()
    assert {"muon", "adamw", "sgd", "adam", "torch_muon"} <= set(registry.names("optimizer"))
    assert {"cosine", "linear", "wsd"} <= set(registry.names("lr_scheduler"))
    assert {"by_name", "by_shape", "by_module"} <= set(registry.names("partitioner"))
    assert "local" in registry.names("sharding_backend")
    assert registry.get("optimizer", "muon").plugin == "muon"


def test_names_are_case_insensitive_and_dash_tolerant() -> None:
    registry = get_registry()
    assert registry.get("optimizer", "MUON") is registry.get("optimizer", "muon")
    assert registry.get("partitioner", "By-Shape").name == "by_shape"


def test_unknown_name_lists_available_and_close_matches() -> None:
    with pytest.raises(UnknownPluginError) as info:
        get_registry().get("optimizer", "muonn")
    message = str(info.value)
    assert "Unknown optimizer 'muonn'" in message
    assert "Available: adadelta" in message and "muon" in message
    assert "Did you mean 'muon'" in message
    assert "(Is the plugin installed?)" in message
    assert info.value.available == sorted(info.value.available)
    assert isinstance(info.value, LookupError)


def test_third_party_entry_point_is_found_with_its_distribution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _install_fakes(
        monkeypatch,
        (
            _FakeDist("acme-opt", "1.2", {"acme": "acme_mod"}),
            {"acme_mod": _optimizer_plugin("acme_sgd")},
        ),
    )
    entry = get_registry().get("optimizer", "acme_sgd")
    assert entry.obj is torch.optim.SGD
    assert entry.plugin == "acme"
    assert entry.distribution == "acme-opt 1.2"
    assert entry.description == "fake acme_sgd"


def test_duplicate_name_across_plugins_names_both_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    _install_fakes(
        monkeypatch,
        (
            _FakeDist("acme-opt", "1.2", {"acme": "acme_mod"}),
            {"acme_mod": _optimizer_plugin("muon")},
        ),
    )
    with pytest.raises(DuplicatePluginError) as info:
        get_registry().get("optimizer", "sgd")
    message = str(info.value)
    assert "'muon' is registered twice" in message
    assert "plugin 'acme' (acme-opt 1.2)" in message
    assert f"plugin 'muon' (hyper-parallel {hyper_parallel.__version__})" in message


def test_duplicate_alias_within_one_plugin_is_an_error() -> None:
    @hookimpl
    def hyper_parallel_register_lr_schedulers(register: Any) -> None:
        register("flat", lambda step, *, total_steps, warmup_steps: 1.0, aliases=("cosine",))

    with pytest.raises(DuplicatePluginError, match="'cosine' is registered twice"):
        register_plugin(
            _module(
                "dup", hyper_parallel_register_lr_schedulers=hyper_parallel_register_lr_schedulers
            )
        )
    # nothing half-registered: the failed plugin is gone and lookups still work
    assert get_registry().get("lr_scheduler", "cosine").plugin == "schedules"
    assert "dup" not in {p.name for p in get_registry().plugins()}


def test_broken_plugin_is_reported_and_the_rest_still_load(monkeypatch: pytest.MonkeyPatch) -> None:
    _install_fakes(
        monkeypatch,
        (_FakeDist("broken-dist", "0.1", {"broken": "no_such_module_hp_test"}), {}),
        (
            _FakeDist("acme-opt", "1.2", {"acme": "acme_mod"}),
            {"acme_mod": _optimizer_plugin("acme_sgd")},
        ),
    )
    with pytest.warns(RuntimeWarning, match="Plugin 'broken' .*broken-dist 0.1.* failed to load"):
        assert get_registry().get("optimizer", "acme_sgd").obj is torch.optim.SGD
    failures = get_registry().failures()
    assert [f.plugin for f in failures] == ["broken"]
    assert failures[0].distribution == "broken-dist 0.1"
    assert "no_such_module_hp_test" in str(failures[0])
    with pytest.raises(
        UnknownPluginError, match="Plugins that failed to load: 'broken' \\(broken-dist 0.1\\)"
    ):
        get_registry().get("optimizer", "broken_opt")


def test_strict_mode_makes_a_broken_plugin_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    _install_fakes(
        monkeypatch, (_FakeDist("broken-dist", "0.1", {"broken": "no_such_module_hp_test"}), {})
    )
    monkeypatch.setenv("HYPER_PARALLEL_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError) as info:
        get_registry().get("optimizer", "muon")
    assert info.value.plugin == "broken"
    assert info.value.distribution == "broken-dist 0.1"
    monkeypatch.setenv("HYPER_PARALLEL_STRICT_PLUGINS", "strict")
    get_registry().reset()
    with pytest.raises(ValueError, match=r"HYPER_PARALLEL_STRICT_PLUGINS='strict' is not a switch"):
        get_registry().get("optimizer", "muon")


def test_hook_that_raises_is_attributed(monkeypatch: pytest.MonkeyPatch) -> None:
    @hookimpl
    def hyper_parallel_register_optimizers(register: Any) -> None:
        raise RuntimeError("boom")

    _install_fakes(
        monkeypatch,
        (
            _FakeDist("exploding", "2.0", {"explode": "explode_mod"}),
            {
                "explode_mod": _module(
                    "explode_mod",
                    hyper_parallel_register_optimizers=hyper_parallel_register_optimizers,
                )
            },
        ),
    )
    with pytest.warns(
        RuntimeWarning,
        match="'explode' \\(exploding 2.0\\) failed in hyper_parallel_register_optimizers: RuntimeError: boom",
    ):
        assert get_registry().get("optimizer", "adamw")


def test_disable_env_blocks_plugins_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYPER_PARALLEL_DISABLE_PLUGINS", "torch_optimizers, Schedules")
    get_registry().reset()
    with pytest.raises(
        UnknownPluginError,
        match="Disabled by HYPER_PARALLEL_DISABLE_PLUGINS: torch_optimizers, schedules",
    ):
        get_registry().get("optimizer", "sgd")
    status = {p.name: p.status for p in get_registry().plugins()}
    assert status["torch_optimizers"] == "disabled" and status["schedules"] == "disabled"
    assert status["muon"] == "loaded"
    assert "cosine" not in get_registry().names("lr_scheduler")


def test_register_callback_rejects_bad_registrations() -> None:
    @hookimpl
    def hyper_parallel_register_optimizers(register: Any) -> None:
        register("bad name!", torch.optim.SGD)

    with pytest.warns(RuntimeWarning, match="'bad name!' is not valid"):
        register_plugin(
            _module(
                "badname", hyper_parallel_register_optimizers=hyper_parallel_register_optimizers
            )
        )
    try:
        assert "bad name!" not in get_registry().names("optimizer")
    finally:
        unregister_plugin("badname")


def test_in_process_plugin_register_and_unregister() -> None:
    module = _optimizer_plugin("notebook_sgd")
    with plugin_registered(module, name="notebook") as name:
        assert name == "notebook"
        entry = get_registry().get("optimizer", "notebook_sgd")
        assert (
            entry.distribution is None
            and entry.source == "plugin 'notebook' (registered in-process)"
        )
        with pytest.raises(DuplicatePluginError, match="'notebook' is already registered"):
            register_plugin(module, name="notebook")
    with pytest.raises(UnknownPluginError):
        get_registry().get("optimizer", "notebook_sgd")
    with pytest.raises(KeyError, match="No in-process plugin named 'notebook'"):
        unregister_plugin("notebook")


def test_loading_is_lazy_and_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = importlib.metadata.distributions

    def counting() -> Any:
        calls.append(1)
        return real()

    monkeypatch.setattr(importlib.metadata, "distributions", counting)
    registry = get_registry()
    registry.reset()
    assert calls == []
    registry.get("optimizer", "sgd")
    registry.get("optimizer", "adam")
    registry.names("lr_scheduler")
    assert len(calls) == 1
    registry.reset()
    registry.get("optimizer", "sgd")
    assert len(calls) == 2


@pytest.fixture(scope="module")
def installed_thirdparty(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pip-install tests/data/thirdparty_plugin into a temporary directory."""
    target = tmp_path_factory.mktemp("site")
    source = Path(__file__).parent / "data" / "thirdparty_plugin"
    build = tmp_path_factory.mktemp("build")
    pip_install_into(source, target, cwd=build)
    return target


def test_really_installed_distribution_is_selected_by_name(
    installed_thirdparty: Path,
    monkeypatch: pytest.MonkeyPatch,
    model: torch.nn.Module,
    batch: torch.Tensor,
) -> None:
    from conftest import lm_loss

    monkeypatch.syspath_prepend(str(installed_thirdparty))
    importlib.invalidate_caches()
    get_registry().reset()
    entry = get_registry().get("optimizer", "signsgd")
    assert entry.distribution == "hp-thirdparty 0.3.0" and entry.plugin == "thirdparty"

    optimizer = get_hyper_optimizer(
        model, optimizers={"signsgd": {"params": list(model.parameters()), "lr": 0.01}}
    )
    assert type(optimizer.optimizers["signsgd"]).__name__ == "SignSGD"
    scheduler = get_hyper_lr_scheduler(
        optimizer, "step_halving", total_steps=30, warmup_steps=0, every=2
    )
    before = float(lm_loss(model, batch).detach())
    for _ in range(4):
        lm_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    assert float(lm_loss(model, batch).detach()) < before
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.25)
    with pytest.raises(TypeError, match="Unknown keyword argument 'evry'.*Did you mean 'every'"):
        get_hyper_lr_scheduler(optimizer, "halving", total_steps=30, evry=2)


def test_duplicate_name_within_one_plugin_is_an_error() -> None:
    @hookimpl
    def hyper_parallel_register_optimizers(register: Any) -> None:
        register("twice", torch.optim.SGD)
        register("Twice", torch.optim.Adam)

    with pytest.raises(DuplicatePluginError, match="'twice' is registered twice"):
        register_plugin(
            _module("twice", hyper_parallel_register_optimizers=hyper_parallel_register_optimizers)
        )
    assert "twice" not in {p.name for p in get_registry().plugins()}


def test_misspelt_hook_is_reported_not_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    @hookimpl
    def hyper_parallel_register_optimizer(register: Any) -> None:  # singular: not a hook
        register("never", torch.optim.SGD)

    typo = _module("typo_mod", hyper_parallel_register_optimizer=hyper_parallel_register_optimizer)
    with pytest.raises(
        PluginLoadError,
        match="unknown hook 'hyper_parallel_register_optimizer'.*the hooks are: hyper_parallel_register_optimizers",
    ):
        register_plugin(typo, name="typo")
    _install_fakes(
        monkeypatch, (_FakeDist("typo-dist", "1.0", {"typo": "typo_mod"}), {"typo_mod": typo})
    )
    with pytest.warns(RuntimeWarning, match="Plugin 'typo' .*typo-dist 1.0.*unknown hook"):
        failures = get_registry().failures()
    assert [f.plugin for f in failures] == ["typo"]


def test_plugin_whose_hook_fails_is_listed_once_as_failed() -> None:
    @hookimpl
    def hyper_parallel_register_partitioners(register: Any) -> None:
        raise RuntimeError("nope")

    with pytest.warns(RuntimeWarning, match="failed in hyper_parallel_register_partitioners"):
        register_plugin(
            _module(
                "half", hyper_parallel_register_partitioners=hyper_parallel_register_partitioners
            )
        )
    try:
        records = [p for p in get_registry().plugins() if p.name == "half"]
        assert [(p.status, "nope" in (p.error or "")) for p in records] == [("failed", True)]
    finally:
        unregister_plugin("half")


class _NotABackend:
    def accepts(self, params: Any) -> bool:
        return True


def _no_params() -> None: ...


def _schedule_without_total_steps(step: int, *, warmup_steps: int) -> float:
    return 1.0


@pytest.mark.parametrize(
    ("hook", "obj", "message"),
    [
        ("hyper_parallel_register_optimizers", 42, r"optimizer 'bad' must be callable, got int"),
        (
            "hyper_parallel_register_optimizers",
            _no_params,
            r"must take params as its first positional",
        ),
        (
            "hyper_parallel_register_lr_schedulers",
            _schedule_without_total_steps,
            r"lacks total_steps",
        ),
        (
            "hyper_parallel_register_partitioners",
            _no_params,
            r"must take model as its first positional",
        ),
        (
            "hyper_parallel_register_sharding_backends",
            lambda: object(),
            r"must be a concrete subclass of .*ShardingBackend",
        ),
        (
            "hyper_parallel_register_sharding_backends",
            _NotABackend,
            r"missing shard_model, map_blocks, map_reductions",
        ),
    ],
)
def test_a_bad_entry_of_each_kind_fails_its_plugin_only(hook: str, obj: Any, message: str) -> None:
    def impl(register: Any) -> None:
        register("bad", obj)

    impl.__name__ = hook
    with pytest.warns(
        RuntimeWarning,
        match=rf"Plugin 'broken' \(registered in-process\) failed in {hook}: .*{message}",
    ):
        register_plugin(_module("broken", **{hook: hookimpl(impl)}))
    try:
        (failure,) = get_registry().failures()
        assert (failure.plugin, failure.distribution) == ("broken", None)
        assert get_registry().get("optimizer", "muon").name == "muon"  # the others still load
        assert "bad" not in get_registry().names("optimizer")
    finally:
        unregister_plugin("broken")


def test_each_kind_has_its_own_frozen_record_type() -> None:
    import dataclasses

    from hyper_parallel.core.plugin._entries import ENTRY_TYPES

    registry = get_registry()
    for kind, record in ENTRY_TYPES.items():
        entries = registry.entries(kind)
        assert entries and all(type(e) is record for e in entries), kind
        with pytest.raises(dataclasses.FrozenInstanceError):
            entries[0].name = "changed"  # type: ignore[misc]
    assert len(set(ENTRY_TYPES.values())) == len(ENTRY_TYPES)


def test_an_optimizer_declares_what_its_loop_must_give() -> None:
    @hookimpl
    def hyper_parallel_register_optimizers(register: Any) -> None:
        register("closure_sgd", torch.optim.SGD, requires=["closure"])

    name = register_plugin(
        _module("needs", hyper_parallel_register_optimizers=hyper_parallel_register_optimizers)
    )
    try:
        entry = get_registry().get("optimizer", "closure_sgd")
        assert entry.requires == ("closure",)
        assert (
            entry.unusable_in_plain_loop() == "its step needs a closure that re-evaluates the loss"
        )
        assert get_registry().get("optimizer", "adamw").unusable_in_plain_loop() is None
    finally:
        unregister_plugin(name)

    @hookimpl
    def hyper_parallel_register_lr_schedulers(register: Any) -> None:
        register("flat", lambda step, *, total_steps, warmup_steps: 1.0, requires=["closure"])

    @hookimpl
    def hyper_parallel_register_optimizers_typo(register: Any) -> None:
        register("odd_sgd", torch.optim.SGD, requires=["closures"])

    for plugin, hooks, message in (
        ("bad", {"hyper_parallel_register_lr_schedulers": hyper_parallel_register_lr_schedulers},
         "requires= is for optimizers"),
        ("typo", {"hyper_parallel_register_optimizers": hyper_parallel_register_optimizers_typo},
         r"requires \['closures'\], which are not known"),
    ):  # fmt: skip
        with pytest.warns(RuntimeWarning, match=message):
            register_plugin(_module(plugin, **hooks))
        try:
            assert "odd_sgd" not in get_registry().names("optimizer")
        finally:
            unregister_plugin(plugin)


def test_matrix_only_is_said_one_way_and_the_old_class_attribute_is_refused() -> None:
    class OldMatrixSGD(torch.optim.SGD):
        matrix_only = True

    @hookimpl
    def old(register: Any) -> None:
        register("old_matrix_sgd", OldMatrixSGD)

    @hookimpl
    def new(register: Any) -> None:
        register("new_matrix_sgd", torch.optim.SGD, requires=("matrices_only",))

    with pytest.warns(RuntimeWarning, match=r'matrix_only = True .* requires=\("matrices_only",\)'):
        register_plugin(_module("oldmatrix", hyper_parallel_register_optimizers=old))
    register_plugin(_module("newmatrix", hyper_parallel_register_optimizers=new))
    try:
        assert "old_matrix_sgd" not in get_registry().names("optimizer")
        entry = get_registry().get("optimizer", "new_matrix_sgd")
        assert entry.matrix_only and entry.unusable_in_plain_loop() is None
    finally:
        unregister_plugin("oldmatrix")
        unregister_plugin("newmatrix")
