"""What a package calls its outputs, and which of them are scores.

:mod:`hstu_export.sources.outputs` names what ``forward`` returns by its structure (dict keys, namedtuple
and dataclass fields, ``output_<i>`` for tuple positions). An :class:`OutputPlan` then gives the package's
outputs, in order, each taken from one of those:

- one output per task: a model that lists its tasks (objects with a ``task_name``, such as
  generative-recommenders' ``TaskConfig``s in ``DlrmHSTU._multitask_configs``) and returns one tensor of
  ``[tasks, candidates]`` (or ``[candidates, tasks]``) predictions serves each task as an output of its
  own, named for the task;
- renamed: ``ExportSettings.output_names`` / ``--output-names`` (``{"output_0": "user_embeddings"}``), or
  ``output_names`` in the model's export hints;
- a kind: ``probability`` (a per-candidate score in [0, 1]: a binary-classification task), ``score`` (a
  per-candidate score ranked by, not a probability: a regression task), ``embedding`` (a vector per row)
  or ``other``. Declared by the model (its task types, ``output_kinds`` in its hints) or the user
  (``--score-outputs``); when neither declares any score, read from the output's dims at export: one
  value per row of a batch or of a jagged feature is a score.

Verification holds scores to the quantization tolerances and ranks them per user; other outputs to
relative error (docs/QUANTIZATION.md). The plan is recorded in the manifest (``outputs``), so the model
can be called and named the same way later (``hstu-export verify``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import Tensor, nn

from hstu_export.errors import ConfigError
from hstu_export.package.manifest import OUTPUT_KINDS, SCORE_KINDS
from hstu_export.package.tensor_dir import file_name

# The C++ runtime writes each output to <encoded name>.pt, staged as <encoded name>.pt.partial: a name
# must fit one file name (255 bytes on the usual file systems) in that form.
MAX_FILE_NAME = 255 - len(".partial")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class PlannedOutput:
    """One output of the package: ``source`` (the model's output by :mod:`hstu_export.sources.outputs`'
    rule), whole or, with ``index``, its slice ``index`` along ``dim`` (one task of a predictions tensor)."""

    name: str
    source: str
    dim: int | None = None
    index: int | None = None
    kind: str | None = None  # declared; None: read from the output's dims at export
    kind_from: str | None = None  # "model" (its tasks or hints) or "user" (--score-outputs)


@dataclass(frozen=True)
class OutputPlan:
    outputs: tuple[PlannedOutput, ...]
    # Some output's kind is a declared score: the others are then no score, whatever their dims.
    scores_declared: bool = False
    tasks_from: str | None = None  # the model attribute the tasks were read from (for the record)

    @property
    def names(self) -> list[str]:
        return [o.name for o in self.outputs]

    @property
    def keeps_model_names(self) -> bool:
        """Whether every output is the model's own, whole, under its own name."""
        return all(o.name == o.source and o.index is None for o in self.outputs)

    def apply(self, flat: dict[str, Any]) -> dict[str, Any]:
        """The model's flattened outputs named as the package's (an output the model left out stays out)."""
        named = {}
        for o in self.outputs:
            if o.source in flat:
                value = flat[o.source]
                named[o.name] = value if o.index is None else value.select(o.dim, o.index)
        return named

    def wrap(self, run: Callable[[Any], dict[str, Tensor]]) -> Callable[[Any], dict[str, Tensor]]:
        """``run`` (the model on a batch, outputs flattened) with its outputs named by this plan."""
        return lambda batch: self.apply(run(batch))

    def apply_to_graph(self, gm: torch.fx.GraphModule) -> None:
        """Rewrites the traced graph's output (a flat ``{name: node}`` dict) to the package's outputs."""
        graph = gm.graph
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        flat = output.args[0]
        named: dict[str, Any] = {}
        with graph.inserting_before(output):
            for o in self.outputs:
                node = flat[o.source]
                named[o.name] = node if o.index is None else graph.call_function(torch.select, (node, o.dim, o.index))
        output.args = (named,)
        gm.recompile()
        gm.meta["output_names"] = list(named)

    def describe(self, dims: dict[str, list[int | str]], examples: dict[str, Tensor]) -> list[dict[str, Any]]:
        """The manifest's ``outputs``: per output its name, kind, how the kind was known, and the model
        output it is taken from. ``dims`` are the outputs' named dims, ``examples`` one value of each."""
        described = []
        for o in self.outputs:
            if o.kind is not None:
                kind, how = o.kind, o.kind_from
            else:
                kind, how = kind_from_dims(dims.get(o.name), examples.get(o.name), self.scores_declared), "shape"
            entry: dict[str, Any] = {"name": o.name, "kind": kind, "kind_from": how, "model_output": o.source}
            if o.index is not None:
                entry.update(dim=o.dim, index=o.index)
            described.append(entry)
        return described

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> OutputPlan | None:
        """The plan a package was exported with (its manifest's ``outputs``); None for a package written
        before outputs were recorded (its outputs are the model's, named by their structure)."""
        entries = manifest.get("outputs")
        if not entries:
            return None
        return cls(tuple(PlannedOutput(e["name"], e["model_output"], e.get("dim"), e.get("index"), e["kind"],
                                       e.get("kind_from")) for e in entries))


