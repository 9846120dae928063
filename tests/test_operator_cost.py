"""Each conversion says what it costs per forward: the operators one forward runs before and after
(issue 26), counted where torch dispatches them, on models nobody here wrote."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from normswap_cli.app import app
from typer.testing import CliRunner

import normswap
from normswap.verify.operators import operator_counts


def _gpt2_factory() -> tuple[torch.nn.Module, tuple, dict]:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128)
    model = transformers.GPT2LMHeadModel(config).eval()
    return model, (torch.randint(0, 128, (2, 12)),), {"use_cache": False}


def test_the_report_says_the_operators_a_recentred_gpt2_adds_and_removes(tmp_path: Path):
    factory = tmp_path / "factories.py"
    factory.write_text(
        "import torch, transformers\n"
        "def gpt2():\n"
        "    torch.manual_seed(0)\n"
        "    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128)\n"
        "    return transformers.GPT2LMHeadModel(config).eval(), (torch.randint(0, 128, (2, 12)),), {'use_cache': False}\n"
    )
    report = tmp_path / "r.json"
    ran = CliRunner().invoke(
        app,
        [
            "convert",
            f"{factory}:gpt2",
            "--to",
            "rmsnorm",
            "--exact",
            "-o",
            str(tmp_path / "g.pt"),
            "--report",
            str(report),
        ],
    )
    assert ran.exit_code == 0, ran.output
    cost = json.loads(report.read_text())["operators"]
    # 5 LayerNorms (2 per block and the final one) become RMSNorms: each a mean of squares
    assert cost["removed"] == {"native_layer_norm": 5}
    assert cost["added"]["mean"] >= 5 and cost["added"]["rsqrt"] == 5
    assert cost["after"] - cost["before"] == sum(cost["added"].values()) - sum(cost["removed"].values())
    assert f"operators per forward {cost['before']:,} -> {cost['after']:,}" in " ".join(ran.output.split())


def test_a_folded_torchvision_resnet_runs_no_batch_norm():
    import torchvision

    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32)
    result = normswap.convert(model, normswap.ConvertConfig(fold_bn=True), (x,))
    assert result.ok and result.operators is not None
    assert result.operators.removed["native_batch_norm"] == 20
    assert "native_batch_norm" not in result.operators.after and not result.operators.added
    # counted on the models themselves: the original still runs its 20
    assert operator_counts(model, (x,), {})["native_batch_norm"] == 20


def test_a_fused_norm_is_one_operator_and_nothing_changed_is_the_same_operators():
    model, args, kwargs = _gpt2_factory()
    fused = normswap.convert(model, normswap.ConvertConfig(to="fused"), args, kwargs)
    assert fused.ok and fused.operators is not None
    added = fused.operators.added
    assert sum(n for op, n in added.items() if op.startswith("normswap.")) == 5, added
    assert fused.operators.removed.get("native_layer_norm") == 5
    nothing = normswap.convert(model, normswap.ConvertConfig(fold_bn=True), args, kwargs)
    assert nothing.ok and nothing.operators is None  # nothing changed: nothing to count


def test_a_pt2_and_the_model_in_memory_report_the_same_operators(tmp_path: Path):
    """A .pt2's module reports training mode; the copy run_model made of it was counted as its work
    (634 -> 134 operators for a folded ResNet-18, where the same model in memory says 90 -> 50)."""
    import torchvision

    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(1, 3, 32, 32)
    path = tmp_path / "r18.pt2"
    torch.export.save(torch.export.export(model, (x,)), path)
    costs = [
        normswap.convert(source, normswap.ConvertConfig(fold_bn=True), (x,)).operators
        for source in (model, str(path))
    ]
    assert costs[0] is not None and costs[1] is not None
    assert costs[0].to_dict() == costs[1].to_dict()
    assert (costs[0].to_dict()["before"], costs[0].to_dict()["after"]) == (90, 50)


def test_only_a_run_that_would_change_the_model_runs_on_a_copy(tmp_path: Path):
    """A .pt2 exported in eval mode changes nothing when run (its module's training flag and its bare
    holders say nothing), so it is not copied on every comparison; one exported in training mode writes
    its BatchNorm statistics, and is."""
    import torchvision

    from normswap.load import load_model
    from normswap.util.modes import updates_its_state

    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32)
    for mode in ("eval", "train"):
        getattr(model, mode)()
        path = tmp_path / f"{mode}.pt2"
        torch.export.save(torch.export.export(model, (x,)), path)
        loaded = load_model(path).model
        assert loaded.training  # as torch.export's module says, whatever the graph does
        assert updates_its_state(loaded) is (mode == "train")
        assert updates_its_state(model) is (mode == "train")
        before = {k: v.clone() for k, v in loaded.state_dict().items()}
        normswap.validate(str(path), str(path))
        assert all(torch.equal(before[k], v) for k, v in loaded.state_dict().items())


class _FunctionalBatchNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(3))
        self.register_buffer("var", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.batch_norm(x, self.mean, self.var, training=self.training)


def test_graphs_that_update_running_statistics_run_on_a_copy(tmp_path: Path):
    """aten's batch_norm/instance_norm write the running statistics they are given in training mode,
    though their schemas are not marked mutable: a .pt2 of a training-mode InstanceNorm with tracked
    statistics, and an fx trace of F.batch_norm(training=True), change when run and must be copied."""
    from normswap.load import load_model
    from normswap.util.modes import updates_its_state
    from normswap.verify.compare import run_model

    instance = torch.nn.Sequential(
        torch.nn.Conv2d(3, 3, 1), torch.nn.InstanceNorm2d(3, track_running_stats=True)
    )
    x = torch.randn(2, 3, 8, 8) + 3
    torch.export.save(torch.export.export(instance.train(), (x,)), tmp_path / "in.pt2")
    traced = torch.fx.symbolic_trace(_FunctionalBatchNorm().train())
    for model in (load_model(tmp_path / "in.pt2").model, traced):
        assert updates_its_state(model)
        before = {k: v.clone() for k, v in model.named_buffers()}
        run_model(model, (x,), {})
        assert all(torch.equal(before[k], v) for k, v in model.named_buffers())
    assert not updates_its_state(torch.fx.symbolic_trace(_FunctionalBatchNorm().eval()))
