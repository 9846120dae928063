"""Remove weight normalization from a vocoder-style conv stack, then add it back: both exact.

Run: python examples/weight_norm.py

``WaveNetLike`` is built the way vocoder checkpoints are: its dilated convs use the deprecated
``torch.nn.utils.weight_norm`` hook (``weight_g``/``weight_v``), the rest use
``torch.nn.utils.parametrizations.weight_norm`` (``parametrizations.weight.original0/1``), and its
ConvTranspose upsampler is normalized per output channel (weight dim 1). RemoveWeightNorm folds every
``g * v / ||v||`` into a plain ``weight``, so the state_dict loads into the same class built without
weight norm, and the model saves as a .pt2 archive.

``build()`` is also a factory for the command line (``examples/weight_norm.py:build``);
``build_plain()`` gives the same model class without weight norm.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from normswap.load import load_model, save_model
from normswap.passes import AddWeightNorm, Pipeline, RemoveWeightNorm
from normswap.verify import compare_models


class WaveNetLike(nn.Module):
    """Gated dilated Conv1d stack, ConvTranspose upsampling and a Linear head."""

    def __init__(self, channels: int = 16, layers: int = 4, weight_norm: bool = True) -> None:
        super().__init__()
        self.inp = nn.Conv1d(1, channels, 1)
        self.dilated = nn.ModuleList(
            nn.Conv1d(channels, 2 * channels, 3, dilation=2**i, padding=2**i) for i in range(layers)
        )
        self.res = nn.ModuleList(nn.Conv1d(channels, channels, 1) for _ in range(layers))
        self.up = nn.ConvTranspose1d(channels, channels, 4, stride=2, padding=1)
        self.head = nn.Linear(channels, 4)
        if weight_norm:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the hook API is deprecated, and still in many checkpoints
                for conv in self.dilated:
                    nn.utils.weight_norm(conv)
            for conv in self.res:
                nn.utils.parametrizations.weight_norm(conv)
            nn.utils.parametrizations.weight_norm(self.up, dim=1)  # ConvTranspose: (in, out, k)
            nn.utils.parametrizations.weight_norm(self.head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for dilated, res in zip(self.dilated, self.res, strict=True):
            a, b = dilated(h).chunk(2, dim=1)
            h = h + res(torch.tanh(a) * torch.sigmoid(b))
        return self.head(self.up(h).transpose(1, 2))


def _inputs() -> tuple[torch.Tensor]:
    return (torch.randn(2, 1, 32, generator=torch.Generator().manual_seed(1)),)


def build() -> tuple[nn.Module, tuple]:
    """The model with weight norm, magnitudes far from ||v|| as after training, and an example input."""
    torch.manual_seed(0)
    model = WaveNetLike().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("weight_g", "original0")):
                p.mul_(1 + torch.rand(p.shape))
    return model, _inputs()


def build_plain() -> tuple[nn.Module, tuple]:
    return WaveNetLike(weight_norm=False).eval(), _inputs()


def main() -> None:
    model, args = build()
    plain, removed = RemoveWeightNorm()(model, args)
    for change in removed.changes:
        print(f"{change.site}: {change.description}")
    cmp = compare_models(model, plain, args)
    print(
        f"removed {len(removed.changes)} weight norms; outputs max abs diff {cmp.outputs[0].max_abs:.3g} "
        f"({cmp.worst_rel:.3g} x max|out|)"
    )

    fresh, _ = build_plain()
    fresh.load_state_dict(plain.state_dict(), strict=True)
    reloaded_ok = compare_models(model, fresh, args).within_tolerance
    print(
        f"plain WaveNetLike(weight_norm=False) loads the state_dict (strict): {'same outputs' if reloaded_ok else 'DIFFERENT'}"
    )

    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "vocoder.pt2"
        save_model(plain, archive, args)
        loaded = load_model(str(archive))
        archive_ok = compare_models(model, loaded.model, args).within_tolerance
    print(f".pt2 round trip: {'same outputs' if archive_ok else 'DIFFERENT'}")

    # And back: add weight norm to every layer of the plain model (exact at insertion), then remove it.
    _, report = Pipeline([AddWeightNorm(), RemoveWeightNorm()])(plain, args)
    added, dropped = (len(p.changes) for p in report.passes)
    print(
        f"add then remove on the plain model: {added} added, {dropped} removed, "
        f"{'exact' if report.ok and report.overall.within_tolerance else 'NOT EXACT'}"
    )

    verdict = cmp.within_tolerance and reloaded_ok and archive_ok and report.ok
    print("exact" if verdict else "NOT EXACT")
    if not verdict:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
