"""Guard a torch.export archive (.pt2) before torch reads it: nothing in it may choose what code runs.

``torch.export.load`` (torch 2.14) runs code that an archive's author controls in three ways:

1. **Pickle.** Several members are unpickled with ``weights_only=False`` or plain :mod:`pickle`:
   ``data/sample_inputs/<model>.pt`` (torch tries the weights-only loader and *falls back* to the full
   one when it fails), legacy ``data/weights/<model>.pt`` and ``data/constants/<model>.pt`` (the same
   fallback), weights and tensor constants whose payload config says ``use_pickle`` (full loader),
   opaque-object constants (``opaque_obj_*``, :func:`pickle.loads`), torchbind custom objects
   (``custom_obj_*``, TorchScript's unpickler) and, when the new layout fails to open, the pre-2.8 zip
   layout's ``serialized_state_dict.pt`` / ``serialized_constants.pt`` / ``serialized_example_inputs.pt``
   (the same fallback).
2. **Symbolic shapes.** Every ``expr_str`` in ``models/<model>.json`` goes through
   :func:`sympy.sympify`, which is :func:`eval`: ``"__import__('os').system(...)"`` runs.
3. **Native code.** Members under ``data/aotinductor/`` are compiled shared libraries that the loader
   opens.

We could load the parts ourselves, but then normswap would re-implement torch's deserializer and drift
from it with every release. We could patch torch's unpickling for the duration of the load, but that is
global state in someone else's library (DESIGN.md: nothing is monkeypatched). So we *scan*, then hand
the archive to torch unchanged:

- members are read through ``torch._C.PyTorchFileReader``, the same reader and the same name lookup
  torch uses (a zip may hold two members of one name, or names that differ in case; reading them with
  :mod:`zipfile` could inspect one member while torch loads another); the pre-2.8 layout, which torch
  reads with :mod:`zipfile`, is scanned with :mod:`zipfile`, every duplicate included;
- every member that torch would unpickle must load with torch's ``weights_only`` unpickler, which
  refuses any global outside its allowlist *before* calling it. A member that loads that way makes
  torch's full unpickler call the same allowlisted globals and nothing else, and makes the
  ``weights_only=False`` fallback unreachable. Opaque and torchbind objects cannot be read that way and
  are refused. ``--trust-pickle`` lifts this rule, and only this one;
- every ``expr_str`` must parse as a sympy expression over shape symbols, numbers, arithmetic,
  comparisons and an allowlist of sympy functions (:func:`_check_expression`); anything else (names
  with underscores, attributes, subscripts, strings other than a symbol's name) is refused;
- AOTInductor members are refused: normswap rewrites graphs, not compiled code;
- after the load, every call in the program's graphs must be a torch operator (an ``OpOverload`` or
  a higher-order operator) or one of the symbolic-shape builtins torch's serializer emits
  (:func:`check_program_calls`), before anything runs the graph.

Reading the archive twice (scan, then torch) is a race only against a process that rewrites the
user's file while normswap runs; such a process can already replace normswap itself.
"""

from __future__ import annotations

import ast
import io
import json
import operator
import os
import pickle
import re
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch
from torch.export.pt2_archive import constants as pt2

from normswap.errors import BadInputError

# torch 2.11's archives have no opaque objects yet (no such constant): the prefix is matched all the same
_OPAQUE_OBJ_PREFIX = getattr(pt2, "OPAQUE_OBJ_FILENAME_PREFIX", "opaque_obj_")

# What to do, said once in every refusal of a pickled member.
_TRUST_HINT = (
    "loading it would run code named by the file; re-export the model with torch.export.save from "
    "plain tensors, or pass --trust-pickle if you trust whoever wrote the file"
)

# The pre-2.8 layout: members at the zip's root that torch.export.load reads when the new layout fails.
_LEGACY_PICKLED_MEMBERS = (
    "serialized_state_dict.pt",
    "serialized_constants.pt",
    "serialized_example_inputs.pt",
)
_LEGACY_PROGRAM_MEMBER = "serialized_exported_program.json"


class UnsafeArchiveError(BadInputError):
    """A .pt2 archive holds something that would run code while torch loads or runs it."""


def _refusal(path: Path, member: str, why: str) -> UnsafeArchiveError:
    return UnsafeArchiveError(f"refusing {path}: archive member {member} {why}")


