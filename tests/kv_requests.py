"""Requests for KV-cache tests: per-user histories that grow between requests, and the models of the
packages exported with --kv-cache (shared by test_kv_cache.py, test_kv_export.py and
test_cpp_kv_cache.py; conftest.py's ``kv_package`` exports them once a session), and what the C++ runtime's
held rows send of a script of requests (test_kv_derive.py, test_tzrec_style.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from hstu_export import generate_batch, save_bundle
from hstu_export.models.config import HSTUConfig
from hstu_export.models.ranking import HstuRankingModel

PAGE = 16  # small pages, so that the tiny model's histories span several
CONFIGS = {
    "no-context": HSTUConfig(contextual_features=(), contextual_vocab_sizes=()),
    "context": HSTUConfig(),
}


def bundle_of(config: HSTUConfig, path: Path) -> Path:
    """The zoo ranking model of ``config`` (seeded) saved as a bundle at ``path``."""
    torch.manual_seed(0)
    model = HstuRankingModel(config).eval()
    return save_bundle(model, path, generate_batch(model.input_schema(), 4, seed=2))


def products_rows_independent() -> bool:
    """Whether this machine's fp32 matrix products give a row the same bits whatever rows come with it: the
    premise of a cached answer equal bit for bit to the full model's (a delta run multiplies fewer rows than
    the full one). Many machines' libraries do (the bit-for-bit tests pass there); MKL on an AMD EPYC with
    AVX-512 does not, even on one thread."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 32, generator=gen), torch.randn(96, 32, generator=gen)
    full = x @ w.t()
    return all(torch.equal(x[-m:] @ w.t(), full[-m:]) for m in (1, 3, 6, 10))


class Users:
    """Per-user histories that requests are built from (so histories can grow between requests)."""

    def __init__(self, config: HSTUConfig, seed: int = 0) -> None:
        self.config = config
        self.gen = torch.Generator().manual_seed(seed)
        self.history: dict[str, list[tuple[int, int, int]]] = {}
        self.context: dict[str, list[int]] = {}

    def grow(self, user: str, count: int, now: int = 10_000) -> None:
        cfg = self.config
        events = self.history.setdefault(user, [])
        for _ in range(count):
            t = now - int(torch.randint(1, 5000, (1,), generator=self.gen))
            events.append((int(torch.randint(0, cfg.item_vocab_size, (1,), generator=self.gen)),
                           int(torch.randint(0, cfg.action_vocab_size, (1,), generator=self.gen)), t))
        self.context.setdefault(user, [int(torch.randint(0, v, (1,), generator=self.gen))
                                       for v in cfg.contextual_vocab_sizes])

    def request(self, users: list[str], candidates: list[int], query_time: int = 10_000) -> dict[str, torch.Tensor]:
        cfg = self.config
        events = [self.history[u] for u in users]
        out = {
            "uih_lengths": torch.tensor([len(e) for e in events]),
            "candidate_lengths": torch.tensor(candidates),
            "uih_item_ids": torch.tensor([x[0] for e in events for x in e]),
            "uih_action_ids": torch.tensor([x[1] for e in events for x in e]),
            "uih_timestamps": torch.tensor([x[2] for e in events for x in e]),
            "candidate_item_ids": torch.randint(0, cfg.item_vocab_size, (sum(candidates),), generator=self.gen),
            "query_time": torch.full((len(users),), query_time),
        }
        for i, name in enumerate(cfg.contextual_features):
            out[name] = torch.tensor([self.context[u][i] for u in users])
        return out


def held_rows_of(manifest: dict, script: list[tuple[list[int], dict[str, torch.Tensor]]]) -> tuple[int, int]:
    """(rows taken from the device, rows sent) of the jagged request features of ``script``'s (user ids, request)
    pairs, served through a cache that holds each user's last rows of each feature: a user's rows are taken where
    its request's begin with those, equal, and sent otherwise; a user twice in one request is neither."""
    jagged = {f["name"]: f["jagged_by"] for f in manifest["input_schema"]["features"] if f["kind"] == "jagged"}
    held: dict[tuple[str, int], torch.Tensor] = {}
    taken = sent = 0
    for ids, request in script:
        for name, by in jagged.items():
            for user, rows in zip(ids, torch.split(request[name], request[by].tolist()), strict=True):
                before = held.get((name, user)) if ids.count(user) == 1 else None
                reused = (before is not None and 0 < before.shape[0] <= rows.shape[0]
                          and torch.equal(rows[:before.shape[0]], before))
                taken += before.shape[0] if reused else 0
                sent += rows.shape[0] - (before.shape[0] if reused else 0)
                if ids.count(user) == 1:
                    held[(name, user)] = rows
    return taken, sent
