"""FX tracing of a model whose forward takes one dict of named tensors.

``HstuTracer`` only decides which modules stay opaque (leaves); the list is data: the torchrec
embedding modules by default, plus whatever the user names (a class name, bare or dotted, or a
submodule path). ``trace`` turns the model's single ``features`` dict into one placeholder per feature,
named exactly as the feature, so ``gm(**batch)`` computes ``model(batch)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import torch.fx
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.fx._symbolic_trace import PHWithMeta

from hstu_export.errors import ConfigError, TraceError
from hstu_export.graph_functions import WRAPPED_FUNCTIONS

# Modules holding embedding tables: the sparse side of the split. Their forward takes a
# KeyedJaggedTensor and runs data-dependent lookups, so they are also leaves of the trace.
EMBEDDING_MODULES: tuple[str, ...] = (
    "torchrec.modules.embedding_modules.EmbeddingCollection",
    "torchrec.modules.embedding_modules.EmbeddingBagCollection",
    "torchrec.modules.fp_embedding_modules.FeatureProcessedEmbeddingBagCollection",
    "torchrec.modules.mc_embedding_modules.ManagedCollisionEmbeddingCollection",
    "torchrec.modules.mc_embedding_modules.ManagedCollisionEmbeddingBagCollection",
)
DEFAULT_LEAF_MODULES: tuple[str, ...] = EMBEDDING_MODULES


def module_matches(module: nn.Module, path: str, specs: Iterable[str]) -> bool:
    """Whether ``module`` (at submodule ``path``) is named by one of ``specs``: a submodule path, or a
    class name, bare (``EmbeddingCollection``) or dotted, of its class or any base class."""
    names: set[str] = {path}
    for cls in type(module).__mro__:
        names.add(cls.__name__)
        names.add(f"{cls.__module__}.{cls.__qualname__}")
    return any(spec in names for spec in specs)


class HstuTracer(torch.fx.Tracer):
    """``torch.fx.Tracer`` whose only job is leaf decisions (and remembering where tracing failed)."""

    def __init__(self, leaf_modules: Sequence[str] = ()) -> None:
        super().__init__(autowrap_functions=WRAPPED_FUNCTIONS)
        self.leaf_modules: tuple[str, ...] = (*DEFAULT_LEAF_MODULES, *leaf_modules)
        # (exception, module path, class name) of the innermost module a failure came out of.
        self.failure: tuple[BaseException, str, str] | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_matches(m, module_qualified_name, self.leaf_modules) or super().is_leaf_module(
            m, module_qualified_name
        )

    def call_module(
        self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as exc:
            # The first frame to see an exception is the innermost module.
            if self.failure is None or self.failure[0] is not exc:
                try:
                    path = self.path_of_module(m)
                except NameError:
                    path = "?"
                self.failure = (exc, path, type(m).__name__)
            raise


def trace(
    model: nn.Module, example_batch: dict[str, Tensor], leaf_modules: Sequence[str] = ()
) -> torch.fx.GraphModule:
    """Symbolically traces ``model`` (forward takes one dict of named tensors).

    The graph module takes one argument per feature, named as the feature, in the order of the model's
    ``input_schema().names`` (else the example batch's key order); every feature is an input even if
    unused. Outputs keep the model's structure (a dict of tensors). ``leaf_modules`` names extra modules
    to keep opaque: class names (bare or dotted) or submodule paths.
    """
    names = _feature_names(model, example_batch)
    leaf_modules = tuple(leaf_modules)
    _check_leaf_specs(model, leaf_modules)
    arg_name = _single_dict_argument(model)
    tracer = HstuTracer(leaf_modules)
    features = {name: PHWithMeta(ph_key=name) for name in names}
    try:
        graph = tracer.trace(model, concrete_args={arg_name: features})
    except Exception as exc:
        raise TraceError(_trace_failure_message(model, tracer, exc)) from exc
    flat = _flatten_inputs(graph, names)
    gm = torch.fx.GraphModule(tracer.root, flat, class_name=type(model).__name__)
    gm.meta["input_names"] = list(names)
    gm.meta["leaf_modules"] = list(tracer.leaf_modules)
    return gm


def _feature_names(model: nn.Module, example_batch: dict[str, Tensor]) -> list[str]:
    if not isinstance(example_batch, dict) or not example_batch:
        raise TraceError("the example batch must be a non-empty dict of named tensors")
    schema_fn = getattr(model, "input_schema", None)
    if not callable(schema_fn):
        names = list(example_batch)
    else:
        names = list(schema_fn().names)
        missing = [n for n in names if n not in example_batch]
        extra = [n for n in example_batch if n not in names]
        if missing or extra:
            raise TraceError(
                f"the example batch does not fit {type(model).__name__}'s input schema "
                f"(missing {missing}, unknown {extra}); build it with hstu_export.generate_batch"
            )
    bad = [n for n in names if not n.isidentifier()]
    if bad:
        raise TraceError(f"feature names {bad} are not Python identifiers; they cannot be graph inputs")
    return names


def _single_dict_argument(model: nn.Module) -> str:
    params = [
        p for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]  # fmt: skip
    required = [p for p in params if p.default is p.empty]
    if len(params) < 1 or len(required) > 1:
        raise TraceError(
            f"{type(model).__name__}.forward must take one dict of named tensors, "
            f"it takes ({', '.join(p.name for p in params)})"
        )
    return params[0].name


def _check_leaf_specs(model: nn.Module, specs: Sequence[str]) -> None:
    modules = list(model.named_modules())
    unmatched = [s for s in specs if not any(module_matches(m, path, [s]) for path, m in modules)]
    if unmatched:
        raise ConfigError(
            f"leaf module(s) {unmatched} match no submodule class or path of {type(model).__name__}; "
            "give a class name (e.g. STULayer) or a path (e.g. transducer.stu.layers.0)"
        )


def _trace_failure_message(model: nn.Module, tracer: HstuTracer, exc: BaseException) -> str:
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    failure = tracer.failure
    if failure is not None and failure[0] is exc:
        _, path, cls = failure
        where = f"module '{path}' ({cls})"
    else:
        cls = type(model).__name__
        where = f"the forward of {cls} itself"
    return (
        f"cannot trace {type(model).__name__}: {where} failed: {type(exc).__name__}: {reason}. "
        f"If {cls} has data-dependent Python control flow or other untraceable code, keep it opaque "
        f"with --leaf-module {cls} (leaf_modules=[{cls!r}] in the Python API)"
    )


def _flatten_inputs(graph: torch.fx.Graph, names: list[str]) -> torch.fx.Graph:
    """Copies ``graph`` with plain placeholders named as the features instead of a pytree codegen."""
    codegen = graph._codegen
    out_spec = getattr(getattr(codegen, "pytree_info", None), "out_spec", None)
    old_placeholders = {n.ph_key: n for n in graph.nodes if n.op == "placeholder"}  # type: ignore[attr-defined]
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for name in names:
        node = new.placeholder(name)
        if node.name != name:  # the namespace renamed it (a Python builtin or keyword)
            raise TraceError(f"feature name {name!r} cannot be a graph input name (it shadows a builtin)")
        if name in old_placeholders:
            env[old_placeholders[name]] = node
            node.meta = dict(old_placeholders[name].meta)
    for node in graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            flat = torch.fx.map_arg(node.args[0], lambda n: env[n])
            result = pytree.tree_unflatten(list(flat), out_spec) if out_spec is not None else flat
            new.output(result)
            continue
        env[node] = new.node_copy(node, lambda n: env[n])
    return new
