"""recenter_layernorm: LayerNorm -> RMSNorm made exact by centering the writers of the residual stream."""

from __future__ import annotations

import model_zoo
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normswap.load import load_model
from normswap.load.checkpoint_write import write_checkpoint_directory
from normswap.modules.centered import CenteredEmbedding
from normswap.modules.norms import RMSNorm
from normswap.passes import Pipeline, RecenterLayerNorm
from normswap.verify.compare import compare_models


def _logits(model: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(*args, **kwargs)
    return out.logits if hasattr(out, "logits") else out


def _assert_exact(original: nn.Module, converted: nn.Module, args: tuple, kwargs: dict, rel: float = 1e-5):
    ref, got = _logits(original, args, kwargs), _logits(converted, args, kwargs)
    assert ref.abs().max() > 0.1  # a model that outputs zeros proves nothing
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max abs {err:.3g} vs max|ref| {ref.abs().max().item():.3g}"


def _layer_norms(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.LayerNorm)]


def test_gpt2_becomes_rmsnorm_exactly_and_keeps_the_head_tied():
    model, args, kwargs = model_zoo.gpt2()
    converted, report = RecenterLayerNorm()(model, args, kwargs)
    assert [c.site for c in report.changes] == [
        "transformer.h.0.ln_1",
        "transformer.h.0.ln_2",
        "transformer.h.1.ln_1",
        "transformer.h.1.ln_2",
        "transformer.ln_f",
    ]
    assert report.skips == [] and _layer_norms(converted) == []
    assert all(isinstance(converted.get_submodule(c.site), RMSNorm) for c in report.changes)
    _assert_exact(model, converted, args, kwargs)
    # the writers: token and position embeddings and both output projections of each block
    centered = [name.split(" ")[0] for c in report.changes for name in c.details["centered"]]
    assert {"lm_head.weight", "transformer.wpe.weight", "transformer.h.1.mlp.c_proj.bias"} <= set(centered)
    wpe = converted.transformer.wpe.weight
    assert wpe.mean(dim=1).abs().max() < 1e-6
    c_proj = converted.transformer.h[0].attn.c_proj
    assert c_proj.weight.mean(dim=1).abs().max() < 1e-6  # HF Conv1D stores (in, out)
    # the token embedding, which the LM head reads, is one tensor still: its rows are centred as they
    # are looked up, the matrix is the original's, tied as before
    wte = converted.transformer.wte
    assert isinstance(wte, CenteredEmbedding) and converted.lm_head.weight is wte.weight
    assert torch.equal(wte.weight, model.transformer.wte.weight)
    ids = torch.arange(50).reshape(2, 25)
    assert wte(ids).mean(-1).abs().max() < 1e-6 and wte(ids).abs().max() > 0.01
    assert converted.config.tie_word_embeddings is True
    assert sum(p.numel() for p in converted.parameters()) == sum(p.numel() for p in model.parameters())
    assert all(c.details["untied"] == [] for c in report.changes)
    assert any("still tied to" in name for c in report.changes for name in c.details["centered"])


def test_gpt2_keeps_its_tie_through_a_model_directory(tmp_path):
    model, args, kwargs = model_zoo.gpt2()
    converted, _ = RecenterLayerNorm()(model, args, kwargs)
    write_checkpoint_directory(converted, tmp_path / "out")
    reloaded = load_model(str(tmp_path / "out")).model
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight
    _assert_exact(model, reloaded, args, kwargs)


def test_a_tied_writer_whose_module_cannot_centre_its_rows_is_untied(monkeypatch):
    """Where the embedding cannot become a CenteredEmbedding (a subclass, a second call site), the tied
    writer is untied: it gets a centred copy, the other reader keeps the original."""
    import normswap.passes.recenter.layernorm as layernorm

    monkeypatch.setattr(layernorm, "output_centring", lambda *args: set())
    model, args, kwargs = model_zoo.gpt2()
    converted, report = RecenterLayerNorm()(model, args, kwargs)
    _assert_exact(model, converted, args, kwargs)
    assert converted.lm_head.weight is not converted.transformer.wte.weight
    assert converted.config.tie_word_embeddings is False
    assert report.changes[0].details["untied"] == [
        "transformer.wte.weight (kept the original for lm_head.weight)"
    ]


