"""One rule for a model that holds or computes NaN/Inf (normswap.util.finite): every command and every
route refuses it the same way, exit 2, naming the tensor and where, before anything is written; a model
whose only non-finite values are a buffer it uses legitimately (a -Inf attention mask) is not refused.

Routes: a model file in memory (convert under every kind of rewrite, export, recalibrate, validate,
inspect with inputs), a model directory in memory, streamed (the byte copies and the tensors an edit
reads) and block by block, and the library's calls."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers
from hf_dirs import make_directory, wav2vec2_config
from normswap_cli.app import app
from safetensors.torch import load_file, save_file
from torch import nn
from typer.testing import CliRunner

from normswap.api import ConvertConfig, convert
from normswap.errors import BrokenModelError
from normswap.passes import FoldBatchNorm, Pipeline

runner = CliRunner()
HERE = str(Path(__file__))
INF_SENTENCE = "the model is broken: its conv.weight holds Inf at [0, 1, 2, 0] (1 non-finite value)"


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.bn, self.head = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _conv_bn(inf: bool = True) -> nn.Module:
    model = ConvBN()
    model.train()
    for _ in range(3):
        model(torch.randn(4, 3, 12, 12))
    model.eval()
    if inf:
        with torch.no_grad():
            model.conv.weight[0, 1, 2, 0] = math.inf
    return model


def _x() -> torch.Tensor:
    return torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(1))


def broken_factory() -> tuple[nn.Module, tuple]:
    return _conv_bn(), (_x(),)


def good_factory() -> tuple[nn.Module, tuple]:
    return _conv_bn(inf=False), (_x(),)


def overflowing_factory() -> tuple[nn.Module, tuple]:
    """Finite weights whose output overflows fp32: the outputs rule, not the weights rule, refuses it."""
    model = _conv_bn(inf=False)
    with torch.no_grad():
        model.head.weight.fill_(3e38)
    return model, (_x(),)


@pytest.fixture(scope="module")
def broken_pt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("broken") / "inf.pt2"
    torch.export.save(torch.export.export(_conv_bn(), (_x(),)), path)
    return path


def _refused(result, out: Path | None = None, sentence: str = INF_SENTENCE) -> None:
    assert result.exit_code == 2, result.output
    assert sentence in result.output, result.output
    assert "nothing can be compared there, and nothing was written" in result.output
    assert out is None or not out.exists()


@pytest.mark.parametrize(
    "rewrite", [["--fold-bn"], ["--to", "fused"], ["--to", "groupnorm", "--groups", "2"], ["--to", "rmsnorm"]]
)
def test_convert_refuses_a_broken_model_file_whatever_the_rewrite(broken_pt2, tmp_path, rewrite):
    # before: --fold-bn exit 1 "exact rewrite changed the outputs", --to fused exit 0 writing the model
    out = tmp_path / "out.pt2"
    _refused(runner.invoke(app, ["convert", str(broken_pt2), *rewrite, "-o", str(out)]), out)


@pytest.mark.parametrize(
    "argv",
    [
        ["export", "{model}", "-o", "{out}.onnx"],
        ["recalibrate", "{model}", "--data", "{data}", "-o", "{out}.pt2"],
        ["validate", "{model}", "{good}"],
        ["inspect", "{model}", "--input-shape", "2,3,12,12"],
    ],
    ids=["export", "recalibrate", "validate", "inspect"],
)
def test_every_command_refuses_it_the_same_way(broken_pt2, tmp_path, argv):
    data = tmp_path / "data.pt"
    torch.save(torch.randn(8, 3, 12, 12), data)
    fields = {"model": str(broken_pt2), "out": str(tmp_path / "out"), "data": str(data)}
    fields["good"] = f"{HERE}:good_factory"
    result = runner.invoke(app, [a.format(**fields) for a in argv])
    if argv[0] == "validate":  # validate reads two models: the sentence names which one
        _refused(
            result, sentence=f"ORIGINAL {broken_pt2} is broken: its conv.weight holds Inf at [0, 1, 2, 0]"
        )
    else:
        _refused(result)
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())


def test_a_broken_converted_model_in_validate_is_refused_too(broken_pt2):
    result = runner.invoke(app, ["validate", f"{HERE}:good_factory", str(broken_pt2)])
    _refused(result, sentence=f"CONVERTED {broken_pt2} is broken: its conv.weight holds Inf")


def test_an_original_that_computes_nan_in_validate_names_the_inputs(tmp_path):
    result = runner.invoke(app, ["validate", f"{HERE}:overflowing_factory", f"{HERE}:good_factory"])
    # named as a model it reads broken is named: by its role and its spec
    _refused(
        result, sentence=f"ORIGINAL {HERE}:overflowing_factory is broken: its output holds Inf at [0, 0]"
    )
    assert "on the inputs 2x3x12x12" in result.output


def test_finite_weights_that_compute_inf_are_refused_by_their_outputs(tmp_path):
    out = tmp_path / "out.pt2"
    result = runner.invoke(app, ["convert", f"{HERE}:overflowing_factory", "--fold-bn", "-o", str(out)])
    _refused(result, out, "the model is broken: its output holds Inf at [0, 0]")
    assert "on the example inputs 2x3x12x12" in result.output


def test_the_library_refuses_it_in_memory():
    with pytest.raises(BrokenModelError, match=r"its conv\.weight holds Inf at \[0, 1, 2, 0\]"):
        convert(_conv_bn(), ConvertConfig(fold_bn=True), example_args=(_x(),))
    with pytest.raises(BrokenModelError, match=r"its conv\.weight holds Inf"):
        Pipeline([FoldBatchNorm()])(_conv_bn(), (_x(),))


class MaskedAttention(nn.Module):
    """A causal self-attention whose mask buffer holds -Inf, as hand-written transformers store it."""

    def __init__(self, dim: int = 16, length: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.qkv, self.out = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.register_buffer("mask", torch.full((length, length), -math.inf).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + self.mask
        return x + self.out(scores.softmax(-1) @ v)


def masked_attention_factory() -> tuple[nn.Module, tuple]:
    return MaskedAttention().eval(), (torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(2)),)


def test_a_minus_inf_mask_buffer_is_not_a_broken_model(tmp_path):
    out = tmp_path / "out.pt2"
    result = runner.invoke(
        app, ["convert", f"{HERE}:masked_attention_factory", "--to", "fused", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert out.exists() and "broken" not in result.output


# ---------------------------------------------------------------------------------------------------
# model directories: in memory, streamed, block by block


@pytest.fixture(scope="module")
def w2v(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A wav2vec2 directory (weight norm in its positional conv), one copy with a NaN in a tensor no
    rewrite touches, one with a NaN in the weight-norm tensor the streamed edit reads."""
    root = tmp_path_factory.mktemp("w2v")
    torch.manual_seed(0)
    model = transformers.Wav2Vec2Model(wav2vec2_config()).eval()
    made = {}
    for name, tensor in (
        ("untouched", "encoder.layers.0.feed_forward.intermediate_dense.weight"),
        ("edited", "encoder.pos_conv_embed.conv.parametrizations.weight.original1"),
    ):
        path = root / name
        model.save_pretrained(path, max_shard_size="30KB")
        for shard in path.glob("*.safetensors"):
            tensors = load_file(shard)
            if tensor in tensors:
                tensors[tensor].view(-1)[5] = math.nan
                save_file(tensors, shard, metadata={"format": "pt"})
        made[name] = path
    return made


