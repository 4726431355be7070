"""Several requests in one package call, and each request's outputs back.

Every feature of a request is laid out users back to back (lengths and per-user features: one row per
user; jagged features: each user's values in order), so requests concatenated feature by feature form
one valid request of their summed batch size. An output whose first dim counts users (``batch``) or a
lengths feature's values (``<lengths>.total``, say one score per candidate), possibly times a fixed
factor, splits back per request by those counts; the manifest's ``artifacts`` says which it is
(docs/PACKAGE.md). An output of any other first dim (static, or ``batch+1``) cannot be split, and such a
package is served one request per call; so is a package whose answers depend on the batch (the manifest's
``batch_dependent``: a user's answer would change with the users it is combined with).
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hstu_export.errors import HstuExportError, RequestError
from hstu_export.package.manifest import Manifest

_DIM = re.compile(r"^(?:(?P<scale>[0-9]+)\*)?(?P<name>[^*+]+?)(?:\+(?P<offset>[0-9]+))?$")
BATCH = "batch"
TOTAL = ".total"


@dataclass(frozen=True)
class OutputRows:
    """How many first-dim rows of output ``name`` a request gets: ``scale`` times its batch size
    (``lengths`` None) or the sum of its ``lengths`` feature."""

    name: str
    lengths: str | None
    scale: int = 1

    def rows(self, request: Mapping[str, Tensor]) -> int:
        if self.lengths is None:
            count = next(t.size(0) for t in request.values())
            return self.scale * count
        return self.scale * int(request[self.lengths].sum())


def output_rows(manifest: Manifest) -> dict[str, OutputRows] | None:
    """Per output, how it splits per request; None when one cannot, or when a user's answer depends on the
    other users of its call (``batch_dependent``): the package is then served one request per call."""
    final = manifest.artifacts.get("dense") or manifest.artifacts.get("model")
    if final is None or manifest.raw.get("batch_dependent"):
        return None
    lengths = {f.name for f in manifest.input_schema.features if f.kind == "lengths"}
    out: dict[str, OutputRows] = {}
    for tensor in final["outputs"]:
        first = tensor["shape"][0] if tensor["shape"] else None
        found = _DIM.match(first) if isinstance(first, str) else None
        if found is None or found["offset"]:
            return None
        name, scale = found["name"], int(found["scale"] or 1)
        if name == BATCH:
            out[tensor["name"]] = OutputRows(tensor["name"], None, scale)
        elif name.endswith(TOTAL) and name[: -len(TOTAL)] in lengths:
            out[tensor["name"]] = OutputRows(tensor["name"], name[: -len(TOTAL)], scale)
        else:
            return None
    return out


def batch_size(schema_features: Sequence[Any], request: Mapping[str, Tensor]) -> int:
    """Users in a (validated) request: the first dim of its lengths / per-user features."""
    first = next(f for f in schema_features if f.kind in ("lengths", "per_user"))
    return int(request[first.name].size(0))


def plan_groups(sizes: Sequence[int], max_users: int) -> list[list[int]]:
    """Consecutive groups of request indices whose users add up to at most ``max_users`` (in arrival
    order, so no request waits behind a later one). Every size must be <= max_users."""
    groups: list[list[int]] = []
    users = 0
    for index, size in enumerate(sizes):
        if not groups or users + size > max_users:
            groups.append([])
            users = 0
        groups[-1].append(index)
        users += size
    return groups


def combine(requests: Sequence[Mapping[str, Tensor]], names: Sequence[str]) -> dict[str, Tensor]:
    """One request holding all of ``requests``' users, in order."""
    if len(requests) == 1:
        return {name: requests[0][name] for name in names}
    return {name: torch.cat([r[name] for r in requests]) for name in names}


