"""Fault campaign, issue 37 item 4: a request the package's own programs refuse is refused by the C++ runtime
(``hstu-export-run``, runtimes/cpp) in one line that names the feature, its value and the limit, as the
Python RequestError messages do (hstu_export/package/schema.py ``validate``).

The manifest's ranges are checked first and name the feature (tests/test_cpp_runtime.py). What reached the
programs' own range checks (passes/guard_ranges.py) was a request the manifest allows and the programs do
not: a manifest edited to allow more than its package was exported for (its checksum line rewritten to
match, tests/manifests.py). Before, the refusal read "running the package failed: The following operation
failed in the TorchScript interpreter."; now it names the feature and the limit the program holds it to (read
from the program), and says that the manifest does not match the programs. Served plainly and through the
KV cache (``--kv-cache``).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from kv_requests import CONFIGS, Users
from manifests import rewrite_manifest

from hstu_export.package.tensor_dir import save_tensors

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("kv_package", ["no-context"], indirect=True)]

CONFIG = CONFIGS["no-context"]


def manifest_sparse_file(root) -> str:  # type: ignore[no-untyped-def]
    import json

    return json.loads((root / "manifest.json").read_text())["backend"]["files"]["sparse"]


def _feature(manifest: dict, name: str) -> dict:
    return next(f for f in manifest["input_schema"]["features"] if f["name"] == name)


def _longer_histories(manifest: dict) -> None:
    _feature(manifest, "uih_lengths")["max_value"] = 100
    manifest["ranges"]["lengths"]["max_lengths"]["uih_lengths"] = 100


def _more_users(manifest: dict) -> None:
    manifest["ranges"]["max_batch_size"] = manifest["ranges"]["lengths"]["max_batch_size"] = 8


def _request(users: dict[str, int], edit=None) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    made = Users(CONFIG, seed=3)
    for user, length in users.items():
        made.grow(user, length)
    request = made.request(list(users), [2] * len(users))
    if edit is not None:
        edit(request)
    return request


def _set(name: str, value: int):  # type: ignore[no-untyped-def]
    def edit(request: dict[str, torch.Tensor]) -> None:
        request[name][0] = value
    return edit


CASES = {
    "history": (_longer_histories, {"a": 47, "b": 3},
                "feature 'uih_lengths' has length 47 beyond the exported maximum 46 (refused by {sparse} "
                "itself; the manifest's maximum is 100, so the manifest does not match the package's programs: "
                "re-export the package)"),
    "id": (lambda m: _feature(m, "uih_item_ids").update(max_value=5000), ({"a": 4, "b": 3}, _set("uih_item_ids", 1000)),
           "feature 'uih_item_ids' has value 1000 beyond the exported maximum 999 (refused by {sparse} itself; "
           "the manifest's maximum is 5000"),
    "negative id": (lambda m: _feature(m, "candidate_item_ids").update(min_value=-5),
                    ({"a": 4, "b": 3}, _set("candidate_item_ids", -1)),
                    "feature 'candidate_item_ids' has value -1 below the minimum 0 (refused by {sparse} itself; "
                    "the manifest's minimum is -5"),
    "users": (_more_users, {u: 3 for u in "abcde"},
              "feature 'uih_lengths' has 5 entries, beyond the exported maximum of 4 users (refused by {sparse} "
              "itself; the manifest allows 8"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cached", [False, True], ids=["plain", "kv-cache"])
def test_a_request_the_programs_refuse_names_the_feature_and_the_limit(cpp_runtime, kv_package, tmp_path, case,
                                                                        cached) -> None:  # type: ignore[no-untyped-def]
    _, root, _ = kv_package
    edit_manifest, users, message = CASES[case]
    # The compiled sparse half (sparse/sparse.pt2) states its limits in its errors; TorchScript's are read from it.
    message = message.format(sparse=manifest_sparse_file(root))
    users, edit_request = users if isinstance(users, tuple) else (users, None)
    package = tmp_path / "pkg"
    shutil.copytree(root, package)
    rewrite_manifest(package, edit_manifest)
    request = save_tensors(_request(users, edit_request), tmp_path / "request")
    kv = ["--kv-cache", "auto", "--user-ids", ",".join(str(i) for i in range(len(users)))] if cached else []
    done = cpp_runtime.run(package, request, *kv, "--out", tmp_path / "out")
    assert done.returncode == 1 and done.stdout == "", done.stdout
    assert done.stderr.startswith("hstu-export-run: error: ") and message in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and not (tmp_path / "out").exists()
    # The untouched package refuses the same request by its manifest, naming the same feature (or the batch).
    done = cpp_runtime.run(root, request, *kv)
    by_manifest = "batch size 5 is beyond the exported maximum 4" if case == "users" else message.split(" (")[0]
    assert done.returncode == 1 and by_manifest in done.stderr, done.stderr


def test_requests_within_the_programs_ranges_still_run(cpp_runtime, kv_package, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The edited manifest serves what both allow: only the refusals changed."""
    _, root, _ = kv_package
    package = tmp_path / "pkg"
    shutil.copytree(root, package)
    rewrite_manifest(package, _longer_histories)
    request = save_tensors(_request({"a": 46, "b": 1}), tmp_path / "request")
    done = cpp_runtime.run(package, request, "--kv-cache", "auto", "--user-ids", "1,2", "-q")
    assert done.returncode == 0 and done.stderr == "", done.stderr


@pytest.mark.parametrize("cached", [False, True], ids=["plain", "kv-cache"])
def test_python_names_the_feature_as_cpp_does(kv_package, tmp_path, cached) -> None:  # type: ignore[no-untyped-def]
    """The Python predictor and its KV cache word the same refusal as the C++ runtime does when it cannot read the
    program's own limit: a RequestError, never a raw torch.jit.Error."""
    import hstu_export
    from hstu_export.errors import RequestError

    _, root, _ = kv_package
    package = tmp_path / "pkg"
    shutil.copytree(root, package)
    rewrite_manifest(package, _longer_histories)
    predictor = hstu_export.load(package)
    request = _request({"a": 47, "b": 3})
    with pytest.raises(RequestError) as info:
        predictor.kv_cache()(request, [1, 2]) if cached else predictor(request)
    sparse = manifest_sparse_file(root)
    assert str(info.value) == (f"feature 'uih_lengths' has length 47 beyond the range {sparse} was exported for "
                               f"(refused by {sparse} itself; the manifest's maximum is 100, so the manifest "
                               "does not match the package's programs: re-export the package)")
