"""Shared fixtures of the fault tests: the tiny model's bundle, saved once per module."""

from __future__ import annotations

import subprocess

import pytest

from hstu_export import generate_batch, save_bundle
from hstu_export.models import build_preset


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def bundle(workdir):
    model = build_preset("tiny", seed=1)
    return save_bundle(model, workdir / "tiny.pt", generate_batch(model.input_schema(), 4, seed=2))


@pytest.fixture
def dead_pid() -> int:
    """The id of a process that has exited (and been reaped), so nothing runs under it."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid
