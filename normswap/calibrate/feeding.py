"""How every command feeds a batch to a model: the one rule.

A batch's keywords are fitted to every model it is fed to (:func:`fit_to_models`: a ``labels`` key a
``.pt2`` does not take is not fed, the ``use_cache=False`` it was exported with is passed), so that the
models a command compares (ORIGINAL and CONVERTED, a teacher and its student) run on the same inputs; it
is moved to the model's device and cast to its floating dtype (data saved as float64 feeds a float32
model; token ids stay integers), and a batch the model cannot run on is the data's fault, said in one
sentence (:class:`~normswap.errors.BadInputError`, exit 2) before any work: ``recalibrate``,
``distill``, ``convert --calibrate`` (in memory and block by block) and ``validate --data`` alike.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import fx, nn

from normswap.calibrate.data import ModelInputs
from normswap.errors import BadInputError, NormswapError
from normswap.errors import describe as _describe
from normswap.util.finite import all_finite


def device_and_dtype(model: nn.Module) -> tuple[torch.device | None, torch.dtype | None]:
    """The device of ``model``'s first tensor, and the one floating dtype of its parameters (of its
    buffers when it has no floating parameter; None when there are several): a bf16 HF model keeps its
    rotary inverse frequencies in a float32 buffer, and its data is still fed in bf16."""
    parameters, buffers = list(model.parameters()), list(model.buffers())
    tensors = parameters + buffers
    device = tensors[0].device if tensors else None
    float_dtypes = {t.dtype for t in parameters if t.is_floating_point()}
    if not float_dtypes:
        float_dtypes = {t.dtype for t in buffers if t.is_floating_point()}
    return device, (float_dtypes.pop() if len(float_dtypes) == 1 else None)


def to_model(inputs: ModelInputs, device: torch.device | None, dtype: torch.dtype | None) -> ModelInputs:
    """``inputs`` on ``device``, their floating tensors cast to ``dtype`` (None: left as they are)."""

    def move(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if dtype is not None and value.is_floating_point() and value.dtype != dtype:
            cast = value.to(dtype)
            if not all_finite(cast) and all_finite(value):  # fp32 data past float16's 65504
                raise BadInputError(
                    f"the data holds values beyond {str(dtype).removeprefix('torch.')}'s range, the model's "
                    f"dtype: largest magnitude {float(value.abs().max()):.6g}; scale it or convert the model"
                )
            value = cast
        return value.to(device) if device is not None else value

    return ModelInputs(tuple(move(a) for a in inputs.args), {k: move(v) for k, v in inputs.kwargs.items()})


@contextlib.contextmanager
def data_fault(model: nn.Module, inputs: ModelInputs, what: str) -> Iterator[None]:
    """Inside, a failure of ``model`` run on ``inputs`` is the data's: "``what`` (shapes) does not fit the
    model" (:class:`~normswap.errors.BadInputError`). :func:`run_batch` calls the model in it; the
    block-by-block route, which runs a batch through the model's parts in turn, runs each part in it."""
    try:
        yield
    except NormswapError:
        raise  # normswap's own refusal inside (e.g. a forward that never reached a block): not the data's
    except Exception as exc:
        hint = ""
        if isinstance(model, fx.GraphModule) and "Guard failed" in str(exc):
            hint = (
                "; a .pt2 model takes only the input shapes it was exported for: give batches of that "
                "shape (e.g. with --batch-size) or the model's factory"
            )
        raise BadInputError(
            f"{what} ({inputs.describe()}) does not fit the model: {_describe(exc)}{hint}"
        ) from None


def run_batch(model: nn.Module, inputs: ModelInputs, what: str) -> Any:
    """``model`` on ``inputs``; a failure is the data's (:func:`data_fault`)."""
    with data_fault(model, inputs, what):
        output = model(*inputs.args, **inputs.kwargs)
    return output


def fit_keywords(model: nn.Module, inputs: ModelInputs, notes: list[str] | None = None) -> ModelInputs:
    """Keyword ``inputs`` as ``model``'s forward names them (``validate`` fits every input to both models
    with it, so that a model directory and its ``.pt2`` run on the same inputs):

    - a key the forward does not take, when it takes no ``**kwargs``, is dropped (a batch's ``labels``
      for a ``.pt2`` exported without them): the model could not be called with it;
    - a setting that a graph capture cannot carry (``use_cache``,
      :data:`~normswap.graph.capture.CAPTURE_HOSTILE`) that the forward requires (a ``.pt2`` exported with
      ``use_cache=False`` passed, as normswap writes them) and the inputs leave unset is passed turned off.

    Each change is said once in ``notes``; positional inputs are left as they are."""
    from normswap.graph.capture import CAPTURE_HOSTILE
    from normswap.load.exported_module import ExportedModule

    # a graph rewrite's .pt runs its program: the forward that names the inputs is the program's
    forward = model.inputs_of if isinstance(model, ExportedModule) else model.forward
    try:
        signature = inspect.signature(forward)
        parameters, given = signature.parameters, set(signature.bind_partial(*inputs.args).arguments)
    except (TypeError, ValueError):
        return inputs
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    kwargs = dict(inputs.kwargs)
    dropped = [] if takes_any else [k for k in kwargs if k not in parameters]
    for key in dropped:
        del kwargs[key]
    required = {
        k: v
        for k, v in CAPTURE_HOSTILE.items()
        if k in parameters
        and parameters[k].default is inspect.Parameter.empty
        and k not in kwargs.keys() | given
    }
    kwargs.update(required)
    if notes is not None:
        name = type(model).__name__
        for key in dropped:
            _note(notes, f"the inputs' {key} is not fed: the model's forward does not take it ({name})")
        for key, value in required.items():
            _note(notes, f"the inputs run with {key}={value}, which the program takes ({name})")
    return ModelInputs(inputs.args, kwargs) if (dropped or required) else inputs


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)


def fit_to_models(
    models: Iterable[nn.Module], inputs: ModelInputs, notes: list[str] | None = None
) -> ModelInputs:
    """``inputs`` as every one of ``models`` takes them (:func:`fit_keywords` for each in turn): the one
    rule for a batch fed to models that are compared (ORIGINAL and CONVERTED, a teacher and its student,
    a model before and after calibration), so that all run on the same inputs. A key one model does not
    take is fed to none (a model directory's ``labels`` when its ``.pt2`` is compared with it)."""
    for model in models:
        inputs = fit_keywords(model, inputs, notes)
    return inputs


def fed(
    model: nn.Module,
    inputs: ModelInputs,
    notes: list[str] | None = None,
    *,
    compared_with: Iterable[nn.Module] = (),
) -> ModelInputs:
    """``inputs`` as ``model`` takes them: their keywords fitted to it and to the models it is
    ``compared_with`` (:func:`fit_to_models`, each change said once in ``notes``), on its device, in its
    floating dtype."""
    return to_model(fit_to_models((model, *compared_with), inputs, notes), *device_and_dtype(model))


def check_batch_fits(model: nn.Module, inputs: ModelInputs, what: str) -> None:
    """Refuse data ``model`` cannot be fed, before any work: one run of ``inputs`` as :func:`fed` makes
    them (``model`` is left in whatever mode it is in; nothing is recorded)."""
    with torch.no_grad():
        run_batch(model, fed(model, inputs), what)


__all__ = [
    "check_batch_fits",
    "data_fault",
    "device_and_dtype",
    "fed",
    "fit_keywords",
    "fit_to_models",
    "run_batch",
    "to_model",
]
