"""The one rule for the permissions of what normswap writes: every output file gets ``0o666 & ~umask``
and every folder ``0o777 & ~umask``, as a file or folder the user created directly would, whichever
route or library wrote it. transformers' ``save_pretrained`` (safetensors) creates ``model.safetensors``
as ``0o600``, while normswap's own writers open files ``0o666`` so the umask applies: the same command
gave ``-rw-------`` in memory and ``-rw-r--r--`` streamed. :func:`normswap.load.save.place`, which every
output passes through before it takes its name, applies this rule."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

_LOCK = threading.Lock()


def current_umask() -> int:
    """The process's umask: read from /proc (Linux), else set and restored at once (under a lock: the
    umask is process-wide, and another thread creating a file meanwhile would see 0)."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def apply_output_modes(path: Path) -> None:
    """Give ``path`` (a complete output: a file, or a folder and everything in it) the modes of the rule
    above. Symlinks are left alone (none is written; chmod would follow one out of the output)."""
    mask = current_umask()
    file_mode, folder_mode = 0o666 & ~mask, 0o777 & ~mask
    if path.is_symlink():
        return
    if not path.is_dir():
        os.chmod(path, file_mode)
        return
    for root, folders, files in os.walk(path):
        for name in files:
            child = os.path.join(root, name)
            if stat.S_ISREG(os.lstat(child).st_mode):
                os.chmod(child, file_mode)
        for name in folders:
            child = os.path.join(root, name)
            if not os.path.islink(child):
                os.chmod(child, folder_mode)
    os.chmod(path, folder_mode)
