"""Reading a model directory straight into shards (normswap.calibrate.parallel_load): the row reads and
the coverage check, in one process (torchrun runs it whole in test_distill_torchrun.py)."""

from __future__ import annotations

import pytest
import torch
from hf_dirs import make_directory

from normswap.calibrate.parallel_load import _check_covered, _computed_buffers
from normswap.errors import BadInputError
from normswap.load.checkpoint_dir import build_on_meta, read_checkpoint_directory
from normswap.load.safetensors_io import read_header, read_rows, read_tensor


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return read_checkpoint_directory(make_directory(tmp_path_factory.mktemp("dirs"), "llama"))


def test_rows_are_read_from_their_byte_range(llama):
    shard = llama.path / llama.shards[0]
    entries, _ = read_header(shard)
    name, entry = next((n, e) for n, e in entries.items() if len(e.shape) == 2)
    whole = read_tensor(shard, entry)
    for start, stop in ((0, 1), (3, 7), (entry.shape[0] - 2, entry.shape[0]), (5, 5)):
        assert torch.equal(read_rows(shard, entry, start, stop), whole[start:stop]), (name, start, stop)
    with pytest.raises(ValueError, match="rows 0:999999"):
        read_rows(shard, entry, 0, 999999)


def test_the_files_must_cover_the_model(llama):
    model = build_on_meta(llama)
    model.tie_weights()
    stored = set(llama.weight_map)
    computed = _computed_buffers(llama)
    assert all("rotary_emb" in name for name in computed)  # the computed frequencies, nothing stored
    _check_covered(model, llama, stored)  # the directory as written: covered
    dropped = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(BadInputError, match=f"missing \\['{dropped}'\\]"):
        _check_covered(model, llama, stored - {dropped})
    with pytest.raises(BadInputError, match=r"unexpected \['extra.weight'\]"):
        _check_covered(model, llama, stored | {"extra.weight"})
