"""Model files and factories: what loads, what is refused, and the exact reason given."""

from __future__ import annotations

import os
import pathlib
import pickle
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from normswap.errors import BadInputError
from normswap.load import ModelFormat, detect_format, load_model, read_tensor_file

TINY_FACTORY = """
def build(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3)).eval()
"""


# --- torch.export archives -------------------------------------------------------------------------


def test_pt2_loads_with_its_example_inputs(
    pt2_file: Path, example_x: torch.Tensor, tiny_model: nn.Module
) -> None:
    assert detect_format(pt2_file) is ModelFormat.EXPORTED_PROGRAM
    loaded = load_model(str(pt2_file))
    assert loaded.format == "pt2"
    assert loaded.source == str(pt2_file)
    assert loaded.example_kwargs == {}
    torch.testing.assert_close(loaded.example_args[0], example_x)
    torch.testing.assert_close(loaded.model(example_x), tiny_model(example_x))


def test_pt2_named_dot_pt_is_still_an_exported_program(pt2_file: Path, tmp_path: Path) -> None:
    renamed = tmp_path / "model.pt"
    shutil.copy(pt2_file, renamed)
    assert detect_format(renamed) is ModelFormat.EXPORTED_PROGRAM
    assert load_model(str(renamed)).format == "pt2"


def test_pt2_without_stored_inputs_gets_synthesized_ones(tmp_path: Path, tiny_model: nn.Module) -> None:
    ep = torch.export.export(tiny_model, (torch.randn(5, 4),))
    ep.example_inputs = None
    path = tmp_path / "bare.pt2"
    torch.export.save(ep, path)
    loaded = load_model(str(path))
    (x,) = loaded.example_args
    assert x.shape == (5, 4) and x.dtype == torch.float32
    assert loaded.example_kwargs == {}
    torch.testing.assert_close(loaded.model(x), tiny_model(x))


class _TokensWithMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, ids: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        return self.norm(self.embed(ids)) * mask.unsqueeze(-1)


def test_pt2_synthesized_inputs_keep_kwargs_dtypes_and_dynamic_sizes(tmp_path: Path) -> None:
    seq = torch.export.Dim("seq")
    ep = torch.export.export(
        _TokensWithMask(),
        (torch.zeros(2, 5, dtype=torch.long),),
        {"mask": torch.ones(2, 5)},
        dynamic_shapes={"ids": {1: seq}, "mask": {1: seq}},
    )
    ep.example_inputs = None
    path = tmp_path / "dynamic.pt2"
    torch.export.save(ep, path)
    loaded = load_model(str(path))
    (ids,) = loaded.example_args
    assert (ids.shape, ids.dtype) == ((2, 5), torch.int64)
    assert set(loaded.example_kwargs) == {"mask"}
    assert loaded.example_kwargs["mask"].dtype == torch.float32
    assert loaded.model(ids, **loaded.example_kwargs).shape == (2, 5, 4)


def test_pt2_is_not_modified_by_loading(pt2_file: Path) -> None:
    before = pt2_file.read_bytes()
    load_model(str(pt2_file))
    assert pt2_file.read_bytes() == before


# --- factories -------------------------------------------------------------------------------------


def test_factory_module_callable(write_factory, example_x: torch.Tensor, tiny_model: nn.Module) -> None:
    name = write_factory(TINY_FACTORY)
    path_before = list(sys.path)
    loaded = load_model(f"{name}:build")
    assert sys.path == path_before
    assert loaded.format == "factory" and loaded.source == f"{name}:build"
    assert loaded.example_args is None and loaded.example_kwargs is None
    torch.testing.assert_close(loaded.model(example_x), tiny_model(example_x))


def test_factory_file_py_callable(tmp_path: Path, example_x: torch.Tensor, tiny_model: nn.Module) -> None:
    path = tmp_path / "sub" / "my_models.py"
    path.parent.mkdir()
    path.write_text("import torch\nfrom torch import nn\n" + TINY_FACTORY)
    path_before = list(sys.path)
    try:
        loaded = load_model(f"{path}:build")
    finally:
        sys.modules.pop("my_models", None)
    assert sys.path == path_before
    assert loaded.format == "factory"
    torch.testing.assert_close(loaded.model(example_x), tiny_model(example_x))


