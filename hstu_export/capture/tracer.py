"""FX tracing of a model as its authors wrote it.

``HstuTracer`` decides leaves (the leaf list is data: torchrec's embedding modules by default, plus
what the user or the model's hints name) and builds the graph's inputs from the input schema: one
placeholder per request feature, assembled into the model's own arguments (KeyedJaggedTensors,
JaggedTensors and KeyedTensors with known keys, dicts, tensors, records such as TorchEasyRec's ``Batch``
holding proxies in their fields, or the zoo's single dict). ``trace`` retries a failing trace with the
failing user function kept opaque (see :mod:`hstu_export.capture.opaque`) and flattens the outputs
into a dict of named tensors, so ``gm(**graph_inputs)`` computes ``flatten_outputs(model(...))``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch.fx
from torch import Tensor, nn
from torchrec.fx.tracer import Tracer as TorchrecTracer

from hstu_export.capture.graph_functions import (
    WRAPPED_FUNCTIONS,
    build_jt,
    build_kjt,
    build_kt,
    build_weighted_jt,
    build_weighted_kjt,
)
from hstu_export.capture.opaque import (
    OpaqueCall,
    failure_location,
    find_culprit,
    patched_user_code,
    user_packages,
)
from hstu_export.capture.proxies import (
    InputJTProxy,
    InputKJTProxy,
    InputKTProxy,
    KeyedProxy,
    embedding_output_keys,
    kjt_proxy_factory,
)
from hstu_export.errors import ConfigError, TraceError
from hstu_export.package.schema import (
    ArgumentSpec,
    InputSchema,
    jt_feature_names,
    kjt_feature_names,
    make_record,
    record_class,
)
from hstu_export.sources.hints import model_hints, resolve_callable
from hstu_export.sources.outputs import named_fields, output_items

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
MAX_OPAQUE_RETRIES = 24


def module_matches(module: nn.Module, path: str, specs: Iterable[str]) -> bool:
    """Whether ``module`` (at submodule ``path``) is named by one of ``specs``: a submodule path, or a
    class name, bare (``EmbeddingCollection``) or dotted, of its class or any base class."""
    names: set[str] = {path}
    for cls in type(module).__mro__:
        names.add(cls.__name__)
        names.add(f"{cls.__module__}.{cls.__qualname__}")
    return any(spec in names for spec in specs)


class HstuTracer(TorchrecTracer):
    """torchrec's tracer (its KJT handling and tracing flag) plus our leaf list, graph inputs from the
    input schema, and proxies that keep KJT keys known."""

    def __init__(self, leaf_modules: Sequence[str] = (), schema: InputSchema | None = None,
                 input_names: Sequence[str] | None = None) -> None:
        super().__init__()
        self._autowrap_function_ids.update(id(f) for f in WRAPPED_FUNCTIONS)
        self.leaf_modules: tuple[str, ...] = (*DEFAULT_LEAF_MODULES, *leaf_modules)
        self.schema = schema
        self.input_names = list(input_names) if input_names is not None else None
        # (exception, module path, class name) of the innermost module a failure came out of.
        self.failure: tuple[BaseException, str, str] | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_matches(m, module_qualified_name, self.leaf_modules) or torch.fx.Tracer.is_leaf_module(
            self, m, module_qualified_name
        )

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            result = super().call_module(m, forward, args, kwargs)
        except Exception as exc:
            # The first frame to see an exception is the innermost module.
            if self.failure is None or self.failure[0] is not exc:
                try:
                    path = self.path_of_module(m)
                except NameError:
                    path = "?"
                self.failure = (exc, path, type(m).__name__)
            raise
        if isinstance(result, torch.fx.Proxy) and result.node.op == "call_module":
            known = embedding_output_keys(m)
            if known is not None:
                kind, keys = known
                return KeyedProxy(result.node, self, keys, kind)
        return result

    def create_proxy(self, kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                     name: str | None = None, type_expr: Any | None = None,
                     proxy_factory_fn: Any = None) -> Any:
        if proxy_factory_fn is None:
            proxy_factory_fn = kjt_proxy_factory(self, kind, target, args, kwargs)
        return super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)

    def create_args_for_root(self, root_fn: Any, is_module: bool, concrete_args: Any = None) -> tuple[Any, list[Any]]:
        if self.schema is None and self.input_names is None:
            return super().create_args_for_root(root_fn, is_module, concrete_args)
        args: list[Any] = [self.root] if is_module else []
        if self.schema is None:  # a forward(features) model with no schema: names from the example batch
            args.append({n: self._placeholder(n, n) for n in self.input_names or ()})
            return root_fn, args
        features = {f.name: self._placeholder(f.name, f.graph_name) for f in self.schema.features}
        if not self.schema.arguments:
            args.append(features)
            return root_fn, args
        values = {a.name: self._argument(a, features) for a in self.schema.arguments if not a.optional_absent}
        bound = _bind_forward(root_fn, values, skip_self=is_module)

        def call(*leading: Any) -> Any:
            return root_fn(*leading, **bound)

        return call, args

    def _placeholder(self, name: str, graph_name: str) -> Any:
        proxy = self.create_proxy("placeholder", graph_name, (), {})
        if proxy.node.name != graph_name:
            raise TraceError(f"feature name {name!r} cannot be a graph input name (it shadows a Python builtin)")
        return proxy

    def _argument(self, arg: ArgumentSpec, features: dict[str, Any], path: str | None = None) -> Any:
        """The traced value of one argument (or part of one, at ``path``): request placeholders assembled
        as the model's own structure, with proxies that keep keys known."""
        path = arg.name if path is None else path
        if arg.kind == "tensor":
            return features[path]
        if arg.kind == "none":
            return None
        if arg.kind == "constant":
            return arg.value
        if arg.kind == "record":
            values = {f.name: self._argument(f, features, f"{path}.{f.name}") for f in arg.fields
                      if f.kind != "default"}
            return make_record(record_class(arg, path), values)
        if arg.kind == "dict":
            if arg.fields:
                return {f.name: self._argument(f, features, f"{path}.{f.name}") for f in arg.fields}
            return {key: features[f"{path}.{key}"] for key in arg.keys}
        if arg.kind == "jt":
            names = jt_feature_names(path, arg.weighted)
            parts = [features[n] for n in names]
            target = build_weighted_jt if arg.weighted else build_jt
            weights = parts[2] if arg.weighted else None
            return self.create_proxy("call_function", target, tuple(parts), {},
                                     proxy_factory_fn=lambda node: InputJTProxy(node, self, parts[0], parts[1], weights))
        if arg.kind == "kt":
            keys = list(arg.keys)
            tensors = [features[f"{path}.{key}"] for key in keys]
            dims = [self.schema.get(f"{path}.{key}").trailing[0] for key in keys]  # type: ignore[union-attr]
            return self.create_proxy("call_function", build_kt, (keys, tensors), {},
                                     proxy_factory_fn=lambda node: InputKTProxy(node, self, keys, tensors, dims))
        names = [kjt_feature_names(path, key, arg.weighted) for key in arg.keys]
        keys = list(arg.keys)
        values = [features[n[0]] for n in names]
        lengths = [features[n[1]] for n in names]
        weights = [features[n[2]] for n in names] if arg.weighted else None
        if weights is None:
            target, call_args = build_kjt, (keys, values, lengths)
        else:
            target, call_args = build_weighted_kjt, (keys, values, lengths, weights)
        return self.create_proxy(
            "call_function", target, call_args, {},
            proxy_factory_fn=lambda node: InputKJTProxy(node, self, keys, values, lengths, weights),
        )