def _weights_only_error(data: bytes) -> str | None:
    """None when ``data`` loads with torch's weights-only unpickler, else the first line of its refusal."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pickle-protocol notices are noise here
        try:
            torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as exc:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            # torch's message is a paragraph; the line naming the refused global is the useful one
            named = next((line for line in lines if "GLOBAL" in line or "global" in line), None)
            return (named or (lines[0] if lines else "refused"))[:200]
        except Exception as exc:
            return f"unreadable ({type(exc).__name__}: {str(exc).strip()[:150]})"
    return None


def _require_weights_only(path: Path, member: str, data: bytes, trust_pickle: bool) -> None:
    if trust_pickle or not data:
        return  # torch reads an empty member as "nothing stored" and unpickles nothing
    refused = _weights_only_error(data)
    if refused is not None:
        raise _refusal(
            path, member, f"is a pickle that torch's weights-only loader refuses ({refused}); {_TRUST_HINT}"
        )


# --------------------------------------------------------------------------------------------------
# Symbolic-shape expressions

# Functions a serialized shape expression may call: sympy's own printing of torch's shape algebra
# (torch/_export/serde/serialize.py, sympy_functions) and the sympy core they are built from.
_SYMPY_CALLS = frozenset(
    {
        "Symbol", "Integer", "Float", "Rational", "Add", "Mul", "Pow", "Abs", "Max", "Min",
        "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "Piecewise", "floor", "ceiling", "sqrt",
        "FloorDiv", "ModularIndexing", "Where", "PythonMod", "Mod", "CleanDiv", "CeilToInt", "FloorToInt",
        "CeilDiv", "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv",
        "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal",
        "ToFloat", "OpaqueUnaryFn_sqrt", "OpaqueUnaryFn_exp", "OpaqueUnaryFn_log",
        "BitwiseFn_bitwise_and", "BitwiseFn_bitwise_or", "BitwiseFn_bitwise_xor", "Identity",
    }
)  # fmt: skip
_SYMPY_CONSTANTS = frozenset({"oo", "zoo", "nan", "true", "false", "True", "False"})
# Symbol assumptions as sympy prints them: Symbol('s0', positive=True, integer=True); and a Float's
# precision: Float('0.5', precision=53).
_CALL_KEYWORDS = frozenset(
    {
        "positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite", "zero",
        "nonzero", "precision",
    }
)  # fmt: skip
# The strings a call may hold: a symbol's name, a Float's digits.
# Shape symbols torch creates: s0, s77, u3, zuf0, ... (a lowercase prefix and a number).
_SHAPE_SYMBOL = re.compile(r"^[a-z]{1,8}[0-9]+$")
_STRING_ARGUMENT = {"Symbol": _SHAPE_SYMBOL, "Float": re.compile(r"^[-+0-9.eE]{1,40}$")}
_ALLOWED_EXPR_NODES = (
    ast.Expression, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Call, ast.Name, ast.Constant,
    ast.Load, ast.keyword, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow,
    ast.USub, ast.UAdd, ast.Not, ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE,
    ast.BitAnd, ast.BitOr, ast.LShift, ast.RShift,
)  # fmt: skip
# sympy's parser evaluates the string; a very long one is not a shape expression
_MAX_EXPRESSION_CHARS = 10_000


def _expression_problem(text: str) -> str | None:
    """None when ``text`` is a plain sympy expression over shape symbols, else what is wrong with it.

    The check runs on Python's own parse of the string: sympy's parser only rewrites names and numbers
    of a string that is already valid Python, so a string whose Python syntax tree holds nothing but
    arithmetic, comparisons, shape symbols and allowlisted calls evaluates to nothing else.
    """
    if not isinstance(text, str):
        return f"is a {type(text).__name__}, not a string"
    if len(text) > _MAX_EXPRESSION_CHARS:
        return f"is {len(text)} characters long"
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return "is not an expression"
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_EXPR_NODES):
            return f"uses {type(node).__name__}"
        if isinstance(node, ast.Name) and not (
            node.id in _SYMPY_CALLS or node.id in _SYMPY_CONSTANTS or _SHAPE_SYMBOL.match(node.id)
        ):
            return f"names {node.id!r}"
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in _SYMPY_CALLS:
                return "calls something other than a sympy shape function"
            for keyword in node.keywords:
                if keyword.arg not in _CALL_KEYWORDS or not isinstance(keyword.value, ast.Constant):
                    return f"passes keyword {keyword.arg!r}"
            for arg in node.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    allowed = _STRING_ARGUMENT.get(node.func.id)
                    if allowed is None or not allowed.match(arg.value):
                        return f"passes the string {arg.value[:40]!r}"
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, bool, str)):
            return f"holds a {type(node.value).__name__} constant"
    return None


def _expressions(value: Any) -> Iterator[Any]:
    """Every value stored under an ``expr_str`` key, at any depth of a serialized program."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                if key == "expr_str":
                    yield child
                else:
                    stack.append(child)
        elif isinstance(item, list):
            stack.extend(item)


