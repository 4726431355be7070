"""Whole requests from exact-shape CUDA graphs without the KV cache (``hstu_export.load(cuda_graphs=...)``,
``hstu-export-run --graphs``, docs/SERVING.md "Whole-request CUDA graphs"): where nothing reads the device before
the outputs (the compiled sparse half's prechecked model, a dense program that reads nothing back), a graph
holds the sparse half's lookups and the dense half, keyed and fed by the request's own tensors. On the CPU the
bookkeeping runs without capturing (Python's ``ShapeGraphs(capture=False)``, C++ ``--graphs buckets``): the same
replays in both runtimes, answers bit for bit those of the package without graphs, and a package that reads the
device refused in one line."""

from __future__ import annotations

import re

import pytest
import torch
from kv_requests import CONFIGS, Users

import hstu_export
from hstu_export.errors import ConfigError
from hstu_export.package.tensor_dir import load_tensors, save_tensors
from hstu_export.runtimes.shape_graphs import ShapeGraphs

pytestmark = pytest.mark.slow

GRAPHS = re.compile(r"whole-request graphs, exact shapes: (\d+) replays, (\d+) graphs captured, (\d+) run as they are")


def _requests(name: str) -> list[dict[str, torch.Tensor]]:
    """Two shapes, then each again and the first a third time: 2 run as they are, 3 replays."""
    users = Users(CONFIGS[name], seed=3)
    users.grow("a", 9)
    users.grow("b", 4)
    first, second = users.request(["a", "b"], [3, 2]), users.request(["a"], [4])
    again = users.request(["a", "b"], [3, 2])  # the first's shapes, other candidates
    return [first, second, again, second, first]


@pytest.mark.parametrize("kv_package", ["no-context"], indirect=True)
def test_a_whole_request_graph_answers_as_the_package_in_python_and_cpp(kv_package, cpp_runtime, tmp_path) -> None:  # type: ignore[no-untyped-def]
    name, root, manifest = kv_package
    assert manifest["backend"]["meta"]["dense_device_reads"] == 0
    plain = hstu_export.load(root)
    assert plain.split is not None and plain.split.sparse_model == "prechecked"
    assert plain.graphs is None and plain.graphs_unsafe() == ""  # on the CPU: none, though nothing forbids them
    graphed = hstu_export.load(root)
    graphed.graphs = ShapeGraphs(graphed._whole_request, (), capture=False)
    script = _requests(name)
    answers = []
    for k, request in enumerate(script):
        got, want = graphed(request), plain(request)
        assert list(got) == plain.output_names and all(torch.equal(got[n], want[n]) for n in want), k
        answers.append(got)
    assert graphed.graphs.counts == {"replays": 3, "captures": 0, "eager": 2, "refused": 0}
    features = {f.graph_name for f in graphed.input_schema.features}
    looked_up = {t["name"] for t in manifest["artifacts"]["dense"]["inputs"] if not t.get("feature")}
    buffers = [set(entry.inputs) for entry in graphed.graphs._graphs.values()]
    # The graph is fed the request, never the rows the sparse half looks up.
    assert len(buffers) == 2 and all(names == features and not names & looked_up for names in buffers)

    # C++: the first request once, then four more runs (the first of them seen twice: replayed from then on).
    request = save_tensors(script[0], tmp_path / "request")
    done = cpp_runtime.run(root, request, "--graphs", "buckets", "--repeat", "4", "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert GRAPHS.findall(done.stdout) == [("4", "0", "1")], done.stdout
    got = load_tensors(tmp_path / "out")
    assert all(torch.equal(got[n], answers[0][n]) for n in answers[0])
    timed = cpp_runtime.run(root, request, "--graphs", "buckets", "--repeat", "2", "--phase-times")
    assert timed.returncode == 0 and "(the sparse half runs in the dense half's graph)" in timed.stdout, timed.stdout
    without = cpp_runtime.run(root, request, "--graphs", "off", "--repeat", "2")
    assert without.returncode == 0 and not GRAPHS.search(without.stdout), without.stdout
    bounded = cpp_runtime.run(root, request, "--graphs", "buckets", "--graph-copy-limit", "100", "--repeat", "4")
    assert bounded.returncode == 0 and GRAPHS.findall(bounded.stdout) == [("0", "0", "5")], bounded.stdout


@pytest.mark.parametrize("kv_package", ["no-context"], indirect=True)
def test_graphs_are_refused_in_one_line_where_they_cannot_run(kv_package, cpp_runtime, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """On the CPU, a package whose dense program reads values back from the device, and bad options."""
    import json
    import shutil

    from manifests import rewrite_manifest

    name, root, _ = kv_package
    request = save_tensors(_requests(name)[0], tmp_path / "request")
    with pytest.raises(ConfigError, match="CUDA graphs need a CUDA package"):
        hstu_export.load(root, cuda_graphs=True)
    with pytest.raises(ConfigError, match="cuda_graphs is True, False or None"):
        hstu_export.load(root, cuda_graphs="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="graph_copy_limit"):
        hstu_export.load(root, graph_copy_limit="lots")
    assert hstu_export.load(root, cuda_graphs=False).graphs is None
    done = cpp_runtime.run(root, request, "--graphs", "on")
    assert done.returncode == 1 and done.stderr.strip().endswith(f"CUDA graphs need a CUDA package; {root} is for cpu")
    for args, words in ((["--graphs", "sometimes"], "--graphs is auto, on, off or buckets, got 'sometimes'"),
                        (["--graphs", "buckets", "--kv-cache", "auto", "--user-ids", "1,2"],
                         "--graphs and --graph-copy-limit serve without --kv-cache")):
        refused = cpp_runtime.run(root, request, *args)
        assert refused.returncode == 2 and words in refused.stderr and len(refused.stderr.splitlines()) == 1, refused

    reads = tmp_path / "reads"
    shutil.copytree(root, reads)
    rewrite_manifest(reads, lambda m: m["backend"]["meta"].update(dense_device_reads=2))
    assert json.loads((reads / "manifest.json").read_text())["backend"]["meta"]["dense_device_reads"] == 2
    why = "its dense program reads 2 value(s) back from the device (backend.meta.dense_device_reads)"
    assert why in hstu_export.load(reads).graphs_unsafe()
    done = cpp_runtime.run(reads, request, "--graphs", "on")
    assert done.returncode == 1 and why in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    served = cpp_runtime.run(reads, request, "--graphs", "auto", "--repeat", "2")  # auto: served without graphs
    assert served.returncode == 0 and not GRAPHS.search(served.stdout), served.stdout


@pytest.mark.parametrize("kv_package", ["context"], indirect=True)
def test_packages_that_read_the_device_first_are_not_replayed(kv_package, tiny_serving_package) -> None:  # type: ignore[no-untyped-def]
    """A sparse half that checks its ranges on the device (a CPU export's default) and a TorchScript package:
    graphs_unsafe says why, and asking for graphs anyway is refused naming it."""
    _, root, _ = kv_package
    assert "checks the request's ranges on the device" in hstu_export.load(root).graphs_unsafe()
    with pytest.raises(ConfigError, match="export with --prechecked-sparse on"):
        hstu_export.load(root, cuda_graphs=True)
    assert "it is a torchscript package" in hstu_export.load(tiny_serving_package).graphs_unsafe()
