"""Tampered .pt2 archives: nothing in an archive runs without --trust-pickle, and every refusal is one
line, exit 2, before anything runs.

Each attack builds a real archive with torch.export.save, then edits one member the way an attacker
would: a pickle whose ``__reduce__`` writes a marker file and then returns what torch expects there, so
that on an unguarded loader the load goes on and the command reports success. One attack for each
place where torch 2.14's ``torch.export.load`` unpickles (or evaluates) archive content; the
``--trust-pickle`` runs are the positive control that the payloads really run.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import logging
import pickle
import re
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from normswap_cli.app import app
from torch import nn
from torch.export.pt2_archive import constants as pt2_constants
from typer.testing import CliRunner

from normswap.load import load_model
from normswap.load.archive import UnsafeArchiveError

# torch 2.11 (the GPU machine's) predates opaque objects in archives, and its deserializer refuses a
# graph target such as torch.os.system before normswap's own check of the loaded graph could name it.
_TORCH_NAMES_BAD_TARGETS = hasattr(pt2_constants, "OPAQUE_OBJ_FILENAME_PREFIX")

runner = CliRunner()


class _ConstantModel(nn.Module):
    """A Linear and a plain tensor attribute, so the archive holds weights and a tensor constant."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8).eval()
        self.offset = torch.ones(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x)) + self.offset


@pytest.fixture(scope="module")
def clean_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = _ConstantModel().eval()
    batch = torch.export.Dim("batch", min=2)
    ep = torch.export.export(model, (torch.randn(4, 8),), dynamic_shapes=({0: batch},))
    path = tmp_path_factory.mktemp("pt2") / "clean.pt2"
    torch.export.save(ep, path)
    return path


class _Payload:
    """Unpickles as ``eval(code)``: writes the marker, then returns the value torch expects."""

    def __init__(self, marker: Path, value: str) -> None:
        self.code = f"(open({str(marker)!r}, 'w').close(), {value})[1]"

    def __reduce__(self) -> tuple:
        return (builtins.eval, (self.code,))


_TORCH = "__import__('torch')"


def _torch_saved(marker: Path, value: str) -> bytes:
    buffer = io.BytesIO()
    torch.save(_Payload(marker, value), buffer)
    return buffer.getvalue()


def _rewrite(
    src: Path,
    dst: Path,
    replace: dict[str, Callable[[bytes], bytes]] | None = None,
    add: dict[str, bytes] | None = None,
) -> Path:
    """Copy a zip, passing each member whose name ends with a key of ``replace`` through its function;
    ``add`` appends members (names relative to the archive's top folder)."""
    replace = replace or {}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        top = zin.namelist()[0].split("/", 1)[0]
        for info in zin.infolist():
            data = zin.read(info.filename)
            for suffix, edit in replace.items():
                if info.filename.endswith("/" + suffix):
                    data = edit(data)
            zout.writestr(info, data)
        for name, data in (add or {}).items():
            zout.writestr(f"{top}/{name}", data)
    return dst


def _edit_config(entry: str, **changes: object) -> Callable[[bytes], bytes]:
    def edit(data: bytes) -> bytes:
        config = json.loads(data)
        config["config"][entry].update(changes)
        return json.dumps(config).encode()

    return edit


def _add_constant_entry(name: str, path_name: str) -> Callable[[bytes], bytes]:
    def edit(data: bytes) -> bytes:
        config = json.loads(data)
        config["config"][name] = {
            "path_name": path_name,
            "is_param": False,
            "use_pickle": True,
            "tensor_meta": None,
        }
        return json.dumps(config).encode()

    return edit


# Each attack: (name, builder(clean, dst, marker) -> tampered path, member named in the refusal).
def _sample_inputs(clean: Path, dst: Path, marker: Path) -> Path:
    payload = _torch_saved(marker, f"(({_TORCH}.randn(4, 8),), {{}})")
    return _rewrite(clean, dst, {"data/sample_inputs/model.pt": lambda _: payload})


