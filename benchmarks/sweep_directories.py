"""Sweep normswap's command line over Hugging Face model directories, one architecture at a time.

Each architecture is built here from a small config (random weights: 1-2 layers, hidden 32-64, a vocabulary
of 256; nothing is downloaded), every norm's weight and bias randomized (weights uniform in 0.75..1.25,
biases in -0.5..0.5, BatchNorm statistics too) so that exactness is not a coincidence of identity norms,
and saved with ``save_pretrained`` as a model directory DIR in a temporary folder. Then the real command
line runs on it, each command in its own process with a timeout, as a user would type it:

    inspect   normswap inspect DIR --json R.json
    fold_dir  normswap convert DIR --fold-norm-affine -o OUT_dir --report R.json   (directory: may stream)
    fold_pt2  normswap convert DIR --fold-norm-affine -o OUT.pt2 --report R.json   (in memory)
    rmsnorm   normswap convert DIR --to rmsnorm --exact -o OUT.pt2 --report R.json
    fused     normswap convert DIR --to fused -o OUT.pt2 --report R.json
    onnx      normswap export DIR -o OUT.onnx --report R.json
    validate  normswap validate DIR OUT_dir --report R.json   (only when fold_dir wrote OUT_dir)

For each: the exit code (0 done, 1 a check failed or a refusal, 2 bad input), wall seconds, whether the
output holds a Python traceback (always a bug) and its last lines, the first ``error:`` line, and from the
report the verdict, changes, skipped sites with their reasons and the worst relative difference.

    nice -n 19 .venv/bin/python benchmarks/sweep_directories.py [--only NAME] [--timeout S] [--out DIR]

``--only`` runs the architectures whose name contains NAME and replaces their lines in the results,
keeping the others. Results: ``sweep_directories.jsonl`` (one line per architecture x command) and
``sweep_directories.md`` (the table) under ``benchmarks/results``. The machine it was written for has two
cores: run it under ``nice`` and leave it one architecture at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
RESULTS = HERE.parent / "results"
NORMSWAP = ROOT / ".venv" / "bin" / "normswap"
VOCAB = 256
TRACEBACK = "Traceback (most recent call last)"

_DEC = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
_ENC = {k: v for k, v in _DEC.items() if k != "num_key_value_heads"}
_SEQ2SEQ = {
    "encoder_layers": 1, "decoder_layers": 1, "d_model": 64, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4,
}  # fmt: skip

# name: (config class, model class, config overrides that make it small)
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 128}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", _DEC),
    "mistral": ("MistralConfig", "MistralForCausalLM", _DEC),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**_DEC, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _DEC),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_DEC, "head_dim": 16}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**_DEC, "head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**_DEC, "head_dim": 16, "sliding_window": 32}),
    "phi": ("PhiConfig", "PhiForCausalLM", _DEC),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", _DEC),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", _DEC),
    "cohere": ("CohereConfig", "CohereForCausalLM", _DEC),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", _DEC),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", _DEC),
    "granite": ("GraniteConfig", "GraniteForCausalLM", _DEC),
    "opt": ("OPTConfig", "OPTForCausalLM", {"num_hidden_layers": 2, "hidden_size": 64, "ffn_dim": 128,
                                             "num_attention_heads": 4, "word_embed_proj_dim": 64,
                                             "max_position_embeddings": 128}),
    "falcon": ("FalconConfig", "FalconForCausalLM", {"num_hidden_layers": 2, "hidden_size": 64,
                                                     "num_attention_heads": 4}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", _ENC),
    "bloom": ("BloomConfig", "BloomForCausalLM", {"n_layer": 2, "hidden_size": 64, "n_head": 4}),
    "mamba": ("MambaConfig", "MambaForCausalLM", {"num_hidden_layers": 2, "hidden_size": 64, "state_size": 8,
                                                  "expand": 2, "conv_kernel": 4}),
    "bert": ("BertConfig", "BertForSequenceClassification", _ENC),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", _ENC),
    "distilbert": ("DistilBertConfig", "DistilBertForSequenceClassification",
                   {"n_layers": 2, "dim": 64, "hidden_dim": 128, "n_heads": 4, "max_position_embeddings": 128}),
    "albert": ("AlbertConfig", "AlbertForMaskedLM", {**_ENC, "embedding_size": 32}),
    "deberta_v2": ("DebertaV2Config", "DebertaV2ForSequenceClassification", _ENC),
    "vit": ("ViTConfig", "ViTForImageClassification", {**_ENC, "image_size": 32, "patch_size": 8}),
    "dinov2": ("Dinov2Config", "Dinov2Model", {**_ENC, "mlp_ratio": 2, "image_size": 32, "patch_size": 8}),
    "clip_vision": ("CLIPVisionConfig", "CLIPVisionModel", {**_ENC, "image_size": 32, "patch_size": 8}),
    "convnext": ("ConvNextConfig", "ConvNextForImageClassification",
                 {"hidden_sizes": [32, 64], "depths": [1, 1], "num_stages": 2, "image_size": 64}),
    "resnet": ("ResNetConfig", "ResNetForImageClassification",
               {"hidden_sizes": [32, 64], "depths": [1, 1], "embedding_size": 32}),
    "swin": ("SwinConfig", "SwinForImageClassification",
             {"image_size": 32, "patch_size": 4, "embed_dim": 32, "depths": [1, 1], "num_heads": [2, 4],
              "window_size": 4}),
    "t5": ("T5Config", "T5ForConditionalGeneration", {"num_layers": 1, "num_decoder_layers": 1, "d_model": 64,
                                                      "d_ff": 128, "num_heads": 4, "d_kv": 16}),
    "bart": ("BartConfig", "BartForConditionalGeneration", {**_SEQ2SEQ, "max_position_embeddings": 128}),
    "whisper": ("WhisperConfig", "WhisperForConditionalGeneration",
                {**_SEQ2SEQ, "num_mel_bins": 16, "max_source_positions": 32, "max_target_positions": 64}),
    "wav2vec2": ("Wav2Vec2Config", "Wav2Vec2ForCTC",
                 {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
                  "conv_dim": [32, 32], "conv_stride": [5, 2], "conv_kernel": [10, 3],
                  "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 2}),
    "speech2text": ("Speech2TextConfig", "Speech2TextForConditionalGeneration",
                    {**_SEQ2SEQ, "input_feat_per_channel": 16, "conv_channels": 32, "num_conv_layers": 2,
                     "max_source_positions": 64, "max_target_positions": 64}),
}  # fmt: skip
_NO_VOCAB = {"vit", "dinov2", "clip_vision", "convnext", "resnet", "swin"}


def _randomize_norms(model: Any) -> None:
    """Every norm's weight in 0.75..1.25, bias in -0.5..0.5, BatchNorm statistics off 0 and 1; seeded."""
    import torch

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if "Norm" not in type(module).__name__:
                continue
            for name in ("weight", "bias", "running_mean", "running_var"):
                tensor = getattr(module, name, None)
                if not isinstance(tensor, torch.Tensor) or tensor.ndim != 1 or not tensor.is_floating_point():
                    continue
                noise = torch.rand(tensor.shape, generator=generator)
                if name == "weight":
                    tensor.copy_(0.75 + 0.5 * noise)
                elif name == "running_var":
                    tensor.copy_(0.5 + noise)
                else:
                    tensor.copy_(noise - 0.5)