@pytest.mark.parametrize("which", ["untouched", "edited"])
@pytest.mark.parametrize("output", ["out_dir", "out.pt2"], ids=["streamed", "in memory"])
def test_a_nan_in_a_directory_is_refused_on_both_routes(w2v, tmp_path, which, output):
    # before: streamed exit 0 with the NaN copied as bytes; in memory exit 1 "exact rewrite changed"
    out = tmp_path / output
    result = runner.invoke(app, ["convert", str(w2v[which]), "--remove-weight-norm", "-o", str(out)])
    name = {
        "untouched": "encoder.layers.0.feed_forward.intermediate_dense.weight holds NaN at [0, 5]",
        "edited": "encoder.pos_conv_embed.conv.parametrizations.weight.original1 holds NaN at [0, 0, 5]",
    }[which]
    _refused(result, out, f"the model is broken: its {name}")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_block_by_block_refuses_it_too(tmp_path):
    llama = make_directory(tmp_path, "llama")
    for shard in llama.glob("*.safetensors"):
        tensors = load_file(shard)
        name = "model.layers.1.mlp.down_proj.weight"
        if name in tensors:
            tensors[name][0, 3] = math.inf
            save_file(tensors, shard, metadata={"format": "pt"})
    torch.save(torch.randint(0, 300, (8, 10)), tmp_path / "calib.pt")
    out = tmp_path / "out"
    args = ["convert", str(llama), "--to", "layernorm", "--calibrate", str(tmp_path / "calib.pt")]
    result = runner.invoke(app, [*args, "--batch-size", "4", "--sequential", "-o", str(out)])
    _refused(result, out, "the model is broken: its model.layers.1.mlp.down_proj.weight holds Inf at [0, 3]")


