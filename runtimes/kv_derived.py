"""A package's derived KV-cache delta program (``kv/delta.pt2`` and ``kv/counts.pt2``, written by
``--kv-cache`` for a model other than the zoo's: hstu_export/kv_derive.py), run for
:class:`hstu_export.serving.kv_derived.DerivedCachedRanker`: ``predictor.kv_cache(budget_bytes=...)``.

A request goes through the package's own sparse half as it does without the cache; the counts program
gives each user's sequence length and target count; the delta program gets the dense half's inputs, the
request's ids its frontier rows are compared as (``kv_derive.DerivedDelta.key_inputs``), and the cache's pages,
page table and cached counts, and returns the outputs and which users were stale. Where the counts are sums of
request features (``kv_cache.counts_on_host``), they are added up on the host instead. On CUDA, a program that
reads nothing back to the host replays calls of shapes it has seen before from CUDA graphs
(:mod:`~hstu_export.runtimes.shape_graphs`). Where nothing before it reads the device either (the counts added up
on the host, the compiled sparse half's prechecked model), a graph holds the whole request: the sparse half's
lookups, then the delta program, keyed by the request's shapes; its copies are then the request's ids and lengths
rather than the rows looked up. A program that holds the sparse half (``kv_cache.sparse_inside``) takes the
request's features and the sparse program's own tables instead of the sparse half's outputs: no sparse half runs
before it."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hstu_export.errors import ConfigError, HstuExportError, PackageError
from hstu_export.kv_derive import DELTA_INPUTS, TARGET_ROWS, counts_on_host
from hstu_export.runtimes.aoti import PRECHECKED_MODEL
from hstu_export.runtimes.graph_io import as_output_dict, plain_first_line
from hstu_export.runtimes.predictor import to_device
from hstu_export.runtimes.shape_graphs import MAX_COPY_BYTES, ShapeGraphs, copy_limit
from hstu_export.serving.kv_padding import RequestPadding
from hstu_export.settings import TORCH_DTYPES


class PackageDerived:
    """A :class:`~hstu_export.serving.kv_derived.DerivedRunner` over a loaded package (``Predictor``)."""

    # The inputs that are the same tensors on every call: the cache's pages.
    STATIC_INPUTS = ("kv_k_pages", "kv_v_pages", "kv_x_pages")
    # The request's tensors among a whole-request graph's inputs are named thus.
    REQUEST_INPUT = "request:"

    def __init__(self, predictor: Any, *, cuda_graphs: bool | None = None,
                 graph_copy_limit: int | str | None = None, shape_buckets: bool | None = None) -> None:
        from hstu_export.package.manifest import resolve_inside
        from hstu_export.runtimes.aoti import _load_pt2

        section = predictor.manifest["kv_cache"]
        split = predictor.split
        if split is None:
            raise PackageError(f"{predictor.root}: KV-cached serving needs the sparse and dense halves apart")
        self.layout: dict[str, Any] = dict(section["layout"])
        self.page_size: int = section["page_size"]
        self.device: torch.device = predictor.device
        self.dtype: torch.dtype = TORCH_DTYPES[predictor.manifest["dtype"]]
        self._predictor, self._split = predictor, split
        self._inputs = list(section["inputs"])
        self._counts_inputs = list(section["counts_inputs"])
        # The counts added up on the host from the request's features (no program, no read back from the device).
        self._features = {t["name"]: t.get("feature") for t in predictor.manifest["artifacts"]["dense"]["inputs"]}
        self._host_counts = section.get("counts_on_host")
        for name in (n for part in (self._host_counts or {}).values() for n in part["terms"]):
            if not self._features.get(name):
                raise PackageError(f"{predictor.root}: manifest field kv_cache.counts_on_host: names {name!r}, which "
                                   f"is not a counts input fed from the request")
        # Request inputs the program takes beside the dense ones (the ids its frontier rows are compared as), each
        # fed from the request as the sparse half is: an input of the sparse artifact that names a feature.
        sparse = {t["name"]: t.get("feature") for t in predictor.manifest["artifacts"].get("sparse", {}).get("inputs", [])}
        # A program with the sparse half inside takes the request and the sparse half's tables, not its outputs.
        self._tables = self._tables_inside(predictor, section.get("sparse_inside"), split)
        made = {*DELTA_INPUTS, TARGET_ROWS, *self._tables}
        self._request_inputs = [name for name in self._inputs if name not in self._features and name not in made]
        for name in self._request_inputs:
            if not sparse.get(name):
                raise PackageError(f"{predictor.root}: manifest field kv_cache.inputs: takes {name!r}, which is neither "
                                   f"a dense input, a cache input nor a sparse input fed from the request")
        boundary = set(predictor.manifest.get("sparse_output_names", []))
        outputs = [name for name in self._inputs if name in boundary] if self._tables else []
        if outputs:
            raise PackageError(f"{predictor.root}: manifest field kv_cache.inputs: takes {outputs[0]!r}, an output of "
                               f"the sparse half, which the program holds (kv_cache.sparse_inside)")
        self._outputs = list(section["outputs"])
        try:
            self._program = _load_pt2(resolve_inside(predictor.root, section["program"], "kv_cache.program"))
            self._counts = _load_pt2(resolve_inside(predictor.root, section["counts_program"],
                                                    "kv_cache.counts_program"))
        except HstuExportError:
            raise
        except Exception as exc:
            raise PackageError(f"{predictor.root}: the KV-cache programs could not be loaded: "
                               f"{plain_first_line(exc)}") from exc
        # CUDA graphs (None: on for a CUDA package whose program reads nothing from the device). A program that
        # reads sizes back cannot be captured: the values it reads would be fixed at the capture's.
        reads = section.get("device_reads")  # absent: an older export, which did not count them
        if cuda_graphs and reads != 0:
            raise ConfigError(f"{predictor.root}: its delta program reads "
                              f"{'an unrecorded number of' if reads is None else reads} value(s) back from the "
                              f"device, so it cannot be replayed from a CUDA graph; use cuda_graphs=None")
        if cuda_graphs and self.device.type != "cuda":
            raise ConfigError(f"CUDA graphs need a CUDA package; {predictor.root} is for {self.device.type}")
        use = self.device.type == "cuda" and reads == 0 if cuda_graphs is None else cuda_graphs
        limit = MAX_COPY_BYTES if graph_copy_limit is None else copy_limit(graph_copy_limit)
        self.graphs: ShapeGraphs | None = ShapeGraphs(self._call, (*self.STATIC_INPUTS, *self._tables),
                                                      max_bytes=limit) if use else None
        # The graphs hold the sparse half too: dense_inputs then gives the request, which _call looks up. (A program
        # with the sparse half inside is the whole request itself.)
        self.whole_request = bool(use and self._host_counts is not None and split.sparse_model == PRECHECKED_MODEL
                                  and not self._tables)
        # Shape buckets (None: with the graphs, which they let replay), where the export found a padding user
        # that leaves the answers as they are (serving/kv_padding.py).
        padding = RequestPadding.from_manifest(section, predictor)
        if shape_buckets and padding is None:
            raise ConfigError(f"{predictor.root}: its manifest records no padding user for the delta program's shape "
                              f"buckets (kv_cache.padding: the export found none whose answers match the model's, or "
                              f"it predates them); use shape_buckets=None")
        self._padding, self._shape_buckets = padding, shape_buckets

    @property
    def padding(self) -> RequestPadding | None:
        """The padding user's rules where requests are padded (``shape_buckets``; None: while there are graphs,
        as in C++, whose ``--kv-graphs buckets`` keeps them without CUDA), else None."""
        on = self.graphs is not None if self._shape_buckets is None else self._shape_buckets
        return self._padding if on else None

    @staticmethod
    def _tables_inside(predictor: Any, inside: Any, split: Any) -> dict[str, Tensor]:
        """The tables a program with the sparse half inside takes (``kv_cache.sparse_inside``), by input name: the
        very tensors handed to the package's sparse program, whose prechecked model must be the one that runs (the
        program clamps ids to the ranges that model was prechecked for)."""
        if inside is None:
            return {}
        names = inside.get("tables") if isinstance(inside, dict) else None
        if not isinstance(names, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in names.items()):
            raise PackageError(f"{predictor.root}: manifest field kv_cache.sparse_inside.tables: is not an object of "
                               f"input names to table names")
        if split.sparse_model != PRECHECKED_MODEL:
            raise PackageError(f"{predictor.root}: its KV-cache delta program holds the sparse half's prechecked "
                               f"model, which this package's ranges do not let run; re-export with --kv-cache")
        held = getattr(split.sparse, "tables", {})
        missing = [table for table in names.values() if table not in held]
        if missing:
            raise PackageError(f"{predictor.root}: manifest field kv_cache.sparse_inside.tables: names "
                               f"{missing[0]!r}, which the sparse half's tables do not hold")
        return {name: held[table] for name, table in names.items()}

    def dense_inputs(self, request: dict[str, Tensor]) -> dict[str, Tensor]:
        """The dense half's inputs, or with whole-request graphs the request on the device (``REQUEST_INPUT``
        before each graph input's name), which the program's call looks up."""
        features = self._predictor.check_request(request)
        graph = {f.graph_name: to_device(features[f.name], self.device) for f in self._predictor.input_schema.features}
        if self.whole_request:
            return {self.REQUEST_INPUT + name: value for name, value in graph.items()}
        if self._tables:  # the program looks up the request itself
            return {name: graph[name] for name in (*self._inputs, *self._counts_inputs) if name in graph}
        return {**self._split.dense_inputs(graph), **{name: graph[name] for name in self._request_inputs}}

    def counts(self, dense: dict[str, Tensor], request: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        if self._host_counts is not None:
            terms = {name for part in self._host_counts.values() for name in part["terms"]}
            return counts_on_host(self._host_counts, {name: torch.as_tensor(request[self._features[name]])
                                                      for name in terms})  # checked by dense_inputs already
        with torch.no_grad():
            lengths, targets = self._counts(**{name: dense[name] for name in self._counts_inputs})
        return lengths, targets

    def delta(self, dense: dict[str, Tensor], cached: Tensor, k_pages: Tensor, v_pages: Tensor, x_pages: Tensor,
              page_table: Tensor, rows: dict[str, Tensor]) -> dict[str, Tensor]:
        return self.run_program(self.program_inputs(dense, cached, k_pages, v_pages, x_pages, page_table, rows))

    def run_program(self, inputs: dict[str, Tensor], *, graphed: bool = True) -> dict[str, Tensor]:
        """The delta program on its inputs (by name): from a CUDA graph where there are graphs, unless
        ``graphed`` is False."""
        try:
            with torch.no_grad():
                return self.graphs(inputs) if graphed and self.graphs is not None else self._call(**inputs)
        except HstuExportError:
            raise
        except Exception as exc:  # the request passed check_request: the program or the runtime failed
            raise PackageError(f"{self._predictor.root}: running the KV-cache delta program failed: "
                               f"{plain_first_line(exc)}") from exc

    def program_inputs(self, dense: dict[str, Tensor], cached: Tensor, k_pages: Tensor, v_pages: Tensor,
                       x_pages: Tensor, page_table: Tensor, rows: dict[str, Tensor]) -> dict[str, Tensor]:
        """The delta program's inputs, by name, for :meth:`run_program`. ``rows``: the row lists by input name
        (:func:`~hstu_export.kv_derive.delta_row_inputs`); the program takes those it lists (an older export's
        takes no ``kv_target_rows``, or no ``kv_new_rows`` either: it counts its new rows itself)."""
        values = {**dense, "kv_cached": cached, "kv_k_pages": k_pages, "kv_v_pages": v_pages, "kv_x_pages": x_pages,
                  "kv_page_table": page_table, **rows, **self._tables}
        request = {name: value for name, value in dense.items() if name.startswith(self.REQUEST_INPUT)}
        if request:  # dense_inputs gave the request (whole-request graphs): _call looks it up
            return {**{name: values[name] for name in self._inputs if name in values}, **request}
        return {name: values[name] for name in self._inputs}

    def _call(self, **inputs: Tensor) -> dict[str, Tensor]:
        start = len(self.REQUEST_INPUT)
        request = {name[start:]: value for name, value in inputs.items() if name.startswith(self.REQUEST_INPUT)}
        if request:  # the sparse half first (inside the graph)
            dense = {**request, **self._split.dense_inputs(request)}
            inputs = {name: inputs[name] if name in inputs else dense[name] for name in self._inputs}
        return as_output_dict(self._program(**inputs), self._outputs)
