"""BatchNorm folding on the fx route against the export route, on torchvision and timm models with BatchNorms.

    python benchmarks/sweep_fx_capture.py [--out benchmarks/results/fx_capture_sweep.jsonl]

Per model (random weights, randomized running statistics, eval mode): ``FoldBatchNorm`` as it runs (the fx
capture where it can be trusted, ``normswap/graph/fx_capture.py``), then with ``fx_analysis`` off (torch.export
always); which route the first took, whether both made the same changes and refusals (site and reason), whether
the folded state dicts are equal bit for bit, and each call's seconds. Any machine; minutes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import timm
import torch
import torchvision
from torch import nn

from normswap.passes import FoldBatchNorm

RESULTS = Path(__file__).resolve().parent / "results" / "fx_capture_sweep.jsonl"
TIMM = [
    "resnet50",
    "mobilenetv3_large_100",
    "regnety_002",
    "densenet121",
    "dpn68",
    "cspresnet50",
    "hrnet_w18_small",
    "dla34",
    "ghostnet_100",
    "mnasnet_100",
    "rexnet_100",
    "res2net50_14w_8s",
    "resnest14d",
    "selecsls42b",
    "vovnet39a",
    "xception41",
    "inception_v3",
    "efficientnet_b0",
    "mixnet_s",
    "fbnetc_100",
    "spnasnet_100",
    "tinynet_a",
    "lcnet_050",
    "repvgg_a0",
    "darknet17",
    "cspdarknet53",
    "hardcorenas_a",
    "semnasnet_050",
    "resnetv2_50",
    "nf_resnet26",
    "convmixer_768_32",
    "bat_resnext26ts",
    "gernet_s",
    "skresnet18",
    "seresnet18",
    "ecaresnet26t",
    "regnetx_002",
    "sebotnet33ts_256",
    "eca_nfnet_l0",
    "levit_128s",
]
TORCHVISION = [
    "resnet18",
    "mobilenet_v2",
    "shufflenet_v2_x0_5",
    "googlenet",
    "inception_v3",
    "efficientnet_b0",
    "regnet_x_400mf",
    "mnasnet0_5",
    "densenet121",
    "resnext50_32x4d",
    "mobilenet_v3_large",
]


def _randomized(model: nn.Module) -> nn.Module:
    """Running statistics far from (0, 1), so that a wrong fold shows."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
                module.running_mean.copy_(torch.rand(module.running_mean.shape, generator=generator) - 0.5)
                module.running_var.copy_(torch.rand(module.running_var.shape, generator=generator) + 0.5)
    return model.eval()


def _decisions(report) -> tuple[list, list]:
    return sorted(c.site for c in report.changes), sorted((s.site, s.reason) for s in report.skips)


def _build(source: str, name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if source == "timm":
        model = timm.create_model(name, pretrained=False, num_classes=10)
        size = model.default_cfg.get("input_size", (3, 224, 224))[1:]
        if "levit" not in name and "botnet" not in name:  # those fix their input size
            size = tuple(min(s, 128) for s in size)
    else:
        extra = {"aux_logits": False, "init_weights": False} if name in ("googlenet", "inception_v3") else {}
        model = getattr(torchvision.models, name)(weights=None, num_classes=10, **extra)
        size = (299, 299) if name == "inception_v3" else (128, 128)
    return _randomized(model), torch.rand(1, 3, *size)


def compare(source: str, name: str) -> dict:
    model, x = _build(source, name)
    start = time.perf_counter()
    routed, routed_report = FoldBatchNorm()(model, (x,))
    routed_s = time.perf_counter() - start
    FoldBatchNorm.fx_analysis = False
    try:
        start = time.perf_counter()
        exported, export_report = FoldBatchNorm()(model, (x,))
        export_s = time.perf_counter() - start
    finally:
        FoldBatchNorm.fx_analysis = True
    ours, theirs = routed.state_dict(), exported.state_dict()
    return {
        "model": f"{source}:{name}",
        "route": routed_report.graph_method,
        "changes": len(routed_report.changes),
        "skips": len(routed_report.skips),
        "same_decisions": _decisions(routed_report) == _decisions(export_report),
        "same_weights": ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours),
        "seconds": round(routed_s, 2),
        "export_seconds": round(export_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    options = parser.parse_args()
    rows = []
    for source, names in (("timm", TIMM), ("torchvision", TORCHVISION)):
        for name in names:
            try:
                row = compare(source, name)
            except Exception as exc:  # a model that does not build or run here is listed, not fatal
                row = {"model": f"{source}:{name}", "error": f"{type(exc).__name__}: {str(exc)[:150]}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    options.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    done = [r for r in rows if "error" not in r]
    agree = sum(r["same_decisions"] and r["same_weights"] for r in done)
    on_fx = [r for r in done if r["route"] == "fx"]
    print(
        f"{agree}/{len(done)} models fold the same sites to the same bits on both routes; {len(on_fx)} took the fx "
        f"route: fold call median {sorted(r['seconds'] for r in on_fx)[len(on_fx) // 2]:.2f} s there against "
        f"{sorted(r['export_seconds'] for r in on_fx)[len(on_fx) // 2]:.2f} s on export"
    )


if __name__ == "__main__":
    main()