def _marked_pickled(config: str, entry: str, member: str, value: str) -> Callable[[Path, Path, Path], Path]:
    """An attack that marks one payload ``use_pickle`` in its config and puts the pickle in its member."""

    def build(clean: Path, dst: Path, marker: Path) -> Path:
        payload = _torch_saved(marker, value)
        return _rewrite(clean, dst, {config: _edit_config(entry, use_pickle=True), member: lambda _: payload})

    return build


_pickled_weight = _marked_pickled(
    "data/weights/model_weights_config.json",
    "lin.weight",
    "data/weights/weight_0",
    f"{_TORCH}.nn.Parameter({_TORCH}.zeros(8, 8))",
)
_pickled_constant = _marked_pickled(
    "data/constants/model_constants_config.json", "offset", "data/constants/tensor_0", f"{_TORCH}.ones(8)"
)


def _opaque_object(clean: Path, dst: Path, marker: Path) -> Path:
    return _rewrite(
        clean,
        dst,
        {"data/constants/model_constants_config.json": _add_constant_entry("extra", "opaque_obj_0")},
        add={"data/constants/opaque_obj_0": pickle.dumps(_Payload(marker, "None"))},
    )


def _legacy_weights(clean: Path, dst: Path, marker: Path) -> Path:
    state = f"{{'lin.weight': {_TORCH}.zeros(8, 8), 'lin.bias': {_TORCH}.zeros(8)}}"
    return _rewrite(clean, dst, add={"data/weights/model.pt": _torch_saved(marker, state)})


def _legacy_constants(clean: Path, dst: Path, marker: Path) -> Path:
    constants = f"{{'offset': {_TORCH}.ones(8)}}"
    return _rewrite(clean, dst, add={"data/constants/model.pt": _torch_saved(marker, constants)})


def _old_zip_layout(clean: Path, dst: Path, marker: Path) -> Path:
    """The pre-2.8 layout, which torch still reads when the new one fails to open."""
    from torch._export.serde.schema import SCHEMA_VERSION
    from torch._export.serde.serialize import serialize

    artifact = serialize(torch.export.load(clean))
    payload = _torch_saved(marker, f"(({_TORCH}.randn(4, 8),), {{}})")
    with zipfile.ZipFile(dst, "w") as archive:
        archive.writestr("version", ".".join(map(str, SCHEMA_VERSION)))
        archive.writestr("serialized_exported_program.json", artifact.exported_program)
        archive.writestr("serialized_state_dict.pt", artifact.state_dict)
        archive.writestr("serialized_constants.pt", artifact.constants)
        archive.writestr("serialized_example_inputs.pt", payload)
    return dst


def _shape_expression(clean: Path, dst: Path, marker: Path) -> Path:
    """Not a pickle: torch parses every shape expression with sympy.sympify, that is, eval."""

    def edit(data: bytes) -> bytes:
        text = data.decode()
        symbol = re.search(r"\"(Symbol\('s\d+'[^\"]*\))\"", text)
        assert symbol is not None, "the dynamic batch should be a symbol in the program"
        evil = f"(open({str(marker)!r}, 'w').close() or {symbol.group(1)})"
        return text.replace(f'"{symbol.group(1)}"', json.dumps(evil), 1).encode()

    return _rewrite(clean, dst, {"models/model.json": edit})


_RUNS_PAYLOAD_WHEN_TRUSTED = [
    ("sample_inputs", _sample_inputs, "data/sample_inputs/model.pt"),
    ("pickled_weight", _pickled_weight, "data/weights/weight_0"),
    ("pickled_constant", _pickled_constant, "data/constants/tensor_0"),
    ("opaque_object", _opaque_object, "data/constants/opaque_obj_0"),
    ("legacy_weights", _legacy_weights, "data/weights/model.pt"),
    ("legacy_constants", _legacy_constants, "data/constants/model.pt"),
    ("old_zip_layout", _old_zip_layout, "serialized_example_inputs.pt"),
]


