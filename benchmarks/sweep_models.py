"""Sweep normswap over models as users run them: one per timm family, torchvision's classification,
detection and segmentation models, and Hugging Face architectures built from small configs with
default settings. Not part of CI: it takes hours on a small machine.

Each model runs in its own process (a crash or a hang is a result, not the end of the sweep), through
the command line a user would type, in-process with typer's runner:

    inspect MODEL                         norm sites found, by kind, and whether a graph was captured
    convert MODEL --fold-bn -o x.pt2      BNs folded / skipped (by reason), the exact error, pass/fail
    convert MODEL --to fused -o x.pt2     norms moved onto the fused kernels
    convert MODEL --to rmsnorm --exact    LayerNorms made RMSNorm exactly (exit 1 when some cannot be)
    export MODEL -o x.onnx                exported and checked in onnxruntime

Weights are random (``pretrained=False``, configs built here), with every norm's statistics and affine
randomized so that exactness is not a coincidence of identity norms. Nothing is downloaded.

    python benchmarks/sweep_models.py [--only SUBSTRING] [--steps inspect,fold_bn] [--timeout S]
                                      [--out benchmarks/results]

Results go to ``sweep_models.jsonl`` (one line per model; a rerun skips models already there unless
``--fresh``) and ``sweep_models.md`` (the table).

Before and after a change: check the earlier commit out as a git worktree, make a folder holding links
``normswap`` -> WORKTREE/normswap and ``normswap_cli`` -> WORKTREE/cli, run this script from the worktree
with that folder first on ``PYTHONPATH`` and another ``--out``, then
``python benchmarks/sweep_models.py --compare BEFORE.jsonl AFTER.jsonl`` writes
``sweep_models_before_after.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
HERE = Path(__file__).resolve()

# Size words in timm's model names, smallest first: the sweep takes the smallest variant of a family.
_SIZE_WORDS = ["atto", "femto", "pico", "nano", "tiny", "xxs", "xs", "mini", "small", "s", "b0", "18", "t"]

TORCHVISION = {
    "classification": [
        "resnet18", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny", "vit_b_16", "swin_t",
        "regnet_y_400mf", "densenet121", "shufflenet_v2_x0_5", "squeezenet1_0", "mnasnet0_5",
        "googlenet", "alexnet", "vgg11_bn", "maxvit_t", "resnext50_32x4d", "wide_resnet50_2",
        "efficientnet_v2_s", "mobilenet_v2", "inception_v3",
    ],
    "detection": ["fasterrcnn_mobilenet_v3_large_320_fpn", "ssdlite320_mobilenet_v3_large", "fcos_resnet50_fpn"],
    "segmentation": ["lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large", "fcn_resnet50"],
}  # fmt: skip

# Hugging Face architectures: (config class, model class, config overrides that make it small).
_SMALL_DECODER = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
}
HF: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_layer": 2, "n_embd": 64, "n_head": 4}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**_SMALL_DECODER, "num_key_value_heads": 2}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_SMALL_DECODER, "num_key_value_heads": 2}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**_SMALL_DECODER, "num_key_value_heads": 2}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**_SMALL_DECODER, "num_key_value_heads": 1, "head_dim": 16}),
    "phi": ("PhiConfig", "PhiForCausalLM", _SMALL_DECODER),
    "opt": ("OPTConfig", "OPTForCausalLM", {"num_hidden_layers": 2, "hidden_size": 64, "ffn_dim": 128,
                                             "num_attention_heads": 4, "word_embed_proj_dim": 64}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", _SMALL_DECODER),
    "bloom": ("BloomConfig", "BloomForCausalLM", {"n_layer": 2, "hidden_size": 64, "n_head": 4}),
    "falcon": ("FalconConfig", "FalconForCausalLM", {"num_hidden_layers": 2, "hidden_size": 64,
                                                     "num_attention_heads": 4}),
    "bert": ("BertConfig", "BertForSequenceClassification", _SMALL_DECODER),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", _SMALL_DECODER),
    "distilbert": ("DistilBertConfig", "DistilBertForSequenceClassification",
                   {"n_layers": 2, "dim": 64, "hidden_dim": 128, "n_heads": 4}),
    "albert": ("AlbertConfig", "AlbertForMaskedLM", {**_SMALL_DECODER, "embedding_size": 32}),
    "electra": ("ElectraConfig", "ElectraForPreTraining", {**_SMALL_DECODER, "embedding_size": 32}),
    "deberta_v2": ("DebertaV2Config", "DebertaV2ForSequenceClassification", _SMALL_DECODER),
    "t5": ("T5Config", "T5EncoderModel", {"num_layers": 2, "d_model": 64, "d_ff": 128, "num_heads": 4,
                                          "d_kv": 16}),
    "bart": ("BartConfig", "BartForConditionalGeneration",
             {"encoder_layers": 2, "decoder_layers": 2, "d_model": 64, "encoder_ffn_dim": 128,
              "decoder_ffn_dim": 128, "encoder_attention_heads": 4, "decoder_attention_heads": 4}),
    "vit": ("ViTConfig", "ViTForImageClassification", {**_SMALL_DECODER, "image_size": 32, "patch_size": 8}),
    "swin": ("SwinConfig", "SwinForImageClassification",
             {"image_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [1, 1], "num_heads": [2, 2],
              "window_size": 4}),
    "convnext": ("ConvNextConfig", "ConvNextForImageClassification",
                 {"hidden_sizes": [16, 32], "depths": [1, 1], "num_stages": 2}),
    "clip_vision": ("CLIPVisionConfig", "CLIPVisionModel", {**_SMALL_DECODER, "image_size": 32, "patch_size": 8}),
    "mobilevit": ("MobileViTConfig", "MobileViTForImageClassification", {"image_size": 64}),
    "resnet_hf": ("ResNetConfig", "ResNetForImageClassification",
                  {"hidden_sizes": [16, 32], "depths": [1, 1], "embedding_size": 16}),
}  # fmt: skip
_VISION_HF = {"vit", "swin", "convnext", "clip_vision", "mobilevit", "resnet_hf"}


def _smallest(names: list[str]) -> str:
    def score(name: str) -> tuple[int, int, str]:
        parts = re.split(r"[_.]", name)
        rank = min((_SIZE_WORDS.index(p) for p in parts if p in _SIZE_WORDS), default=len(_SIZE_WORDS))
        return rank, len(name), name

    return min(names, key=score)


def model_specs() -> list[str]:
    """Every model of the sweep, as ``source:name``."""
    import timm

    # the quickest first, so that a sweep cut short still covers every source
    specs = [f"hf:{name}" for name in HF]
    specs += [f"torchvision-{kind}:{name}" for kind, names in TORCHVISION.items() for name in names]
    for family in timm.list_modules():
        names = timm.list_models(module=family)
        if names:
            specs.append(f"timm:{_smallest(names)}")
    return specs


def _randomize_norms(model: Any) -> Any:
    """Non-trivial running statistics and affines for every norm, seeded."""
    import torch

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            for name in ("running_mean", "weight", "bias", "running_var"):
                tensor = getattr(module, name, None)
                if not isinstance(tensor, torch.Tensor) or tensor.ndim != 1 or not tensor.is_floating_point():
                    continue
                if "Norm" not in type(module).__name__ and "BN" not in type(module).__name__:
                    continue
                noise = torch.rand(tensor.shape, generator=generator)
                if name == "running_var":
                    tensor.copy_(0.5 + noise)
                elif name == "weight":
                    tensor.copy_(0.75 + 0.5 * noise)
                else:
                    tensor.copy_(noise - 0.5)
    return model


def build(spec: str) -> Any:
    """The model of ``spec`` and its example inputs: ``(model, args)`` or ``(model, args, kwargs)``."""
    import torch

    torch.manual_seed(0)
    source, name = spec.split(":", 1)
    if source == "timm":
        import timm

        model = timm.create_model(name, pretrained=False)
        size = model.pretrained_cfg.get("input_size", (3, 224, 224))
        return _randomize_norms(model.eval()), (torch.randn(1, *size),)
    if source.startswith("torchvision"):
        import torchvision

        kind = source.split("-", 1)[1]
        extra = {"weights_backbone": None} if kind != "classification" else {}
        if name == "inception_v3":
            extra["init_weights"] = False
        model = torchvision.models.get_model(name, weights=None, **extra).eval()
        side = 299 if name == "inception_v3" else 224
        x = torch.rand(1, 3, side, side)
        return _randomize_norms(model), ([x[0]],) if kind == "detection" else (x,)
    import transformers

    config_name, model_name, overrides = HF[name]
    config = getattr(transformers, config_name)(**overrides)
    if hasattr(config, "vocab_size") and name not in _VISION_HF:
        config.vocab_size = 128
    model = _randomize_norms(getattr(transformers, model_name)(config).eval())
    if name in _VISION_HF:
        side = getattr(config, "image_size", 32)
        return model, (), {"pixel_values": torch.randn(1, 3, side, side)}
    ids = torch.randint(0, 128, (1, 16))
    if name == "bart":
        return model, (), {"input_ids": ids, "decoder_input_ids": ids[:, :8]}
    return model, (), {"input_ids": ids}


def factory() -> Any:
    """What the command line loads: ``benchmarks/sweep_models.py:factory`` with NORMSWAP_SWEEP_MODEL set."""
    return build(os.environ["NORMSWAP_SWEEP_MODEL"])


STEPS = {
    "inspect": ["inspect", "{model}", "--json", "{dir}/inspect.json"],
    "fold_bn": ["convert", "{model}", "--fold-bn", "-o", "{dir}/fold.pt2", "--report", "{dir}/fold.json"],
    "fused": ["convert", "{model}", "--to", "fused", "-o", "{dir}/fused.pt2", "--report", "{dir}/fused.json"],
    "rmsnorm": [
        "convert", "{model}", "--to", "rmsnorm", "--exact", "-o", "{dir}/rms.pt2", "--report", "{dir}/rms.json",
    ],
    "onnx": ["export", "{model}", "-o", "{dir}/model.onnx", "--report", "{dir}/onnx.json"],
}  # fmt: skip


def _last_error(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    found = next((line for line in reversed(lines) if line.startswith("error:")), None)
    return (found or (lines[-1] if lines else ""))[:300]


def _summary(step: str, report: dict[str, Any] | None) -> dict[str, Any]:
    if report is None:
        return {}
    if step == "inspect":
        return {"sites": report.get("counts", {}), "graph": report.get("graph_method")}
    if step == "onnx":
        return {}
    changed = sum(len(p["changes"]) for p in report.get("passes", []))
    skips = Counter(s["reason"][:90] for p in report.get("passes", []) for s in p["skips"])
    worst = max(
        (
            o["max_rel"]
            for p in report.get("passes", [])
            if p.get("validation")
            for o in p["validation"]["outputs"]
        ),
        default=None,
    )
    return {"changed": changed, "skipped": sum(skips.values()), "skip_reasons": dict(skips), "max_rel": worst}


def run_one(spec: str, steps: list[str]) -> dict[str, Any]:
    """The chosen steps for one model, in this process."""
    from normswap_cli.app import app
    from typer.testing import CliRunner

    os.environ["NORMSWAP_SWEEP_MODEL"] = spec
    runner = CliRunner()
    result: dict[str, Any] = {"model": spec, "steps": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for step in steps:
            argv = STEPS[step]
            args = [a.format(model=f"{HERE}:factory", dir=tmp) for a in argv]
            start = time.perf_counter()
            done = runner.invoke(app, args)
            seconds = time.perf_counter() - start
            report_arg = next((a for a in args if a.endswith(".json")), None)
            report = (
                json.loads(Path(report_arg).read_text()) if report_arg and Path(report_arg).exists() else None
            )
            crashed = done.exit_code not in (0, 1, 2) or (
                done.exception is not None and not isinstance(done.exception, SystemExit)
            )
            result["steps"][step] = {
                "exit": done.exit_code,
                "crash": f"{type(done.exception).__name__}: {str(done.exception)[:200]}" if crashed else None,
                "error": _last_error(done.output) if done.exit_code else None,
                "seconds": round(seconds, 1),
                **_summary(step, report),
            }
    return result


def _cell(step: dict[str, Any] | None, what: str) -> str:
    if not step:
        return "-"
    if step.get("crash"):
        return "CRASH"
    if what == "sites":
        sites = step.get("sites") or {}
        text = " ".join(f"{k} {v}" for k, v in sorted(sites.items())) or "none"
        return text + ("" if step.get("graph") else " (no graph)")
    if what == "onnx":
        return "ok" if step["exit"] == 0 else f"exit {step['exit']}"
    if step["exit"] not in (0, 1):
        return f"exit {step['exit']}"
    cell = f"{step.get('changed', 0)} changed"
    if step.get("skipped"):
        cell += f", {step['skipped']} skipped"
    if step.get("max_rel") is not None:
        cell += f", err {step['max_rel']:.1e}"
    if step["exit"] == 1:
        cell += ", FAIL"
    return cell


def write_table(rows: list[dict[str, Any]], path: Path) -> None:
    header = "| model | sites | fold-bn | fused | rmsnorm --exact | onnx | seconds |\n|---|---|---|---|---|---|---|\n"
    lines = []
    reasons: Counter[str] = Counter()
    for row in rows:
        steps = row.get("steps", {})
        if row.get("timeout") or row.get("failed"):
            lines.append(f"| {row['model']} | {row.get('timeout') or row.get('failed')} | | | | | |")
            continue
        for step in ("fold_bn", "fused", "rmsnorm"):
            for reason, n in (steps.get(step, {}).get("skip_reasons") or {}).items():
                reasons[f"{step}: {reason}"] += n
        seconds = sum(s.get("seconds", 0) for s in steps.values())
        lines.append(
            f"| {row['model']} | {_cell(steps.get('inspect'), 'sites')} | {_cell(steps.get('fold_bn'), 'x')} | "
            f"{_cell(steps.get('fused'), 'x')} | {_cell(steps.get('rmsnorm'), 'x')} | "
            f"{_cell(steps.get('onnx'), 'onnx')} | {seconds:.0f} |"
        )
    top = "\n".join(f"- {n} x {reason}" for reason, n in reasons.most_common(25))
    path.write_text(
        "# normswap model sweep\n\nWritten by `python benchmarks/sweep_models.py`; one row per model, "
        "random weights, default settings.\n\n" + header + "\n".join(lines) + "\n\n## Skip reasons, most "
        "frequent first\n\n" + top + "\n"
    )


def totals(rows: list[dict[str, Any]], source: str) -> dict[str, int]:
    """What the issue counts, over the models of one source (hf, torchvision, timm)."""
    picked = [r for r in rows if r["model"].startswith(source)]
    count: Counter[str] = Counter(models=len(picked))
    for row in picked:
        steps = row.get("steps")
        if not steps:
            count["timed out or failed"] += 1
            continue
        count["graph captured (default settings)"] += bool(steps.get("inspect", {}).get("graph"))
        for step, label in (("fold_bn", "BNs folded"), ("fused", "norms fused")):
            if steps.get(step, {}).get("exit") == 0:
                count[label] += steps[step].get("changed", 0)
        count["rmsnorm --exact exit 0"] += steps.get("rmsnorm", {}).get("exit") == 0
        count["ONNX exported and checked"] += steps.get("onnx", {}).get("exit") == 0
        count["steps that crashed (traceback)"] += sum(1 for s in steps.values() if s.get("crash"))
    return dict(count)


def write_comparison(before: Path, after: Path, path: Path) -> None:
    """Totals before and after, per source, over the models both runs hold."""

    def read(p: Path) -> dict[str, dict[str, Any]]:
        return {row["model"]: row for row in map(json.loads, p.read_text().splitlines())}

    def trimmed(row: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
        # a run may have taken fewer steps (--steps): count a step only where both runs took it
        if "steps" not in row or "steps" not in other:
            return row
        return {**row, "steps": {k: v for k, v in row["steps"].items() if k in other["steps"]}}

    old, new = read(before), read(after)
    common = sorted(set(old) & set(new))
    full = {m: new[m] for m in common}
    old = {m: trimmed(old[m], new[m]) for m in common}
    new = {m: trimmed(new[m], old[m]) for m in common}
    lines = ["| source | figure | before | after | after, every step it took |", "|---|---|---|---|---|"]
    for source in ("hf", "torchvision", "timm"):
        was = totals([old[m] for m in common], source)
        now = totals([new[m] for m in common], source)
        every = totals([full[m] for m in common], source)
        for key in dict.fromkeys([*was, *now, *every]):
            lines.append(
                f"| {source} | {key} | {was.get(key, 0)} | {now.get(key, 0)} | {every.get(key, 0)} |"
            )
    path.write_text(
        f"# Sweep before and after\n\n`{before.name}` vs `{after.name}`, over the {len(common)} models both "
        "hold. *before* and *after* count a step only where both runs took it (a run with `--steps` takes "
        "fewer); the last column counts every step of the after run.\n\n" + "\n".join(lines) + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", help="run the models whose spec contains this text")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per model [600]")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--fresh", action="store_true", help="rerun models already in the results")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="two .jsonl runs")
    parser.add_argument(
        "--steps", default=",".join(STEPS), help=f"comma-separated steps to take [{','.join(STEPS)}]"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    options = parser.parse_args()
    steps = options.steps.split(",")
    if unknown := [s for s in steps if s not in STEPS]:
        parser.error(f"unknown steps {unknown}; the steps are {list(STEPS)}")
    if options.one:
        print(json.dumps(run_one(options.one, steps)))
        return
    if options.compare:
        options.out.mkdir(parents=True, exist_ok=True)
        write_comparison(*options.compare, options.out / "sweep_models_before_after.md")
        return
    options.out.mkdir(parents=True, exist_ok=True)
    jsonl = options.out / "sweep_models.jsonl"
    rows = (
        [json.loads(line) for line in jsonl.read_text().splitlines()]
        if jsonl.exists() and not options.fresh
        else []
    )
    done = {row["model"] for row in rows}
    specs = [s for s in model_specs() if (options.only or "") in s]
    for spec in specs:
        if spec in done:
            continue
        start = time.perf_counter()
        try:
            finished = subprocess.run(
                [sys.executable, str(HERE), "--one", spec, "--steps", options.steps],
                capture_output=True,
                text=True,
                timeout=options.timeout,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
            last = finished.stdout.strip().splitlines()[-1] if finished.stdout.strip() else ""
            row = (
                json.loads(last)
                if last.startswith("{")
                else {
                    "model": spec,
                    "failed": f"process exit {finished.returncode}: {_last_error(finished.stderr)}",
                }
            )
        except subprocess.TimeoutExpired:
            row = {"model": spec, "timeout": f"timed out after {options.timeout:.0f} s"}
        row["wall_seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        with jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{spec}: {row['wall_seconds']} s", flush=True)
    write_table(rows, options.out / "sweep_models.md")


if __name__ == "__main__":
    main()
