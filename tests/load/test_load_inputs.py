"""Example inputs: --input-shape parsing, synthesis, --inputs files and which source wins."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from normswap.errors import BadInputError
from normswap.load import (
    InputSpec,
    LoadedModel,
    load_inputs_file,
    make_inputs,
    parse_input_shape,
    require_inputs,
    resolve_inputs,
)


@pytest.mark.parametrize(
    ("text", "shape", "dtype"),
    [
        ("1,3,224,224", (1, 3, 224, 224), torch.float32),
        ("int64:1,16", (1, 16), torch.int64),
        ("float16:2,8", (2, 8), torch.float16),
        ("bf16:4", (4,), torch.bfloat16),
        ("bool:2,5", (2, 5), torch.bool),
        (" INT32: 3 , 7 ", (3, 7), torch.int32),
    ],
)
def test_parse_input_shape(text: str, shape: tuple, dtype: torch.dtype) -> None:
    assert parse_input_shape(text) == InputSpec(shape=shape, dtype=dtype)


@pytest.mark.parametrize("text", ["", "1,,3", "a,b", "float99:1,2", "1,0", "int64:", "1,-2", "1x3"])
def test_parse_input_shape_rejects(text: str) -> None:
    with pytest.raises(BadInputError) as info:
        parse_input_shape(text)
    message = str(info.value)
    assert message.startswith(
        f"bad --input-shape {text!r}: expected comma-separated positive sizes like 1,3,224,224"
    )
    assert "int64:1,16" in message


def test_make_inputs_shapes_dtypes_and_seed() -> None:
    specs = [InputSpec((2, 3), torch.float32), InputSpec((4,), torch.bfloat16), InputSpec((5,), torch.bool)]
    first = make_inputs(specs, seed=3)
    assert [(t.shape, t.dtype) for t in first] == [
        ((2, 3), torch.float32),
        ((4,), torch.bfloat16),
        ((5,), torch.bool),
    ]
    for a, b in zip(first, make_inputs(specs, seed=3), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], make_inputs(specs, seed=4)[0])


def test_make_inputs_token_ids_fit_the_smallest_embedding() -> None:
    model = nn.ModuleDict({"small": nn.Embedding(7, 4), "big": nn.Embedding(50, 4)})
    (ids,) = make_inputs([InputSpec((4000,), torch.int64)], model)
    assert ids.dtype == torch.int64
    assert ids.min().item() == 0 and ids.max().item() == 6


def test_make_inputs_token_ids_without_embedding() -> None:
    (ids,) = make_inputs([InputSpec((4000,), torch.int64)], nn.Linear(2, 2))
    assert ids.min().item() >= 0 and ids.max().item() == 99


def test_make_inputs_narrow_int_dtype_stays_in_range() -> None:
    (ids,) = make_inputs([InputSpec((4000,), torch.int8)], nn.Embedding(1000, 2))
    assert ids.min().item() >= 0 and ids.max().item() <= 127


@pytest.mark.parametrize(
    ("saved", "n_args", "kwarg_keys"),
    [
        (torch.ones(2), 1, set()),
        ((torch.ones(2), torch.zeros(3)), 2, set()),
        ([torch.ones(2)], 1, set()),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long)}, 0, {"input_ids"}),
        (((torch.ones(2),), {"mask": torch.ones(2)}), 1, {"mask"}),
    ],
    ids=["tensor", "tuple", "list", "dict", "args_kwargs_pair"],
)
def test_load_inputs_file(tmp_path: Path, saved: object, n_args: int, kwarg_keys: set) -> None:
    path = tmp_path / "inputs.pt"
    torch.save(saved, path)
    args, kwargs = load_inputs_file(path)
    assert isinstance(args, tuple) and len(args) == n_args
    assert set(kwargs) == kwarg_keys


def test_load_inputs_file_rejects_non_tensor_content(tmp_path: Path) -> None:
    path = tmp_path / "inputs.pt"
    torch.save(3, path)
    with pytest.raises(BadInputError, match=r"^inputs file .* holds a int: expected a tensor, a tuple/list"):
        load_inputs_file(path)


def test_load_inputs_file_missing(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match=r"^inputs file not found: "):
        load_inputs_file(tmp_path / "absent.pt")


def _loaded(example_args: tuple | None = None, example_kwargs: dict | None = None) -> LoadedModel:
    return LoadedModel(
        model=nn.Embedding(10, 2),
        example_args=example_args,
        example_kwargs=example_kwargs,
        source="test",
        format="factory",
    )


def test_resolve_inputs_priority(tmp_path: Path) -> None:
    path = tmp_path / "inputs.pt"
    torch.save((torch.full((1,), 5.0),), path)
    loaded = _loaded(example_args=(torch.zeros(9),))

    args, kwargs = resolve_inputs(loaded, inputs_file=path, input_shapes=["int64:3"])
    assert torch.equal(args[0], torch.full((1,), 5.0)) and kwargs == {}

    args, _ = resolve_inputs(loaded, input_shapes=["int64:3"])
    assert args[0].shape == (3,) and args[0].dtype == torch.int64
    assert args[0].max().item() < 10  # the model's Embedding(10, 2)

    args, kwargs = resolve_inputs(loaded)
    assert torch.equal(args[0], torch.zeros(9)) and kwargs == {}


def test_resolve_inputs_kwargs_only_example() -> None:
    args, kwargs = resolve_inputs(_loaded(example_kwargs={"x": torch.ones(1)}))
    assert args == () and set(kwargs) == {"x"}


def test_require_inputs_says_how_to_give_them() -> None:
    assert resolve_inputs(_loaded()) is None
    with pytest.raises(BadInputError) as info:
        require_inputs(_loaded())
    assert str(info.value) == (
        "this command needs example inputs: pass --inputs FILE (a tuple or dict of tensors saved with "
        "torch.save) or --input-shape 1,3,224,224 (repeatable; prefix int64: for token ids)"
    )
