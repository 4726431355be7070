"""A package never claims more than its compiled programs hold (runtimes/compiled_bounds.py).

Inductor may narrow a dynamic dim while it compiles, by a choice taken on the export example's size: a CUDA
package of a TorchEasyRec-style model was compiled for at most 3 users (its example's number, and the model's
number of contextual tokens a user) while its manifest said 32, and 32 users stopped the process with a
device-side assert. Here Inductor is made to take such a choice (``evaluate_min(batch, 3)``, as a lowering
clamps a slice, on the export example of 3 users) on the CPU: the input bounds export records are the ones the
program itself checks, and export narrows the package's number of users to them and says so in one line.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import sympy
import torch

import hstu_export
from hstu_export import ExportSettings, VerifySettings
from hstu_export.errors import ExportError, RequestError
from hstu_export.exporter import NarrowedRangeWarning
from hstu_export.models import build_preset
from hstu_export.package.tensor_dir import save_tensors
from hstu_export.runtimes.base import DimSpec
from hstu_export.runtimes.compiled_bounds import (
    exported_bounds,
    named,
    narrowed_dims,
    narrower_than_exported,
    recording_input_bounds,
)


def _clamping(monkeypatch: pytest.MonkeyPatch, at: int) -> None:
    """Every graph Inductor compiles takes ``min(batch, at)`` on the first input whose dim 0 is 3 in the example
    (the number of users), before its code is generated, guarding on the example's choice as Inductor's own
    lowerings do: at 3, ``batch <= 3`` from then on; at 2, ``batch >= 3``."""
    from torch._inductor.graph import GraphLowering

    original = GraphLowering.codegen_with_cpp_wrapper

    def clamping(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        env = self.sizevars.shape_env
        examples = getattr(env, "backed_var_to_val", None) or env.var_to_val
        for value in self.graph_inputs.values():
            size = value.get_size()[0] if hasattr(value, "get_size") and value.get_size() else None
            if isinstance(size, sympy.Symbol) and examples.get(size) == 3:  # the batch: 3 users in the example
                self.sizevars.evaluate_min(size, sympy.Integer(at))
                break
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GraphLowering, "codegen_with_cpp_wrapper", clamping)


@pytest.fixture
def inductor_clamps_batch_at_3(monkeypatch: pytest.MonkeyPatch) -> None:
    _clamping(monkeypatch, 3)


class Rows(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


@pytest.mark.slow
def test_the_recorded_bounds_are_the_ones_the_program_checks(inductor_clamps_batch_at_3, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from hstu_export.runtimes.aoti import _compile

    batch = torch.export.Dim("batch", min=1, max=32)
    program = torch.export.export(Rows(), (torch.randn(3, 4),), dynamic_shapes=({0: batch},), strict=False)
    [bounds] = _compile(program, tmp_path / "rows.pt2", {})
    assert bounds == {"x": [(2, 3), None]}  # traced from 2 (valid for 1), and now at most 3
    assert [d.to_json() for d in narrowed_dims("dense", [bounds], {"x": {0: DimSpec("batch", 1, 32)}})] == [
        {"dim": "batch", "bound": "max", "declared": 32, "compiled": 3, "program": "dense", "input": "x", "axis": 0}]
    assert narrowed_dims("dense", [bounds], {"x": {0: DimSpec("batch", 1, 3)}}) == []
    # A dim derived from the batch (offsets: batch + 1) is compared as the batch; a minimum above 2 is narrowing.
    assert narrowed_dims("dense", [{"o": [(3, 5)]}], {"o": {0: DimSpec("batch", 1, 8, offset=1)}})[0].compiled == 4
    [least] = narrowed_dims("dense", [{"o": [(5, 33)]}], {"o": {0: DimSpec("batch", 1, 32, offset=1)}})
    assert (least.bound, least.declared, least.compiled) == ("min", 1, 4)
    assert named([[(2, 3)], None], ["x", "n"]) == {"x": [(2, 3)]} and named([[(2, 3)]], ["x", "n"]) == {}
    # Against the ranges torch.export gave the program (the KV cache's programs are checked so).
    assert exported_bounds(program) == {"x": [(1, 32), None]}
    assert narrower_than_exported("delta", exported_bounds(program), [bounds]) == [
        "AOTInductor compiled the delta program for x dim 0 at most 3 (exported for 32)"]
    assert narrower_than_exported("delta", {"x": [(1, 3), None]}, [bounds]) == []
    assert narrower_than_exported("delta", {"x": [(1, 32), None]}, [{"x": [(4, 32), None]}]) == [
        "AOTInductor compiled the delta program for x dim 0 at least 4 (exported for 1)"]
    monkeypatch.setenv("AOTI_RUNTIME_CHECK_INPUTS", "1")
    compiled = torch._inductor.aoti_load_package(str(tmp_path / "rows.pt2"))
    assert torch.equal(compiled(torch.ones(3, 4)), torch.full((3, 4), 3.0))
    with pytest.raises(RuntimeError, match="dim value is too large at 0, expected to be <= 3, but got: 4"):
        compiled(torch.ones(4, 4))


class Projection(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(7, 13)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


@pytest.mark.slow
def test_the_matmul_padding_pass_does_not_narrow_the_users(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """torch 2.11's matmul padding pass compares the symbolic sizes in its heuristic (``K > M``), which narrows the
    batch to below K. The pass runs only for CUDA: here it is let run on the CPU with that comparison. Our compiles
    leave the pass off (KEEPING_DECLARED_RANGES) and keep the declared 32 users; with the user's
    ``shape_padding=True`` (an ``--aoti-option``, which wins) the batch is held below K = 7 (K and N not a multiple of the alignment,
    so the pass considers padding them)."""
    from torch._inductor.fx_passes import pad_mm

    from hstu_export.runtimes.aoti import _compile

    def compares_symbolic_sizes(match, mat1, mat2, op, input=None):  # type: ignore[no-untyped-def]
        return bool(mat1.shape[1] > mat1.shape[0]) and False  # the comparison guards; no padding is chosen

    monkeypatch.setattr(pad_mm, "check_device", lambda a, b: True)
    monkeypatch.setattr(pad_mm, "has_triton", lambda: True)
    monkeypatch.setattr(pad_mm, "_should_pad", compares_symbolic_sizes)
    batch = torch.export.Dim("batch", min=1, max=32)
    program = torch.export.export(Projection(), (torch.randn(3, 7),), dynamic_shapes=({0: batch},), strict=False)
    assert _compile(program, tmp_path / "kept.pt2", {}) == [{"x": [(2, 32), None]}]
    assert _compile(program, tmp_path / "padded.pt2", {"shape_padding": True}) == [{"x": [(2, 6), None]}]


def test_nothing_is_recorded_outside_the_context_and_the_hook_is_removed() -> None:
    from torch._inductor.graph import GraphLowering

    before = GraphLowering.codegen_with_cpp_wrapper
    with recording_input_bounds() as outer, recording_input_bounds() as inner:
        assert GraphLowering.codegen_with_cpp_wrapper is not before
        assert outer == [] and inner == []
    assert GraphLowering.codegen_with_cpp_wrapper is before


@pytest.mark.slow
def test_export_narrows_the_users_to_what_inductor_compiled(inductor_clamps_batch_at_3, tmp_path: Path,
                                                            cpp_runtime) -> None:
    model = build_preset("tiny", seed=1)
    bundle = hstu_export.save_bundle(model, tmp_path / "tiny.pt", hstu_export.generate_batch(model.input_schema(), 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = hstu_export.export(bundle, tmp_path / "pkg", ExportSettings(
            backend="aoti", max_batch_size=8, verify=VerifySettings(num_random_batches=1)))
    notes = [str(w.message) for w in caught if issubclass(w.category, NarrowedRangeWarning)]
    assert len(notes) == 1 and "\n" not in notes[0], notes
    assert notes[0].startswith("batch size narrowed to <= 3 (declared 8): the compiled program refuses requests "
                               "beyond it (AOTInductor compiled the "), notes
    manifest = json.loads((result.path / "manifest.json").read_text())
    assert manifest["ranges"]["max_batch_size"] == 3 and manifest["ranges"]["dims"]["batch"] == [1, 3]
    [record] = manifest["ranges"]["narrowed"]
    assert (record["feature"], record["bound"], record["declared"], record["exported"]) == ("batch size", "max", 8, 3)
    assert {d["dim"] for d in manifest["backend"]["meta"]["narrowed_dims"]} == {"batch"}
    users = [int(m.group(1)) for b in result.parity["batches"] if (m := re.search(r"\bB=(\d+)", b["batch"]))]
    assert result.parity["passed"] and max(users) == 3, users
    predictor = hstu_export.load(result.path)
    assert predictor(hstu_export.generate_batch(predictor.input_schema, 3, seed=2))
    four = hstu_export.generate_batch(predictor.input_schema, 4, seed=2)
    with pytest.raises(RequestError, match="batch size 4 is beyond the exported maximum 3"):
        predictor(four)
    done = cpp_runtime.run(result.path, save_tensors(four, tmp_path / "four"), "--out", tmp_path / "out")
    assert done.returncode != 0 and "batch size 4 is beyond the exported maximum 3" in done.stderr, done.stderr


@pytest.mark.slow
def test_a_program_compiled_for_at_least_3_users_is_not_written(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    _clamping(monkeypatch, 2)  # min(batch, 2) on the example of 3 users: batch >= 3 from then on
    model = build_preset("tiny", seed=1)
    bundle = hstu_export.save_bundle(model, tmp_path / "tiny.pt", hstu_export.generate_batch(model.input_schema(), 3))
    with pytest.raises(ExportError, match=r"AOTInductor compiled the (sparse|dense) program for \w+ dim 0 at least 3, "
                                          r"while a request may hold 1 users: the package would not serve the "
                                          r"smallest requests; nothing was written"):
        hstu_export.export(bundle, tmp_path / "pkg", ExportSettings(backend="aoti", max_batch_size=8,
                                                                    verify=VerifySettings(enabled=False)))
    assert not (tmp_path / "pkg").exists()


@pytest.mark.slow
def test_the_derived_kv_programs_bounds_are_read_too(inductor_clamps_batch_at_3, tmp_path: Path) -> None:
    """The KV cache's delta and counts programs, compiled for the declared 8 users and held to 3 as the dense
    program is: recorded in the manifest's kv_cache section; the package serves 3 users, cached and not."""
    model = build_preset("tiny", seed=1)
    bundle = hstu_export.save_bundle(model, tmp_path / "tiny.pt", hstu_export.generate_batch(model.input_schema(), 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = hstu_export.export(bundle, tmp_path / "pkg", ExportSettings(
            backend="aoti", max_batch_size=8, kv_cache=True, kv_program="derived",
            verify=VerifySettings(num_random_batches=1)))
    assert [str(w.message) for w in caught if issubclass(w.category, NarrowedRangeWarning)] != []
    kv = result.manifest["kv_cache"]
    assert {(d["program"], d["dim"], d["compiled"]) for d in kv["narrowed_dims"]} >= {("KV-cache delta", "batch", 3)}
    assert result.manifest["ranges"]["max_batch_size"] == 3
    assert result.parity["passed"] and result.parity["kv_cache"]["passed"]
