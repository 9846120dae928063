"""Models from factories: ``package.module:callable`` or ``path/to/file.py:callable``, imported only when
the user names them, and what a factory may return (a module, ``(module, inputs)``, ``(module, args,
kwargs)``)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.errors import BadInputError, describe, first_line

_IDENTIFIER_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _resolve_attribute(module: Any, attr_path: str, factory: str) -> Any:
    obj = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise BadInputError(
                f"factory '{factory}': module '{module.__name__}' has no attribute '{attr_path}'"
            ) from None
    return obj


def _import_module_from_cwd(module_name: str, factory: str) -> Any:
    # The factory usually lives in the user's project, which is the working directory but is not on
    # sys.path when normswap runs as an installed script. The directory goes *last*, for the import
    # only: a stray torchvision.py in it must not shadow the installed package (and run in its place).
    # A user who wants their folder first says so with PYTHONPATH=. or names the file (models.py:build).
    saved_path = list(sys.path)
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise BadInputError(f"cannot import factory module '{module_name}': {first_line(exc)}") from None
    except Exception as exc:
        raise BadInputError(
            f"factory module '{module_name}' failed while importing: {describe(exc)}"
        ) from None
    finally:
        sys.path[:] = saved_path


def _module_name_for_file(path: Path) -> str:
    # Registering the file under its own stem lets modules it defines be pickled (torch.save of the
    # rewritten model) and reloaded later from the same folder; fall back to a private name on clashes.
    stem = path.stem
    if stem.isidentifier() and stem not in sys.modules:
        return stem
    safe = re.sub(r"\W", "_", stem)
    return f"_normswap_factory_{safe}_{abs(hash(str(path))):x}"


def _import_module_from_file(path: Path, factory: str) -> Any:
    if not path.is_file():
        raise BadInputError(f"factory file not found: {path} (in factory '{factory}')")
    name = _module_name_for_file(path)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise BadInputError(f"cannot load factory file {path}: not a Python source file")
    module = importlib.util.module_from_spec(spec)
    saved_path = list(sys.path)
    # Sibling imports inside the factory file should work as they do when the user runs it directly.
    sys.path.insert(0, str(path.resolve().parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise BadInputError(f"factory file {path} failed while importing: {describe(exc)}") from None
    finally:
        sys.path[:] = saved_path
    return module


def _as_example_inputs(value: Any, factory: str) -> tuple[tuple | None, dict | None]:
    """Normalize what a factory returned next to its model into (args, kwargs)."""
    if value is None:
        return None, None
    if isinstance(value, torch.Tensor):
        return (value,), {}
    if isinstance(value, (tuple, list)):
        return tuple(value), {}
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise BadInputError(f"factory '{factory}' returned example kwargs whose keys are not all strings")
        return (), dict(value)
    raise BadInputError(
        f"factory '{factory}' returned example inputs of type {type(value).__name__}: "
        "expected a tensor, a tuple/list of positional args or a dict of kwargs"
    )


def unpack_model_and_inputs(result: Any, origin: str) -> tuple[nn.Module, tuple | None, dict | None]:
    """Accept ``module``, ``(module, inputs)`` or ``(module, args, kwargs)``."""
    if isinstance(result, nn.Module):
        return result, None, None
    if isinstance(result, tuple) and len(result) in (2, 3) and isinstance(result[0], nn.Module):
        if len(result) == 2:
            args, kwargs = _as_example_inputs(result[1], origin)
            return result[0], args, kwargs
        _, args, kwargs = result
        if not isinstance(args, (tuple, list)) or not isinstance(kwargs, Mapping):
            raise BadInputError(
                f"{origin} returned (module, args, kwargs) whose args is not a tuple or kwargs not a dict"
            )
        return result[0], tuple(args), dict(kwargs)
    raise BadInputError(
        f"{origin} gave a {type(result).__name__}, not a torch.nn.Module "
        "(expected a module, (module, example_inputs) or (module, args, kwargs))"
    )


def import_callable(spec: str, what: str = "factory", bad_spec: str | None = None) -> Any:
    """The callable named by ``package.module:attr`` or ``path/to/file.py:attr`` (a dotted attr path).

    ``what`` names it in messages ("factory", "data factory"); ``bad_spec`` replaces the message for a
    spec that is neither form.
    """
    target, _, attr_path = spec.rpartition(":")
    usage = bad_spec or f"bad {what} '{spec}': expected package.module:callable or path/to/file.py:callable"
    if not target or not _IDENTIFIER_PATH.match(attr_path):
        raise BadInputError(usage)
    looks_like_file = target.endswith(".py") or "/" in target or os.sep in target or Path(target).is_file()
    if looks_like_file:
        module = _import_module_from_file(Path(target), spec)
    elif _IDENTIFIER_PATH.match(target):
        module = _import_module_from_cwd(target, spec)
    else:
        raise BadInputError(usage)
    found = _resolve_attribute(module, attr_path, spec)
    if not callable(found):
        raise BadInputError(f"{what} '{spec}' is a {type(found).__name__}, not a callable")
    return found


def load_factory(spec: str) -> tuple[nn.Module, tuple | None, dict | None]:
    factory = import_callable(spec)
    try:
        result = factory()
    except Exception as exc:
        raise BadInputError(f"factory '{spec}' raised {describe(exc)}") from None
    return unpack_model_and_inputs(result, f"factory '{spec}'")


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """While in the block, every parameter a module registers is moved to the meta device as it is
    registered, through torch's own hook for that (``register_module_parameter_registration_hook``; what
    ``accelerate.init_empty_weights`` does, which normswap does not depend on): the model's weights take
    no memory, and its buffers (rotary frequencies, running statistics) are built as the model builds
    them. The hook is removed on the way out, also on error."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        # a parameter already on meta is kept as it is: assigning one module's parameter to another (a
        # tied head) must leave them one parameter
        if param is None or param.is_meta:
            return None
        return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    handle = register_module_parameter_registration_hook(on_meta)
    try:
        yield
    finally:
        handle.remove()


def load_factory_without_weights(spec: str) -> tuple[nn.Module, tuple | None, dict | None]:
    """Like :func:`load_factory`, but the model's parameters are on the meta device (its buffers and
    example inputs are real): for a model whose weights come from a --weights file, read later by rows."""
    with _parameters_on_meta():
        return load_factory(spec)
