"""The peer libraries the benchmarks compare against: installing and loading them.

Peers are installed with ``--no-deps`` into ``.bench-peers/`` at the repository
root (git-ignored), never into the environment itself, so they cannot change
torch's version. Each peer that is missing or fails to load is reported with
the reason instead of a figure.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "PEER_DIR",
    "PEER_REQUIREMENTS",
    "MuonPeer",
    "install_peers",
    "muon_peers",
    "use_peer_dir",
]

PEER_DIR = Path(__file__).resolve().parent.parent / ".bench-peers"

#: Pinned so that figures from different runs compare the same code.
PEER_REQUIREMENTS = (
    "timm==1.0.31",
    "heavyball==3.2.1",
    "opt-einsum>=3.4",  # heavyball's one dependency besides torch and numpy
    "pytorch-optimizer==4.1.0",
    "google-crc32c==1.9.0",  # the checkpoint case's CRC32C
)

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class MuonPeer:
    """A peer's Muon: how to build it at its defaults, or why it is not measured."""

    name: str
    ns_dtype: str  # the dtype its Newton-Schulz runs in; none of the peers lets it be chosen
    make: OptimizerFactory | None = None
    reason: str = ""


def install_peers() -> int:
    """``pip install --no-deps --target .bench-peers`` the pinned peers; pip's exit code."""
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
               "--upgrade", "--target", str(PEER_DIR), *PEER_REQUIREMENTS]  # fmt: skip
    print("$", " ".join(command), flush=True)
    return subprocess.call(command)


def use_peer_dir() -> None:
    if PEER_DIR.is_dir() and str(PEER_DIR) not in sys.path:
        sys.path.append(str(PEER_DIR))


def _timm_muon() -> type[torch.optim.Optimizer]:
    # ``import timm`` loads its model zoo, which needs torchvision; there is no
    # torchvision build for this torch on CPU. The optimizer needs none of it:
    # load ``timm.optim.muon`` from the installed files with the two package
    # ``__init__`` modules left out. The code measured is timm's own.
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("timm is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    for name, path in (("timm", root), ("timm.optim", root / "optim")):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package
    module = importlib.import_module("timm.optim.muon")
    return module.Muon  # type: ignore[no-any-return]


def _load(name: str, ns_dtype: str, build: Callable[[], OptimizerFactory]) -> MuonPeer:
    try:
        return MuonPeer(name, ns_dtype, make=build())
    except Exception as exc:  # a peer that does not load is reported, not fatal
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
        if isinstance(exc, ImportError):
            reason += " (python -m benchmarks --install-peers)"
        return MuonPeer(name, ns_dtype, reason=reason)


#: The peer Muons, by the name each row gives it.
MUON_PEER_NAMES = ("torch.optim.Muon", "timm", "heavyball", "pytorch_optimizer")


def muon_peers(lr: float, names: tuple[str, ...] = MUON_PEER_NAMES) -> list[MuonPeer]:
    """The peer Muons named (all by default), each at its own defaults but ``lr``."""
    use_peer_dir()

    def torch_muon() -> OptimizerFactory:
        muon = getattr(torch.optim, "Muon", None)
        if muon is None:
            raise ImportError(f"torch {torch.__version__} has no torch.optim.Muon")
        return lambda params: muon(params, lr=lr)

    def timm() -> OptimizerFactory:
        muon = _timm_muon()
        return lambda params: muon(params, lr=lr)

    def heavyball() -> OptimizerFactory:
        module = importlib.import_module("heavyball")
        return lambda params: module.Muon(params, lr=lr)

    def pytorch_optimizer() -> OptimizerFactory:
        module = importlib.import_module("pytorch_optimizer")
        # its Muon updates only the groups marked ``use_muon`` (the rest get AdamW)
        return lambda params: module.Muon([{"params": params, "use_muon": True}], lr=lr)

    loaders = {
        "torch.optim.Muon": ("bf16", torch_muon),
        "timm": ("bf16", timm),
        "heavyball": ("bf16 (stochastic rounding)", heavyball),
        "pytorch_optimizer": ("bf16", pytorch_optimizer),
    }
    return [_load(name, *loaders[name]) for name in MUON_PEER_NAMES if name in names]


def peer_versions() -> dict[str, str]:
    """Installed version of each peer package, or ``"missing"``."""
    use_peer_dir()
    from importlib.metadata import PackageNotFoundError, distributions, version

    found: dict[str, str] = {}
    for package in ("timm", "heavyball", "pytorch-optimizer"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            # a --target install is found through sys.path only after a refresh
            matches = [d.version for d in distributions(path=[str(PEER_DIR)])
                       if d.metadata["Name"].lower().replace("_", "-") == package]  # fmt: skip
            found[package] = matches[0] if matches else "missing"
    return found