def kind_from_dims(dims: list[int | str] | None, value: Tensor | None, scores_declared: bool) -> str:
    """An output's kind from its named dims: one floating value per row of a batch or a jagged feature
    (``[X.total]``, ``[batch]``, optionally ``[.., 1]``; or ``[batch, candidates]``) is a score, unless
    the model or the user declared which outputs are; a row of static width is an embedding."""
    if not dims or value is None or not value.is_floating_point():
        return "other"
    per_row = isinstance(dims[0], str)
    if per_row and not scores_declared and (len(dims) == 1 or (len(dims) == 2 and (dims[1] == 1 or isinstance(dims[1], str)))):
        return "score"
    if per_row and len(dims) >= 2 and isinstance(dims[-1], int) and dims[-1] >= 2:
        return "embedding"
    return "other"


# -- planning --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # probability | score


def model_tasks(model: nn.Module) -> tuple[str, list[Task]] | None:
    """The tasks a model lists: an attribute of it or of a submodule holding a list of objects with a
    string ``task_name`` (``DlrmHSTU._multitask_configs``). Their ``task_type`` gives the kind: a binary
    classification is a probability, anything else a score. None when no list, or lists that disagree."""
    found: dict[tuple[str, ...], tuple[str, list[Task]]] = {}
    for path, module in model.named_modules():
        for attr, value in vars(module).items():
            if not (isinstance(value, (list, tuple)) and value
                    and all(isinstance(getattr(t, "task_name", None), str) for t in value)):
                continue
            names = tuple(t.task_name for t in value)
            found.setdefault(names, (f"{path}.{attr}" if path else attr,
                                     [Task(t.task_name, _task_kind(getattr(t, "task_type", None))) for t in value]))
    return next(iter(found.values())) if len(found) == 1 else None


def _task_kind(task_type: Any) -> str:
    text = str(getattr(task_type, "name", task_type)).upper()
    return "probability" if "BINARY" in text or "CLASSIF" in text else "score"


def _task_axis(value: Tensor, other: Tensor | None, count: int) -> int | None:
    """The axis of a 2-D predictions tensor that holds ``count`` tasks while the other follows the batch:
    ``other`` (the same output on a batch of other sizes) keeps that axis and changes the other one. Without
    ``other`` nothing tells a task axis from a batch that happens to have ``count`` rows: None."""
    if not (isinstance(value, Tensor) and isinstance(other, Tensor) and value.dim() == other.dim() == 2
            and value.is_floating_point()):
        return None
    for axis in (0, 1):
        rows = 1 - axis
        if value.size(axis) == other.size(axis) == count and other.size(rows) != value.size(rows):
            return axis
    return None


