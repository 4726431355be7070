"""The input dims an AOTInductor program was compiled for, read from Inductor while it compiles.

torch.export hands Inductor each dynamic dim with the range export declared. Inductor can still narrow a range
while it lowers and generates code: a choice it takes on the example's size becomes a fact about the symbol
(``evaluate_min(batch, 3)`` on an example of 3 users holds only while ``batch <= 3``). The program is then
correct only inside the narrower range. AOTInductor checks its inputs against that range only when the process
sets ``AOTI_RUNTIME_CHECK_INPUTS=1``; otherwise it runs past it, and a CUDA program can then stop the whole
process with a device-side assert.

``recording_input_bounds()`` records, for every graph Inductor compiles with a C++ wrapper (the programs of an
AOTInductor package), each input dim's smallest and largest value as that input check computes them.
``narrowed_dims`` compares them with the dims export declared, so export can narrow the package's ranges to what
its programs hold, or refuse a program that does not serve the smallest requests.

This reaches into Inductor (``GraphLowering.codegen_with_cpp_wrapper``, its ``graph_inputs`` and shape
environment). With a torch that lacks them nothing is recorded, and verification's corner batches are then the
only check.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# A dim's smallest and largest size in a compiled program (None: unbounded on that side).
DimBounds = tuple[int | None, int | None]
# Per compiled graph, its inputs in order: per dim, its bounds (None: static); None for an input that is not a
# tensor.
GraphBounds = list[list[DimBounds | None] | None]
# The same keyed by the program's input names.
InputBounds = dict[str, list[DimBounds | None]]
# torch.export traces a dim declared from 1 as at least 2 (the program is still valid for 1): a compiled lower
# bound of 2 is no narrowing.
TRACED_MINIMUM = 2

_lock = threading.Lock()
_recorders: list[list[GraphBounds]] = []
_original: Any = None


def _lowering_class() -> Any | None:
    try:
        from torch._inductor.graph import GraphLowering
        from torch.utils._sympy.value_ranges import bound_sympy  # noqa: F401
    except ImportError:
        return None
    return GraphLowering if hasattr(GraphLowering, "codegen_with_cpp_wrapper") else None


def _bounds_of(size: Any, ranges: Any) -> DimBounds:
    """A size expression's smallest and largest value over the symbols' ``ranges`` (None where unbounded: torch's
    int_oo is no sympy Integer)."""
    import sympy
    from torch.utils._sympy.value_ranges import bound_sympy

    held = bound_sympy(size, ranges)
    low, high = (int(b) if isinstance(b, sympy.Integer) else None for b in (held.lower, held.upper))
    return low, high


def _input_bounds(graph: Any) -> GraphBounds:
    """What AOTInductor's input check would hold each input of ``graph`` to: a dim's bounds over the shape
    environment's ranges, as they stand once the code is generated."""
    import sympy

    ranges = graph.sizevars.shape_env.var_to_range
    bounds: GraphBounds = []
    for value in graph.graph_inputs.values():
        get_size = getattr(value, "get_size", None)
        if get_size is None:
            bounds.append(None)  # a symbolic int input, not a tensor
            continue
        dims: list[DimBounds | None] = []
        for size in get_size():
            if isinstance(size, (int, sympy.Integer)):
                dims.append(None)
                continue
            dims.append(_bounds_of(size, ranges))
        bounds.append(dims)
    return bounds


def named(bounds: GraphBounds, names: list[str]) -> InputBounds:
    """``bounds`` keyed by the program's input names (its user inputs, in order); nothing when they differ in
    number, as they would with an Inductor that passes its inputs otherwise."""
    if len(bounds) != len(names):
        return {}
    return {name: dims for name, dims in zip(names, bounds, strict=True) if dims is not None}


def program_bounds(program: Any, recorded: list[GraphBounds]) -> list[InputBounds]:
    """The graphs recorded while ``program`` (a torch.export ExportedProgram) compiled, keyed by its input names."""
    names = list(program.graph_signature.user_inputs)
    return [named(graph, names) for graph in recorded]


