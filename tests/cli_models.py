"""Models for ``aload load --model tests.cli_models:NAME`` in the CLI tests."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class Engine(nn.Module):
    """vLLM-style: ``load_weights`` copies each tensor into its parameter and names what it loaded."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.full((256, 1024), float("nan")))
        self.b = nn.Parameter(torch.full((3,), float("nan")))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        done = set()
        for name, t in weights:
            getattr(self, name).data.copy_(t)
            done.add(name)
        assert torch.equal(self.a.data, torch.ones(256, 1024)) and torch.equal(self.b.data, torch.zeros(3))
        return done


def engine() -> Engine:
    return Engine()


class Slow(nn.Module):
    """A ``load_weights`` slow enough to be interrupted."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        import os
        import time
        from pathlib import Path

        for _ in weights:
            if os.environ.get("ALOAD_TEST_READY"):  # tells the test the load is under way
                Path(os.environ["ALOAD_TEST_READY"]).touch()
            time.sleep(0.05)
        return set()


def slow() -> Slow:
    return Slow()
