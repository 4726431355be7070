"""Requests whose tensors are views, on another device, or unusable: the predictor copies what compiled
code cannot read as is, and refuses what it cannot use with a RequestError.

AOTInductor reads its inputs as contiguous memory without checking strides: a stride-2 view of
``candidate_lengths`` passed as is aborts the process (exit 134), and a strided ``uih_timestamps`` gives
wrong scores.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import types

import pytest
import torch

import hstu_export
from hstu_export import ExportSettings, VerifySettings, generate_batch
from hstu_export.errors import RequestError
from hstu_export.runtimes.predictor import plain_tensor

pytestmark = pytest.mark.slow

MAX_BATCH = 6
BACKENDS = ["aoti", "torchscript", "onnx"]


@pytest.fixture(scope="module")
def packages(workdir, bundle):
    """One package per backend, exported once for the module."""
    out = {}
    for backend in BACKENDS:
        settings = ExportSettings(backend=backend, max_batch_size=MAX_BATCH, verify=VerifySettings(num_random_batches=1))
        out[backend] = hstu_export.export(bundle, workdir / f"pkg-{backend}", settings).path
    return out


@pytest.fixture(scope="module")
def predictors(packages):
    return {backend: hstu_export.load(path) for backend, path in packages.items()}


def strided(t: torch.Tensor, fill: int) -> torch.Tensor:
    """The values of ``t`` as a stride-2 view, with ``fill`` in the gaps a contiguous read would see."""
    buffer = torch.full((2 * t.numel(),), fill, dtype=t.dtype)
    buffer[::2] = t
    view = buffer[::2]
    assert view.stride() == (2,) and torch.equal(view, t)
    return view


def offset(t: torch.Tensor, fill: int) -> torch.Tensor:
    """The values of ``t`` as a contiguous view that starts 3 elements into its storage."""
    buffer = torch.full((t.numel() + 5,), fill, dtype=t.dtype)
    buffer[3:3 + t.numel()] = t
    return buffer[3:3 + t.numel()]


FRESH_PROCESS = textwrap.dedent("""
    import sys, torch, hstu_export
    from hstu_export import generate_batch
    sys.path.insert(0, sys.argv[3])
    from test_request_tensors import offset, strided

    predictor = hstu_export.load(sys.argv[1])
    batch = generate_batch(predictor.input_schema, 4, seed=3)
    results = {"contiguous": predictor(batch)}
    # Timestamps first: their garbage only changes scores; garbage lengths abort an unfixed AOTI run.
    for name in sorted(batch, key=lambda n: n != "uih_timestamps"):
        for how, view in (("stride-2", strided), ("offset", offset)):
            results[f"{name} {how}"] = predictor(dict(batch, **{name: view(batch[name], 1000)}))
    first = batch["user_age"][:1]
    results["user_age expanded"] = predictor(dict(batch, user_age=first.expand(4)))
    results["user_age expanded reference"] = predictor(dict(batch, user_age=first.repeat(4)))
    torch.save(results, sys.argv[2])
""")


@pytest.mark.parametrize("backend", BACKENDS)
def test_views_in_a_fresh_process_give_the_contiguous_outputs(packages, backend, tmp_path):
    """Every feature as a stride-2 view (and as an offset view) gives exactly the contiguous outputs.
    In a child process, so that an abort in compiled code fails this test rather than the test run."""
    from pathlib import Path

    script = tmp_path / "serve.py"
    script.write_text(FRESH_PROCESS)
    proc = subprocess.run(
        [sys.executable, str(script), str(packages[backend]), str(tmp_path / "out.pt"), str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-1500:]}"
    results = torch.load(tmp_path / "out.pt", weights_only=True)
    reference = results.pop("contiguous")
    expanded_reference = results.pop("user_age expanded reference")
    assert len(results) == 2 * 9 + 1
    for variant, outputs in results.items():
        expected = expanded_reference if variant == "user_age expanded" else reference
        for task in expected:
            assert torch.equal(outputs[task], expected[task]), f"{backend}: {variant} changed {task}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_timestamps_give_the_contiguous_scores(predictors, backend):
    predictor = predictors[backend]
    batch = generate_batch(predictor.input_schema, 5, seed=11)
    expected = predictor(batch)
    got = predictor(dict(batch, uih_timestamps=strided(batch["uih_timestamps"], 10**12)))
    for task in expected:
        assert torch.equal(got[task], expected[task])


@pytest.mark.parametrize("backend", BACKENDS)
def test_unusable_tensors_raise_request_errors(predictors, backend):
    predictor = predictors[backend]
    batch = generate_batch(predictor.input_schema, 2, seed=3)
    lengths = batch["candidate_lengths"]
    with pytest.raises(RequestError, match="'candidate_lengths' is a meta tensor"):
        predictor(dict(batch, candidate_lengths=lengths.to("meta")))
    with pytest.raises(RequestError, match=r"'candidate_lengths' has layout torch\.sparse_coo.*to_dense"):
        predictor(dict(batch, candidate_lengths=lengths.to_sparse()))
    with pytest.raises(RequestError, match="'uih_item_ids' must be a tensor, got list"):
        predictor(dict(batch, uih_item_ids=batch["uih_item_ids"].tolist()))
    with pytest.raises(RequestError, match="'user_id' must be a tensor, got ndarray"):
        predictor(dict(batch, user_id=batch["user_id"].numpy()))
    with pytest.raises(RequestError, match="dict of named tensors, got list"):
        predictor([batch])
    # Validation runs on the plain tensors and still names the problem.
    with pytest.raises(RequestError, match="length 47 beyond the exported maximum 46"):
        predictor(dict(batch, uih_lengths=strided(torch.tensor([1, 47]), 1)))
    with pytest.raises(RequestError, match="unknown feature"):
        predictor(dict(batch, extra=[1, 2]))


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_tensors_without_plain_memory_are_refused():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.ones(3, dtype=torch.int64)
    with pytest.raises(RequestError, match="'x' is a FakeTensor"):
        plain_tensor("x", fake)
    with pytest.raises(RequestError, match="layout torch.sparse_csr"):
        plain_tensor("x", torch.eye(3).to_sparse_csr())
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    with pytest.raises(RequestError, match="nested tensor"):
        plain_tensor("x", nested)


def test_grad_views_and_parameters_are_made_plain():
    leaf = torch.arange(12, dtype=torch.float32).requires_grad_()
    view = leaf[::3]
    out = plain_tensor("x", view)
    assert not out.requires_grad and out.is_contiguous() and out.stride() == (1,)
    assert torch.equal(out, view.detach())
    single = torch.arange(4)[::4]  # one element, stride 4: "contiguous", yet not the strides compiled for
    assert plain_tensor("x", single).stride() == (1,)
    param = plain_tensor("x", torch.nn.Parameter(torch.ones(2, 3).t()))
    assert type(param) is torch.Tensor and param.stride() == (2, 1) and not param.requires_grad
    plain = torch.arange(5)
    assert plain_tensor("x", plain).data_ptr() == plain.data_ptr()  # nothing to do: no copy


def test_a_read_only_mapping_is_a_request(predictors):
    predictor = predictors["torchscript"]
    batch = generate_batch(predictor.input_schema, 3, seed=8)
    expected = predictor(batch)
    got = predictor(types.MappingProxyType(batch))
    for task in expected:
        assert torch.equal(got[task], expected[task])


def test_many_threads_with_views_match_one(predictors):
    predictor = predictors["aoti"]
    batches = [generate_batch(predictor.input_schema, 1 + i % MAX_BATCH, seed=300 + i) for i in range(16)]
    single = [predictor(b) for b in batches]
    # Harmless garbage only (timestamps strided, the rest offset): an unfixed AOTI run must fail this
    # test, not abort the test run.
    views = [
        {name: strided(t, 10**12) if name == "uih_timestamps" else offset(t, 1000) for name, t in b.items()}
        if i % 2 else b
        for i, b in enumerate(batches)
    ]
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def worker(tid: int) -> None:
        try:
            for i in range(tid, len(views), 4):
                results[i] = predictor(views[i])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for i, expected in enumerate(single):
        for task in expected:
            assert torch.equal(results[i][task], expected[task])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to make a CUDA tensor")
def test_cuda_tensors_are_moved_to_a_cpu_package(predictors):
    predictor = predictors["aoti"]
    batch = generate_batch(predictor.input_schema, 3, seed=9)
    expected = predictor(batch)
    got = predictor({name: t.cuda()[::1] if i % 2 else t for i, (name, t) in enumerate(batch.items())})
    for task in expected:
        assert got[task].device.type == "cpu"
        assert torch.equal(got[task], expected[task])
