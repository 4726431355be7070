"""Triton Inference Server Python-backend model for an hstu-export package (copied as ``model.py`` into the
model repository that ``hstu-export serving-repo`` writes; docs/SERVING.md).

Each Triton request carries one request of the package: every feature as a tensor of shape
``[1, n, *trailing]`` (Triton's leading batch dim of 1; ``n`` users, or values for a jagged feature).
The dynamic batcher hands ``execute`` several requests at once; they run in as few package calls as the
package's maximum batch size allows (``hstu_export.serving.batching``), and each gets its own outputs,
``[1, m, *trailing]``, or its own error. Tensors cross by DLPack, so GPU tensors are not copied.

Needs, in the Python environment Triton runs this file with: hstu-export and the torch the package was
exported with (and fbgemm-gpu / torchrec when the package names them). CI runs it in a real server on CPU
(tests/test_triton_server.py; docs/SERVING.md says how the backend's Python finds that environment).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend
from torch.utils import dlpack

import hstu_export
from hstu_export.errors import HstuExportError, RequestError
from hstu_export.serving.batching import BatchingPredictor


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        config = json.loads(args["model_config"])
        parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        package = Path(args["model_repository"]) / args["model_version"] / parameters.get("package", "package")
        if args.get("model_instance_kind") == "GPU":
            torch.cuda.set_device(int(args["model_instance_device_id"]))
        self.batcher = BatchingPredictor(hstu_export.load(package))
        self.inputs = [i["name"] for i in config["input"]]
        self.outputs = [o["name"] for o in config["output"]]

    def execute(self, requests: list[Any]) -> list[Any]:
        batch, responses = [], []
        for request in requests:
            try:
                batch.append({name: _request_tensor(request, name) for name in self.inputs})
            except HstuExportError as exc:
                batch.append(exc)
        ready = [i for i, item in enumerate(batch) if not isinstance(item, HstuExportError)]
        results = dict(zip(ready, self.batcher([batch[i] for i in ready])))
        for index, item in enumerate(batch):
            result = results.get(index, item)
            if isinstance(result, HstuExportError):
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(result))))
                continue
            tensors = [pb_utils.Tensor.from_dlpack(name, dlpack.to_dlpack(result[name].unsqueeze(0).contiguous()))
                       for name in self.outputs]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses


def _request_tensor(request: Any, name: str) -> torch.Tensor:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        raise RequestError(f"request is missing input {name!r}")
    value = dlpack.from_dlpack(tensor.to_dlpack())
    if value.dim() < 1 or value.size(0) != 1:
        raise RequestError(
            f"input {name!r} has shape {list(value.shape)}: send each feature as [1, n, ...] (one request per "
            "Triton batch element)")
    return value[0]