def test_factory_returning_model_and_tensor(write_factory) -> None:
    name = write_factory(TINY_FACTORY + "\ndef with_x():\n    return build(), torch.ones(3, 4)\n")
    loaded = load_model(f"{name}:with_x")
    (x,) = loaded.example_args
    assert torch.equal(x, torch.ones(3, 4))
    assert loaded.example_kwargs == {}


@pytest.mark.parametrize(
    ("returned", "args_len", "kwargs_keys"),
    [
        ("(build(), [torch.ones(1), torch.zeros(2)])", 2, set()),
        ("(build(), {'input_ids': torch.ones(1, 3)})", 0, {"input_ids"}),
        ("(build(), (torch.ones(1),), {'mask': torch.ones(1)})", 1, {"mask"}),
    ],
)
def test_factory_example_input_forms(write_factory, returned: str, args_len: int, kwargs_keys: set) -> None:
    name = write_factory(TINY_FACTORY + f"\ndef make():\n    return {returned}\n")
    loaded = load_model(f"{name}:make")
    assert len(loaded.example_args) == args_len
    assert set(loaded.example_kwargs) == kwargs_keys


@pytest.mark.parametrize(
    ("body", "attr", "reason"),
    [
        ("def make():\n    return 3\n", "make", "gave a int, not a torch.nn.Module"),
        ("make = 5\n", "make", "is a int, not a callable"),
        (
            "def make():\n    raise ValueError('no weights here')\n",
            "make",
            "raised ValueError: no weights here",
        ),
        ("", "absent", "has no attribute 'absent'"),
    ],
)
def test_factory_refusals(write_factory, body: str, attr: str, reason: str) -> None:
    name = write_factory(body)
    with pytest.raises(BadInputError, match=r"^factory") as info:
        load_model(f"{name}:{attr}")
    assert reason in str(info.value)
    assert "\n" not in str(info.value)


def test_factory_import_error_names_the_module() -> None:
    with pytest.raises(BadInputError) as info:
        load_model("nosuchpkg_normswap.models:build")
    assert str(info.value) == (
        "cannot import factory module 'nosuchpkg_normswap.models': No module named 'nosuchpkg_normswap'"
    )


def test_factory_file_missing(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match="factory file not found"):
        load_model(f"{tmp_path / 'absent.py'}:build")


def test_factory_file_with_syntax_error(tmp_path: Path) -> None:
    path = tmp_path / "broken_factory_file.py"
    path.write_text("def build(:\n")
    with pytest.raises(BadInputError, match="failed while importing: SyntaxError"):
        load_model(f"{path}:build")


# --- --weights -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["torch_state_dict", "safetensors", "checkpoint_dict"])
def test_weights_round_trip(
    write_factory, tiny_model_factory, tmp_path: Path, example_x: torch.Tensor, kind: str
) -> None:
    name = write_factory(TINY_FACTORY)
    trained = tiny_model_factory(7)
    state = trained.state_dict()
    if kind == "safetensors":
        # The suffix says nothing: the file is recognized by its header.
        weights = tmp_path / "weights.bin"
        save_file({k: v.contiguous() for k, v in state.items()}, str(weights))
    elif kind == "checkpoint_dict":
        weights = tmp_path / "ckpt.pt"
        torch.save({"epoch": 3, "state_dict": state}, weights)
    else:
        weights = tmp_path / "weights.pt"
        torch.save(state, weights)

    loaded = load_model(f"{name}:build", weights=weights)
    expected = trained(example_x)
    assert not torch.allclose(tiny_model_factory(0)(example_x), expected)
    torch.testing.assert_close(loaded.model(example_x), expected, rtol=0, atol=0)


def test_weights_with_wrong_keys_lists_them(write_factory, tmp_path: Path, tiny_model: nn.Module) -> None:
    name = write_factory(TINY_FACTORY)
    state = tiny_model.state_dict()
    del state["2.bias"]
    state["extra.weight"] = torch.zeros(1)
    weights = tmp_path / "w.pt"
    torch.save(state, weights)
    with pytest.raises(BadInputError) as info:
        load_model(f"{name}:build", weights=weights)
    assert str(info.value) == (
        f"weights file {weights} does not match the model: missing keys: 2.bias; unexpected keys: extra.weight"
    )


