"""The package contract (docs/PACKAGE.md, docs/manifest.schema.json): a real manifest validates, and the
schema refuses what the contract forbids. (tests/conftest.py validates every manifest the suite writes.)"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import torch

import hstu_export
from hstu_export import ExportSettings, VerifySettings, generate_batch, save_bundle
from hstu_export.models import build_preset

SCHEMA = json.loads((Path(__file__).resolve().parent.parent / "docs" / "manifest.schema.json").read_text())


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("contract")
    model = build_preset("tiny", seed=1)
    bundle = save_bundle(model, root / "tiny.pt", generate_batch(model.input_schema(), 4, seed=2))
    settings = ExportSettings(backend="torchscript", max_batch_size=4, verify=VerifySettings(num_random_batches=1))
    return hstu_export.export(bundle, root / "pkg", settings).path


def test_manifest_validates_and_describes_the_artifact(package: Path) -> None:
    manifest = json.loads((package / "manifest.json").read_text())
    jsonschema.validate(manifest, SCHEMA)
    model = manifest["artifacts"]["model"]
    assert model["file"] == manifest["backend"]["files"]["model"] and model["format"] == "torchscript"
    assert [t["name"] for t in model["inputs"]] == [f["name"] for f in manifest["input_schema"]["features"]]
    assert [t["name"] for t in model["outputs"]] == manifest["output_names"]
    assert model["outputs"][0]["shape"] == ["candidate_lengths.total"]
    # The artifact really takes its inputs in that order and returns those names, with no grad.
    module = torch.jit.load(str(package / model["file"]))
    batch = generate_batch(hstu_export.InputSchema.from_json(manifest["input_schema"]), 2, seed=3)
    out = module(*[batch[t["name"]] for t in model["inputs"]])
    assert list(out) == manifest["output_names"] and not any(t.requires_grad for t in out.values())


@pytest.mark.parametrize(("path", "value"), [
    (("format_version",), 3),
    (("backend", "files", "model"), "../model.ts"),
    (("backend", "files", "model"), "/etc/passwd"),
    (("files",), {"a//b": "0" * 64}),
    (("artifacts", "model", "inputs", 0, "shape", 0), "a*b"),
    (("op_libraries",), ["os"]),
    (("input_schema", "features", 0, "kind"), "ragged"),
])
def test_schema_refuses_what_the_contract_forbids(package: Path, path: tuple, value: object) -> None:
    manifest = copy.deepcopy(json.loads((package / "manifest.json").read_text()))
    target = manifest
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(manifest, SCHEMA)


def test_missing_artifacts_section_is_refused(package: Path) -> None:
    manifest = json.loads((package / "manifest.json").read_text())
    del manifest["artifacts"]
    with pytest.raises(jsonschema.ValidationError, match="'artifacts' is a required property"):
        jsonschema.validate(manifest, SCHEMA)


@torch.library.custom_op("contract_probe::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _twice_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _CallsCustomOp(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.contract_probe.twice(x).sin() + 1


@pytest.mark.slow
def test_aoti_package_lists_the_ops_it_calls_at_run_time(tmp_path: Path) -> None:
    """The op libraries of an AOTInductor artifact are those it calls through its proxy executor (what it
    did not compile), read from the compiled package: decomposed aten code needs none."""
    from hstu_export.runtimes.aoti import package_op_libraries

    program = torch.export.export(_CallsCustomOp(), (torch.randn(4, 3),))
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "probe.pt2"))
    assert package_op_libraries(Path(path)) == {"contract_probe"}
    plain = torch.export.export(torch.nn.Linear(3, 2), (torch.randn(4, 3),))
    path = torch._inductor.aoti_compile_and_package(plain, package_path=str(tmp_path / "plain.pt2"))
    assert package_op_libraries(Path(path)) == set()


def test_output_dims_are_named_by_how_they_change() -> None:
    """A static axis stays an int even when it equals a dynamic size (3 tasks, 3 users); an axis that
    follows an input dim is named after it, with a factor or an offset when it has one."""
    from hstu_export.package.artifacts import name_dims

    first = {"per_task": torch.zeros(3, 7), "per_user": torch.zeros(3, 16), "pairs": torch.zeros(14),
             "offsets": torch.zeros(4), "nonzero": torch.zeros(5)}
    second = {"per_task": torch.zeros(3, 9), "per_user": torch.zeros(5, 16), "pairs": torch.zeros(18),
              "offsets": torch.zeros(6), "nonzero": torch.zeros(2)}
    shapes = name_dims(first, {"batch": 3, "candidate_lengths.total": 7},
                       second, {"batch": 5, "candidate_lengths.total": 9})
    assert shapes == {"per_task": [3, "candidate_lengths.total"], "per_user": ["batch", 16],
                      "pairs": ["2*candidate_lengths.total"], "offsets": ["batch+1"], "nonzero": ["dynamic"]}
