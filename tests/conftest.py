"""Settings for every test process."""

from __future__ import annotations

import os

# Under pytest-xdist each worker is one process on a machine with few cores; torch's intra-op threads (one
# per core by default) in every worker oversubscribe them and the suite runs about a quarter slower
# (tests/export/test_rewrite_formats.py with -n 2 on 2 cores: 94 s, 71 s with one thread per worker). One
# thread per worker; the processes the tests start inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
