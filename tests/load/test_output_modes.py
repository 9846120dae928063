"""Every file and folder a command writes gets the modes the umask gives (``0o666``/``0o777`` less the
umask), on every route: transformers' ``save_pretrained`` left the in-memory route's ``model.safetensors``
``-rw-------`` where the streamed and block-by-block routes, normswap's own writers, gave
``-rw-r--r--`` (normswap.load.file_modes, applied where every output takes its name)."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from hf_dirs import make_directory, stream

from normswap import save
from normswap.load import file_modes, load_model
from normswap.load.save import atomic_write, directory_output


@pytest.fixture
def umask_027() -> Iterator[int]:
    old = os.umask(0o027)
    try:
        yield 0o027
    finally:
        os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    """Each path under ``root`` (``root`` itself as ".") -> its permission bits."""
    found = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        found[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return found


def test_every_route_writes_the_modes_the_umask_gives(tmp_path, umask_027):
    source = make_directory(tmp_path, "llama")
    shards = list(source.glob("*.safetensors"))
    assert shards and {stat.S_IMODE(s.stat().st_mode) for s in shards} == {0o600}  # save_pretrained's mode
    loaded = load_model(str(source))  # the in-memory directory writer: save_pretrained, then loaded back
    save(
        loaded.model,
        tmp_path / "memory",
        loaded.example_args,
        loaded.example_kwargs,
        source=loaded.checkpoint,
    )
    streamed = stream(source, tmp_path / "streamed", fold_norm_affine=True)
    assert streamed.edited_tensors > 0  # the streamed route did run
    memory, stream_modes = _modes(tmp_path / "memory"), _modes(tmp_path / "streamed")
    assert {".", "config.json", shards[0].name} <= set(memory)
    assert memory == stream_modes  # the same files, the same modes, whichever route wrote them
    folders = {p for p in memory if (tmp_path / "memory" / p).is_dir()}
    assert {p: m for p, m in memory.items() if p in folders} == dict.fromkeys(folders, 0o750)
    assert {p: m for p, m in memory.items() if p not in folders} == dict.fromkeys(
        set(memory) - folders, 0o640
    )


def test_a_file_output_gets_the_umask_modes_whoever_created_it(tmp_path, umask_027):
    atomic_write(tmp_path / "out.pt", _private)
    assert stat.S_IMODE((tmp_path / "out.pt").stat().st_mode) == 0o640


def _private(temp: Path) -> None:  # a writer that makes its file private, as safetensors does
    temp.write_bytes(b"x")
    os.chmod(temp, 0o600)


def test_a_file_system_that_refuses_chmod_still_gets_the_output(tmp_path, umask_027, monkeypatch):
    # Before the modes rule, outputs on CIFS/vfat/FUSE mounts (chmod answers EPERM/ENOTSUP) were
    # written; they still are, each file keeping the mode its writer gave it.
    atomic_write(tmp_path / "out.pt", _private)  # os.chmod is still the real one inside the writer
    real_chmod = os.chmod

    def refuse(path: object, mode: int, **kwargs: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted", str(path))

    monkeypatch.setattr(os, "chmod", refuse)
    for name in ("refused.pt", "out.pt"):  # a new output, and one replacing the earlier one
        atomic_write(tmp_path / name, lambda temp: temp.write_bytes(b"y"))
        assert (tmp_path / name).read_bytes() == b"y"
    with directory_output(tmp_path / "model") as temp:
        (temp / "config.json").write_text("{}")
    assert (tmp_path / "model" / "config.json").read_text() == "{}"
    monkeypatch.setattr(os, "chmod", real_chmod)
    # Created 0o666 under umask 027 by normswap's temp file: the mode it got, unchanged.
    assert stat.S_IMODE((tmp_path / "refused.pt").stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out.pt", "refused.pt"]  # no temps


@pytest.mark.parametrize("mask", [0o027, 0o077, 0o002])
def test_without_proc_the_umask_comes_from_a_probe_not_from_os_umask(tmp_path, monkeypatch, mask):
    old = os.umask(mask)
    try:

        def no_proc(*args: object, **kwargs: object) -> object:  # as on macOS, or /proc not mounted
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", "/proc/self/status")

        def no_umask(*args: object) -> int:  # setting the process umask races with other threads
            raise AssertionError("os.umask called")

        monkeypatch.setattr(file_modes, "open", no_proc, raising=False)  # shadows the builtin there
        monkeypatch.setattr(os, "umask", no_umask)
        assert file_modes.current_umask(tmp_path) == mask
        atomic_write(tmp_path / "out.pt", _private)
        with directory_output(tmp_path / "model") as temp:
            (temp / "sub").mkdir(mode=0o700)
            _private(temp / "sub" / "weights.bin")
        monkeypatch.undo()
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out.pt").stat().st_mode) == 0o666 & ~mask
    for folder in (tmp_path / "model", tmp_path / "model" / "sub"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~mask
    assert stat.S_IMODE((tmp_path / "model/sub/weights.bin").stat().st_mode) == 0o666 & ~mask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out.pt"]  # the probes are gone