@pytest.mark.parametrize(
    ("build", "member"),
    [pytest.param(build, member, id=name) for name, build, member in _RUNS_PAYLOAD_WHEN_TRUSTED]
    + [pytest.param(_shape_expression, "models/model.json", id="shape_expression")],
)
def test_tampered_archive_is_refused_before_anything_runs(
    tmp_path: Path, clean_archive: Path, build: Callable, member: str
) -> None:
    marker = tmp_path / "payload-ran"
    tampered = build(clean_archive, tmp_path / "tampered.pt2", marker)
    out = tmp_path / "out.pt2"
    result = runner.invoke(app, ["convert", str(tampered), "--fold-bn", "-o", str(out)])
    assert not marker.exists(), "the archive's payload ran"
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    error_lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and member in error_lines[0], result.output
    assert not out.exists()


@pytest.mark.parametrize(
    ("build", "member"),
    [pytest.param(build, member, id=name) for name, build, member in _RUNS_PAYLOAD_WHEN_TRUSTED]
    + [pytest.param(_shape_expression, "models/model.json", id="shape_expression")],
)
def test_the_reader_without_weights_refuses_what_the_whole_reader_refuses(
    tmp_path: Path, clean_archive: Path, build: Callable, member: str
) -> None:
    """The .pt2 read onto the meta device for torchrun's shards goes through the same archive check."""
    from normswap.load.program import load_program_on_meta

    marker = tmp_path / "payload-ran"
    tampered = build(clean_archive, tmp_path / "tampered.pt2", marker)
    with pytest.raises(UnsafeArchiveError, match=re.escape(member)):
        load_program_on_meta(tampered, trust_pickle=False)
    assert not marker.exists(), "the archive's payload ran"


@pytest.mark.parametrize(
    "build", [pytest.param(build, id=name) for name, build, _ in _RUNS_PAYLOAD_WHEN_TRUSTED]
)
def test_payloads_are_live_under_trust_pickle(tmp_path: Path, clean_archive: Path, build: Callable) -> None:
    """The control: with --trust-pickle torch's own loader reaches the payload, so the refusals above
    are what kept it from running (and --trust-pickle means what it says)."""
    if build is _opaque_object and not hasattr(pt2_constants, "OPAQUE_OBJ_FILENAME_PREFIX"):
        pytest.skip(f"torch {torch.__version__} has no opaque objects in its archives: nothing to control")
    marker = tmp_path / "payload-ran"
    tampered = build(clean_archive, tmp_path / "tampered.pt2", marker)
    # some payloads return values the rest of the archive does not fit; they ran regardless
    with contextlib.suppress(Exception):
        load_model(str(tampered), trust_pickle=True)
    assert marker.exists()


def test_shape_expression_is_refused_even_under_trust_pickle(tmp_path: Path, clean_archive: Path) -> None:
    marker = tmp_path / "payload-ran"
    tampered = _shape_expression(clean_archive, tmp_path / "tampered.pt2", marker)
    with pytest.raises(UnsafeArchiveError, match="shape expression"):
        load_model(str(tampered), trust_pickle=True)
    assert not marker.exists()


def test_torchbind_object_is_refused(tmp_path: Path, clean_archive: Path) -> None:
    tampered = _rewrite(
        clean_archive,
        tmp_path / "tampered.pt2",
        {"data/constants/model_constants_config.json": _add_constant_entry("obj", "custom_obj_0")},
        add={"data/constants/custom_obj_0": b"\x80\x02N."},
    )
    with pytest.raises(UnsafeArchiveError, match="custom_obj_0 is a torchbind object"):
        load_model(str(tampered))


def test_constant_of_an_unknown_kind_is_refused(tmp_path: Path, clean_archive: Path) -> None:
    # A name no torch version gives a tensor constant: whatever this torch does with it, a scan that
    # only knows tensors does not let it through.
    marker = tmp_path / "payload-ran"
    tampered = _rewrite(
        clean_archive,
        tmp_path / "tampered.pt2",
        {"data/constants/model_constants_config.json": _add_constant_entry("obj", "future_obj_0")},
        add={"data/constants/future_obj_0": pickle.dumps(_Payload(marker, "None"))},
    )
    with pytest.raises(
        UnsafeArchiveError, match="future_obj_0 is a constant of a kind normswap does not know"
    ):
        load_model(str(tampered))
    assert not marker.exists()