def build(name: str, directory: Path) -> dict[str, Any]:
    """Build architecture ``name`` small and random, save it to ``directory``; what was built."""
    import torch
    import transformers

    torch.manual_seed(0)
    config_name, model_name, overrides = ARCHS[name]
    config = getattr(transformers, config_name)(**overrides)
    if name not in _NO_VOCAB:
        config.vocab_size = VOCAB
        # token ids of the default configs point past a small vocabulary
        for key, value in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
            if getattr(config, key, None) is not None:
                setattr(config, key, value)
        if getattr(config, "decoder_start_token_id", None) is not None:
            config.decoder_start_token_id = 1
    model = getattr(transformers, model_name)(config).eval()
    _randomize_norms(model)
    model.save_pretrained(directory)
    norms = Counter(type(m).__name__ for m in model.modules() if "Norm" in type(m).__name__)
    return {"model_class": model_name, "parameters": sum(p.numel() for p in model.parameters()),
            "norm_modules": dict(norms)}  # fmt: skip


def commands(directory: Path, work: Path) -> dict[str, list[str]]:
    out_dir = work / "fold_dir_out"
    return {
        "inspect": ["inspect", str(directory), "--json", str(work / "inspect.json")],
        "fold_dir": ["convert", str(directory), "--fold-norm-affine", "-o", str(out_dir),
                     "--report", str(work / "fold_dir.json")],
        "fold_pt2": ["convert", str(directory), "--fold-norm-affine", "-o", str(work / "fold.pt2"),
                     "--report", str(work / "fold_pt2.json")],
        "rmsnorm": ["convert", str(directory), "--to", "rmsnorm", "--exact", "-o", str(work / "rms.pt2"),
                    "--report", str(work / "rmsnorm.json")],
        "fused": ["convert", str(directory), "--to", "fused", "-o", str(work / "fused.pt2"),
                  "--report", str(work / "fused.json")],
        "onnx": ["export", str(directory), "-o", str(work / "model.onnx"), "--report", str(work / "onnx.json")],
        "validate": ["validate", str(directory), str(out_dir), "--report", str(work / "validate.json")],
    }  # fmt: skip