def _check_program_json(path: Path, member: str, data: bytes) -> None:
    try:
        program = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _refusal(path, member, f"is not valid JSON ({type(exc).__name__})") from None
    for expression in _expressions(program):
        problem = _expression_problem(expression)
        if problem is not None:
            shown = str(expression)[:60]
            raise _refusal(
                path,
                member,
                f"holds a shape expression {shown!r} that {problem}: torch would evaluate it as Python code",
            )


# --------------------------------------------------------------------------------------------------
# Members of the torch.export layout


def _json_member(path: Path, reader: Any, member: str) -> dict[str, Any]:
    try:
        config = json.loads(reader.get_record(member))
    except Exception as exc:
        raise _refusal(path, member, f"is not valid JSON ({type(exc).__name__})") from None
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict) or not all(isinstance(e, dict) for e in entries.values()):
        raise _refusal(path, member, "is not a payload config of torch.export")
    return entries


def _payload_member(path: Path, config_member: str, folder: str, entry: dict[str, Any]) -> str:
    name = entry.get("path_name")
    if not isinstance(name, str):
        raise _refusal(path, config_member, "names a payload that is not a string")
    return os.path.join(folder, name)


def _scan_payloads(path: Path, reader: Any, records: set[str], model: str, trust_pickle: bool) -> None:
    """The weights and constants of one program: mirrors torch's ``_load_state_dict``/``_load_constants``."""
    for legacy in (f"{pt2.WEIGHTS_DIR}{model}.pt", f"{pt2.CONSTANTS_DIR}{model}.pt"):
        # torch reads these (and then ignores the payload configs) with a weights_only=False fallback
        if legacy in records:
            _require_weights_only(path, legacy, reader.get_record(legacy), trust_pickle)
    weights_config = pt2.WEIGHTS_CONFIG_FILENAME_FORMAT.format(model)
    if weights_config in records:
        for entry in _json_member(path, reader, weights_config).values():
            if entry.get("use_pickle"):
                member = _payload_member(path, weights_config, pt2.WEIGHTS_DIR, entry)
                _require_weights_only(path, member, _record(path, reader, member), trust_pickle)
    constants_config = pt2.CONSTANTS_CONFIG_FILENAME_FORMAT.format(model)
    if constants_config in records:
        for entry in _json_member(path, reader, constants_config).values():
            member = _payload_member(path, constants_config, pt2.CONSTANTS_DIR, entry)
            # classified by the path name as written, the way torch does: a name such as
            # "opaque_obj_/../tensor_0" is an opaque object to torch, whatever member it reaches
            name = entry["path_name"]
            if name.startswith(pt2.TENSOR_CONSTANT_FILENAME_PREFIX):
                if entry.get("use_pickle"):
                    _require_weights_only(path, member, _record(path, reader, member), trust_pickle)
            elif not trust_pickle:
                # Every constant but a tensor is refused: torchbind objects, opaque Python objects
                # (a kind torch 2.11's archives do not have yet: the prefix is matched all the same),
                # and any kind this torch does not name.
                if name.startswith(pt2.CUSTOM_OBJ_FILENAME_PREFIX):
                    kind = "a torchbind object"
                elif name.startswith(_OPAQUE_OBJ_PREFIX):
                    kind = "an opaque Python object"
                else:
                    kind = "a constant of a kind normswap does not know"
                raise _refusal(path, member, f"is {kind}, which only the full unpickler reads; {_TRUST_HINT}")


