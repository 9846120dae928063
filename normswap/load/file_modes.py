"""The one rule for the permissions of what normswap writes: every output file gets ``0o666 & ~umask``
and every folder ``0o777 & ~umask``, as a file or folder the user created directly would, whichever
route or library wrote it. transformers' ``save_pretrained`` (safetensors) creates ``model.safetensors``
as ``0o600``, while normswap's own writers open files ``0o666`` so the umask applies: the same command
gave ``-rw-------`` in memory and ``-rw-r--r--`` streamed. :func:`normswap.load.save.place`, which every
output passes through before it takes its name, applies this rule.

The rule is best-effort: a file system that refuses chmod (CIFS, vfat and many FUSE mounts answer EPERM,
ENOTSUP or ENOSYS) leaves each file the mode it was created with, and the output is still written, as it
was before this rule existed."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path


def _umask_from_proc() -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        return None  # no /proc (macOS) or no Umask line (a kernel before 4.7): the probe's turn
    return None


def _umask_from_probe(folder: Path) -> int | None:
    """The umask as the kernel applies it in ``folder``: a probe folder made there with mode ``0o777``
    gets ``0o777 & ~umask``, then is removed. os.umask would tell it too, but only by setting the
    process-wide umask for a moment, during which a file another thread creates gets the wrong mode; the
    probe changes no process state. It is a folder, not a file opened ``0o666``, because a file cannot
    show the umask's execute bits, which the folder mode needs. None where no probe can be made there."""
    probe = folder / f".normswap-umask-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.mkdir(probe, 0o777)  # fails if the name exists: the probe is always normswap's own
    except OSError:
        return None
    try:
        return 0o777 & ~os.lstat(probe).st_mode
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


def current_umask(folder: Path | None = None) -> int | None:
    """The process's umask, read from /proc (Linux). Where that has no ``Umask`` line, it is derived
    from a probe folder made in ``folder`` (see :func:`_umask_from_probe`); None if neither works."""
    mask = _umask_from_proc()
    if mask is None and folder is not None:
        mask = _umask_from_probe(folder)
    return mask


def _chmod(path: str | Path, mode: int) -> None:
    # Best-effort (see the module's note): any OSError means this file system keeps the created mode.
    with contextlib.suppress(OSError):
        os.chmod(path, mode)


def apply_output_modes(path: Path) -> None:
    """Give ``path`` (a complete output: a file, or a folder and everything in it) the modes of the rule
    above, as far as its file system allows. Symlinks are left alone (none is written; chmod would follow
    one out of the output)."""
    if path.is_symlink():
        return
    mask = current_umask(path.parent)
    if mask is None:  # nothing tells the umask: every file keeps the mode it was created with
        return
    file_mode, folder_mode = 0o666 & ~mask, 0o777 & ~mask
    if not path.is_dir():
        _chmod(path, file_mode)
        return
    for root, folders, files in os.walk(path):
        for name in files:
            child = os.path.join(root, name)
            if stat.S_ISREG(os.lstat(child).st_mode):
                _chmod(child, file_mode)
        for name in folders:
            child = os.path.join(root, name)
            if not os.path.islink(child):
                _chmod(child, folder_mode)
    _chmod(path, folder_mode)
