"""Every file and folder a command writes gets the modes the umask gives (``0o666``/``0o777`` less the
umask), on every route: transformers' ``save_pretrained`` left the in-memory route's ``model.safetensors``
``-rw-------`` where the streamed and block-by-block routes, normswap's own writers, gave
``-rw-r--r--`` (normswap.load.file_modes, applied where every output takes its name)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from hf_dirs import make_directory, stream

from normswap import save
from normswap.load import load_model
from normswap.load.save import atomic_write


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
    def private(temp: Path) -> None:  # a writer that makes its file private, as safetensors does
        temp.write_bytes(b"x")
        os.chmod(temp, 0o600)

    atomic_write(tmp_path / "out.pt", private)
    assert stat.S_IMODE((tmp_path / "out.pt").stat().st_mode) == 0o640