def _record(path: Path, reader: Any, member: str) -> bytes:
    try:
        return reader.get_record(member)
    except Exception:
        raise _refusal(path, member, "is named by a payload config but missing") from None


def _scan_pt2_layout(path: Path, file: IO[bytes], trust_pickle: bool) -> None:
    try:
        reader = torch._C.PyTorchFileReader(file)
        records = set(reader.get_all_records())
    except Exception:
        return  # torch cannot open it either; it falls back to the zip layout scanned below
    aoti = sorted(r for r in records if r.startswith(pt2.AOTINDUCTOR_DIR))
    if aoti:
        raise _refusal(
            path,
            aoti[0],
            "is AOTInductor-compiled native code, which torch.export.load would load; normswap never "
            "does: save the exported program alone with torch.export.save",
        )
    for record in sorted(records):
        if not record.startswith(pt2.MODELS_DIR):
            continue
        # the program name as torch derives it: models/<name>.json
        prefix, suffix = pt2.MODELS_FILENAME_FORMAT.split("{}")
        model = record[len(prefix) : -len(suffix)]
        _check_program_json(path, record, reader.get_record(record))
        sample_inputs = pt2.SAMPLE_INPUTS_FILENAME_FORMAT.format(model)
        if sample_inputs in records:
            _require_weights_only(path, sample_inputs, reader.get_record(sample_inputs), trust_pickle)
        _scan_payloads(path, reader, records, model, trust_pickle)


def _scan_legacy_layout(path: Path, file: IO[bytes], trust_pickle: bool) -> None:
    try:
        archive = zipfile.ZipFile(file)
    except zipfile.BadZipFile:
        return
    with archive:
        # every entry, duplicates included: torch's legacy reader walks infolist() and keeps the last
        for info in archive.infolist():
            if info.filename in _LEGACY_PICKLED_MEMBERS:
                _require_weights_only(path, info.filename, archive.read(info), trust_pickle)
            elif info.filename == _LEGACY_PROGRAM_MEMBER:
                _check_program_json(path, info.filename, archive.read(info))


def check_pt2_archive(path: Path, file: IO[bytes], *, trust_pickle: bool = False) -> None:
    """Refuse an archive that would run code while ``torch.export.load`` reads it (see the module doc).

    ``file`` is the open archive that will then be given to torch; it is left at position 0. Raises
    :class:`UnsafeArchiveError` naming the member and what to do.
    """
    for scan in (_scan_pt2_layout, _scan_legacy_layout):
        file.seek(0)
        scan(path, file, trust_pickle)
    file.seek(0)


# --------------------------------------------------------------------------------------------------
# After the load: what the graph calls

# Builtins that torch's serializer writes as call targets for symbolic shape arithmetic
# (torch/_export/serde/serialize.py, _SYM_OPS) and for the items of multi-output ops.
_SHAPE_BUILTINS: frozenset[Any] = frozenset(
    {
        operator.getitem, operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
        operator.mod, operator.pow, operator.neg, operator.pos, operator.eq, operator.ne, operator.lt,
        operator.le, operator.gt, operator.ge, operator.and_, operator.or_, operator.lshift,
        operator.rshift, operator.not_, operator.truth, __import__("math").trunc,
        torch.sym_int, torch.sym_float, torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_ite,
        torch._sym_sqrt,
    }
)  # fmt: skip


def _is_torch_operator(target: Any) -> bool:
    return isinstance(target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)) or (
        target in _SHAPE_BUILTINS
    )


def check_program_calls(path: Path, program: torch.export.ExportedProgram) -> None:
    """Refuse a loaded program whose graphs call anything but torch operators, before it ever runs.

    torch resolves a serialized target such as ``torch.os.system`` by attribute lookup; its verifier
    rejects that today, but which verifier runs is chosen by the archive's own ``dialect`` field.
    """
    for module in program.graph_module.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            if node.op == "call_function" and not _is_torch_operator(node.target):
                name = getattr(node.target, "__qualname__", None) or repr(node.target)
                raise UnsafeArchiveError(
                    f"refusing {path}: its graph calls {str(name)[:80]} (node {node.name}), which is not "
                    "a torch operator"
                )
            if node.op in ("call_method", "call_module"):
                raise UnsafeArchiveError(
                    f"refusing {path}: its graph has a {node.op} node ({node.name}), which an exported "
                    "program never holds"
                )