def _bind_forward(root_fn: Any, values: dict[str, Any], skip_self: bool) -> dict[str, Any]:
    params = list(inspect.signature(inspect.unwrap(root_fn)).parameters.values())[1 if skip_self else 0:]
    bound: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in values:
            bound[p.name] = values.pop(p.name)
        elif p.default is p.empty:
            raise TraceError(f"forward parameter {p.name!r} has no input in the schema and no default")
    if values:
        raise TraceError(f"the input schema has argument(s) {sorted(values)} that forward does not take")
    return bound


def trace(
    model: nn.Module,
    example_batch: dict[str, Tensor] | None = None,
    leaf_modules: Sequence[str] = (),
    *,
    schema: InputSchema | None = None,
    opaque_functions: Sequence[Any] = (),
) -> torch.fx.GraphModule:
    """Symbolically traces ``model``.

    The graph module takes one argument per request feature, named by the feature's graph name, in
    schema order; every feature is an input even if unused. Its output is a flat dict of named
    tensors (see :mod:`hstu_export.sources.outputs`). The schema is ``schema``, else ``model.input_schema()``,
    else (for a model whose forward takes one dict of tensors) the example batch's keys.
    ``leaf_modules`` names extra modules to keep opaque (class names, bare or dotted, or submodule
    paths); ``opaque_functions`` extra functions to record as single calls (callables or
    ``module.function`` names). Functions that fail to trace are made opaque automatically and listed
    in ``gm.meta["opaque_calls"]``.
    """
    schema, input_names = _resolve_inputs(model, example_batch, schema)
    leaf_modules = tuple(leaf_modules)
    _check_leaf_specs(model, leaf_modules)
    hints = model_hints(model)
    leaves = [*leaf_modules, *hints.leaf_modules]
    functions = [resolve_callable(f) for f in (*opaque_functions, *hints.opaque_functions)]
    packages = user_packages(model) | {f.__module__.partition(".")[0] for f in functions if hasattr(f, "__module__")}
    methods: list[tuple[type, str]] = []
    opaque: list[OpaqueCall] = []
    state = _module_state(model)
    for _ in range(MAX_OPAQUE_RETRIES):
        tracer = HstuTracer(leaves, schema, input_names)
        try:
            with patched_user_code(packages, functions, methods):
                graph = tracer.trace(model)
            break
        except Exception as exc:
            _restore_module_state(model, state)
            opaque.append(_keep_opaque(exc, model, tracer, functions, methods, leaves))
    else:
        raise TraceError(f"cannot trace {type(model).__name__}: still failing after keeping "
                         f"{len(opaque)} functions opaque ({', '.join(o.name for o in opaque[-3:])}, ...)")
    _restore_module_state(model, state)
    _built_outputs_as_fields(graph)
    if example_batch is not None:
        _expand_container_outputs(tracer.root, graph, _graph_inputs(schema, example_batch))
    graph = _flat_outputs(graph)
    gm = torch.fx.GraphModule(tracer.root, graph, class_name=type(model).__name__)
    gm.meta["input_names"] = [n for n in (schema.graph_names if schema else input_names or [])]
    gm.meta["schema"] = schema
    gm.meta["leaf_modules"] = list(tracer.leaf_modules)
    gm.meta["opaque_calls"] = [o.to_json() for o in opaque]
    gm.meta["user_packages"] = sorted(packages)
    gm.meta["output_names"] = list(next(n for n in graph.nodes if n.op == "output").args[0])
    return gm


