"""--to crmsnorm (Pre-CRMSNorm): the residual stream of pre-LN transformers nobody here wrote, stored in
d - 1 dims, exact; what it saves; what it refuses and why."""

from __future__ import annotations

import model_zoo
import pytest
import torch
import transformers
from hf_dirs import configs, randomize_norms
from torch import fx, nn

import normswap
from normswap.modules.zero_sum import ZeroSumRMSNorm, complete_zero_sum
from normswap.passes import CompressStream


def _hf(name: str) -> tuple[nn.Module, tuple, dict]:
    cls, config = configs()[name]
    torch.manual_seed(0)
    model = cls(config).eval()
    randomize_norms(model)
    return model, (torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(2)),), {}


def _hf_vit() -> tuple[nn.Module, tuple, dict]:
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_labels=10,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(config).eval()
    randomize_norms(model)
    return model, (torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3)),), {}


def _main(output: object) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


MODELS = {
    "hf-gpt2": lambda: model_zoo.gpt2(),  # output shape computed from the stream's width in Python
    "hf-opt": lambda: _hf("opt"),
    "hf-phi": lambda: _hf("phi"),
    "hf-vit": _hf_vit,
    "torchvision-vit": lambda: model_zoo.small_vit(),  # reshape(n, self.hidden_dim, -1) in its forward
    "timm-vit-layerscale": lambda: model_zoo.timm_vit(init_values=0.1),  # scales folded, then narrowed
    "timm-vit-registers": lambda: model_zoo.timm_vit(
        class_token=False, global_pool="avg", fc_norm=True, reg_tokens=2
    ),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_stream_is_one_narrower_and_the_model_the_same_function(name):
    model, args, kwargs = MODELS[name]()
    norms = sum(isinstance(m, nn.LayerNorm) for m in model.modules())
    result = normswap.convert(model, normswap.ConvertConfig(to="crmsnorm", exact=True), args, kwargs)
    assert result.ok, result.report.to_dict()
    report = result.report.passes[0]
    assert report.pass_name == "compress_stream" and len(report.changes) == norms and not report.skips
    converted = result.model
    assert isinstance(converted, fx.GraphModule)
    zero_sum = [m for m in converted.modules() if isinstance(m, ZeroSumRMSNorm)]
    assert len(zero_sum) == norms
    hidden = zero_sum[0].normalized_shape[0]
    # No LayerNorm left in the graph, and every residual add on the stream is d - 1 wide.
    ops = [n for n in converted.graph.nodes if n.op == "call_function"]
    assert not any("layer_norm" in str(n.target) for n in ops)
    widths = set()
    for module in zero_sum:
        module.register_forward_pre_hook(lambda _m, inputs: widths.add(inputs[0].shape[-1]))
    with torch.no_grad():
        expected, got = _main(model(*args, **kwargs)), _main(converted(*args, **kwargs))
    assert widths == {hidden - 1}
    assert (expected - got).abs().max() <= 1e-5 * expected.abs().max()


def test_exact_on_inputs_it_was_not_converted_with():
    model, args, kwargs = model_zoo.gpt2()
    converted = normswap.convert(model, normswap.ConvertConfig(to="crmsnorm", exact=True), args, kwargs).model
    ids = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected, got = model(ids, use_cache=False).logits, converted(ids, use_cache=False).logits
    assert (expected - got).abs().max() <= 1e-5 * expected.abs().max()


def test_what_it_saves_over_pre_rmsnorm():
    """Every writer of the stream loses one output coordinate, but the token embedding, which the LM head
    shares: it stays whole and tied (its rows centred and narrowed as they are looked up). So the model is
    smaller than --to rmsnorm --exact's, and than the original, by one d-th of the other writers."""
    model, args, kwargs = model_zoo.gpt2()
    rms = normswap.convert(model, normswap.ConvertConfig(to="rmsnorm", exact=True), args, kwargs).model
    crms = normswap.convert(model, normswap.ConvertConfig(to="crmsnorm", exact=True), args, kwargs).model
    d = 64
    writers = ["transformer.wpe.weight"]
    for i in range(2):
        writers += [
            f"transformer.h.{i}.{part}.c_proj.{t}" for part in ("attn", "mlp") for t in ("weight", "bias")
        ]
    rms_params = dict(rms.named_parameters())
    crms_params = dict(crms.named_parameters(remove_duplicate=False))
    for name in writers:
        assert crms_params[name].shape[-1] == d - 1 and rms_params[name].shape[-1] == d, name
    saved = sum(rms_params[n].numel() for n in writers) // d
    original = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in rms.parameters()) == original  # the tie kept: no second matrix
    assert original - sum(p.numel() for p in crms.parameters()) == saved
    # the tied matrix: one tensor of the full width, read by the embedding lookup and the LM head
    tied = [n for n, p in crms.named_parameters(remove_duplicate=False) if p.shape == (128, d)]
    assert len({id(crms.get_parameter(n)) for n in tied}) == 1