def test_gpt2_bf16_within_the_bf16_tolerance():
    model, args, kwargs = model_zoo.gpt2()
    model = model.to(torch.bfloat16)
    converted, report = Pipeline([RecenterLayerNorm()])(model, args, kwargs)
    assert report.ok and len(report.passes[0].changes) == 5
    assert converted.transformer.wte.weight.dtype == torch.bfloat16
    _assert_exact(model, converted, args, kwargs, rel=1.6e-2)


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(model_zoo.small_vit, id="torchvision-vit"),
        pytest.param(model_zoo.timm_vit, id="timm-vit-class-token"),
        pytest.param(
            lambda: model_zoo.timm_vit(class_token=False, global_pool="avg", fc_norm=True, reg_tokens=2),
            id="timm-vit-avgpool-fcnorm-registers",
        ),
    ],
)
def test_vision_transformers_become_rmsnorm_exactly(build):
    model, args, kwargs = build()
    expected = len(_layer_norms(model))
    converted, report = RecenterLayerNorm()(model, args, kwargs)
    assert len(report.changes) == expected >= 5, report.skips
    assert _layer_norms(converted) == []
    _assert_exact(model, converted, args, kwargs)


def test_torchvision_vit_centers_patch_conv_class_token_and_positions():
    model, args, kwargs = model_zoo.small_vit()
    converted, report = RecenterLayerNorm()(model, args, kwargs)
    centered = {name.split(" ")[0]: name for c in report.changes for name in c.details["centered"]}
    assert "conv_proj.weight" in centered and "via conv2d" in centered["conv_proj.weight"]
    assert "class_token" in centered and "encoder.pos_embedding" in centered
    # MultiheadAttention's out_proj is applied inside F.multi_head_attention_forward, not as a module
    assert "encoder.layers.encoder_layer_0.self_attention.out_proj.weight" in centered
    conv = converted.conv_proj
    assert conv.weight.double().mean(dim=0).abs().max() < 1e-6 and conv.bias.double().mean().abs() < 1e-6


def test_bert_is_post_ln_only_its_embedding_norm_converts():
    model, args, kwargs = model_zoo.bert()
    converted, report = RecenterLayerNorm()(model, args, kwargs)
    # the embedding sum is read only by embeddings.LayerNorm: that one is genuinely exact
    assert [c.site for c in report.changes] == ["embeddings.LayerNorm"]
    assert len(report.skips) == 4
    reasons = " | ".join(s.reason for s in report.skips)
    assert "a post-LN block" in reasons and "which would see its mean" in reasons
    out = compare_models(model, converted, args, kwargs)
    assert out.within_tolerance


class _PreLN(nn.Module):
    """A pre-LN block whose stream can be spoiled in the ways the pass must notice."""

    def __init__(self, spoil: str, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.gamma = nn.Parameter(torch.rand(dim) + 0.5)
        self.spoil = spoil

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.spoil == "input":
            h = h + extra
        update = self.proj(self.norm1(h))
        if self.spoil == "gelu":
            update = nn.functional.gelu(update)
        if self.spoil == "layerscale":
            update = update * self.gamma
        if self.spoil == "computed-scale":
            update = update * self.gamma.exp()
        h = h + update
        if self.spoil == "read":
            return self.norm2(h) + h.sum(-1, keepdim=True)
        if self.spoil == "constant":
            h = h + 1.0
        return self.norm2(h)


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [
        ("none", None),
        ("input", "graph input extra is written into the residual stream as it is"),
        ("gelu", "gelu (gelu) writes into the residual stream and is not a linear map"),
        ("layerscale", None),
        ("computed-scale", "scales the stream by a per-feature factor that cannot be folded into the layer"),
        ("read", "is read by sum (sum), which would see its mean"),
        ("constant", "adds the constant 1.0 to the stream"),
    ],
)
def test_refuses_streams_it_cannot_recenter_with_the_reason(spoil, reason):
    torch.manual_seed(0)
    model = model_zoo.randomize_norms(_PreLN(spoil)).eval()
    args = (torch.randn(3, 5, 8), torch.randn(3, 5, 16))
    converted, report = RecenterLayerNorm()(model, args)
    if reason is None:
        assert len(report.changes) == 2 and report.skips == []
        _assert_exact(model, converted, args, {})
        return
    assert report.changes == [] and len(report.skips) == 2
    assert all(reason in s.reason for s in report.skips), report.skips[0].reason
    assert all(s.reason.startswith("input stream cannot be recentered: ") for s in report.skips)
    torch.testing.assert_close(_logits(converted, args, {}), _logits(model, args, {}), rtol=0, atol=0)