def _keep_opaque(exc: Exception, model: nn.Module, tracer: HstuTracer, functions: list[Any],
                 methods: list[tuple[type, str]], leaves: list[str]) -> OpaqueCall:
    """Chooses what to keep opaque after a failed trace (and records it), or raises TraceError."""
    culprit = find_culprit(exc, model)
    reason = _first_line(exc)
    if culprit.kind == "function" and culprit.target not in functions:
        functions.append(culprit.target)
        return OpaqueCall("function", culprit.name, reason, culprit.where)
    if culprit.kind == "method":
        cls, name, owner = culprit.target
        if owner is not model and (cls, name) not in methods and _path_of(model, owner) is not None:
            methods.append((cls, name))
            return OpaqueCall("method", culprit.name, reason, culprit.where)
    if culprit.kind == "module" and culprit.target is not model:
        path = _path_of(model, culprit.target)
        embeds = [p for p, m in culprit.target.named_modules() if module_matches(m, p, EMBEDDING_MODULES)]
        if path is not None and not embeds and path not in leaves:
            leaves.append(path)
            return OpaqueCall("module", path, reason, culprit.where)
    raise TraceError(_trace_failure_message(model, tracer, exc, culprit.where)) from exc


def _path_of(root: nn.Module, module: nn.Module) -> str | None:
    return next((p for p, m in root.named_modules() if m is module and p), None)


