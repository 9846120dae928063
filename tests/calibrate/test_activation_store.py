"""The activation store of the sequential calibration: memory up to its budget, files past it, nothing left."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from normswap.calibrate.activations import ActivationStore
from normswap.errors import BadInputError
from normswap.load import save as save_module


def test_tensors_past_the_budget_go_to_disk_and_come_back_equal(tmp_path):
    store = ActivationStore(
        budget=3 * 400, destination=tmp_path / "out"
    )  # room for three (10, 10) fp32 tensors
    tensors = {("o", b): torch.randn(10, 10, generator=torch.Generator().manual_seed(b)) for b in range(5)}
    for key, tensor in tensors.items():
        store.put(key, tensor)
    assert store.held_bytes == 1200 and store.spilled_bytes == 800
    assert len(list(tmp_path.glob(".out.activations.normswap-tmp-*/*.safetensors"))) == 2
    for key, tensor in tensors.items():
        assert torch.equal(store.get(key), tensor)
    store.put(("o", 0), torch.zeros(10, 10))  # a replaced tensor frees its room
    assert torch.equal(store.get(("o", 0)), torch.zeros(10, 10)) and store.held_bytes == 1200
    store.put(("o", 4), torch.ones(10, 10))  # a spilled one is replaced by a file of its own
    assert torch.equal(store.get(("o", 4)), torch.ones(10, 10))
    assert len(list(tmp_path.glob(".out.activations.normswap-tmp-*/*.safetensors"))) == 2
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_within_the_budget_nothing_is_written(tmp_path):
    store = ActivationStore(budget=10**6, destination=tmp_path / "out")
    store.put("h", torch.ones(4, 4, dtype=torch.bfloat16))
    assert store.get("h").dtype == torch.bfloat16 and not store.spilled and store.peak_held_bytes == 32
    store.close()
    assert list(tmp_path.iterdir()) == []


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork to know a dead pid")
def test_a_killed_runs_spill_folder_is_removed_by_the_next_run(tmp_path):
    # a run killed with SIGKILL leaves its spill folder; the next run on this host removes it once that
    # pid is gone, and keeps a live process's (a run going on beside it)
    out = tmp_path / "out"
    name = out.with_name("out.activations")
    host = save_module._host()
    dead = save_module._temp_path(name, host, _dead_pid(), "0a1b2c3d")
    live = save_module._temp_path(name, host, 1, "0a1b2c3d")
    for folder in (dead, live):
        folder.mkdir()
        (folder / "1.safetensors").write_bytes(b"activations of a killed run")
    store = ActivationStore(budget=0, destination=out)
    assert not dead.exists()
    assert live.exists()
    store.put("h", torch.ones(3))  # this run's own spill folder is another one, removed at close
    assert torch.equal(store.get("h"), torch.ones(3))
    store.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]


def test_a_spill_folder_without_an_output_is_named_for_the_next_run_too(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    store = ActivationStore(budget=0)
    store.put("h", torch.ones(3))
    (folder,) = tmp_path.iterdir()
    assert folder.name.startswith(f".normswap.activations.normswap-tmp-{save_module._host()}-{os.getpid()}-")
    store.close()
    assert list(tmp_path.iterdir()) == []


_FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys
    from pathlib import Path
    import torch
    from normswap.calibrate.activations import ActivationStore
    from normswap.errors import BadInputError

    # writes past 64 KiB fail with EFBIG, as a full disk fails them with ENOSPC (SIGXFSZ ignored)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
    store = ActivationStore(budget=0, destination=Path(sys.argv[1]) / "out")
    try:
        store.put("h", torch.zeros(1 << 16))
    except BadInputError as exc:
        print(exc)
    finally:
        store.close()
    """
)


def test_a_spill_that_fails_to_write_is_one_line(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    (line,) = run.stdout.strip().splitlines()
    assert line.startswith(f"cannot spill activations to {tmp_path}/.out.activations.normswap-tmp-")
    assert line.endswith(": File too large; free some space there or raise --activation-memory")
    assert "Traceback" not in run.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_says_so(tmp_path, monkeypatch):
    import safetensors.torch

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    store = ActivationStore(budget=0, destination=tmp_path / "out")
    with pytest.raises(
        BadInputError, match=r"^cannot spill activations to .*: no space left on device; free"
    ):
        store.put("h", torch.ones(3))
    store.close()
    assert list(tmp_path.iterdir()) == []
