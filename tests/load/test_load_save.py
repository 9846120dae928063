"""Saving: atomic writes, formats by suffix, and never writing over the input model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import normswap
from normswap.errors import BadInputError
from normswap.load import atomic_write, load_model, save_model


class _WriterFailed(Exception):
    pass


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def test_atomic_write_success_leaves_no_temp(tmp_path: Path) -> None:
    seen: list[Path] = []

    def write(temp: Path) -> None:
        seen.append(temp)
        temp.write_bytes(b"complete")

    target = tmp_path / "out.pt2"
    atomic_write(target, write)
    assert target.read_bytes() == b"complete"
    (temp,) = seen
    assert temp.parent == tmp_path
    assert temp.name.startswith(".out.pt2.normswap-tmp-") and temp.suffix == ".pt2"
    assert _leftovers(tmp_path) == []


def test_atomic_write_failure_leaves_nothing(tmp_path: Path) -> None:
    def write(temp: Path) -> None:
        temp.write_bytes(b"half")
        raise _WriterFailed

    target = tmp_path / "out.pt"
    with pytest.raises(_WriterFailed):
        atomic_write(target, write)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_failure_keeps_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "out.pt"
    target.write_bytes(b"previous")

    def write(temp: Path) -> None:
        temp.write_bytes(b"half")
        raise _WriterFailed

    with pytest.raises(_WriterFailed):
        atomic_write(target, write)
    assert target.read_bytes() == b"previous"
    assert _leftovers(tmp_path) == []


def test_atomic_write_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(BadInputError) as info:
        atomic_write(tmp_path / "nope" / "out.pt", lambda temp: None)
    assert str(info.value) == f"output directory does not exist: {tmp_path / 'nope'}"


def test_save_pt2_round_trip(tmp_path: Path, tiny_model: nn.Module, example_x: torch.Tensor) -> None:
    out = tmp_path / "rewritten.pt2"
    assert save_model(tiny_model, out, (example_x,)) == "pt2"
    loaded = load_model(str(out))
    assert loaded.format == "pt2"
    torch.testing.assert_close(loaded.model(example_x), tiny_model(example_x), rtol=0, atol=0)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("suffix", [".pt", ".pth"])
def test_save_pickle_round_trip(
    tmp_path: Path, tiny_model: nn.Module, example_x: torch.Tensor, suffix: str
) -> None:
    out = tmp_path / f"rewritten{suffix}"
    assert save_model(tiny_model, out, (example_x,)) == "pickle"
    loaded = load_model(str(out), trust_pickle=True)
    torch.testing.assert_close(loaded.model(example_x), tiny_model(example_x), rtol=0, atol=0)


def test_save_refuses_unknown_suffix(tmp_path: Path, tiny_model: nn.Module, example_x: torch.Tensor) -> None:
    out = tmp_path / "model.bin"
    with pytest.raises(BadInputError) as info:
        save_model(tiny_model, out, (example_x,))
    assert (
        str(info.value) == f"cannot save to {out}: unknown suffix '.bin' (accepted: .pt2, .pt, .pth, .onnx)"
    )
    assert not out.exists()


def test_save_refuses_to_overwrite_the_input(
    tmp_path: Path, tiny_model: nn.Module, example_x: torch.Tensor
) -> None:
    source = tmp_path / "model.pt"
    torch.save(tiny_model, source)
    before = source.read_bytes()
    # Reached through a different spelling of the same path.
    with pytest.raises(BadInputError, match=r"^-o .*model\.pt is also the input model: choose another path$"):
        save_model(tiny_model, tmp_path / "." / "model.pt", (example_x,), refuse_path=source)
    assert source.read_bytes() == before


def test_save_pt2_failure_leaves_no_file(tmp_path: Path, example_x: torch.Tensor) -> None:
    class DataDependent(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # torch.export cannot trace a branch on tensor data
                return x
            return -x

    out = tmp_path / "out.pt2"
    with pytest.raises(BadInputError, match=r"^torch.export could not trace the model for \.pt2 output"):
        save_model(DataDependent(), out, (example_x,))
    assert list(tmp_path.iterdir()) == []


def test_save_pickle_of_unpicklable_model(tmp_path: Path, example_x: torch.Tensor) -> None:
    class Local(nn.Module):  # a class defined in a function cannot be found again by pickle
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    out = tmp_path / "out.pt"
    with pytest.raises(
        BadInputError, match=r"^cannot pickle the model for \.pt output .*; save as \.pt2 instead$"
    ):
        save_model(Local(), out, (example_x,))
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_os_error_becomes_bad_input(tmp_path: Path) -> None:
    def write(temp: Path) -> None:
        raise OSError(28, "No space left on device")

    target = tmp_path / "out.pt"
    with pytest.raises(BadInputError) as info:
        atomic_write(target, write)
    assert str(info.value) == (
        f"no space left on device writing {target}: free some space or choose another folder"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_save_onnx_matches_eager(tmp_path: Path, tiny_model: nn.Module, example_x: torch.Tensor) -> None:
    ort = pytest.importorskip("onnxruntime")
    out = tmp_path / "model.onnx"
    with pytest.raises(BadInputError, match=r"written by normswap\.save, which checks it in onnxruntime"):
        save_model(tiny_model, out, (example_x,))  # the loader's writer writes no unchecked ONNX
    assert normswap.save(tiny_model, out, (example_x,)).format == "onnx"
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (result,) = session.run(None, {session.get_inputs()[0].name: example_x.numpy()})
    torch.testing.assert_close(torch.from_numpy(result), tiny_model(example_x), rtol=1e-5, atol=1e-5)
    assert _leftovers(tmp_path) == []