def _resolve_inputs(model: nn.Module, example_batch: Any, schema: InputSchema | None
                    ) -> tuple[InputSchema | None, list[str] | None]:
    if schema is None:
        schema_fn = getattr(model, "input_schema", None)
        schema = schema_fn() if callable(schema_fn) else None
    if schema is None:
        if not isinstance(example_batch, dict) or not example_batch:
            raise TraceError(
                f"{type(model).__name__} has no input schema: pass schema= (see hstu_export.infer_schema) or, "
                "for a forward that takes one dict of tensors, an example batch"
            )
        _single_dict_argument(model)
        names = list(example_batch)
        bad = [n for n in names if not n.isidentifier()]
        if bad:
            raise TraceError(f"feature names {bad} are not Python identifiers; they cannot be graph inputs")
        return None, names
    if not schema.arguments:
        _single_dict_argument(model)
    if example_batch is not None:
        missing = [n for n in schema.names if n not in example_batch]
        extra = [n for n in example_batch if n not in schema.names]
        if missing or extra:
            raise TraceError(
                f"the example batch does not fit {type(model).__name__}'s input schema "
                f"(missing {missing}, unknown {extra}); build it with hstu_export.generate_batch"
            )
    return schema, None


def _single_dict_argument(model: nn.Module) -> str:
    params = [
        p for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]  # fmt: skip
    required = [p for p in params if p.default is p.empty]
    if len(params) < 1 or len(required) > 1:
        raise TraceError(
            f"{type(model).__name__}.forward takes ({', '.join(p.name for p in params)}); give its input "
            "schema (hstu_export.infer_schema from an example in the model's own format) to trace it"
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


def _first_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _trace_failure_message(model: nn.Module, tracer: HstuTracer, exc: BaseException, where: str) -> str:
    failure = tracer.failure
    if failure is not None and failure[0] is exc:
        _, path, cls = failure
        module = f"module '{path}' ({cls})"
    else:
        cls = type(model).__name__
        module = f"the forward of {cls} itself"
    where = where if where != "?" else failure_location(exc)
    return (
        f"cannot trace {type(model).__name__}: {module} failed at {where}: {_first_line(exc)}. "
        f"Move the untraceable code into a module-level function (it is then kept as one opaque call), "
        f"or keep the module opaque with --leaf-module {cls} (leaf_modules=[{cls!r}]) if it holds no "
        "embedding tables"
    )


def _module_state(model: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
    return [(m, dict(m.__dict__)) for m in model.modules()]


def _restore_module_state(model: nn.Module, state: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    """Undo attribute assignments that model code made while being traced (e.g. a KV cache set to a
    proxy): tracing must leave the user's model as it was."""
    for module, saved in state:
        current = module.__dict__
        # The tracer's own additions stay: tensor constants the graph reads with get_attr.
        for key in [k for k in current if k not in saved and not k.startswith("_tensor_constant")]:
            del current[key]
        for key, value in saved.items():
            if current.get(key, _UNSET) is not value:
                current[key] = value


_UNSET = object()


def _graph_inputs(schema: InputSchema | None, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    return schema.to_graph_inputs(batch) if schema is not None else dict(batch)


def _built_outputs_as_fields(graph: torch.fx.Graph) -> None:
    """A namedtuple or dataclass the model returns is traced as a call of its class: its fields become a
    dict in the output, so they are named as the eager model's fields are (:mod:`hstu_export.sources.outputs`),
    and the call (nothing else uses it) goes."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    built: list[torch.fx.Node] = []

    def fields_of(x: Any) -> Any:
        if isinstance(x, torch.fx.Node) and x.op == "call_function" and isinstance(x.target, type):
            cls = x.target
            if issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple):
                values = {**dict(zip(cls._fields, x.args)), **x.kwargs}
            elif dataclasses.is_dataclass(cls):
                values = {**dict(zip([f.name for f in dataclasses.fields(cls)], x.args)), **x.kwargs}
            else:
                return x
            built.append(x)
            return {k: fields_of(v) for k, v in values.items()}
        if (named := named_fields(x)) is not None:
            return {k: fields_of(v) for k, v in named}
        if isinstance(x, dict):
            return {k: fields_of(v) for k, v in x.items()}
        if isinstance(x, (tuple, list)):
            return type(x)(fields_of(v) for v in x)
        return x

    output.args = (fields_of(output.args[0]),)
    for node in built:  # outermost first: each then has no user left
        if not node.users:
            graph.erase_node(node)


def _expand_container_outputs(root: nn.Module, graph: torch.fx.Graph, inputs: dict[str, Tensor]) -> None:
    """An output node whose value is a container at run time (what an opaque leaf or call returned)
    is replaced by getitem nodes of its elements, so outputs are named as the eager model's are."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    if not any(isinstance(a, torch.fx.Node) and a.op in ("call_module", "call_function", "call_method")
               for a in _nodes_in(output.args[0])):
        return
    probe = torch.fx.GraphModule(root, copy.deepcopy(graph))
    names = [str(n.target) for n in graph.nodes if n.op == "placeholder"]
    with torch.no_grad():
        value = probe(*(inputs[n] for n in names))

    def expand(structure: Any, runtime: Any) -> Any:
        if isinstance(structure, torch.fx.Node):
            if (named := named_fields(runtime)) is not None:  # an opaque call returned a namedtuple or dataclass
                with graph.inserting_before(output):
                    return {k: expand(graph.call_function(getattr, (structure, k)), v) for k, v in named}
            if isinstance(runtime, dict):
                with graph.inserting_before(output):
                    return {k: expand(graph.call_function(operator.getitem, (structure, k)), v) for k, v in runtime.items()}
            if isinstance(runtime, (tuple, list)):
                with graph.inserting_before(output):
                    return [expand(graph.call_function(operator.getitem, (structure, i)), v) for i, v in enumerate(runtime)]
            return structure
        if isinstance(structure, dict) and isinstance(runtime, dict):
            return {k: expand(v, runtime.get(k)) for k, v in structure.items()}
        if isinstance(structure, (tuple, list)) and isinstance(runtime, (tuple, list)):
            return type(structure)(expand(s, r) for s, r in zip(structure, runtime))
        return structure

    output.args = (expand(output.args[0], value),)


def _nodes_in(structure: Any) -> list[Any]:
    found: list[Any] = []
    torch.fx.node.map_arg(structure, found.append)
    return found


def _flat_outputs(graph: torch.fx.Graph) -> torch.fx.Graph:
    """Rewrites the output node to a flat ``{name: node}`` dict (see :mod:`hstu_export.sources.outputs`) and
    drops the pytree codegen the trace may have installed."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    items = output_items(output.args[0], is_leaf=lambda x: isinstance(x, torch.fx.Node))
    flat = {name: value for name, value in items if isinstance(value, torch.fx.Node)}
    if not flat:
        raise TraceError("the model returns no tensors")
    output.args = (flat,)
    graph._codegen = torch.fx.graph.CodeGen()
    return graph
