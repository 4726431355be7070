"""The ``hstu-export`` console script on a user's own package, each command a fresh process.

A package ``acme_rank`` (written to a temporary directory, never installed) holds a torchrec model
registered as ``acme_ranker`` and a factory ``build_acme``. Its bundles are exported three ways: with
``--import acme_rank.models``; through a fake installed distribution whose ``hstu_export.models`` entry
point names the class (no ``--import``); and by the factory import path stored in the bundle. Mistakes
(no ``--import``, a module that does not exist, a factory module not on the path) end in one line
``error: ...`` and exit code 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

EXE = Path(sys.executable).parent / "hstu-export"
# Small and quick: TorchScript compiles in seconds, and one random batch besides the edge cases.
FAST = ["--backend", "torchscript", "--max-batch-size", "3", "--verify-batches", "1", "-q"]
FACTORY = "acme_rank.models:build_acme"
MAX_TAGS = 4

MODELS_PY = '''\
"""Acme's ranker: pooled torchrec embeddings of a KeyedJaggedTensor plus a dict of dense features."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import hstu_export

KEYS = ["user_id", "item_id", "item_tags"]


@dataclass
class AcmeConfig:
    dim: int = 8
    num_items: int = 200

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AcmeConfig:
        return cls(**data)


@hstu_export.register_model("acme_ranker", AcmeConfig)
class AcmeRanker(nn.Module):
    def __init__(self, config: AcmeConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.dim
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="user", embedding_dim=dim, num_embeddings=100, feature_names=["user_id"]),
                EmbeddingBagConfig(name="item", embedding_dim=dim, num_embeddings=config.num_items,
                                   feature_names=["item_id"]),
                EmbeddingBagConfig(name="tags", embedding_dim=dim, num_embeddings=50, feature_names=["item_tags"]),
            ],
            device=torch.device("cpu"),
        )
        self.age = nn.Linear(1, dim)
        self.mlp = nn.Sequential(nn.Linear(4 * dim + 4, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, sparse_features: KeyedJaggedTensor, dense_features: dict[str, Tensor]) -> dict[str, Tensor]:
        pooled = self.ebc(sparse_features)
        per_key = pooled.to_dict()
        age = self.age(dense_features["user_age"].unsqueeze(-1))
        x = torch.cat([pooled.values(), age, dense_features["context"]], dim=-1)
        return {
            "ctr": torch.sigmoid(self.mlp(x).squeeze(-1)),
            "affinity": (per_key["user_id"] * per_key["item_id"]).sum(-1) + per_key["item_tags"].norm(dim=-1),
        }


def build_acme(dim: int = 8, num_items: int = 200, seed: int = 0) -> AcmeRanker:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AcmeRanker(AcmeConfig(dim=dim, num_items=num_items)).eval()


def example_inputs(batch_size: int = 3, seed: int = 0) -> tuple[KeyedJaggedTensor, dict[str, Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    tag_len = torch.randint(1, 5, (batch_size,), generator=gen)
    ones = torch.ones(batch_size, dtype=torch.int64)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=KEYS,
        values=torch.cat([torch.randint(0, 100, (batch_size,), generator=gen),
                          torch.randint(0, 200, (batch_size,), generator=gen),
                          torch.randint(0, 50, (int(tag_len.sum()),), generator=gen)]),
        lengths=torch.cat([ones, ones, tag_len]),
    )
    dense = {"user_age": torch.rand(batch_size, generator=gen) * 60, "context": torch.randn(batch_size, 4, generator=gen)}
    return kjt, dense
'''

SAVE_PY = f'''\
import sys
from pathlib import Path

import hstu_export
from acme_rank.models import build_acme, example_inputs

out = Path(sys.argv[1])
model = build_acme(dim=8, num_items=200)
example = example_inputs(3)
ranges = {{"sparse_features": (1, {MAX_TAGS})}}
hstu_export.save_bundle(model, out / "registered.pt", example_inputs=example, ranges=ranges)
hstu_export.save_bundle(model, out / "factory.pt", example_inputs=example, ranges=ranges,
                        factory="{FACTORY}", factory_kwargs={{"dim": 8, "num_items": 200}})
'''

DISCOVER_PY = '''\
import json
from importlib import metadata

import hstu_export

dist = metadata.distribution("acme-rank")
print(json.dumps({
    "version": dist.version,
    "entry_points": [[ep.name, ep.value] for ep in metadata.entry_points(group="hstu_export.models")],
    "registered": hstu_export.registered_models(),
}))
'''


@dataclass(frozen=True)
class Acme:
    root: Path
    pkgs: Path  # holds acme_rank/
    site: Path  # holds acme_rank-0.1.dist-info/ only
    nowhere: Path  # an empty directory: a PYTHONPATH without acme_rank
    registered: Path  # bundle naming "acme_ranker"
    factory: Path  # bundle naming FACTORY


def _run(args: list[str], *pythonpath: Path, exe: Path = EXE, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    return subprocess.run([str(exe), *args], capture_output=True, text=True, env=env, cwd=pythonpath[0],
                          timeout=timeout)


def _ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


def _usage_error(proc: subprocess.CompletedProcess[str]) -> str:
    """The one line a user mistake prints (exit code 2, no traceback)."""
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:"), lines[0]
    return lines[0]


def _manifest(package: Path) -> dict:
    manifest = json.loads((package / "manifest.json").read_text())
    for name in manifest["files"]:
        assert (package / name).is_file(), name
    return manifest


def _check_package(proc: subprocess.CompletedProcess[str], package: Path, bundle: Path, name: str) -> dict:
    assert proc.stdout.strip() == str(package)  # -q prints only the package path
    manifest = _manifest(package)
    assert manifest["model"]["name"] == name
    assert manifest["model"]["bundle"] == str(bundle)
    assert manifest["backend"]["name"] == "torchscript"
    assert manifest["ranges"]["max_batch_size"] == 3
    max_lengths = manifest["ranges"]["lengths"]["max_lengths"]
    assert max_lengths["sparse_features.item_tags.lengths"] == MAX_TAGS
    parity = manifest["parity"]
    assert not parity.get("skipped") and parity["passed"] is True
    assert len(parity["batches"]) >= 2  # edge cases and one random batch
    assert all(row["passed"] for row in parity["batches"])
    assert parity["worst"]["rel_l2"] <= parity["tolerances"]["rel_l2"]
    return manifest


@pytest.fixture(scope="module")
def acme(tmp_path_factory: pytest.TempPathFactory) -> Acme:
    root = tmp_path_factory.mktemp("acme")
    pkgs, site, nowhere = root / "pkgs", root / "site", root / "nowhere"
    (pkgs / "acme_rank").mkdir(parents=True)
    (pkgs / "acme_rank" / "__init__.py").write_text('"""Acme\'s ranking models."""\n')
    (pkgs / "acme_rank" / "models.py").write_text(MODELS_PY)
    dist_info = site / "acme_rank-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-rank\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[hstu_export.models]\nacme_ranker = acme_rank.models:AcmeRanker\n")
    nowhere.mkdir()
    (root / "save.py").write_text(SAVE_PY)
    _ok(_run([str(root / "save.py"), str(root)], pkgs, exe=Path(sys.executable)))
    return Acme(root, pkgs, site, nowhere, root / "registered.pt", root / "factory.pt")


def test_bundles_store_a_name_or_a_factory_and_the_inferred_schema(acme: Acme) -> None:
    registered = torch.load(acme.registered, weights_only=True)
    assert registered["source"] == {"kind": "registered", "name": "acme_ranker",
                                    "config": {"dim": 8, "num_items": 200}}
    factory = torch.load(acme.factory, weights_only=True)
    assert factory["source"] == {"kind": "factory", "factory": FACTORY, "kwargs": {"dim": 8, "num_items": 200}}
    for data in (registered, factory):
        schema = json.loads(data["input_schema"])  # inferred from the example call: the model has none
        names = {f["name"] for f in schema["features"]}
        assert {"sparse_features.item_tags.lengths", "dense_features.user_age", "dense_features.context"} <= names
        assert data["example_batch"]["dense_features.context"].shape == (3, 4)


def test_registered_name_without_import_is_one_line(acme: Acme) -> None:
    line = _usage_error(_run(["describe", str(acme.registered)], acme.pkgs))
    assert "acme_ranker" in line and "--import" in line


def test_import_registers_the_model_export_and_verify(acme: Acme) -> None:
    package = acme.root / "registered.torchscript"
    proc = _ok(_run([str(acme.registered), "--import", "acme_rank.models", "--out", str(package), *FAST], acme.pkgs))
    manifest = _check_package(proc, package, acme.registered, "acme_ranker")
    assert manifest["model"]["source"]["kind"] == "registered"
    assert manifest["model"]["config"] == {"dim": 8, "num_items": 200}

    proc = _ok(_run(["verify", str(package), "--import", "acme_rank.models", "--batches", "1"], acme.pkgs))
    assert "parity ok" in proc.stdout


def test_import_of_a_missing_module_is_one_line(acme: Acme) -> None:
    package = acme.root / "missing.torchscript"
    line = _usage_error(_run([str(acme.registered), "--import", "no_such_module_xyz", "--out", str(package), *FAST],
                             acme.pkgs))
    assert "no_such_module_xyz" in line and "--import" in line
    assert not package.exists()


def test_entry_point_resolves_the_name_without_import(acme: Acme) -> None:
    # importlib.metadata reads the dist-info directory on sys.path as an installed distribution.
    proc = _ok(_run(["-c", DISCOVER_PY], acme.pkgs, acme.site, exe=Path(sys.executable)))
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["version"] == "0.1"
    assert ["acme_ranker", "acme_rank.models:AcmeRanker"] in found["entry_points"]
    assert "acme_ranker" in found["registered"]

    package = acme.root / "entry_point.torchscript"
    proc = _ok(_run([str(acme.registered), "--out", str(package), *FAST], acme.pkgs, acme.site))
    _check_package(proc, package, acme.registered, "acme_ranker")


def test_factory_path_exports_without_import(acme: Acme) -> None:
    package = acme.root / "factory.torchscript"
    proc = _ok(_run([str(acme.factory), "--out", str(package), *FAST], acme.pkgs))
    manifest = _check_package(proc, package, acme.factory, FACTORY)
    assert manifest["model"]["source"] == {"kind": "factory", "factory": FACTORY,
                                           "kwargs": {"dim": 8, "num_items": 200}}


def test_factory_module_not_on_the_path_is_one_line(acme: Acme) -> None:
    package = acme.root / "unreachable.torchscript"
    line = _usage_error(_run([str(acme.factory), "--out", str(package), *FAST], acme.nowhere))
    assert "acme_rank.models" in line and "PYTHONPATH" in line
    assert not package.exists()
