"""Tiny models and files shared by the load tests."""

from __future__ import annotations

import itertools
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

_counter = itertools.count()


def make_tiny_model(seed: int = 0) -> nn.Module:
    """Linear -> LayerNorm -> Linear: small, exportable, and its weights depend on the seed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3)).eval()


@pytest.fixture
def tiny_model() -> nn.Module:
    return make_tiny_model()


@pytest.fixture
def tiny_model_factory() -> Callable[[int], nn.Module]:
    """The builder itself, for tests that need two differently initialized copies."""
    return make_tiny_model


@pytest.fixture
def example_x() -> torch.Tensor:
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(123))


@pytest.fixture(scope="module")
def pt2_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One torch.export archive per test module: exporting costs about a second."""
    model = make_tiny_model()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(123))
    path = tmp_path_factory.mktemp("pt2") / "tiny.pt2"
    torch.export.save(torch.export.export(model, (x,)), path)
    return path


@pytest.fixture
def write_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], str]]:
    """Write a uniquely named factory module into tmp_path (the cwd) and return its module name."""
    monkeypatch.chdir(tmp_path)
    names: list[str] = []

    def write(body: str) -> str:
        name = f"normswap_test_factory_{next(_counter)}"
        header = "import torch\nfrom torch import nn\n\n"
        (tmp_path / f"{name}.py").write_text(header + textwrap.dedent(body))
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)