def test_zero_sum_norm_is_the_rms_norm_of_the_completed_vector():
    torch.manual_seed(0)
    x = torch.randn(4, 7, 16)
    x = x - x.mean(-1, keepdim=True)
    norm = ZeroSumRMSNorm(16, eps=1e-5, bias=True)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_()
    reference = nn.functional.layer_norm(x, (16,), norm.weight, norm.bias, 1e-5)
    torch.testing.assert_close(norm(x[..., :15]), reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(complete_zero_sum(x[..., :15]), x, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="over 16 features reads 15, got 16"):
        norm(x)


def test_post_ln_bert_narrows_only_its_embedding_stream():
    """BERT's embedding sum is read by its embedding LayerNorm alone: narrowed. Its blocks are post-LN
    (attention reads a LayerNorm's output, which sees the mean): refused, each with the reason."""
    model, args, kwargs = model_zoo.bert()
    converted, report = CompressStream()(model, args, kwargs)
    assert [c.site for c in report.changes] == ["embeddings.LayerNorm"]
    assert converted.get_parameter("embeddings.word_embeddings.weight").shape == (128, 63)
    reasons = [s.reason for s in report.skips]
    assert len(reasons) == 4 and all(
        r.startswith("its residual stream cannot be narrowed: ") for r in reasons
    )
    assert sum("(a post-LN block)" in r for r in reasons) == 3, reasons
    assert "is read by linear@encoder.layer.0.attention" in reasons[0]
    with torch.no_grad():
        expected, got = model(*args).last_hidden_state, converted(*args).last_hidden_state
    assert (expected - got).abs().max() <= 1e-5 * expected.abs().max()

    result = normswap.convert(model, normswap.ConvertConfig(to="crmsnorm", exact=True), args, kwargs)
    assert not result.ok
    assert result.refusal.startswith(
        "--exact: 4 LayerNorm(s) cannot become RMSNorm on a narrower stream exactly"
    )


def test_a_directory_output_is_refused_before_the_work_and_a_pickle_is_not(tmp_path):
    # an exported graph pickles as its program (tests/load/test_portable_outputs.py); a model directory
    # holds a transformers model's modules, which a graph no longer has
    normswap.ConvertConfig(to="crmsnorm", exact=True, output=tmp_path / "out.pt").passes()
    with pytest.raises(normswap.BadInputError, match="a model directory cannot hold"):
        normswap.ConvertConfig(to="crmsnorm", exact=True, output=tmp_path / "outdir").passes()


@pytest.mark.parametrize("to", ["rmsnorm", "crmsnorm"])
def test_float64_models_are_exact_and_the_tied_head_keeps_its_weights(to):
    """Centering in float64 must copy: ``.double()`` of a float64 weight is the weight itself, and
    centering it in place centered GPT-2's tied LM head too (2.7% off, found in review)."""
    model, args, kwargs = model_zoo.gpt2()
    model = model.double()
    head = model.lm_head.weight.detach().clone()
    result = normswap.convert(model, normswap.ConvertConfig(to=to, exact=True), args, kwargs)
    assert result.ok, result.refusal
    assert torch.equal(model.lm_head.weight, head)
    with torch.no_grad():
        expected, got = model(*args, **kwargs).logits, result.model(*args, **kwargs).logits
    assert (expected - got).abs().max() <= 1e-10 * expected.abs().max()


def test_bfloat16_is_held_to_the_half_precision_rule():
    """In bf16 the narrowed model must be as close to the original as bf16 allows (the exact passes'
    half-precision tolerance), close to Pre-RMSNorm's own figure (measured 40.9 dB vs 43.1 dB)."""
    model, args, kwargs = model_zoo.gpt2()
    model = model.to(torch.bfloat16)
    figures = {}
    for to in ("rmsnorm", "crmsnorm"):
        result = normswap.convert(model, normswap.ConvertConfig(to=to, exact=True), args, kwargs)
        assert result.ok, result.refusal
        validation = result.report.passes[0].validation
        assert validation["within_tolerance"] and len(validation["verified_inputs"]) == 5
        figures[to] = validation["worst_sqnr_db"]
    assert figures["crmsnorm"] > 35.0 and figures["crmsnorm"] > figures["rmsnorm"] - 6.0, figures