def _max_rel(node: Any) -> float | None:
    """The worst ``max_rel`` of a report's compared outputs and stages (not its per-layer figures)."""
    found: list[float] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key in ("layers", "sites", "norm_sites"):
                    continue  # per-layer figures of validate differ by design (a folded norm's output)
                if key == "max_rel" and isinstance(item, (int, float)):
                    found.append(float(item))
                else:
                    walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(node)
    return max(found) if found else None


def summarize(step: str, report: dict[str, Any] | None) -> dict[str, Any]:
    if report is None:
        return {"report": False}
    if step == "inspect":
        return {"report": True, "sites": report.get("counts", {}), "graph": report.get("graph_method"),
                "graph_errors": [str(e)[:200] for e in report.get("graph_errors") or []]}  # fmt: skip
    passes = report.get("passes") or []
    skips = [s for p in passes for s in p.get("skips") or []]
    summary: dict[str, Any] = {
        "report": True,
        "verdict": report.get("verdict") or ("written" if report.get("written") else "not written"),
        "refusal": report.get("refusal"),
        "written": report.get("written"),
        "changes": sum(len(p.get("changes") or []) for p in passes),
        "skipped": len(skips),
        "skip_reasons": dict(Counter(str(s.get("reason"))[:160] for s in skips)),
        "exact_failures": [str(f)[:200] for f in report.get("exact_failures") or []],
        "route": report.get("route"),
        "max_rel": _max_rel({k: v for k, v in report.items() if k != "layers"}),
    }
    if step == "validate":
        summary["verdict"] = {True: "PASS", False: "FAIL"}.get(report.get("passed"), report.get("passed"))
        summary["first_divergent"] = report.get("first_divergent")
        summary["failure"] = report.get("failure")
    return summary


def _first_error(output: str) -> str | None:
    for line in output.splitlines():
        if line.strip().startswith("error:"):
            return line.strip()[:400]
    return None


def _traceback_tail(output: str, lines: int = 15) -> list[str]:
    start = output.rfind(TRACEBACK)
    return output[start:].rstrip().splitlines()[-lines:] if start >= 0 else []


