"""A .pt2 read without its weights (for torchrun's shards): the program on the meta device, each weight's
byte range in the archive, rows read from those ranges equal to what torch's loader reads; a layout this
reader does not handle is loaded whole; the checks before training trace it on fake weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_dirs import make_directory
from torch import nn

from normswap.load import load_model
from normswap.load.program import load_program_on_meta
from normswap.load.safetensors_io import read_rows, read_tensor
from normswap.util.fake_weights import fake_weights


@pytest.fixture(scope="module")
def llama_pt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF Llama (tied embedding and head) exported with torch.export.save, as a user's program."""
    root = tmp_path_factory.mktemp("program")
    model = load_model(str(make_directory(root, "llama"))).model
    model.config.tie_word_embeddings = True
    model.tie_weights()
    ids = torch.randint(0, 300, (2, 11))
    free = {"input_ids": {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}}
    path = root / "llama.pt2"
    torch.export.save(
        torch.export.export(model, (), {"input_ids": ids}, dynamic_shapes=free, strict=False), path
    )
    return path


def test_every_weight_is_located_and_its_rows_read_as_torch_reads_them(llama_pt2: Path) -> None:
    read = load_program_on_meta(llama_pt2, trust_pickle=False)
    assert read is not None
    model, _, kwargs, weights = read
    whole = load_model(str(llama_pt2)).model.state_dict()
    state = model.state_dict(keep_vars=True)
    assert state.keys() == whole.keys()
    # every stored weight is on the meta device and located; the constants (rotary frequencies) were read
    assert weights.entries.keys() == state.keys() and all(tensor.is_meta for tensor in state.values())
    read_for_real = {name for name, buffer in model.named_buffers() if not buffer.is_meta}
    assert read_for_real == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    assert kwargs is not None and set(kwargs) == {"input_ids"}
    for name, entry in weights.entries.items():
        assert torch.equal(read_tensor(weights.path, entry), whole[name]), name
        if entry.shape and entry.shape[0] >= 3:
            assert torch.equal(read_rows(weights.path, entry, 1, 3), whole[name][1:3]), name
    # the tied head is the embedding's member, read from the same bytes
    head, embedding = weights.entries["lm_head.weight"], weights.entries["model.embed_tokens.weight"]
    assert (head.start, head.end) == (embedding.start, embedding.end)


class _Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 4).t())  # stored with strides (1, 4): not one row run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_a_layout_not_read_by_range_is_left_to_the_whole_load(tmp_path: Path) -> None:
    path = tmp_path / "transposed.pt2"
    torch.export.save(torch.export.export(_Transposed(), (torch.randn(2, 4),)), path)
    assert load_model(str(path)).model.weight.stride() == (1, 4)  # torch keeps the layout it saved
    assert load_program_on_meta(path, trust_pickle=False) is None


def test_a_program_on_meta_traces_on_fake_weights_and_gets_its_meta_tensors_back(llama_pt2: Path) -> None:
    """The program asserts the device it was captured on; fake tensors on the inputs' device satisfy it."""
    from normswap.graph.capture import capture_graph

    read = load_program_on_meta(llama_pt2, trust_pickle=False)
    assert read is not None
    model, args, kwargs, _ = read
    for name, buffer in list(model.named_buffers()):
        owner, _, attribute = name.rpartition(".")
        model.get_submodule(owner)._buffers[attribute] = buffer.to("meta")
    before = {name: tensor for name, tensor in model.state_dict(keep_vars=True).items()}
    with pytest.raises(Exception, match="device"):
        torch.export.export(model, args or (), kwargs, strict=False)  # meta weights, CPU inputs
    with fake_weights(model, args, kwargs):
        captured = capture_graph(model, args, kwargs)
    assert captured.method == "export" and captured.graph is not None
    after = model.state_dict(keep_vars=True)
    assert all(after[name] is tensor and tensor.is_meta for name, tensor in before.items())


def test_compressed_weight_members_are_not_read_by_range(llama_pt2: Path, tmp_path: Path) -> None:
    """torch stores each weight member as is; a writer that compresses them makes byte ranges meaningless:
    such an archive is loaded whole instead of read as garbage."""
    import zipfile

    compressed = tmp_path / "compressed.pt2"
    with zipfile.ZipFile(llama_pt2) as source, zipfile.ZipFile(compressed, "w") as target:
        for info in source.infolist():
            packed = zipfile.ZIP_DEFLATED if "/data/weights/weight_" in info.filename else zipfile.ZIP_STORED
            target.writestr(info.filename, source.read(info), compress_type=packed)
    assert load_program_on_meta(compressed, trust_pickle=False) is None
    assert load_program_on_meta(llama_pt2, trust_pickle=False) is not None


def test_a_weight_member_stored_twice_is_not_read_by_range(llama_pt2: Path, tmp_path: Path) -> None:
    """torch's reader resolves a name stored twice to one entry; a range checked on the other would read
    something else: an archive with a plain copy ahead of a compressed weight member is loaded whole."""
    import zipfile

    doubled = tmp_path / "doubled.pt2"
    with zipfile.ZipFile(llama_pt2) as source, zipfile.ZipFile(doubled, "w") as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith("/data/weights/weight_0"):
                target.writestr(info.filename, data, compress_type=zipfile.ZIP_STORED)
                target.writestr(info.filename, data, compress_type=zipfile.ZIP_DEFLATED)
            else:
                target.writestr(info.filename, data, compress_type=zipfile.ZIP_STORED)
    assert load_program_on_meta(doubled, trust_pickle=False) is None


def test_the_older_layout_torch_still_reads_is_left_to_the_whole_load(tmp_path: Path) -> None:
    """torch.export.load still reads the pre-2.8 zip layout (members at the zip's root); this reader does
    not, so it says so (None) and the whole load reads it."""
    from old_pt2 import write_old_layout

    program = torch.export.export(_Transposed().eval(), (torch.randn(2, 4),))
    old = write_old_layout(tmp_path / "old.pt2", program, ((torch.randn(2, 4),), {}))
    assert load_program_on_meta(old, trust_pickle=False) is None
    assert load_model(str(old)).model(torch.ones(2, 4)).shape == (2, 6)


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.stage = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.stage(x)


def test_an_unflattened_list_of_blocks_is_found_and_a_stage_of_layers_is_not() -> None:
    from normswap.verify.blockwise import block_list, find_blocks

    unflattened = torch.export.unflatten(torch.export.export(_Stack(), (torch.randn(2, 4),)))
    assert find_blocks(unflattened) == ("blocks", 3)
    assert len(block_list(unflattened.get_submodule("blocks"))) == 3
    assert block_list(unflattened.get_submodule("stage")) == []  # children of unequal shapes