def test_validate_blockwise_names_which_directory_is_broken(tmp_path):
    """validate reads two models: block by block too, the sentence says which one is broken."""
    good = make_directory(tmp_path / "good", "llama")
    broken = make_directory(tmp_path / "broken", "llama")
    name = "model.layers.1.mlp.down_proj.weight"
    for shard in broken.glob("*.safetensors"):
        tensors = load_file(shard)
        if name in tensors:
            tensors[name][0, 3] = math.nan
            save_file(tensors, shard, metadata={"format": "pt"})
    for role, pair in (("ORIGINAL", (broken, good)), ("CONVERTED", (good, broken))):
        result = runner.invoke(app, ["validate", *map(str, pair), "--blockwise"])
        _refused(result, sentence=f"{role} {broken} is broken: its {name} holds NaN at [0, 3]")


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e5m2, torch.complex64]
)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_the_check_finds_every_kind_in_every_dtype(dtype, value):
    """The one-pass min/max check (util.finite.all_finite) and the exact search agree, float8 and
    complex included; a finite tensor of huge float64 values is finite (no sum to overflow)."""
    from normswap.util.finite import all_finite, first_nonfinite

    t = torch.randn(3, 5).to(dtype)
    assert first_nonfinite(t) is None
    t[2, 3] = value
    found = first_nonfinite(t)
    kind = "NaN" if math.isnan(value) else ("Inf" if value > 0 else "-Inf")
    index = [2, 3, 0] if dtype.is_complex else [2, 3]
    assert found == (1, index, kind)
    if not dtype.is_complex:
        assert not all_finite(t)
    assert all_finite(torch.full((3,), 1e308, dtype=torch.float64))


def test_an_inf_in_a_stored_parameter_is_refused_streamed_and_in_memory(tmp_path):
    """A parameter holds neither NaN nor Inf (a buffer may hold Inf): the stream knows which stored names
    are parameters from the model it builds on the meta device."""
    llama = make_directory(tmp_path, "llama")
    name = "model.layers.0.mlp.up_proj.weight"
    for shard in llama.glob("*.safetensors"):
        tensors = load_file(shard)
        if name in tensors:
            tensors[name][2, 1] = -math.inf
            save_file(tensors, shard, metadata={"format": "pt"})
    for output in (tmp_path / "out", tmp_path / "out.pt2"):
        result = runner.invoke(app, ["convert", str(llama), "--fold-norm-affine", "-o", str(output)])
        _refused(result, output, f"the model is broken: its {name} holds -Inf at [2, 1]")


def test_inspect_of_a_directory_with_inputs_runs_on_its_meta_model(tmp_path):
    """A directory's model is built on the meta device: the outputs rule has no values to read there, and
    a forward that cannot run on meta tensors (GPT-2's .item()) is no verdict on the inputs."""
    gpt2 = make_directory(tmp_path, "gpt2")
    result = runner.invoke(app, ["inspect", str(gpt2), "--input-shape", "int64:1,8"])
    assert result.exit_code == 0, result.output
    assert "graph captured with export" in result.output


def nan_statistics_factory() -> tuple[nn.Module, tuple]:
    model = _conv_bn(inf=False)
    with torch.no_grad():
        model.bn.running_var[3] = math.nan  # overflowed statistics: what recalibrate repairs
    return model, (_x(),)


