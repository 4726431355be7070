"""A package's KV-cache delta program (``kv/delta.pt2``, written by ``--kv-cache``), run for
:class:`hstu_export.serving.kv_cache.CachedRanker`: ``predictor.kv_cache(budget_bytes=...)``.

A delta request goes through the package's own sparse half (the history past each user's cached prefix
only), then the delta program gets the embeddings (contextual ones for the users with nothing cached),
the request's lengths and times, and the cache's pages and page table; it returns the model's outputs
and writes the new K/V into the pages. The program trusts the counts it is given;
:class:`~hstu_export.serving.kv_cache.CachedRanker` derives them from a validated request.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from hstu_export.errors import ConfigError, HstuExportError, PackageError
from hstu_export.kv_export import bucket_steps, legacy_program_bounds, page_table_width_bound
from hstu_export.models.cached import KVLayout, stacked_contextual
from hstu_export.models.ranking import HISTORY_LENGTHS, HISTORY_TOKEN_FEATURES
from hstu_export.runtimes.graph_io import as_output_dict, plain_first_line
from hstu_export.runtimes.kv_graphs import Buckets, GraphCache, bucket_width, pad_to_bucket, unpad
from hstu_export.runtimes.predictor import to_device
from hstu_export.settings import TORCH_DTYPES

# The sparse half's outputs per history token (zoo names).
HISTORY_EMBEDDINGS = ("uih_item_emb", "uih_action_emb")
# What a delta program returned before it wrote the new K/V into the pages itself (packages of then).
OLD_KV_OUTPUTS = {"kv_new_k", "kv_new_v", "kv_users", "kv_positions"}


class PackageDelta:
    """A :class:`~hstu_export.serving.kv_cache.DeltaRunner` over a loaded package (``Predictor``)."""

    def __init__(self, predictor: Any, *, cuda_graphs: bool | None = None, graph_max_batch: int | None = None) -> None:
        from hstu_export.package.manifest import resolve_inside
        from hstu_export.runtimes.aoti import _load_pt2

        section = predictor.manifest.get("kv_cache")
        if section is None:
            raise PackageError(f"{predictor.root} has no KV-cache delta program; export it with --kv-cache")
        split = predictor.split
        if split is None:
            raise PackageError(f"{predictor.root}: KV-cached serving needs the sparse and dense halves apart")
        layout = section["layout"]
        self.layout = KVLayout(
            layout["num_layers"], layout["num_heads"], layout["attention_dim"], layout["linear_dim"],
            tuple(layout["contextual_features"]), layout["time_bucket_base"], layout["num_time_buckets"],
            TORCH_DTYPES[predictor.manifest["dtype"]],
        )  # fmt: skip
        self.page_size: int = section["page_size"]
        self.device: torch.device = predictor.device
        self._predictor = predictor
        self._split = split
        self._inputs = list(section["inputs"])
        self._min_history = predictor.package_manifest.ranges.lengths.min_lengths.get(HISTORY_LENGTHS, 0)
        self._outputs = list(section["outputs"])
        if OLD_KV_OUTPUTS & set(self._outputs):
            raise PackageError(f"{predictor.root}: its delta program was exported by an older hstu-export (it returns "
                               f"the new K/V instead of writing them into the cache); export it again with --kv-cache")
        # With CUDA graphs (the default on CUDA; None: on for a CUDA package), requests of up to
        # graph_max_batch users (default: any) run in shape buckets replayed from CUDA graphs
        # (runtimes/kv_graphs.py; docs/KV_CACHE.md, "Using it"). The bucket steps stay within the program's
        # bounds.
        ranges = predictor.package_manifest.ranges.lengths
        bounds = section.get("bounds") or legacy_program_bounds(ranges)  # packages that do not record them
        step_h, step_c = bucket_steps(ranges)
        self._buckets = Buckets(history=step_h, candidates=step_c,
                                max_width=page_table_width_bound(section["max_seq_len"], self.page_size),
                                max_batch=bounds["batch"], max_history=bounds["new_history"],
                                max_candidates=bounds["candidates"], fitted_counts=section.get("fits_counts") is True)
        self._graph_max_batch = graph_max_batch
        use_graphs = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        if use_graphs and self.device.type != "cuda":
            raise ConfigError(f"CUDA graphs need a CUDA package; {predictor.root} is for {self.device.type}")
        self.graphs = GraphCache(self._run, self._buckets, self.layout.contextual_seq_len) if use_graphs else None
        path = resolve_inside(predictor.root, section["program"], "kv_cache.program")
        try:
            self._program = _load_pt2(path)
        except Exception as exc:
            raise PackageError(f"{predictor.root}: AOTInductor could not load {section['program']}: "
                               f"{plain_first_line(exc)}") from exc

    def validate(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        return self._predictor.check_request(features)

    def __call__(self, features: dict[str, Tensor], cached: Tensor, k_pages: Tensor, v_pages: Tensor,
                 page_table: Tensor) -> dict[str, Tensor]:
        try:
            return self.run_program(self.program_inputs(features, cached, k_pages, v_pages, page_table))
        except HstuExportError:
            raise
        except Exception as exc:  # the programs' own checks and guards, named as the predictor names them
            raise self._predictor.refusal(exc, features) from exc

    def program_inputs(self, features: dict[str, Tensor], cached: Tensor, k_pages: Tensor, v_pages: Tensor,
                       page_table: Tensor) -> dict[str, Tensor]:
        """The delta program's inputs for a delta request: its sparse half run, the contextual embeddings
        of the users with nothing cached stacked, the cache's tensors."""
        schema = self._predictor.input_schema
        padded, keep = self._pad_history(features)
        graph = {f.graph_name: to_device(padded[f.name], self.device) for f in schema.features}
        with torch.no_grad():
            emb = self._split.dense_inputs(graph)
            if keep is not None:  # drop the padding's embeddings; the program gets the request's own history
                emb = {**emb, **{name: emb[name].index_select(0, keep) for name in HISTORY_EMBEDDINGS}}
                emb.update({name: to_device(features[name], self.device) for name in (HISTORY_LENGTHS, "uih_timestamps")})
            values = {**emb, "contextual_emb": stacked_contextual(emb, self.layout.contextual_features, cached,
                                                                  emb["uih_item_emb"]),
                      "kv_cached": to_device(cached.to(torch.int64), self.device), "kv_k_pages": k_pages,
                      "kv_v_pages": v_pages, "kv_page_table": to_device(page_table.to(torch.int32), self.device)}
        return {name: values[name].contiguous() for name in self._inputs}

    def table_width(self, width: int) -> int:
        """The width to build a page table ``width`` pages wide at (its later columns the scratch page): its
        shape bucket's when requests run in buckets, so that the graph copies it in as it is."""
        return bucket_width(width, self._buckets) if self.graphs is not None else width

    def run_program(self, inputs: dict[str, Tensor], *, bucketed: bool | None = None) -> dict[str, Tensor]:
        """The delta program alone on :meth:`program_inputs` (what benchmarks time): the model's outputs; the
        new K/V written into the pages. With CUDA graphs, a request goes to its shape bucket's graph;
        ``bucketed`` forces the padding to a bucket on or off, without graphs when on (tests compare the
        two)."""
        batch = inputs["kv_cached"].shape[0]
        graphs = self.graphs is not None and (self._graph_max_batch is None or batch <= self._graph_max_batch)
        if graphs and bucketed is None:
            assert self.graphs is not None
            with torch.no_grad():
                out = self.graphs(inputs)
        elif bucketed:
            padded, candidates = pad_to_bucket(inputs, self._buckets, self.layout.contextual_seq_len)
            with torch.no_grad():
                out = unpad(self._run(**padded), candidates)
        else:
            with torch.no_grad():
                out = self._run(**inputs)
        return out

    def _run(self, **inputs: Tensor) -> dict[str, Tensor]:
        return as_output_dict(self._program(**inputs), self._outputs)

    def _pad_history(self, features: dict[str, Tensor]) -> tuple[dict[str, Tensor], Tensor | None]:
        """A delta request may bring fewer new history tokens than the sparse half accepts (often none:
        only new candidates). Each such user gets placeholder tokens (id 0) up to the exported minimum;
        returns the request so padded, and the rows of the real tokens (None: nothing padded)."""
        # In NumPy: a few numbers a user, where each torch op on the host costs more than the work.
        lengths = features[HISTORY_LENGTHS].cpu().numpy().astype(np.int64)
        pad = np.maximum(self._min_history - lengths, 0)
        if not pad.any():
            return features, None
        padded_lengths = lengths + pad
        # A real token's row: its user's start in the padded request, plus its place among the user's tokens.
        shift = (np.cumsum(padded_lengths) - padded_lengths) - (np.cumsum(lengths) - lengths)
        real = torch.from_numpy(np.repeat(shift, lengths) + np.arange(int(lengths.sum())))
        total = int(padded_lengths.sum())
        out = dict(features)
        for name in HISTORY_TOKEN_FEATURES:
            value = features[name]
            filled = value.new_zeros((total, *value.shape[1:]))
            filled[real.to(value.device)] = value
            out[name] = filled
        out[HISTORY_LENGTHS] = torch.from_numpy(padded_lengths).to(features[HISTORY_LENGTHS].device,
                                                                  features[HISTORY_LENGTHS].dtype)
        return out, real.to(self.device)
