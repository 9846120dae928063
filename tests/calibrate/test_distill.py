"""Distillation of a converted model towards the original: the library and ``normswap distill``."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import model_zoo
import pytest
import torch
import torch.nn.functional as F
from normswap_cli.app import app
from torch import nn
from typer.testing import CliRunner

from normswap.calibrate.distill import distill
from normswap.calibrate.distill_loss import distillation_loss
from normswap.errors import BadInputError
from normswap.passes import SwapNorm

ZOO = str(Path(model_zoo.__file__))
runner = CliRunner()


def _random_batches(count: int, shape: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(count)]


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _changed(before: dict[str, torch.Tensor], model: nn.Module) -> set[str]:
    return {k for k, v in model.state_dict().items() if not torch.equal(before[k], v)}


@pytest.fixture(scope="module")
def resnet_gn():
    """torchvision resnet18 with randomized BN statistics, and the same with every BN swapped to GroupNorm."""
    teacher, args, kwargs = model_zoo.resnet18(size=32)
    student, _ = SwapNorm("groupnorm", groups=8)(teacher, args, kwargs)
    return teacher, student


# ---------------------------------------------------------------------------------------------------
# Library


def test_resnet18_groupnorm_distillation_raises_holdout_sqnr(resnet_gn):
    teacher, student = resnet_gn
    teacher_state, student_state = _snapshot(teacher), _snapshot(student)
    data = _random_batches(5, (4, 3, 32, 32))  # 4 cycled, the last held out
    seen: list[tuple[int, int, float]] = []
    distilled, report = distill(teacher, student, data, steps=15, lr=1e-3, on_step=lambda *a: seen.append(a))

    # Measured: held-out SQNR -0.6 dB -> 13.5 dB, top-1 0% -> 100% (4 samples); margins kept wide.
    assert report.sqnr_before_db < 1.0
    assert report.sqnr_after_db - report.sqnr_before_db > 8.0, report.to_dict()
    assert report.holdout_loss_after < 0.2 * report.holdout_loss_before
    top1_before, top1_after = report.before.outputs[0].top1_agreement, report.after.outputs[0].top1_agreement
    assert top1_after >= 0.75 and top1_after > top1_before
    assert report.loss_min < 0.1 * report.loss_first and report.steps_done == 15 and report.ok
    assert report.batches == 4 and report.samples == 16 and report.holdout_samples == 4
    assert report.holdout_source == "last batch of the data" and report.loss_outputs == ["output"]
    assert report.trained_elements == report.total_elements == sum(p.numel() for p in student.parameters())
    assert [s[0] for s in seen] == list(range(1, 16)) and seen[0][2] == report.losses[0]

    # The teacher and the caller's student are untouched; the returned copy is back in eval mode.
    assert _changed(teacher_state, teacher) == set() and _changed(student_state, student) == set()
    assert distilled is not student and not any(m.training for m in distilled.modules())
    assert all(p.requires_grad for p in distilled.parameters())
    # The report's "after" is what the returned model computes on the held-out batch.
    with torch.no_grad():
        after = distilled(data[-1])
        reference = teacher(data[-1])
    assert abs(F.mse_loss(after, reference).item() - report.holdout_loss_after) < 1e-6


def test_train_norms_changes_only_norm_parameters(resnet_gn):
    teacher, student = resnet_gn
    data = _random_batches(3, (2, 3, 32, 32))
    distilled, report = distill(teacher, student, data, steps=2, lr=1e-2, train="norms")

    norm_paths = {p for p, m in distilled.named_modules() if isinstance(m, nn.GroupNorm)}
    assert len(norm_paths) == 20 and set(report.trained_modules) == norm_paths
    expected = {f"{p}.{name}" for p in norm_paths for name in ("weight", "bias")}
    assert _changed(_snapshot(student), distilled) == expected
    assert report.trained_tensors == 40
    assert report.trained_elements == sum(distilled.get_parameter(k).numel() for k in expected)


def test_batchnorm_statistics_stay_frozen_and_dropout_stays_off():
    import torchvision

    torch.manual_seed(0)
    teacher = model_zoo.randomize_norms(torchvision.models.mobilenet_v3_small(num_classes=10)).eval()
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        student.classifier[3].weight.add_(0.5 * torch.randn_like(student.classifier[3].weight))
    dropouts = [m for m in student.modules() if isinstance(m, nn.Dropout)]
    assert dropouts and dropouts[0].p > 0
    flags: list[bool] = []
    for m in student.modules():
        if isinstance(m, (nn.Dropout, nn.BatchNorm2d)):
            m.register_forward_pre_hook(lambda mod, _a: flags.append(mod.training))
    stats = {k: v.clone() for k, v in student.state_dict().items() if "running" in k or "num_batches" in k}
    student.train()  # the caller's modes come back exactly, whatever they were

    data = _random_batches(3, (4, 3, 32, 32), seed=1)
    distilled, report = distill(teacher, student, data, steps=3, inplace=True)

    assert distilled is student and flags and not any(flags)  # every forward ran dropout/BN in eval
    for key, value in stats.items():
        assert torch.equal(student.state_dict()[key], value), key
    assert all(m.training for m in student.modules())
    assert report.losses[0] > report.losses[-1] and len(report.losses) == 3


def test_first_loss_is_the_eval_mode_loss():
    # A student with heavy dropout: training-mode noise would make the first loss differ from this one.
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    student = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.9), nn.ReLU(), nn.Linear(16, 4)).train()
    data = _random_batches(2, (32, 8))
    with torch.no_grad():
        expected = F.mse_loss(student.eval()(data[0]), teacher(data[0])).item()
    student.train()
    _, report = distill(teacher, student, data, steps=1)
    assert abs(report.losses[0] - expected) < 1e-7


def test_kl_distillation_of_gpt2_with_dyt():
    teacher, args, kwargs = model_zoo.gpt2()
    student, swap = SwapNorm("dyt")(teacher, args, kwargs)
    assert len(swap.changes) == 5
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 128, (4, 16), generator=g) for _ in range(5)]
    distilled, report = distill(teacher, student, data, steps=30, lr=3e-3, loss="kl", temperature=2.0)

    # Measured: held-out KL 0.0168 -> 0.0103, logits SQNR 0.34 dB -> 2.46 dB.
    assert report.loss_outputs == ["output.logits"] and report.temperature == 2.0
    assert report.holdout_loss_after < 0.75 * report.holdout_loss_before, report.to_dict()
    assert report.sqnr_after_db - report.sqnr_before_db > 1.0
    with torch.no_grad():
        t, s = teacher(data[-1]).logits, distilled(data[-1]).logits
    kl = F.kl_div(F.log_softmax(s / 2, -1), F.softmax(t / 2, -1), reduction="batchmean") * 4
    # batchmean divides by the batch only; the report averages over samples and tokens too.
    assert abs(kl.item() / 16 - report.holdout_loss_after) < 1e-5


def test_loss_definitions():
    g = torch.Generator().manual_seed(0)
    s1, t1 = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    s2, t2 = torch.randn(2, generator=g), torch.randn(2, generator=g)
    pooled = torch.cat([(s1 - t1).flatten(), s2 - t2]).pow(2).mean()
    got = distillation_loss([("a", s1), ("b", s2)], [("a", t1), ("b", t2)], "mse")
    assert torch.allclose(got, pooled)
    # KL(p_t || p_s) at temperature T, times T^2, averaged over rows.
    temperature = 3.0
    p_t = torch.softmax(t1 / temperature, -1)
    manual = (p_t * (p_t.log() - torch.log_softmax(s1 / temperature, -1))).sum(-1).mean() * temperature**2
    got = distillation_loss([("a", s1)], [("a", t1)], "kl", temperature)
    assert torch.allclose(got, manual) and got > 0
    assert distillation_loss([("a", t1)], [("a", t1)], "kl", 2.0).abs() < 1e-6


class _Net(nn.Module):
    def __init__(self, out: int = 4, norm: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16) if norm else nn.Identity()
        self.fc2 = nn.Linear(16, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(self.fc1(x)).relu())


@pytest.mark.parametrize(
    ("student", "options", "batches", "reason"),
    [
        (_Net(), {"steps": 0}, 3, "--steps must be at least 1, got 0"),
        (_Net(), {"steps": 2, "lr": -1.0}, 3, "--lr must be a positive number"),
        (_Net(), {"steps": 2, "loss": "l1"}, 3, "--loss 'l1': choose from mse, kl"),
        (_Net(), {"steps": 2, "train": "convs"}, 3, "--train 'convs': choose from all, norms"),
        (_Net(), {"steps": 2}, 0, "nothing to distil on: the data yields no batches"),
        (_Net(), {"steps": 2}, 1, "a single batch, which is held out"),
        (_Net(out=5), {"steps": 2}, 3, "the two models' outputs differ on the held-out batch: the original "
         "returns output (4, 4); the converted model returns output (4, 5)"),
        (_Net(norm=False), {"steps": 2, "train": "norms"}, 3, "--train norms: the converted model has no norm"),
        (_Net(out=1), {"steps": 2, "loss": "kl"}, 3, "--loss kl reads the last dim as classes"),
    ],
)  # fmt: skip
def test_refusals_name_the_reason(student, options, batches, reason):
    teacher = _Net(out=1) if options.get("loss") == "kl" else _Net()
    before = _snapshot(student)
    with pytest.raises(BadInputError, match=None) as info:
        distill(teacher, student, _random_batches(batches, (4, 8)), **options)
    assert reason in str(info.value)
    assert _changed(before, student) == set()


def test_same_model_is_refused():
    model = _Net()
    with pytest.raises(BadInputError, match="the same object"):
        distill(model, model, _random_batches(3, (4, 8)), steps=1)
    with pytest.raises(BadInputError, match="shares parameters"):
        distill(model, nn.Sequential(model), _random_batches(3, (4, 8)), steps=1, inplace=True)


class _UnusedNorm(_Net):
    def __init__(self) -> None:
        super().__init__(norm=False)
        self.spare = nn.LayerNorm(16)  # a norm the forward never calls


def test_norms_that_do_not_reach_the_outputs_are_refused():
    student = _UnusedNorm()
    with pytest.raises(BadInputError, match=r"do not depend on the parameters selected for training"):
        distill(_Net(), student, _random_batches(3, (4, 8)), steps=2, train="norms", inplace=True)
    assert all(p.requires_grad for p in student.parameters()) and student.training  # flags restored


def test_works_inside_no_grad():
    with torch.no_grad():
        _, report = distill(_Net(), _Net(), _random_batches(3, (4, 8)), steps=3, lr=1e-2)
    assert report.ok and report.losses[-1] < report.losses[0]


def test_holdout_and_cycling_notes():
    teacher, student = _Net(), _Net()
    _, report = distill(teacher, student, _random_batches(10, (4, 8)), steps=3, holdout=torch.randn(6, 8))
    assert report.batches == 3 and report.holdout_samples == 6
    assert report.holdout_source == "separate held-out batch"
    assert report.notes == ["3 steps use at most 3 training batches: the data was read no further"]
    _, report = distill(teacher, student, _random_batches(10, (4, 8)), steps=3)
    assert report.holdout_source == "the batch after the first 3 of the data"
    _, report = distill(teacher, student, _random_batches(3, (4, 8)), steps=5)
    assert report.batches == 2 and report.notes == ["2 training batches cycled over 5 steps"]


def test_non_finite_loss_stops_and_fails_the_report():
    teacher = _Net()
    student = _Net()
    with torch.no_grad():
        student.fc2.bias.fill_(float("nan"))
    _, report = distill(teacher, student, _random_batches(3, (4, 8)), steps=4)
    assert not report.ok and report.steps_done == 1
    assert "training loss is nan at step 1: training stopped" in report.notes[-1]


# ---------------------------------------------------------------------------------------------------
# CLI

FACTORIES = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, out=4, norm=True):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16) if norm else nn.Identity()
        self.fc2 = nn.Linear(16, out)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)).relu())


def teacher():
    torch.manual_seed(0)
    return Net(), (torch.randn(4, 8),)


def student():
    torch.manual_seed(1)
    return Net(), (torch.randn(4, 8),)


def wide():
    return Net(out=5), (torch.randn(4, 8),)


def no_norm():
    return Net(norm=False), (torch.randn(4, 8),)
"""


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(FACTORIES)
    data = tmp_path / "data.pt"
    torch.save(torch.randn(20, 8, generator=torch.Generator().manual_seed(0)), data)
    return path, data