def test_aoti_native_code_is_refused_even_under_trust_pickle(tmp_path: Path, clean_archive: Path) -> None:
    tampered = _rewrite(
        clean_archive, tmp_path / "tampered.pt2", add={"data/aotinductor/model/model.so": b"\x7fELF"}
    )
    with pytest.raises(UnsafeArchiveError, match=r"data/aotinductor/model/model\.so is AOTInductor"):
        load_model(str(tampered), trust_pickle=True)


def test_graph_calling_a_python_function_is_refused(tmp_path: Path, clean_archive: Path) -> None:
    marker = tmp_path / "payload-ran"

    def edit(data: bytes) -> bytes:
        program = json.loads(data)
        node = program["graph_module"]["graph"]["nodes"][-1]
        node["target"] = "torch.os.system"
        node["inputs"] = [{"name": "command", "arg": {"as_string": f"touch {marker}"}, "kind": 1}]
        return json.dumps(program).encode()

    tampered = _rewrite(clean_archive, tmp_path / "tampered.pt2", {"models/model.json": edit})
    out = tmp_path / "out.pt2"
    result = runner.invoke(app, ["convert", str(tampered), "--fold-bn", "-o", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    if _TORCH_NAMES_BAD_TARGETS:
        assert "system" in result.output  # normswap's check of the loaded graph names the call
    else:
        # torch 2.11's deserializer refuses such a target itself, with a message that does not name it
        assert "error when deserializing" in result.output, result.output
    assert not marker.exists() and not out.exists()


def test_duplicate_member_names_cannot_hide_a_payload(tmp_path: Path, clean_archive: Path) -> None:
    """Two members of one name: the scan must read the one torch reads, whichever order they come in."""
    marker = tmp_path / "payload-ran"
    payload = _torch_saved(marker, f"(({_TORCH}.randn(4, 8),), {{}})")
    with zipfile.ZipFile(clean_archive) as archive:
        name = next(n for n in archive.namelist() if n.endswith("data/sample_inputs/model.pt"))
        benign = archive.read(name)
    for first, second in ((benign, payload), (payload, benign)):
        tampered = tmp_path / "dup.pt2"
        _rewrite(clean_archive, tampered)
        with zipfile.ZipFile(tampered, "a") as archive, pytest.warns(UserWarning, match="Duplicate name"):
            archive.writestr(name, first)
            archive.writestr(name, second)
        with contextlib.suppress(UnsafeArchiveError):
            load_model(str(tampered))
        assert not marker.exists()


def test_untampered_archives_still_load(tmp_path: Path, clean_archive: Path) -> None:
    loaded = load_model(str(clean_archive))
    (x,) = loaded.example_args
    assert x.shape == (4, 8)
    reference = torch.export.load(clean_archive).module()
    torch.testing.assert_close(loaded.model(x), reference(x), rtol=0, atol=0)


def test_untampered_old_zip_layout_still_loads(tmp_path: Path, clean_archive: Path) -> None:
    from old_pt2 import write_old_layout

    program = torch.export.load(clean_archive)
    old = write_old_layout(tmp_path / "old.pt2", program, program.example_inputs)
    loaded = load_model(str(old))
    x = torch.randn(3, 8)
    torch.testing.assert_close(loaded.model(x), torch.export.load(clean_archive).module()(x))


def test_hf_model_exported_with_torch_export_loads(tmp_path: Path) -> None:
    """Shape expressions of a real dynamic export (batch and sequence symbols, their products and
    floor divisions) pass the expression check."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=100)
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 100, (2, 16))
    batch, seq = torch.export.Dim("batch", min=2, max=8), torch.export.Dim("seq", min=2, max=64)
    ep = torch.export.export(
        model,
        (),
        {"input_ids": ids, "use_cache": False},
        dynamic_shapes={"input_ids": {0: batch, 1: seq}, "use_cache": None},
        strict=False,
    )
    path = tmp_path / "gpt2.pt2"
    torch.export.save(ep, path)
    loaded = load_model(str(path))
    other = torch.randint(0, 100, (3, 9))
    want = model(input_ids=other, use_cache=False).logits
    got = loaded.model(input_ids=other, use_cache=False)
    got = got["logits"] if isinstance(got, dict) else got.logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "expression",
    [
        "s0",
        "Symbol('s77', positive=True, integer=True)",
        "Mul(Integer(32), Symbol('s53', positive=True, integer=True))",
        "FloorDiv(Mul(s27, s77), Integer(2))",
        "Max(2, s0*s1)//3 + Integer(-1)",
        "Eq(Mod(s0, 2), 0)",
        "Float('0.5', precision=53)",
        "True",
    ],
)
def test_shape_expressions_torch_writes_are_accepted(expression: str) -> None:
    from normswap.load.archive import _expression_problem

    assert _expression_problem(expression) is None


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("__import__('os').system('x')", "calls something other than a sympy shape function"),
        ("open('f', 'w')", "calls something other than a sympy shape function"),
        ("sympify('1')", "calls something other than a sympy shape function"),
        ("s0.__class__", "uses Attribute"),
        ("[s0][0]", "uses Subscript"),
        ("lambda: 1", "uses Lambda"),
        ("Symbol('x; import os')", "passes the string"),
        ("Symbol('s0', evaluate=open)", "passes keyword 'evaluate'"),
        ("__builtins__", "names '__builtins__'"),
        ("s0 if s1 else s2", "uses IfExp"),
    ],
)
def test_shape_expressions_that_reach_python_are_refused(expression: str, problem: str) -> None:
    from normswap.load.archive import _expression_problem

    found = _expression_problem(expression)
    assert found is not None and found.startswith(problem)


def test_constant_kind_is_read_from_the_path_name_as_torch_reads_it(
    tmp_path: Path, clean_archive: Path
) -> None:
    """An opaque object whose path name leads back to a tensor member is still an opaque object."""
    marker = tmp_path / "payload-ran"
    tampered = _rewrite(
        clean_archive,
        tmp_path / "tampered.pt2",
        {
            "data/constants/model_constants_config.json": _add_constant_entry(
                "extra", "opaque_obj_/../tensor_0"
            )
        },
        add={"data/constants/opaque_obj_/../tensor_0": pickle.dumps(_Payload(marker, "None"))},
    )
    with pytest.raises(UnsafeArchiveError, match="opaque Python object"):
        load_model(str(tampered))
    assert not marker.exists()


def test_torch_fallback_warning_reaches_the_user_under_trust_pickle(
    tmp_path: Path, clean_archive: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """normswap listens to torch.export's log while it loads; what torch warns about a load that worked
    (here: its fallback to the full unpickler) is passed on, one line, not swallowed."""
    tampered = _sample_inputs(clean_archive, tmp_path / "tampered.pt2", tmp_path / "payload-ran")
    # Where the record is printed depends on torch's logging setup (its own stderr handler, or the
    # root logger: pytest's capture under torch 2.11); what normswap controls is that the record
    # reaches torch's logger once, as one line.
    passed_on: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = passed_on.append  # type: ignore[method-assign]
    logger = logging.getLogger("torch._export.serde.serialize")
    logger.addHandler(handler)
    try:
        load_model(str(tampered), trust_pickle=True)
    finally:
        logger.removeHandler(handler)
    err = capfd.readouterr().err
    fallback = [r for r in passed_on if "Fallback to weights_only=False succeeded" in r.getMessage()]
    assert len(fallback) == 1, [r.getMessage() for r in passed_on]
    assert "\n" not in fallback[0].getMessage() and fallback[0].exc_info is None
    assert "Traceback" not in err
