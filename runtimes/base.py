"""The backend interface.

A backend turns the dense graph (and says how the sparse graph is stored) into files inside a package,
and loads those files back into a runner. Backends are registered by name in ``runtimes/__init__.py``;
adding one is one file plus one line there.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.fx import GraphModule

from hstu_export.settings import ExportSettings

Features = dict[str, Tensor]
Outputs = dict[str, Tensor]


@dataclass(frozen=True)
class DimSpec:
    """A named dynamic dimension and its range; dims with one name must be equal at run time. With an
    ``offset`` or ``scale`` the dim is derived from the named one (offsets: ``batch + 1``; a feature with
    k values per user: ``k * batch``); min/max are the named dim's."""

    name: str
    min: int
    max: int
    offset: int = 0
    scale: int = 1  # the dim is name * scale + offset (a feature of fixed length k per user: k * batch)


@dataclass
class CompileInputs:
    """Everything a backend needs, independent of how the pipeline produced it."""

    sparse: GraphModule
    dense: GraphModule
    sparse_input_names: list[str]
    dense_input_names: list[str]
    output_names: list[str]
    example_features: Features  # on the export device; every dynamic dim >= 2
    example_dense_inputs: Features  # sparse(example_features) plus passed-through features
    sparse_dynamic_dims: dict[str, dict[int, DimSpec]]
    dense_dynamic_dims: dict[str, dict[int, DimSpec]]
    settings: ExportSettings
    # The whole model as one GraphModule (calls ``sparse`` then ``dense``), for single-artifact backends.
    combined: GraphModule | None = None
    # Top-level packages of the user's code (opaque calls into it run during torch.export).
    user_packages: frozenset[str] = frozenset()
    # What the halves returned on the export example (the manifest describes the artifacts with them).
    example_sparse_outputs: Features = field(default_factory=dict)
    example_outputs: Features = field(default_factory=dict)


@dataclass
class BackendArtifacts:
    """What a backend wrote: files by role (relative paths) and facts for the manifest."""

    files: dict[str, str]
    meta: dict[str, Any] = field(default_factory=dict)
    op_libraries: list[str] = field(default_factory=list)
    # A role's artifact format where the backend chooses it per export (package/artifacts.py FORMATS otherwise).
    formats: dict[str, str] = field(default_factory=dict)
    # A role's constants stored outside its program (``artifacts.<role>.constants``: file, format, tensors).
    constants: dict[str, dict[str, Any]] = field(default_factory=dict)


Runner = Callable[[Features], Outputs]

# The words of the artifacts' range checks after "AssertionError: <feature>" (check_ranges' TorchScript asserts in
# hstu_export/capture/graph_functions.py), and which limit each one means: the runtimes name the feature and the
# limit from them, and word a compiled sparse half's refusals the same way.
RANGE_CHECK_MESSAGES = (
    (" has more rows than the package was exported for", "rows"),
    (" has a value below the exported range", "low"),
    (" has a value beyond the exported range", "high"),
)


@dataclass
class SplitRunner:
    """Runs a package stored as two artifacts: the sparse graph (features -> boundary tensors), then the
    dense one (boundary tensors + passed-through features -> outputs). ``dense`` takes keyword tensors;
    benchmarks call it directly to time the dense part alone."""

    sparse: Runner
    dense: Callable[..., Any]
    passthrough: list[str]
    output_names: list[str]
    # A compiled sparse half's model that runs (runtimes/aoti.py prechecked_applies); None for any other sparse half.
    sparse_model: str | None = None

    def dense_inputs(self, features: Features) -> Features:
        with torch.no_grad():
            inputs = self.sparse(features)
        # The sparse half may return views (a KeyedTensor's per-key slices); compiled dense programs read
        # their inputs as contiguous memory.
        inputs = {name: value.contiguous() for name, value in inputs.items()}
        inputs.update({name: features[name] for name in self.passthrough})
        return inputs

    def __call__(self, features: Features) -> Outputs:
        from hstu_export.runtimes.graph_io import as_output_dict

        inputs = self.dense_inputs(features)
        with torch.no_grad():
            return as_output_dict(self.dense(**inputs), self.output_names)


class Backend(abc.ABC):
    name: str = ""
    description: str = ""
    devices: tuple[str, ...] = ("cpu", "cuda")

    def default_op_target(self, device: torch.device) -> str:
        """The op mapping this backend wants when the user does not choose one."""
        return "triton" if device.type == "cuda" else "aten"

    def check_available(self, settings: ExportSettings) -> None:  # noqa: B027  (optional hook)
        """Raise BackendUnavailableError (one line: what is missing and how to get it) before any work."""

    supports_dryrun: bool = False

    def dryrun(self, inputs: CompileInputs) -> str:
        """A report of how the backend would partition the dense graph, building nothing."""
        raise NotImplementedError(f"the {self.name} backend has no dry run")

    @abc.abstractmethod
    def compile(self, inputs: CompileInputs, out_dir: Path) -> BackendArtifacts:
        """Write this backend's files into ``out_dir`` (the package being built)."""

    @abc.abstractmethod
    def load(self, root: Path, manifest: dict[str, Any], device: torch.device,
             tables_device: torch.device | None = None) -> Runner:
        """A callable features -> outputs over the files ``compile`` wrote. ``tables_device``: where tables stored
        outside their program live (``artifacts.<role>.constants``; None: on ``device``); ``load`` refuses it for
        a package without such tables, so a backend that never writes them ignores it."""


def torch_dynamic_shapes(
    names: list[str], dims: dict[str, dict[int, DimSpec]]
) -> dict[str, dict[int, torch.export.Dim]]:
    """torch.export dynamic_shapes for kwargs ``names``: one Dim object per dim name, so dims that share
    a name are constrained equal."""
    made: dict[str, torch.export.Dim] = {}
    result: dict[str, dict[int, torch.export.Dim]] = {}
    for input_name in names:
        axes = {}
        for axis, spec in dims.get(input_name, {}).items():
            if spec.name not in made:
                made[spec.name] = torch.export.Dim(_identifier(spec.name), min=spec.min, max=spec.max)
            dim = made[spec.name] * spec.scale if spec.scale != 1 else made[spec.name]
            axes[axis] = dim + spec.offset if spec.offset else dim
        result[input_name] = axes
    return result


def _identifier(name: str) -> str:
    out = "".join(c if c.isalnum() else "_" for c in name)
    return out if out[:1].isalpha() else f"d_{out}"
