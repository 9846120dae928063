"""``--fold-bn`` streamed from a Hugging Face model directory: the same tensors as the in-memory route, each
folded layer checked against the BatchNorm it replaces, and nothing written when a check fails."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from hf_dirs import convert_in_memory, stream
from hf_dirs import stored_tensors as _tensors
from normswap_cli.app import app
from typer.testing import CliRunner

from normswap.api import ConvertConfig, convert
from normswap.errors import BrokenModelError, CheckFailedError
from normswap.load import load_model
from normswap.load.weight_files import find_weights

runner = CliRunner()


def _randomize_statistics(model: torch.nn.Module) -> None:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                for name, low, high in (
                    ("running_mean", -0.5, 0.5),
                    ("running_var", 0.5, 1.5),
                    ("weight", 0.5, 1.5),
                    ("bias", -0.5, 0.5),
                ):
                    tensor = getattr(module, name)
                    tensor.copy_(low + (high - low) * torch.rand(tensor.shape, generator=generator))


def _models() -> dict[str, tuple[type, object, torch.dtype]]:
    resnet = transformers.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32, 48], depths=[1, 2, 1], layer_type="bottleneck", num_labels=7
    )
    return {
        "resnet": (transformers.ResNetForImageClassification, resnet, torch.float32),
        "resnet-bf16": (transformers.ResNetForImageClassification, resnet, torch.bfloat16),
        "regnet": (
            transformers.RegNetForImageClassification,
            transformers.RegNetConfig(
                embedding_size=16, hidden_sizes=[16, 32], depths=[1, 2], groups_width=8, num_labels=5
            ),
            torch.float32,
        ),
        "mobilenet_v2": (
            transformers.MobileNetV2ForImageClassification,
            transformers.MobileNetV2Config(depth_multiplier=0.35, image_size=64, num_labels=5),
            torch.float32,
        ),
    }


def _directory(
    tmp_path: Path, name: str, break_statistics: str | None = None, variance: float = -1.0
) -> tuple[Path, torch.nn.Module]:
    cls, config, dtype = _models()[name]
    torch.manual_seed(0)
    model = cls(config).eval()
    _randomize_statistics(model)
    if break_statistics is not None:
        with torch.no_grad():
            model.get_submodule(break_statistics).running_var[0] = (
                variance  # -1: var + eps < 0, no affine map
            )
    model = model.to(dtype)
    model.save_pretrained(tmp_path / name, max_shard_size="20KB")  # sharded, with an index
    return tmp_path / name, model


@pytest.mark.parametrize("name", ["resnet", "resnet-bf16", "regnet", "mobilenet_v2"])
def test_the_streamed_fold_writes_what_the_in_memory_route_writes(tmp_path, name):
    source, model = _directory(tmp_path, name)
    assert len(list(source.glob("*.safetensors"))) > 1
    streamed = stream(source, tmp_path / "streamed", fold_bn=True)
    result = convert_in_memory(source, {"fold_bn": True}, tmp_path / "memory")

    ours, theirs = _tensors(tmp_path / "streamed"), _tensors(tmp_path / "memory")
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
    batchnorms = [p for p, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert sorted(c.site for c in streamed.report.changes) == sorted(batchnorms) and not streamed.report.skips
    assert sorted(c.site for c in result.report.passes[0].changes) == sorted(batchnorms)
    assert not any(k.startswith(tuple(f"{bn}." for bn in batchnorms)) for k in ours)
    # every folded layer was checked against its BatchNorm, in the stored dtype's exact tolerance
    assert len(streamed.fold_checks) == len(batchnorms)
    assert all(
        c.within_tolerance and c.dtype == str(model.dtype).removeprefix("torch.")
        for c in streamed.fold_checks
    )
    record = json.loads((tmp_path / "streamed" / "normswap.json").read_text())["modules"]
    assert record == json.loads((tmp_path / "memory" / "normswap.json").read_text())["modules"]
    index = find_weights(tmp_path / "streamed")
    assert set(index.weight_map) == set(ours)
    # an Identity where the config builds a BatchNorm: stock loaders would build another model
    assert index.hidden and find_weights(tmp_path / "memory").hidden
    assert "holding bias, weight; the config builds a Conv2d holding weight" in streamed.stock_refused
    # what a user loads from it computes the original's function
    back = load_model(str(tmp_path / "streamed")).model
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in back.modules())
    pixels = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1)).to(model.dtype)
    with torch.no_grad():
        want, got = model(pixel_values=pixels).logits.double(), back(pixel_values=pixels).logits.double()
    tolerance = 3e-2 if model.dtype == torch.bfloat16 else 1e-5
    assert float((want - got).abs().max() / want.abs().max()) <= tolerance


def test_a_wrong_fold_is_caught_by_its_check_and_nothing_is_written(tmp_path, monkeypatch):
    from normswap.passes.batchnorm import group as batchnorm_group

    source, _ = _directory(tmp_path, "resnet")
    real = batchnorm_group.folded_weights

    def off_by_a_little(group, tensors):
        weight, bias = real(group, tensors)
        if group.bn.endswith("embedder.embedder.normalization"):
            bias = bias + 1e-3 * bias.abs().max()
        return weight, bias

    monkeypatch.setattr(batchnorm_group, "folded_weights", off_by_a_little)
    with pytest.raises(
        CheckFailedError,
        match=r"verification: resnet\.embedder\.embedder\.normalization -> "
        r"resnet\.embedder\.embedder\.convolution as written is outside the exact tolerance.*nothing written",
    ):
        stream(source, tmp_path / "out", fold_bn=True)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["resnet"]  # no temporary sibling left


def test_statistics_without_an_affine_map_are_a_broken_model_on_both_routes(tmp_path):
    """running_var + eps <= 0 makes the BatchNorm compute NaN on every input: the model is broken, and
    both routes refuse it (normswap.util.finite), in memory through its outputs, streamed at the
    statistics (the stream runs no whole model); nothing is written."""
    broken = "resnet.encoder.stages.1.layers.0.shortcut.normalization"
    source, _ = _directory(tmp_path, "resnet", break_statistics=broken)
    with pytest.raises(BrokenModelError, match=rf"its {broken}\.running_var \+ eps is not positive at \[0\]"):
        stream(source, tmp_path / "streamed", fold_bn=True)
    loaded = load_model(str(source))
    with pytest.raises(BrokenModelError, match=r"the model is broken: its output.logits holds NaN"):
        convert(loaded.model, ConvertConfig(fold_bn=True), loaded.example_args, loaded.example_kwargs)
    assert not (tmp_path / "streamed").exists()
    result = runner.invoke(app, ["convert", str(source), "--fold-bn", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and "the model is broken" in result.output, result.output
    # whatever the rewrite: a stream that folds no BatchNorm refuses the model too (it used to copy it
    # with exit 0, "nothing to change", where the in-memory route refused it)
    other = runner.invoke(app, ["convert", str(source), "--fold-norm-affine", "-o", str(tmp_path / "out")])
    assert other.exit_code == 2, other.output
    assert f"its {broken}.running_var + eps is not positive at [0]" in other.output
    assert not (tmp_path / "out").exists()


def test_an_infinite_variance_is_skipped_alike_on_both_routes(tmp_path):
    """running_var = +Inf is legitimate in a buffer (its channel computes its bias: the outputs are
    finite), so no route refuses the model; neither folds that BatchNorm, for the same reason."""
    skipped = "resnet.encoder.stages.1.layers.0.shortcut.normalization"
    source, _ = _directory(tmp_path, "resnet", break_statistics=skipped, variance=math.inf)
    streamed = stream(source, tmp_path / "streamed", fold_bn=True)
    loaded = load_model(str(source))
    result = convert(loaded.model, ConvertConfig(fold_bn=True), loaded.example_args, loaded.example_kwargs)
    memory = [(s.site, s.reason, s.cause) for s in result.report.passes[0].skips]
    assert [(s.site, s.reason, s.cause) for s in streamed.report.skips] == memory  # the cause too
    assert memory == [
        (
            skipped,
            "BatchNorm statistics are not finite with running_var + eps > 0: it is no affine map to fold",
            None,
        )
    ]
    assert result.ok


def test_the_cli_streams_a_fold_and_says_how_it_was_checked(tmp_path):
    source, _ = _directory(tmp_path, "regnet")
    result = runner.invoke(app, ["convert", str(source), "--fold-bn", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "fold_batchnorm (exact, streamed): 12 changed, 0 skipped" in result.output
    assert "verified 12 rewritten layers against the originals" in result.output
    assert "converting in memory" not in result.output
    # with another rewrite beside it, it is not one stream: in memory, and said so
    both = runner.invoke(
        app, ["convert", str(source), "--fold-bn", "--fold-norm-affine", "-o", str(tmp_path / "two")]
    )
    assert both.exit_code == 0, both.output
    assert (
        "note: a stream runs one rewrite: --fold-bn, --fold-layerscale, --fold-norm-affine, --add-weight-norm, --remove-weight-norm or --to rmsnorm --exact: converting in memory"
        in " ".join(both.output.split())
    )
