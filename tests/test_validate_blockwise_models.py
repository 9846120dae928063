"""Block-by-block verification of two models held in memory (``verify_blockwise_models``): each block
of the converted model runs on the original's activation of that block, so a wrong block is named and
its error does not carry over to the blocks after it."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_dirs import configs, randomize_norms  # noqa: E402

from normswap import ConvertConfig, convert  # noqa: E402
from normswap.errors import BadInputError  # noqa: E402
from normswap.verify.blockwise import centered, identity, verify_blockwise_models  # noqa: E402


def _model(name: str, layers: int = 3) -> torch.nn.Module:
    cls, config = configs()[name]
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = cls(config).eval()
    randomize_norms(model)
    return model


def _inputs() -> list[tuple[tuple, dict]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ((), {"input_ids": torch.randint(0, 300, shape, generator=generator)}) for shape in ((1, 16), (2, 5))
    ]


@pytest.mark.parametrize(
    ("name", "options", "relate"),
    [
        ("gpt2", {"to": "rmsnorm", "exact": True}, centered),
        ("llama", {"fold_norm_affine": True}, identity),
    ],
)
def test_an_exact_conversion_passes_every_block_and_a_wrong_block_is_named(name, options, relate):
    original = _model(name)
    inputs = _inputs()
    converted = convert(original, ConvertConfig(**options), *inputs[0]).model
    reports = verify_blockwise_models(original, converted, inputs, relate)
    assert [len(r.stages) for r in reports] == [3 + 2, 3 + 2]  # embeddings, 3 blocks, head
    assert all(r.ok for r in reports), [r.to_dict() for r in reports]
    assert max(r.worst_rel for r in reports) <= 1e-5
    # a weight of block 1 moved by 1%: block 1 is named, and blocks 0 and 2 still pass
    block = converted.get_submodule(reports[0].blocks_path.split(" ")[0])[1]
    weight = max(block.parameters(), key=lambda p: p.numel())
    with torch.no_grad():
        weight.mul_(1.01)
    reports = verify_blockwise_models(original, converted, inputs, relate)
    for report in reports:
        within = {stage: c.within_tolerance for stage, c in report.stages}
        assert report.first_divergent == "block 1"
        assert within["block 0"] and within["block 2"] and not within["block 1"]


def test_models_with_different_blocks_are_refused_with_the_reason():
    with pytest.raises(
        BadInputError, match=r"the models' blocks differ: ORIGINAL has 3 in model\.layers, CONVERTED 2"
    ):
        verify_blockwise_models(_model("llama", 3), _model("llama", 2), _inputs())


def test_two_directories_of_other_architectures_are_refused_on_the_directory_route(tmp_path):
    """`validate gpt2-dir llama-dir --blockwise` crashed (exit 3, AttributeError: no attribute
    'transformer'): the directory route now holds the same rule as the in-memory one."""
    from hf_dirs import make_directory
    from normswap_cli.app import app
    from typer.testing import CliRunner

    gpt2, llama = make_directory(tmp_path, "gpt2"), make_directory(tmp_path, "llama")
    result = CliRunner().invoke(app, ["validate", str(gpt2), str(llama), "--blockwise"])
    assert result.exit_code == 2, result.output
    assert (
        "the models' blocks differ: ORIGINAL has 2 in transformer.h, CONVERTED 2 in model.layers"
        in result.output
    )