def plan_outputs(model: nn.Module, example: dict[str, Tensor], other: dict[str, Tensor] | None, *,
                 renames: dict[str, str], score_outputs: tuple[str, ...] = (), declared_kinds: dict[str, str] | None = None,
                 reserved: tuple[str, ...] = ()) -> OutputPlan:
    """The package's outputs for a model whose flattened outputs are ``example`` (on the export example) and
    ``other`` (on a batch of other sizes, or None). ``renames`` and ``declared_kinds`` come from the model's
    hints and the settings, ``score_outputs`` from the settings; ``reserved`` are names outputs may not
    take (the request's features). ConfigError names what is wrong."""
    declared_kinds = dict(declared_kinds or {})
    outputs: list[PlannedOutput] = []
    tasks = model_tasks(model)
    split_source, tasks_from = None, None
    if tasks is not None:
        where, listed = tasks
        axes = {name: axis for name, value in example.items()
                if (axis := _task_axis(value, (other or {}).get(name), len(listed))) is not None}
        if len(axes) == 1:
            split_source, axis = next(iter(axes.items()))
            tasks_from = where
    for source in example:
        if source == split_source:
            outputs += [PlannedOutput(t.name, source, axis, i, _checked_probability(t.kind, example[source], axis, i), "model")
                        for i, t in enumerate(listed)]
        else:
            outputs.append(PlannedOutput(source, source))
    outputs = _renamed(outputs, renames, split_source)
    names = [o.name for o in outputs]
    for name in names:
        check_output_name(name, reserved)
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"output name(s) {', '.join(map(repr, dup))} given to more than one output "
                          f"(outputs: {', '.join(names)}); each output needs a name of its own (--output-names)")
    outputs = _with_kinds(outputs, score_outputs, declared_kinds)
    scores_declared = any(o.kind in SCORE_KINDS for o in outputs)
    return OutputPlan(tuple(outputs), scores_declared, tasks_from)


def _checked_probability(kind: str, value: Tensor, axis: int, index: int) -> str:
    """A task declared binary whose predictions leave [0, 1] on the example returns logits: a score."""
    if kind != "probability":
        return kind
    row = value.select(axis, index).detach()
    return kind if bool(((row >= 0) & (row <= 1)).all()) else "score"


def _renamed(outputs: list[PlannedOutput], renames: dict[str, str], split_source: str | None) -> list[PlannedOutput]:
    known = [o.name for o in outputs]
    for old in renames:
        if old == split_source and old not in known:
            tasks = ", ".join(o.name for o in outputs if o.source == old)
            raise ConfigError(f"--output-names {old}: the model's {old} is served as one output per task ({tasks}); "
                              "rename those instead")
        if old not in known:
            raise ConfigError(f"--output-names {old}=...: the model has no output {old!r}; its outputs are "
                              f"{', '.join(known)}")
    return [PlannedOutput(renames.get(o.name, o.name), o.source, o.dim, o.index, o.kind, o.kind_from) for o in outputs]


def _with_kinds(outputs: list[PlannedOutput], score_outputs: tuple[str, ...],
                declared: dict[str, str]) -> list[PlannedOutput]:
    """Kinds the user (``score_outputs``, by the package's name or the model's) and the model's hints
    (``declared``) give, over what the model's tasks say."""
    by_name = {o.name: o for o in outputs}
    by_source = {o.source: o for o in outputs if o.index is None}

    def find(name: str, what: str) -> PlannedOutput:
        found = by_name.get(name) or by_source.get(name)
        if found is None:
            raise ConfigError(f"{what} {name}: no output of the model is called {name!r}; its outputs are "
                              f"{', '.join(by_name)}")
        return found

    kinds: dict[str, tuple[str, str]] = {}
    for name, kind in declared.items():
        if kind not in OUTPUT_KINDS:
            raise ConfigError(f"output kind {kind!r} for {name}: use one of {', '.join(OUTPUT_KINDS)}")
        kinds[find(name, "output kind for").name] = (kind, "model")
    for name in score_outputs:
        o = find(name, "--score-outputs")
        known = kinds.get(o.name, (o.kind, o.kind_from))[0]
        kinds[o.name] = ("probability" if known == "probability" else "score", "user")
    return [PlannedOutput(o.name, o.source, o.dim, o.index, *kinds.get(o.name, (o.kind, o.kind_from)))
            for o in outputs]


def check_output_name(name: Any, reserved: tuple[str, ...] = ()) -> None:
    """ConfigError unless both runtimes can carry ``name`` as an output: a non-empty string without
    control characters (manifests refuse them) whose file (``<percent-encoded name>.pt``, as the C++
    runtime and ``hstu-export run --output-dir`` write it) fits a file name, and no request feature's."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"output name {name!r}: an output needs a non-empty name")
    if _CONTROL.search(name):
        raise ConfigError(f"output name {name!r} contains a control character; use letters, digits, '_', '.' or '-'")
    if len(file_name(name)) > MAX_FILE_NAME:
        raise ConfigError(f"output name {name[:40]!r}... is too long: its file, {file_name(name)[:40]}..., would exceed "
                          f"{MAX_FILE_NAME} bytes; shorten it")
    if name in reserved:
        raise ConfigError(f"output name {name!r} is a request feature's name; give the output another one")