def run_command(args: list[str], timeout: float) -> dict[str, Any]:
    start = time.perf_counter()
    env = {**os.environ, "COLUMNS": "160", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    try:
        done = subprocess.run(
            [str(NORMSWAP), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
        )
        rc: int | str = done.returncode
        output = (done.stdout or "") + "\n" + (done.stderr or "")
    except subprocess.TimeoutExpired as expired:
        rc = "timeout"
        output = "\n".join(
            x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
            for x in (expired.stdout, expired.stderr)
        )
    tail = [line for line in output.rstrip().splitlines() if line.strip()][-15:]
    return {
        "rc": rc,
        "seconds": round(time.perf_counter() - start, 1),
        "traceback": TRACEBACK in output,
        "traceback_tail": _traceback_tail(output),
        "error": _first_error(output),
        "output_tail": tail if rc != 0 else [],
    }


def sweep_one(name: str, timeout: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix=f"normswap_sweep_{name}_") as tmp:
        directory, work = Path(tmp) / name, Path(tmp) / "work"
        work.mkdir()
        start = time.perf_counter()
        built = subprocess.run(
            [sys.executable, str(HERE), "--build", name, str(directory)],
            capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )  # fmt: skip
        last = built.stdout.strip().splitlines()[-1] if built.stdout.strip() else ""
        if built.returncode != 0 or not last.startswith("{"):
            error = [line for line in built.stderr.strip().splitlines() if line.strip()][-15:]
            return [{"arch": name, "command": "build", "rc": built.returncode, "built": False,
                     "seconds": round(time.perf_counter() - start, 1), "output_tail": error}]  # fmt: skip
        info = json.loads(last)
        rows.append({"arch": name, "command": "build", "rc": 0, "built": True,
                     "seconds": round(time.perf_counter() - start, 1), **info})  # fmt: skip
        for step, args in commands(directory, work).items():
            if step == "validate" and not (work / "fold_dir_out" / "config.json").exists():
                rows.append(
                    {"arch": name, "command": step, "rc": None, "not_run": "fold_dir wrote no directory"}
                )
                continue
            result = run_command(args, timeout)
            report_path = Path(args[args.index("--json" if step == "inspect" else "--report") + 1])
            try:
                report = json.loads(report_path.read_text()) if report_path.exists() else None
            except ValueError:
                report = None
            rows.append({"arch": name, "command": step, "argv": ["normswap", *args], **result,
                         **summarize(step, report)})  # fmt: skip
            print(f"  {name} {step}: rc {result['rc']} {result['seconds']} s"
                  + (" TRACEBACK" if result["traceback"] else ""), flush=True)  # fmt: skip
        shutil.rmtree(work, ignore_errors=True)
    return rows


STEPS = ["inspect", "fold_dir", "fold_pt2", "rmsnorm", "fused", "onnx", "validate"]


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    if row.get("not_run"):
        return "not run"
    rc = row["rc"]
    if row.get("traceback"):
        return f"**{rc} TRACEBACK**"
    parts = [f"{rc}"]
    step = row["command"]
    if step == "inspect":
        sites = row.get("sites") or {}
        parts.append(" ".join(f"{k} {v}" for k, v in sorted(sites.items())) or "no sites")
        parts.append(f"graph: {row.get('graph') or 'none'}")
    elif rc == 0 or row.get("report"):
        verdict = row.get("verdict")
        if verdict is not None:
            parts.append(str(verdict))
        if step not in ("onnx", "validate"):
            parts.append(f"{row.get('changes', 0)} ch/{row.get('skipped', 0)} sk")
        if row.get("route"):
            parts.append(row["route"])
        if row.get("max_rel") is not None:
            parts.append(f"rel {row['max_rel']:.1e}")
    if rc != 0 and (row.get("error") or row.get("refusal")):
        message = str(row.get("error") or row.get("refusal")).replace("|", "/")
        parts.append(message[:90] + ("..." if len(message) > 90 else ""))
    elif rc not in (0, None) and not row.get("error"):
        parts.append("(no error: line)")
    return ", ".join(parts)


def write_markdown(rows: list[dict[str, Any]], path: Path, command: str) -> None:
    by_arch: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_arch.setdefault(row["arch"], {})[row["command"]] = row
    commands_used = list(dict.fromkeys(r["sweep_command"] for r in rows if r.get("sweep_command")))
    revisions = Counter(r.get("revision", "unknown") for r in rows if r["command"] == "build")
    ran = [r for r in rows if r["command"] in STEPS and not r.get("not_run")]
    rcs = Counter(str(r["rc"]) if r["rc"] in (0, 1, 2) else "other" for r in ran)
    tracebacks = [r for r in ran if r.get("traceback")]
    dropped = {a: s["build"] for a, s in by_arch.items() if not s["build"].get("built")}
    lines = [
        "# normswap sweep over Hugging Face model directories",
        "",
        "Produced by "
        + ", then ".join(f"`{c}`" for c in commands_used or [command])
        + " (random small models, norms randomized, every command through the real CLI in its own process).",
        "",
        "normswap revision per architecture: "
        + "; ".join(f"{rev} ({n} architectures)" for rev, n in revisions.items())
        + " (the code may change while a sweep runs: rerun one with `--only NAME`).",
        "",
        f"Architectures: {len(by_arch) - len(dropped)} built, {len(dropped)} dropped (config not built offline). "
        f"Commands run: {len(ran)}; exit 0: {rcs['0']}, exit 1: {rcs['1']}, exit 2: {rcs['2']}, "
        f"other (timeout, crash): {rcs['other']}; **with a traceback: {len(tracebacks)}**.",
        "",
        "Cells: exit code, then the report's verdict, changes/skips (ch/sk), route, worst relative difference "
        "of the compared outputs (rel), and the first `error:` line when it failed.",
        "",
        "| arch | " + " | ".join(STEPS) + " | s |",
        "|---|" + "---|" * len(STEPS) + "---|",
    ]
    for arch, steps in by_arch.items():
        if arch in dropped:
            continue
        seconds = sum(s.get("seconds") or 0 for s in steps.values())
        lines.append(f"| {arch} | " + " | ".join(_cell(steps.get(s)) for s in STEPS) + f" | {seconds:.0f} |")
    if dropped:
        lines += ["", "## Dropped architectures", ""]
        lines += [f"- {a}: {(r.get('output_tail') or ['?'])[-1][:200]}" for a, r in dropped.items()]
    lines += ["", "## Tracebacks", ""]
    for row in tracebacks:
        lines += [f"### {row['arch']} / {row['command']} (exit {row['rc']})", "", "```",
                  " ".join(row["argv"]), *row["traceback_tail"], "```", ""]  # fmt: skip
    if not tracebacks:
        lines.append("None.")
    lines += ["", "## Failures and refusals (non-zero exit), last lines of output", ""]
    for row in ran:
        if row["rc"] != 0 and not row.get("traceback"):
            lines += [f"### {row['arch']} / {row['command']} (exit {row['rc']})", "", "```",
                      *[line[:200] for line in row.get("output_tail", [])[-8:]], "```", ""]  # fmt: skip
    reasons: Counter[str] = Counter()
    for row in ran:
        for reason, n in (row.get("skip_reasons") or {}).items():
            reasons[f"{row['command']}: {reason}"] += n
    lines += ["", "## Skip reasons, most frequent first", ""]
    lines += [f"- {n} x {reason}" for reason, n in reasons.most_common(40)]
    path.write_text("\n".join(lines) + "\n")


def _revision() -> str:
    """The checkout's commit, and whether normswap's code differs from it (it may change during a sweep)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "normswap", "cli"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
    except OSError:
        return "unknown"
    return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", help="run the architectures whose name contains this text")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per command [300]")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--build", nargs=2, metavar=("NAME", "DIR"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.build:
        print(json.dumps(build(options.build[0], Path(options.build[1]))))
        return
    options.out.mkdir(parents=True, exist_ok=True)
    jsonl = options.out / "sweep_directories.jsonl"
    names = [n for n in ARCHS if (options.only or "") in n]
    if not names:
        parser.error(f"no architecture matches {options.only!r}; they are {', '.join(ARCHS)}")
    kept = []
    if options.only and jsonl.exists():
        kept = [r for r in map(json.loads, jsonl.read_text().splitlines()) if r["arch"] not in names]
    rows: list[dict[str, Any]] = list(kept)
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in kept))
    argv = " ".join(sys.argv[1:])
    command = f"nice -n 19 .venv/bin/python benchmarks/sweep_directories.py{' ' + argv if argv else ''}"
    for name in names:
        start = time.perf_counter()
        print(f"{name} ...", flush=True)
        try:
            new = sweep_one(name, options.timeout)
        except subprocess.TimeoutExpired:
            new = [{"arch": name, "command": "build", "rc": "timeout", "built": False,
                    "output_tail": [f"building timed out after {options.timeout:.0f} s"]}]  # fmt: skip
        revision = _revision()
        for row in new:
            row["sweep_command"] = command
            row["revision"] = revision
        rows += new
        with jsonl.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in new)
        print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
    order = {n: i for i, n in enumerate(ARCHS)}
    rows.sort(key=lambda r: order.get(r["arch"], len(order)))
    write_markdown(rows, options.out / "sweep_directories.md", command)


if __name__ == "__main__":
    main()