def _run(*args: str):
    return runner.invoke(app, list(args))


def _one_line_error(result, text: str, code: int = 2) -> None:
    assert result.exit_code == code, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: ") and text in lines[-1], result.output


def test_cli_distills_and_reports(tiny, tmp_path):
    factories, data = tiny
    out, report = tmp_path / "out.pt", tmp_path / "report.json"
    result = _run(
        "distill", f"{factories}:teacher", f"{factories}:student", "--data", str(data), "--batch-size", "4",
        "--steps", "40", "--lr", "1e-2", "-o", str(out), "--report", str(report),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"data file {data}: 20 samples of (8,) in batches of 4" in result.output
    assert (
        "distill (data-driven): 40 AdamW steps, lr 0.01, mse loss on output; 4 training batches"
        in result.output
    )
    assert "Held-out batch (4 samples, last batch of the data)" in result.output
    assert f"wrote {out} (pickle)" in result.output

    data_json = json.loads(report.read_text())
    assert data_json["written"] and data_json["ok"] and data_json["kind"] == "data-driven"
    assert data_json["steps_done"] == 40 and len(data_json["losses"]) == 40
    curve = data_json["loss_curve"]
    assert curve["first"] == data_json["losses"][0] and curve["last"] == data_json["losses"][-1]
    assert curve["min"] == min(data_json["losses"]) and curve["last"] < 0.5 * curve["first"]
    assert data_json["sqnr_after_db"] > data_json["sqnr_before_db"] + 3.0
    assert data_json["holdout_loss_after"] < data_json["holdout_loss_before"]

    # The report's held-out loss is what the written model computes against the original.
    model = torch.load(out, weights_only=False)
    assert not any(m.training for m in model.modules())
    holdout = torch.load(data)[16:]
    spec = importlib.util.spec_from_file_location("tiny_check", factories)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    reference, _ = module.teacher()
    with torch.no_grad():
        mse = F.mse_loss(model(holdout), reference(holdout)).item()
    assert abs(mse - data_json["holdout_loss_after"]) < 1e-6


def test_cli_train_norms_and_kl(tiny, tmp_path):
    factories, data = tiny
    out = tmp_path / "out.pt2"
    result = _run(
        "distill", f"{factories}:teacher", f"{factories}:student", "--data", str(data), "--batch-size", "4",
        "--steps", "3", "--train", "norms", "--loss", "kl", "--temperature", "2", "-o", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "kl at T=2 loss on output" in result.output
    assert "trained 1 norm modules, 2 tensors, 32 of" in result.output
    assert f"wrote {out} (pt2)" in result.output and out.exists()


@pytest.mark.parametrize(
    ("converted", "data_kind", "options", "reason"),
    [
        ("student", "ok", ["--steps", "0"], "--steps must be at least 1, got 0"),
        ("student", "ok", ["--steps", "2", "--temperature", "2"], "--temperature applies to --loss kl"),
        ("student", "ok", ["--steps", "2", "--loss", "ce"], "--loss 'ce': choose from mse, kl"),
        ("wide", "ok", ["--steps", "2"], "the two models' outputs differ on the held-out batch"),
        ("no_norm", "ok", ["--steps", "2", "--train", "norms"], "--train norms: the converted model has no norm"),
        ("student", "one", ["--steps", "2"], "the data yields a single batch, which is held out"),
        ("student", "empty", ["--steps", "2"], "holds an empty list: no batches"),
        ("student", "ok", ["--steps", "2", "--resume"], "--checkpoint-every and --resume need --checkpoint-dir"),
        ("student", "ok", ["--steps", "2", "--shard-teacher"], "--shard-teacher applies under torchrun"),
        ("student", "ok", ["--steps", "2", "--checkpoint-dir", "{tmp}/out.pt"], "is also -o: choose another path"),
    ],
)  # fmt: skip
def test_cli_refusals_write_nothing(tiny, tmp_path, converted, data_kind, options, reason):
    factories, data = tiny
    if data_kind == "ok":
        options = ["--batch-size", "4", *options]
    else:  # lists of batches, which refuse --batch-size
        data = tmp_path / f"{data_kind}.pt"
        torch.save([torch.randn(4, 8)] if data_kind == "one" else [], data)
    out = tmp_path / "out.pt"
    options = [o.replace("{tmp}", str(tmp_path)) for o in options]
    result = _run(
        "distill", f"{factories}:teacher", f"{factories}:{converted}", "--data", str(data), *options,
        "-o", str(out),
    )  # fmt: skip
    _one_line_error(result, reason)
    assert not out.exists() and not list(tmp_path.glob(".out.pt.normswap-tmp-*"))


def test_cli_refuses_to_overwrite_the_converted_model(tiny, tmp_path):
    factories, data = tiny
    converted = tmp_path / "student.pt"
    module_student = _Net()
    torch.save(module_student, converted)
    before = converted.read_bytes()
    result = _run(
        "distill", f"{factories}:teacher", str(converted), "--trust-pickle", "--data", str(data),
        "--steps", "1", "-o", str(converted),
    )  # fmt: skip
    _one_line_error(result, f"-o {converted} is also CONVERTED: choose another path")
    assert converted.read_bytes() == before


@pytest.mark.slow
def test_cli_pt2_student_with_norms_only(resnet_gn, tmp_path):
    # A .pt2 student: the exported graph's norms are lifted back into modules, so --train norms finds them.
    _, student = resnet_gn
    converted = tmp_path / "gn.pt2"
    torch.export.save(torch.export.export(student, (torch.randn(2, 3, 32, 32),), strict=False), converted)
    data = tmp_path / "calib.pt"
    torch.save(torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0)), data)
    out = tmp_path / "out.pt2"
    result = _run(
        "distill", f"{ZOO}:resnet18_factory", str(converted), "--data", str(data), "--batch-size", "2",
        "--steps", "3", "--lr", "1e-2", "--train", "norms", "-o", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "trained 20 norm modules, 40 tensors, 9,600 of 11,181,642 parameters" in result.output
    assert f"wrote {out} (pt2)" in result.output
    written = torch.export.load(out).module()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert not torch.allclose(written(x), torch.export.load(converted).module()(x))


def test_cli_writes_onnx_as_convert_does(tiny, tmp_path):
    """The output options mean what they mean on convert: --opset, --static-shapes and --dtype for a
    distilled model's .onnx (and a bf16 .onnx is refused before the training, not after it)."""
    factories, data = tiny
    common = [
        "distill", f"{factories}:teacher", f"{factories}:student", "--data", str(data), "--batch-size", "4",
        "--steps", "2",
    ]  # fmt: skip
    out, report = tmp_path / "s.onnx", tmp_path / "r.json"
    ran = _run(*common, "-o", str(out), "--opset", "17", "--static-shapes", "--report", str(report))
    assert ran.exit_code == 0, ran.output
    written = json.loads(report.read_text())["onnx"]
    assert written["opset"] == 17 and written["dynamic_axes"] == {} and written["within_tolerance"]
    refused = _run(*common, "-o", str(tmp_path / "b.onnx"), "--dtype", "bfloat16")
    _one_line_error(refused, "onnxruntime's CPU build has no bf16 kernels")
    assert "AdamW" not in refused.output  # refused before the work


def test_activation_checkpointing_trains_the_same_model_and_leaves_it_as_it_was():
    """Each block recomputes its activations in the backward: the same losses and weights as keeping them
    (an HF Llama's decoder layers take keyword inputs), and afterwards the blocks run their own forward."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    teacher = transformers.LlamaForCausalLM(config).eval()
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.05 * torch.randn_like(p))
    data = [torch.randint(0, 96, (3, 9), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    calls: list[int] = []
    student.model.layers[0].self_attn.register_forward_hook(lambda *_: calls.append(1))
    kept, kept_report = distill(teacher, student, data, steps=3, lr=1e-3)
    without = len(calls)
    recomputed, report = distill(teacher, student, data, steps=3, lr=1e-3, activation_checkpointing=True)
    assert len(calls) - without == without + 3  # each of the 3 steps runs the block's forward once more
    assert "2 blocks (model.layers) recompute their activations in the backward" in report.notes
    for a, b in zip(kept_report.losses, report.losses, strict=True):
        assert abs(a - b) <= 1e-6 * abs(a)
    for (name, a), b in zip(kept.state_dict().items(), recomputed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    assert not any("forward" in layer.__dict__ for layer in recomputed.model.layers)
    with pytest.raises(
        BadInputError, match="--activation-checkpointing: the converted model has no list of blocks"
    ):
        distill(
            nn.Linear(4, 4),
            nn.Linear(4, 4),
            _random_batches(3, (2, 4)),
            steps=1,
            activation_checkpointing=True,
        )


_DYT_FACTORIES = """
import torch, transformers
from normswap.modules.layout import DyT

def build():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=300, use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).eval(), (torch.randint(0, 300, (2, 8)),)

def build_dyt():
    model, inputs = build()
    for block in model.model.layers:
        block.input_layernorm = DyT(32)
    return model, inputs
"""


def test_a_student_a_directory_cannot_hold_is_refused_before_training(tmp_path, monkeypatch):
    """distill -o DIR with a DyT student: refused after all its steps; now before the first, with the
    sentence convert says for the same model."""
    import normswap.calibrate.distill as engine

    def trains(*args, **kwargs):
        raise AssertionError("training started before the output was judged")

    monkeypatch.setattr(engine, "distill", trains)
    factories = tmp_path / "dyt.py"
    factories.write_text(_DYT_FACTORIES)
    data = tmp_path / "tokens.pt"
    torch.save(torch.randint(0, 300, (12, 8), generator=torch.Generator().manual_seed(0)), data)
    result = _run(
        "distill", f"{factories}:build", f"{factories}:build_dyt", "--data", str(data), "--batch-size", "4",
        "--steps", "40", "-o", str(tmp_path / "out"),
    )  # fmt: skip
    _one_line_error(
        result, "the converted model's model.layers.0.input_layernorm (DyT) is not what its config"
    )
    assert not (tmp_path / "out").exists()