def test_timm_layerscale_is_folded_into_the_projection_before_centering():
    model, args, kwargs = model_zoo.timm_vit(init_values=0.1)
    converted, report = RecenterLayerNorm()(model, args, kwargs)
    assert len(report.changes) == 5 and report.skips == []
    _assert_exact(model, converted, args, kwargs)
    centered = [name for c in report.changes for name in c.details["centered"]]
    assert "blocks.1.ls2.gamma (folded into the layer before it, now ones)" in centered
    assert torch.equal(converted.blocks[1].ls2.gamma, torch.ones(192))
    fc2 = converted.blocks[1].mlp.fc2
    assert fc2.weight.double().mean(dim=0).abs().max() < 1e-6


def test_layernorm_over_two_dims_and_functional_calls_are_skipped():
    model = nn.Sequential(nn.Linear(4, 12), nn.Unflatten(-1, (3, 4)), nn.LayerNorm((3, 4))).eval()
    _, report = RecenterLayerNorm()(model, (torch.randn(2, 4),))
    assert report.changes == []
    assert "only a LayerNorm over the last dim equals RMSNorm" in report.skips[0].reason
    _, report = RecenterLayerNorm()(model_zoo.HandWrittenNet().eval(), (torch.randn(2, 16),))
    functional = [s for s in report.skips if "::" in s.site]
    assert functional and "needs a graph rewrite" in functional[0].reason


def _hf_causal_lm(name: str) -> nn.Module:
    import transformers as T

    small = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128}
    configs = {
        "opt": (T.OPTConfig, T.OPTForCausalLM, {"ffn_dim": 128, "word_embed_proj_dim": 64}),
        "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, {"intermediate_size": 128}),
        "phi": (T.PhiConfig, T.PhiForCausalLM, {"intermediate_size": 128}),
        "falcon": (T.FalconConfig, T.FalconForCausalLM, {}),
        "bloom": (T.BloomConfig, T.BloomForCausalLM, {}),
    }
    config_cls, model_cls, extra = configs[name]
    torch.manual_seed(0)
    config = config_cls(**small, **extra, bos_token_id=0, eos_token_id=0)
    return model_zoo.randomize_norms(model_cls(config)).eval()


@pytest.mark.parametrize(
    ("name", "converted"),
    [("opt", 5), ("gpt_neox", 5), ("phi", 3), ("falcon", 3)],  # Phi and Falcon: one LN per parallel block
)
def test_other_pre_ln_decoders_become_rmsnorm_exactly(name, converted):
    model = _hf_causal_lm(name)
    args, kwargs = (model_zoo._token_ids(128),), {"use_cache": False}
    new, report = RecenterLayerNorm()(model, args, kwargs)
    assert len(report.changes) == converted and report.skips == [], report.skips
    _assert_exact(model, new, args, kwargs)


def test_bloom_embedding_layernorm_starts_the_stream_so_it_is_refused():
    model = _hf_causal_lm("bloom")
    args, kwargs = (model_zoo._token_ids(128),), {"use_cache": False}
    _, report = RecenterLayerNorm()(model, args, kwargs)
    assert [c.site for c in report.changes] == ["transformer.word_embeddings_layernorm"]
    assert all("transformer.word_embeddings_layernorm is written into the residual stream" in s.reason
               for s in report.skips)  # fmt: skip