def to_host(outputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``outputs`` on the host. From a CUDA device the copies are queued without blocking and an event after
    them is waited for: the caller waits for its own call's work only, not for what other threads queued on
    the stream after it (as a blocking copy's stream synchronisation would)."""
    on_cuda = [v.device for v in outputs.values() if v.device.type == "cuda"]
    if not on_cuda:
        return {name: value.cpu() for name, value in outputs.items()}
    host = {name: value.to("cpu", non_blocking=True) for name, value in outputs.items()}
    for device in dict.fromkeys(on_cuda):
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()
    return host


def _sums(parts: Sequence[Tensor]) -> list[int]:
    """The sum of each of ``parts`` (whole numbers, none empty), read at once."""
    ends = torch.tensor([p.numel() for p in parts]).cumsum(0) - 1
    running = torch.cat(parts).reshape(-1).to(torch.int64).cumsum(0)
    at = running[ends.to(running.device)].tolist()
    return [b - a for a, b in zip([0, *at[:-1]], at)]


def split_outputs(outputs: Mapping[str, Tensor], requests: Sequence[Mapping[str, Tensor]],
                  rows: Mapping[str, OutputRows]) -> list[dict[str, Tensor]]:
    """Each request's share of the outputs of their combined call."""
    if len(requests) == 1:
        return [dict(outputs)]
    parts: list[dict[str, Tensor]] = [{} for _ in requests]
    totals: dict[str, list[int]] = {}  # each request's sum of a lengths feature, read once for every output
    for name, value in outputs.items():
        spec = rows[name]
        if spec.lengths is None:
            counts = [spec.rows(r) for r in requests]
        else:
            if spec.lengths not in totals:
                totals[spec.lengths] = _sums([r[spec.lengths] for r in requests])
            counts = [spec.scale * total for total in totals[spec.lengths]]
        if sum(counts) != value.size(0):
            raise RequestError(f"output {name!r} has {value.size(0)} rows, the requests account for {sum(counts)}; "
                               "it cannot be split per request")
        for part, piece in zip(parts, torch.split(value, counts)):
            part[name] = piece
    return parts


class BatchingPredictor:
    """Runs many requests with as few package calls as the exported maximum batch size allows; each
    request gets its own outputs or its own error (a bad request never fails the others: a call that fails
    is run again one request at a time).

    With ``ranker`` (``predictor.kv_cache(...)``, a :class:`~hstu_export.serving.kv_cache.CachedRanker`), the
    calls go through its KV cache: each request then comes with its users' ids (``user_ids``, one list per
    request, one id per user).

    ``host_outputs``: each call's outputs are moved to the host before they are split per request (one copy
    per output, not one per request and output)."""

    def __init__(self, predictor: Any, ranker: Any | None = None, *, host_outputs: bool = False) -> None:
        self.predictor = predictor
        self.ranker = ranker
        self.host_outputs = host_outputs
        self.schema = predictor.input_schema
        self.max_batch_size: int = predictor.max_batch_size
        self.rows = output_rows(predictor.package_manifest)

    @property
    def batches_requests(self) -> bool:
        return self.rows is not None

    def __call__(self, requests: Sequence[Mapping[str, Tensor]],
                 user_ids: Sequence[Sequence[Hashable]] | None = None) -> list[dict[str, Tensor] | HstuExportError]:
        if (self.ranker is None) != (user_ids is None) or (user_ids is not None and len(user_ids) != len(requests)):
            raise ValueError("user_ids: one list of ids per request with a ranker, none without")
        results: list[dict[str, Tensor] | HstuExportError] = [RequestError("not run")] * len(requests)
        valid: list[int] = []
        sizes: list[int] = []
        # The layout of each request; the values of a group are checked together when it runs (a value out of
        # range then fails the call, and its requests run again one by one).
        layouts = self.schema.validate_each(
            [dict(r) if isinstance(r, Mapping) and not isinstance(r, dict) else r for r in requests], self.max_batch_size)
        for index, size in enumerate(layouts):
            if isinstance(size, RequestError):
                results[index] = size
            elif user_ids is not None and len(user_ids[index]) != size:
                results[index] = RequestError(f"{len(user_ids[index])} user ids for a request of {size} users")
            else:
                sizes.append(size)
                valid.append(index)
        groups = plan_groups(sizes, self.max_batch_size) if self.rows is not None else [[i] for i in range(len(valid))]
        for group in groups:
            members = [valid[i] for i in group]
            try:
                shares = self._run(requests, members, user_ids)
            except HstuExportError as exc:
                if len(members) == 1:
                    results[members[0]] = exc
                    continue
                shares = []
                for member in members:  # alone, so that only the request at fault fails
                    try:
                        shares.extend(self._run(requests, [member], user_ids))
                    except HstuExportError as alone:
                        shares.append(alone)  # type: ignore[arg-type]
            for member, share in zip(members, shares):
                results[member] = share
        return results

    def _run(self, requests: Sequence[Mapping[str, Tensor]], members: list[int],
             user_ids: Sequence[Sequence[Hashable]] | None) -> list[dict[str, Tensor]]:
        batch = [requests[i] for i in members]
        combined = combine(batch, self.schema.names)
        if user_ids is None:
            outputs = self.predictor(combined)
        else:
            outputs = self.ranker(combined, [user for i in members for user in user_ids[i]])
        if self.host_outputs:
            outputs = to_host(outputs)
        return split_outputs(outputs, batch, self.rows or {})
