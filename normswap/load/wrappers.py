"""The user's module inside the wrappers torch puts around a model for running it, not for what it
computes: ``torch.compile``'s ``OptimizedModule`` (``._orig_mod``), ``nn.DataParallel`` and
``DistributedDataParallel`` (``.module``). A conversion works on the module inside: through the
wrapper every check recompiled for each shape it tried (a ResNet-18 took minutes and hit dynamo's
recompile limit) and every site and saved key carried the wrapper's prefix (``_orig_mod.``,
``module.``). A module whose weights are on the meta device (shapes without values) is refused here, in
one sentence, where it failed deep inside a check ("Tensor.item() cannot be called on meta tensors")."""

from __future__ import annotations

import sys

from torch import nn

from normswap.errors import BadInputError


def unwrapped(model: nn.Module) -> tuple[nn.Module, str | None]:
    """The module inside ``model``'s run-time wrappers, and a note saying which were set aside (None
    when there were none); BadInputError for weights on the meta device."""
    # only torch.compile makes an OptimizedModule, and it imports dynamo first: importing it here would
    # cost every conversion over a second
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    compiled = eval_frame.OptimizedModule if eval_frame is not None else ()
    taken: list[str] = []
    while True:
        if isinstance(model, compiled):
            taken.append("torch.compile's wrapper (converted: ._orig_mod)")
            model = model._orig_mod
        elif isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            taken.append(f"{type(model).__name__} (converted: .module)")
            model = model.module
        else:
            break
    meta = next((name for name, t in model.state_dict(keep_vars=True).items() if t.is_meta), None)
    if meta is not None:
        raise BadInputError(
            f"the model's weights are on the meta device ({meta}: a shape without values): load its "
            "weights first (load_state_dict(..., assign=True), or to_empty() and load_state_dict)"
        )
    if not taken:
        return model, None
    return model, (
        f"the model given is wrapped by {' and '.join(taken)}: the module inside is converted, and the "
        "result is that module (wrap it again to run it so)"
    )
