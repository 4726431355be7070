"""What each artifact of a package takes and returns, in order: the manifest's ``artifacts`` section and
``op_library_files`` (docs/PACKAGE.md), so a server in another language calls the files without reading
our code.

Every tensor is described by name, dtype and shape; a dim is an int (static) or the name of a dynamic
dim from ``ranges.dims`` (``batch``, ``<lengths feature>.total``), optionally with an offset or a factor
(``batch+1``, ``2*batch``). Inputs and outputs are listed in the positional order the artifact takes and
returns them.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from hstu_export.runtimes.base import CompileInputs, DimSpec

# Artifact formats by (backend, role); a backend may choose another per export (``BackendArtifacts.formats``:
# the aoti backend's sparse half is AOTInductor's when it is plain tensor code).
FORMATS = {
    ("aoti", "sparse"): "torchscript", ("aoti", "dense"): "aoti",
    ("onnx", "sparse"): "torchscript", ("onnx", "dense"): "onnx",
    ("trt", "sparse"): "torchscript", ("trt", "dense"): "torch_tensorrt",
    ("torchscript", "model"): "torchscript",
}

# What C++ (or any non-Python process) loads for each op library a manifest names. fbgemm_gpu's ops are
# registered by its shared library, found in the installed fbgemm_gpu package; load it with
# dlopen(RTLD_NOW | RTLD_GLOBAL) before the artifacts. Our own ops are defined in Python only.
OP_LIBRARY_FILES: dict[str, dict[str, Any]] = {
    # The table-batched embedding ops (quantized lookups included) live in the two libraries after the first.
    "fbgemm_gpu": {"package": "fbgemm_gpu",
                   "shared_libraries": {"linux": ["fbgemm_gpu_py.so", "fbgemm_gpu_tbe_common.so",
                                                  "fbgemm_gpu_tbe_inference.so"]},
                   "load": "dlopen RTLD_NOW|RTLD_GLOBAL, in this order, before the artifacts"},
    "hstu_export.ops": {"package": "hstu_export", "shared_libraries": {},
                        "load": "Python only (torch.library ops defined in Python): no C++ equivalent"},
    "torch_tensorrt": {"package": "torch_tensorrt", "shared_libraries": {"linux": ["lib/libtorchtrt_runtime.so"]},
                       "load": "dlopen RTLD_NOW|RTLD_GLOBAL, before the artifacts"},
}


def dim_text(spec: DimSpec) -> str:
    text = spec.name if spec.scale == 1 else f"{spec.scale}*{spec.name}"
    return f"{text}+{spec.offset}" if spec.offset else text


def tensor_entry(name: str, tensor: Tensor, dims: dict[int, DimSpec] | None = None) -> dict[str, Any]:
    """``{name, dtype, shape}``: dims from ``dims`` (by axis), else the static size."""
    shape: list[int | str] = []
    for axis, size in enumerate(tensor.shape):
        shape.append(dim_text(dims[axis]) if dims and axis in dims else int(size))
    return {"name": name, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": shape}


def name_dims(first: dict[str, Tensor], first_dims: dict[str, int], second: dict[str, Tensor],
              second_dims: dict[str, int]) -> dict[str, list[int | str]]:
    """Output shapes from two runs whose named input dims (``first_dims``, ``second_dims``: name -> size)
    all changed: an axis of the same size in both is static; one that changed is the input dim that
    changed alike, or ``k*dim``, or ``dim+c``; otherwise ``dynamic`` (data-dependent, no named dim)."""
    shapes: dict[str, list[int | str]] = {}
    for name, tensor in first.items():
        other = second[name]
        shape: list[int | str] = []
        for axis, size in enumerate(tensor.shape):
            a, b = int(size), int(other.shape[axis]) if axis < other.dim() else -1
            shape.append(a if a == b else _matching_dim(a, b, first_dims, second_dims))
        shapes[name] = shape
    return shapes


def _matching_dim(a: int, b: int, first: dict[str, int], second: dict[str, int]) -> str:
    pairs = [(name, first[name], second[name]) for name in first if name in second and first[name] != second[name]]
    for name, x, y in pairs:
        if (a, b) == (x, y):
            return name
    for name, x, y in pairs:
        if a % x == 0 and a // x > 1 and b == (a // x) * y:
            return f"{a // x}*{name}"
    for name, x, y in pairs:
        if a - x == b - y and a > x:
            return f"{name}+{a - x}"
    return "dynamic"


def describe(backend: str, files: dict[str, str], inputs: CompileInputs,
             feature_dims: dict[str, dict[int, DimSpec]], feature_names: dict[str, str],
             output_shapes: dict[str, list[int | str]],
             formats: dict[str, str] | None = None,
             constants: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """The ``artifacts`` section: for each file of the backend, its format and ordered inputs/outputs.
    ``feature_dims``: the dynamic dims of every request feature, by graph-input name; ``feature_names``:
    the request name of each graph input that is a request feature (inputs fed from the request carry
    it as ``feature``; the others are outputs of the sparse artifact); ``output_shapes``: the outputs'
    shapes with dims named (``name_dims``); ``formats``: the backend's choice of format for a role, where it
    made one; ``constants``: per role, the tables stored outside its program."""
    features = inputs.example_features
    dense_dims = inputs.dense_dynamic_dims
    outputs, sparse_outputs = inputs.example_outputs, inputs.example_sparse_outputs
    ordered_outputs = [dict(tensor_entry(n, outputs[n]), shape=output_shapes[n]) for n in inputs.output_names]

    def feature_input(name: str, tensor: Tensor, dims: dict[int, DimSpec] | None) -> dict[str, Any]:
        entry = tensor_entry(name, tensor, dims)
        if name in feature_names:
            entry["feature"] = feature_names[name]
        return entry

    out: dict[str, dict[str, Any]] = {}
    for role, relpath in files.items():
        entry: dict[str, Any] = {"file": relpath,
                                 "format": (formats or {}).get(role) or FORMATS.get((backend, role), "unknown")}
        if role == "sparse":
            entry["inputs"] = [feature_input(n, features[n], feature_dims.get(n)) for n in inputs.sparse_input_names]
            entry["outputs"] = [tensor_entry(n, sparse_outputs[n], dense_dims.get(n)) for n in sparse_outputs]
            entry["returns"] = ("a tuple of the outputs in this order" if entry["format"] == "aoti"
                                else "a dict of the outputs by name")
        elif role == "dense":
            entry["inputs"] = [
                feature_input(n, inputs.example_dense_inputs[n], dense_dims.get(n)) if n not in sparse_outputs
                else tensor_entry(n, inputs.example_dense_inputs[n], dense_dims.get(n))
                for n in inputs.dense_input_names
            ]
            entry["outputs"] = ordered_outputs
            entry["returns"] = "a tuple of the outputs in this order"
        elif role == "model":
            entry["inputs"] = [feature_input(n, features[n], feature_dims.get(n)) for n in features]
            entry["outputs"] = ordered_outputs
            entry["returns"] = "a dict of the outputs by name"
        if role in (constants or {}):
            entry["constants"] = constants[role]
        out[role] = entry
    return out


def op_library_files(libraries: list[str]) -> dict[str, dict[str, Any]]:
    return {name: OP_LIBRARY_FILES[name] for name in libraries if name in OP_LIBRARY_FILES}