class _Spoiled(nn.Module):
    """Streams that look recenterable op by op but are not (found in review); each must be refused."""

    def __init__(self, how: str, dim: int = 16) -> None:
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(50, dim)
        self.ln1, self.ln = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.dw = nn.Conv1d(dim, dim, 3, padding=1, groups=dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        if self.how == "writer-reads-stream":  # h + f(h) with no norm before f
            h = h + self.fc(h)
        elif self.how == "grouped-conv-writer":  # a depthwise conv's output is not centered by its weight
            h = h + self.dw(self.ln1(h).transpose(1, 2)).transpose(1, 2)
        elif self.how == "layernorm-fp32":  # CLIP's LayerNormFp32: the cast must not hide later readers
            h = h + self.fc(F.layer_norm(h.float(), (16,), self.ln1.weight, self.ln1.bias))
            return self.head(self.ln(h)) + h.sum(-1, keepdim=True)
        return self.head(self.ln(h))


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("writer-reads-stream", "linear@fc reads the stream it writes into"),
        ("grouped-conv-writer", "conv1d@dw is a grouped convolution writing into the stream"),
        ("layernorm-fp32", "which would see its mean"),
    ],
)
def test_streams_that_only_look_recenterable_are_refused(how, reason):
    torch.manual_seed(0)
    model = model_zoo.randomize_norms(_Spoiled(how)).eval()
    ids = torch.randint(0, 50, (2, 7))
    converted, report = RecenterLayerNorm()(model, (ids,))
    assert "ln" not in [c.site for c in report.changes]
    assert any(reason in s.reason for s in report.skips), [s.reason for s in report.skips]
    torch.testing.assert_close(converted(ids), model(ids), rtol=0, atol=0)


def test_without_example_inputs_streams_are_refused_not_crashed():
    model, _, _ = model_zoo.gpt2()
    _, report = RecenterLayerNorm()(model)
    assert report.changes == [] and report.skips
    assert all("no shapes" in s.reason or "no graph" in s.reason for s in report.skips), report.skips[0]


def test_a_module_shared_under_two_names_is_not_untied_through_itself():
    class EncoderDecoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Embedding(50, 16)
            self.enc_emb = self.dec_emb = self.shared
            self.enc_ln1, self.enc_ln = nn.LayerNorm(16), nn.LayerNorm(16)
            self.enc_fc, self.dec_fc = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x, y):
            a = self.enc_emb(x)
            a = a + self.enc_fc(self.enc_ln1(a))
            return self.dec_fc(self.dec_emb(y)) + self.enc_ln(a).mean(1, keepdim=True)

    torch.manual_seed(0)
    model = model_zoo.randomize_norms(EncoderDecoder()).eval()
    args = (torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (2, 5)))
    converted, report = RecenterLayerNorm()(model, args)
    assert report.changes == []
    assert "through the same module" in report.skips[0].reason
    torch.testing.assert_close(converted(*args), model(*args), rtol=0, atol=0)


@pytest.mark.parametrize(
    "shape,dim", [((7, 5), 0), ((7, 5), 1), ((3, 4, 6), 1), ((6, 2, 3, 3), 0), ((9,), 0)]
)
@pytest.mark.parametrize("scaled", [False, True])
def test_centering_in_slices_is_the_same_as_on_the_whole_tensor(shape, dim, scaled):
    """center_along works on slices to bound its fp64 memory: every slice size gives the same bits as
    one whole-tensor pass, on a non-contiguous input too."""
    from normswap.passes.recenter.layernorm import center_along

    torch.manual_seed(0)
    tensor = torch.randn(*reversed(shape)).permute(*reversed(range(len(shape))))  # non-contiguous
    scale = torch.rand(shape[dim]) + 0.5 if scaled else None
    whole = center_along(tensor, dim, scale, chunk_elements=tensor.numel())
    expected = tensor.double()
    if scale is not None:
        expected = expected * scale.double().reshape([-1 if d == dim else 1 for d in range(tensor.ndim)])
    expected = (expected - expected.mean(dim, keepdim=True)).float()
    assert torch.equal(whole, expected)
    for chunk in (1, 5, 13):
        assert torch.equal(center_along(tensor, dim, scale, chunk_elements=chunk), whole)
        in_place = tensor.clone()
        assert center_along(in_place, dim, scale, out=in_place, chunk_elements=chunk) is not None
        assert torch.equal(in_place, whole)
    assert float(whole.double().mean(dim).abs().max()) < 1e-6
