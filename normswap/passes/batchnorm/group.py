"""The fold of one BatchNorm module into the Conv or Linear beside it, as one group of tensor edits that
both routes run: the in-memory pass on the model's own tensors, the stream on stored ones.

The group reads the layer's weight (and bias, when it has one) and the BatchNorm's running statistics and
affine, by state-dict name, and writes the layer's new weight and bias (:func:`folded_weights`: the
arithmetic of :mod:`normswap.passes.batchnorm.arithmetic`, fp64 inside, the stored dtype out); a layer
without a bias gains one. What becomes of the BatchNorm module (an Identity, or its activation kept) is
the route's: the pass replaces it, a stream records it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from normswap.passes.batchnorm.arithmetic import (
    bn_scale_shift,
    fold_bn_into_conv_transpose_weights,
    fold_bn_into_conv_weights,
    fold_bn_into_next_layer_weights,
)
from normswap.passes.batchnorm.layers import CONV_TRANSPOSES
from normswap.passes.core.edits import TensorEdit, Tensors

_STATISTICS = ("running_mean", "running_var", "weight", "bias")


@dataclass(frozen=True)
class FoldGroup:
    """One BatchNorm folded into one layer, by tensor name: the BN's path and statistics (key -> stored
    name, None where it has none), the layer's path, weight and bias names and whether the bias exists,
    the direction ("backward": the BN reads the layer; "forward": the layer reads the BN), eps, the
    layer's groups and output features, and whether it is a transposed convolution."""

    bn: str
    layer: str
    direction: str
    eps: float
    stats: dict[str, str | None]
    weight: str
    bias: str
    bias_stored: bool
    groups: int
    out_features: int
    transpose: bool = False

    def edit(self) -> TensorEdit:
        """The group as tensor edits: the layer's weight and bias written (the bias created when the
        layer had none)."""
        reads = (self.weight, *((self.bias,) if self.bias_stored else ()))
        reads += tuple(name for name in self.stats.values() if name is not None)

        def compute(t: Tensors) -> Tensors:
            weight, bias = folded_weights(self, t)
            return {self.weight: weight, self.bias: bias}

        creates = {} if self.bias_stored else {self.bias: (self.weight, (self.out_features,))}
        return TensorEdit(f"fold {self.bn}", reads, compute, (self.weight, self.bias), creates=creates)


def fold_group(
    bn_path: str,
    bn: nn.Module | dict[str, str | None],
    eps: float,
    layer_path: str,
    layer: nn.Module,
    direction: str,
) -> FoldGroup:
    """The group folding the BatchNorm ``bn`` at ``bn_path`` into ``layer`` at ``layer_path``; ``bn`` is
    the module, or an ``F.batch_norm`` call's tensors by full name (key -> name, None where not given)."""
    if isinstance(bn, dict):
        stats = bn
    else:
        stats = {
            key: (f"{bn_path}.{key}" if getattr(bn, key, None) is not None else None) for key in _STATISTICS
        }
    transpose = isinstance(layer, CONV_TRANSPOSES)
    weight = layer.weight
    out_features = int(weight.shape[1] * layer.groups if transpose else weight.shape[0])
    return FoldGroup(
        bn_path,
        layer_path,
        direction,
        eps,
        stats,
        f"{layer_path}.weight",
        f"{layer_path}.bias",
        layer.bias is not None,
        int(getattr(layer, "groups", 1)),
        out_features,
        transpose,
    )


def folded_weights(group: FoldGroup, t: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's new weight and bias from the group's tensors ``t`` (fp64 inside, stored dtype out)."""
    stats = {key: (t[name] if name is not None else None) for key, name in group.stats.items()}
    scale, shift = bn_scale_shift(
        stats["running_mean"],
        stats["running_var"],
        group.eps,
        stats["weight"],
        stats["bias"],  # type: ignore[arg-type]
    )
    bias = t[group.bias] if group.bias_stored else None
    if group.direction == "backward" and group.transpose:
        return fold_bn_into_conv_transpose_weights(t[group.weight], bias, scale, shift, groups=group.groups)
    if group.direction == "backward":
        return fold_bn_into_conv_weights(t[group.weight], bias, scale, shift, out_channel_dim=0)
    return fold_bn_into_next_layer_weights(t[group.weight], bias, scale, shift, group.groups)