def test_weights_with_many_missing_keys_are_capped_at_five(write_factory, tmp_path: Path) -> None:
    name = write_factory(TINY_FACTORY)
    weights = tmp_path / "w.pt"
    torch.save({"only.weight": torch.zeros(1)}, weights)
    with pytest.raises(
        BadInputError, match=r"missing keys: 0\.weight, 0\.bias, 1\.weight, 1\.bias, 2\.weight \(\+1 more\)"
    ):
        load_model(f"{name}:build", weights=weights)


def test_weights_with_wrong_shape(write_factory, tmp_path: Path, tiny_model: nn.Module) -> None:
    name = write_factory(TINY_FACTORY)
    state = tiny_model.state_dict()
    state["0.weight"] = torch.zeros(8, 5)
    weights = tmp_path / "w.pt"
    torch.save(state, weights)
    with pytest.raises(BadInputError, match=r"does not fit the model: size mismatch for 0\.weight"):
        load_model(f"{name}:build", weights=weights)


def test_weights_that_are_a_pickled_module_are_refused(
    write_factory, tmp_path: Path, tiny_model: nn.Module
) -> None:
    name = write_factory(TINY_FACTORY)
    weights = tmp_path / "whole_model.pt"
    torch.save(tiny_model, weights)
    with pytest.raises(
        BadInputError, match="is a pickled Python object, not a state dict: --weights must be"
    ):
        load_model(f"{name}:build", weights=weights)


def test_weights_with_a_model_file_are_refused(pt2_file: Path, tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match=r"--weights only applies to a factory"):
        load_model(str(pt2_file), weights=tmp_path / "w.pt")


# --- refused model files ---------------------------------------------------------------------------


def test_torchscript_is_refused(tmp_path: Path, tiny_model: nn.Module) -> None:
    path = tmp_path / "scripted.pt"
    torch.jit.save(torch.jit.script(tiny_model), path)
    assert detect_format(path) is ModelFormat.TORCHSCRIPT
    with pytest.raises(BadInputError) as info:
        load_model(str(path))
    assert str(info.value) == (
        f"{path} is a TorchScript archive; normswap rewrites eager or torch.export models: "
        "export it with torch.export.save or give its factory as package.module:callable"
    )


def test_state_dict_as_model_is_refused_with_weights_hint(tmp_path: Path, tiny_model: nn.Module) -> None:
    path = tmp_path / "sd.pth"
    torch.save(tiny_model.state_dict(), path)
    assert detect_format(path) is ModelFormat.STATE_DICT
    with pytest.raises(BadInputError) as info:
        load_model(str(path))
    assert str(info.value) == (
        f"{path} holds a state dict (weights only), not a model: give the model's factory as "
        f"package.module:callable and pass this file with --weights {path}"
    )


def test_safetensors_as_model_is_refused_with_weights_hint(tmp_path: Path, tiny_model: nn.Module) -> None:
    path = tmp_path / "model.safetensors"
    save_file(tiny_model.state_dict(), str(path))
    assert detect_format(path) is ModelFormat.SAFETENSORS
    with pytest.raises(BadInputError, match=rf"not a model: .* --weights {re.escape(str(path))}$"):
        load_model(str(path))


def test_tensor_file_as_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save(torch.ones(2), path)
    with pytest.raises(BadInputError, match=r"holds a Tensor of tensors, not a model or a state dict"):
        load_model(str(path))


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.pt2"
    with pytest.raises(BadInputError) as info:
        load_model(str(path))
    assert str(info.value) == (
        f"model file not found: {path} (give a .pt2 file, or a factory as package.module:callable)"
    )


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.pt2"
    path.touch()
    with pytest.raises(BadInputError) as info:
        load_model(str(path))
    assert str(info.value) == f"model file is empty: {path}"


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match=r"is a directory without a config\.json"):
        load_model(str(tmp_path))