def test_recalibrate_repairs_broken_statistics_and_refuses_a_broken_weight(broken_pt2, tmp_path):
    """recalibrate re-estimates BatchNorm statistics without reading them: a NaN there is what it repairs
    (the held-out outputs before it hold NaN, after it none), while a broken weight is still refused."""
    data = tmp_path / "data.pt"
    torch.save(torch.randn(16, 3, 12, 12, generator=torch.Generator().manual_seed(3)), data)
    out = tmp_path / "repaired.pt2"
    result = runner.invoke(
        app,
        [
            "recalibrate",
            f"{HERE}:nan_statistics_factory",
            "--data",
            str(data),
            "--batch-size",
            "4",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    repaired = torch.export.load(out).module()
    assert bool(torch.isfinite(repaired(_x())).all())
    assert bool(torch.isfinite(repaired.get_buffer("bn.running_var")).all())
    refused = runner.invoke(
        app, ["recalibrate", str(broken_pt2), "--data", str(data), "-o", str(tmp_path / "x.pt2")]
    )
    _refused(refused, tmp_path / "x.pt2")


def masked_logits_factory() -> tuple[nn.Module, tuple]:
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.head = nn.LayerNorm(8), nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(x)).masked_fill(torch.tensor([False, True, False, False]), -math.inf)

    return Masked().eval(), (torch.randn(2, 8),)


def test_inspect_compares_nothing_so_masked_logits_are_not_refused():
    result = runner.invoke(app, ["inspect", f"{HERE}:masked_logits_factory", "--input-shape", "2,8"])
    assert result.exit_code == 0, result.output
    assert "layer 1" in result.output


def test_an_original_that_computes_nan_is_refused_streamed_as_in_memory(tmp_path):
    """Finite float16 weights whose block overflows: in memory the outputs refuse the model; streamed,
    the block-by-block verification runs the original and refuses it the same way (it used to fail the
    check, exit 1, "nothing was compared there")."""
    llama = make_directory(tmp_path, "llama", dtype=torch.float16)
    for shard in llama.glob("*.safetensors"):
        tensors = load_file(shard)
        if "model.layers.1.post_attention_layernorm.weight" in tensors:
            tensors["model.layers.1.post_attention_layernorm.weight"][5] = 60000.0
        if "model.layers.1.mlp.up_proj.weight" in tensors:
            tensors["model.layers.1.mlp.up_proj.weight"][:, 5] = 4.0
        save_file(tensors, shard, metadata={"format": "pt"})
    streamed = runner.invoke(app, ["convert", str(llama), "--fold-norm-affine", "-o", str(tmp_path / "out")])
    _refused(streamed, tmp_path / "out", "the model is broken: its block 1 output holds NaN")
    memory = runner.invoke(app, ["convert", str(llama), "--fold-norm-affine", "-o", str(tmp_path / "o.pt2")])
    _refused(memory, tmp_path / "o.pt2", "the model is broken: its output.logits holds NaN")


def test_what_normswap_wrote_is_judged_by_its_comparison_not_refused(w2v):
    """A directory normswap wrote is read unchecked by its verification (its NaN fails the check, exit
    1); a directory the user gave is held to the rule."""
    from normswap.load.checkpoint_dir import read_checkpoint_directory, stored_tensor_reader

    directory = read_checkpoint_directory(w2v["untouched"])
    name = "encoder.layers.0.feed_forward.intermediate_dense.weight"
    assert math.isnan(float(stored_tensor_reader(directory, checked=False)(name)[0, 5]))
    with pytest.raises(BrokenModelError, match=r"holds NaN at \[0, 5\]"):
        stored_tensor_reader(directory)(name)


def test_the_stored_names_held_to_the_parameter_rule(tmp_path):
    """The stream tells parameters from buffers among the stored names (through transformers' renamings):
    a ResNet's BatchNorm statistics are buffers, its weights parameters; GPT-NeoX's stored head is one."""
    from normswap.load.checkpoint_dir import build_on_meta, parameter_names, read_checkpoint_directory

    torch.manual_seed(0)
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    transformers.ResNetForImageClassification(config).save_pretrained(tmp_path / "resnet")
    neox = transformers.GPTNeoXConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100
    )
    transformers.GPTNeoXForCausalLM(neox).save_pretrained(tmp_path / "neox")
    for name, parameter, buffer in (
        (
            "resnet",
            "resnet.embedder.embedder.convolution.weight",
            "resnet.embedder.embedder.normalization.running_var",
        ),
        ("neox", "embed_out.weight", None),
    ):
        directory = read_checkpoint_directory(tmp_path / name)
        names = parameter_names(build_on_meta(directory), directory)
        assert parameter in names and parameter in directory.weight_map
        if buffer is not None:
            assert buffer in directory.weight_map and buffer not in names