def _install(lowering: Any) -> None:
    global _original
    original = _original = lowering.codegen_with_cpp_wrapper

    def recording(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if not getattr(self, "is_const_graph", False):
            try:
                bounds = _input_bounds(self)
            except Exception:  # an Inductor whose internals differ: no record, verification still checks
                return result
            with _lock:
                for recorder in _recorders:
                    recorder.append(bounds)
        return result

    lowering.codegen_with_cpp_wrapper = recording


# Inductor options every compile of ours starts from; the user's ``--aoti-option`` overrides them. The matmul
# padding pass decides on the example's sizes, and torch 2.11's takes its heuristics' comparisons (``K > M``, the
# arithmetic intensity) on the symbolic sizes themselves: each becomes a guard. A bf16 TorchEasyRec-style model
# at DLRMv3's dims came out compiled for at most the example's 3 users and for at least 1024 candidates
# (benchmarks/investigations/compiled_narrowing.py, on an H200). The pass pads matmul dims that are not a
# multiple of the alignment; an HSTU layer's dims are.
KEEPING_DECLARED_RANGES = {"shape_padding": False}


@contextlib.contextmanager
def recording_input_bounds() -> Iterator[list[GraphBounds]]:
    """While active, every compiled graph's input bounds are appended to the yielded list, in compile order
    (any thread; nested or concurrent uses install the hook once), and Inductor compiles with
    :data:`KEEPING_DECLARED_RANGES`."""
    import torch._inductor.config

    with torch._inductor.config.patch(KEEPING_DECLARED_RANGES), _recording() as recorded:
        yield recorded


@contextlib.contextmanager
def _recording() -> Iterator[list[GraphBounds]]:
    lowering = _lowering_class()
    recorded: list[GraphBounds] = []
    if lowering is None:
        yield recorded
        return
    with _lock:
        if not _recorders:
            _install(lowering)
        _recorders.append(recorded)
    try:
        yield recorded
    finally:
        with _lock:
            _recorders.remove(recorded)
            if not _recorders:
                lowering.codegen_with_cpp_wrapper = _original


@dataclass(frozen=True)
class NarrowedDim:
    """A declared dynamic dim that a compiled program holds to a smaller maximum or a larger minimum."""

    name: str  # the dim's name: "batch" or "<lengths feature>.total"
    bound: str  # "max" or "min"
    declared: int
    compiled: int
    program: str  # "dense", "sparse", ...
    input: str
    axis: int

    def to_json(self) -> dict[str, Any]:
        return {"dim": self.name, "bound": self.bound, "declared": self.declared, "compiled": self.compiled,
                "program": self.program, "input": self.input, "axis": self.axis}


def narrowed_dims(program: str, bounds: list[InputBounds], dims: dict[str, dict[int, Any]]) -> list[NarrowedDim]:
    """Each declared dim (``dims``: input name -> axis -> DimSpec) whose compiled maximum in any of ``bounds`` is
    below the declared one, or whose compiled minimum is above it (and above the traced minimum of 2), at its
    narrowest; the dim as a DimSpec's symbol (``size = scale * symbol + offset``)."""
    found: dict[tuple[str, str], NarrowedDim] = {}

    def note(spec: Any, bound: str, declared: int, compiled: int, name: str, axis: int) -> None:
        key = (spec.name, bound)
        if key not in found or (compiled < found[key].compiled if bound == "max" else compiled > found[key].compiled):
            found[key] = NarrowedDim(spec.name, bound, declared, compiled, program, name, axis)

    for graph in bounds:
        for name, axes in dims.items():
            held = graph.get(name)
            if held is None:
                continue
            for axis, spec in axes.items():
                pair = held[axis] if axis < len(held) else None
                if pair is None:
                    continue
                lower, upper = pair
                if upper is not None and (top := math.floor((upper - spec.offset) / spec.scale)) < spec.max:
                    note(spec, "max", spec.max, top, name, axis)
                if lower is not None and (least := math.ceil((lower - spec.offset) / spec.scale)) > max(
                        spec.min, TRACED_MINIMUM):
                    note(spec, "min", spec.min, least, name, axis)
    return sorted(found.values(), key=lambda d: (d.name, d.bound))


def exported_bounds(program: Any) -> InputBounds:
    """Each user input's dims of ``program`` (a torch.export ExportedProgram) with the range torch.export gave
    them (its ``range_constraints``), in the form of ``recording_input_bounds``' records."""
    import torch

    names = set(program.graph_signature.user_inputs)
    ranges = program.range_constraints
    bounds: InputBounds = {}
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if node.op != "placeholder" or node.name not in names or not isinstance(value, torch.Tensor):
            continue
        dims: list[DimBounds | None] = []
        for size in value.shape:
            if not isinstance(size, torch.SymInt):
                dims.append(None)
                continue
            dims.append(_bounds_of(size.node.expr, ranges))
        bounds[node.name] = dims
    return bounds


def narrower_than_exported(program: str, exported: InputBounds, compiled: list[InputBounds]) -> list[str]:
    """One phrase per input dim a compiled graph holds to a narrower range than torch.export gave it (a compiled
    minimum of 2 where export allowed less is how dims declared from 1 are traced, not a narrowing)."""
    found = []
    for graph in compiled:
        for name, dims in graph.items():
            for axis, (held, declared) in enumerate(zip(dims, exported.get(name, []), strict=False)):
                if held is None or declared is None:
                    continue
                (low, high), (least, most) = held, declared
                if high is not None and (most is None or high < most):
                    found.append(f"{name} dim {axis} at most {high} (exported for {most})")
                if low is not None and low > max(least or 0, TRACED_MINIMUM):
                    found.append(f"{name} dim {axis} at least {low} (exported for {least})")
    return [f"AOTInductor compiled the {program} program for {phrase}" for phrase in dict.fromkeys(found)]


def refuse_narrowed(program: str, exported: Any, recorded: list[GraphBounds]) -> None:
    """Raise ExportError, in one line, when a program compiled while ``recording_input_bounds`` recorded
    ``recorded`` holds an input dim to a narrower range than torch.export gave it (``exported``): for programs
    whose ranges export cannot narrow, such as the KV cache's."""
    from hstu_export.errors import ExportError

    found = narrower_than_exported(program, exported_bounds(exported), program_bounds(exported, recorded))
    if found:
        raise ExportError(f"{found[0]}: it would be served past what it was compiled for; nothing was written "
                          "(export without --kv-cache)")