def test_garbage_file(tmp_path: Path) -> None:
    path = tmp_path / "garbage.pt"
    path.write_bytes(b"this is not a model at all" * 10)
    with pytest.raises(BadInputError) as info:
        load_model(str(path))
    assert str(info.value) == (
        f"not a model file normswap can read: {path} "
        "(neither a torch.save/torch.export archive, a pickle nor a safetensors file)"
    )


@pytest.mark.parametrize("fraction", [0.5, 0.95])
def test_truncated_torch_save_file(tmp_path: Path, tiny_model: nn.Module, fraction: float) -> None:
    full = tmp_path / "full.pt"
    torch.save(tiny_model.state_dict(), full)
    data = full.read_bytes()
    path = tmp_path / "truncated.pt"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(BadInputError) as info:
        detect_format(path)
    assert (
        str(info.value) == f"not a model file normswap can read: {path} (a truncated or corrupt zip archive)"
    )


def test_truncated_pt2(tmp_path: Path, pt2_file: Path) -> None:
    path = tmp_path / "truncated.pt2"
    path.write_bytes(pt2_file.read_bytes()[:200])
    with pytest.raises(BadInputError, match=r"^not a model file normswap can read"):
        load_model(str(path))


# --- pickles ---------------------------------------------------------------------------------------


class _TouchOnUnpickle:
    """Unpickling this creates a file: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


class _ShellOnUnpickle:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def _pickle_dump(obj: object, path: Path) -> None:
    with path.open("wb") as f:
        pickle.dump(obj, f)


MALICIOUS = [_TouchOnUnpickle, _ShellOnUnpickle]
WRITERS = {"torch.save": torch.save, "pickle.dump": _pickle_dump}


@pytest.mark.parametrize("payload_cls", MALICIOUS, ids=lambda c: c.__name__)
def test_malicious_payload_really_runs_when_unpickled(tmp_path: Path, payload_cls: type) -> None:
    # Without this, the refusal test below could pass because the payload is inert.
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(payload_cls(marker)))
    assert marker.exists()


@pytest.mark.parametrize("payload_cls", MALICIOUS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("writer", list(WRITERS))
def test_malicious_pickle_is_refused_without_running(tmp_path: Path, payload_cls: type, writer: str) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "model.pt"
    WRITERS[writer]({"model": payload_cls(marker)}, path)

    assert detect_format(path) is ModelFormat.PICKLED_OBJECT
    with pytest.raises(BadInputError) as info:
        load_model(str(path))
    assert str(info.value) == (
        f"{path} is a pickled Python object; unpickling runs arbitrary code, so normswap refuses it "
        "without --trust-pickle (or export the model with torch.export.save, or give its factory)"
    )
    # The same file given as --inputs or --weights must not run either.
    with pytest.raises(BadInputError, match="is a pickled Python object, not tensors"):
        read_tensor_file(path, what="inputs file")
    assert not marker.exists()


@pytest.mark.parametrize("writer", list(WRITERS))
def test_trusted_pickle_of_a_module_loads(
    tmp_path: Path, tiny_model: nn.Module, example_x: torch.Tensor, writer: str
) -> None:
    path = tmp_path / "whole.pt"
    WRITERS[writer](tiny_model, path)
    assert detect_format(path) is ModelFormat.PICKLED_OBJECT
    loaded = load_model(str(path), trust_pickle=True)
    assert loaded.format == "pickle"
    assert loaded.example_args is None
    torch.testing.assert_close(loaded.model(example_x), tiny_model(example_x), rtol=0, atol=0)


def test_trusted_pickle_with_example_inputs(tmp_path: Path, tiny_model: nn.Module) -> None:
    path = tmp_path / "whole.pt"
    torch.save((tiny_model, torch.ones(2, 4)), path)
    loaded = load_model(str(path), trust_pickle=True)
    assert torch.equal(loaded.example_args[0], torch.ones(2, 4))


def test_trusted_pickle_that_is_not_a_module(tmp_path: Path) -> None:
    import datetime

    path = tmp_path / "date.pt"
    torch.save(datetime.date(2020, 1, 1), path)
    with pytest.raises(BadInputError, match=r"gave a date, not a torch\.nn\.Module"):
        load_model(str(path), trust_pickle=True)
