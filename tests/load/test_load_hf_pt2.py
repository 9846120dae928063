"""A .pt2 of a Hugging Face model (outputs are ModelOutput classes) and of a fused model loads back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import model_zoo
import pytest
import torch

from normswap.passes import FuseNorm

ROOT = Path(__file__).resolve().parents[2]


def _inspect_in_a_fresh_process(path: Path) -> str:
    # a fresh interpreter has imported neither transformers nor normswap's ops: loading must do it
    code = (
        "import sys, json\n"
        "from normswap.load import load_model\n"
        "from normswap.discover import find_norms\n"
        "loaded = load_model(sys.argv[1])\n"
        "inv = find_norms(loaded.model, loaded.example_args, loaded.example_kwargs)\n"
        "print(json.dumps([[s.kind, s.class_name, s.casting] for s in inv]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=False, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Ran into the following error" not in done.stderr  # torch's retry noise is kept quiet
    return done.stdout


def test_hf_gpt2_pt2_loads_back(tmp_path):
    model, args, kwargs = model_zoo.gpt2()
    path = tmp_path / "gpt2.pt2"
    torch.export.save(torch.export.export(model, args, kwargs, strict=False), path)
    out = _inspect_in_a_fresh_process(path)
    assert out.count('"layer"') == 5


def test_fused_llama_pt2_loads_back_into_fused_modules(tmp_path):
    from normswap.load import load_model

    model, args, kwargs = model_zoo.llama()
    fused, _ = FuseNorm()(model, args, kwargs)
    path = tmp_path / "llama_fused.pt2"
    torch.export.save(torch.export.export(fused, args, kwargs, strict=False), path)
    out = _inspect_in_a_fresh_process(path)
    assert out.count('["rms", "normswap.modules.fused.FusedRMSNorm", "llama"]') == 5
    loaded = load_model(str(path))
    lifted = dict(loaded.model.named_modules())["model.norm"]
    assert type(lifted).__name__ == "FusedRMSNorm" and lifted.casting == "llama"
    with torch.no_grad():
        expected = fused(*args, **kwargs).logits
        got = loaded.model(*args, **kwargs)
    got = got["logits"] if isinstance(got, dict) else got.logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_pt2_saved_from_batch_one_examples_takes_other_batch_sizes(tmp_path):
    """Model directories' example inputs are 1 x 16 token ids; torch.export specializes a size-1 dim, so
    the saved program is traced on a batch of two: it must take any batch and length."""
    from normswap.load import load_model, save_model

    model, _, _ = model_zoo.gpt2()
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    path = tmp_path / "g.pt2"
    save_model(model, path, (), {"input_ids": ids, "use_cache": False})
    loaded = load_model(path).model
    for shape in ((1, 16), (3, 16), (3, 7)):
        x = torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want, got = (
                model(input_ids=x, use_cache=False).logits,
                loaded(input_ids=x, use_cache=False).logits,
            )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _users_llama_pt2(tmp_path):
    """An HF Llama exported with plain torch.export (not by normswap): its RMSNorms are ops in the root's
    graph, their weights on bare holder modules that nothing calls."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ids = torch.randint(0, 64, (2, 8))
    path = tmp_path / "llama.pt2"
    program = torch.export.export(model, (), {"input_ids": ids}, strict=False)
    torch.export.save(program, path)
    return path, program, ids


def test_a_users_llama_pt2_has_its_norms_lifted_into_modules_and_every_rewrite_reaches_them(tmp_path):
    """Each hand-written RMSNorm is cut out of the root's graph into a module of its own that runs the
    same nodes: the loaded model computes what torch's program computes, bit for bit, and module rewrites
    (a swap, the exact affine fold, the fused kernels) change every norm."""
    from normswap_cli.app import app
    from typer.testing import CliRunner

    from normswap.discover import find_norms
    from normswap.load import load_model

    path, program, ids = _users_llama_pt2(tmp_path)
    loaded = load_model(str(path))
    with torch.no_grad():
        assert torch.equal(loaded.model(input_ids=ids).logits, program.module()(input_ids=ids).logits)
    sites = find_norms(loaded.model, loaded.example_args, loaded.example_kwargs).sites
    assert len(sites) == 5 and all(s.source == "structural" and s.is_module for s in sites)
    assert {type(loaded.model.get_submodule(s.path)).__name__ for s in sites} == {"LiftedNorm"}
    for number, option in enumerate((["--to", "layernorm"], ["--fold-norm-affine"], ["--to", "fused"])):
        output = tmp_path / f"out{number}.pt2"
        result = CliRunner().invoke(app, ["convert", str(path), *option, "-o", str(output)])
        assert result.exit_code == 0 and "5 changed, 0 skipped" in result.output, result.output


class _SharedRms(torch.nn.Module):
    """A hand-written RMSNorm that also returns its reciprocal RMS: not a norm alone."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x * r * self.weight, r


class _ReadsTheRms(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = _SharedRms()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        y, r = self.norm(x)
        return self.proj(y) + r


def test_a_norm_that_cannot_be_cut_out_is_not_swapped_as_a_module(tmp_path):
    """Left in the root's graph (its reciprocal RMS is read outside it), the norm's holder is a bare module
    that nothing calls; replacing it would change nothing the model computes, so module rewrites skip the
    norm with that reason instead of reporting a swap that changed nothing."""
    from normswap_cli.app import app
    from typer.testing import CliRunner

    from normswap.discover import find_norms
    from normswap.load import load_model

    path = tmp_path / "shared.pt2"
    torch.export.save(torch.export.export(_ReadsTheRms().eval(), (torch.randn(2, 8),)), path)
    loaded = load_model(str(path))
    assert type(loaded.model.get_submodule("norm")) is torch.nn.Module  # not lifted
    sites = find_norms(loaded.model, loaded.example_args, loaded.example_kwargs).sites
    assert len(sites) == 1 and sites[0].source == "pattern" and not sites[0].is_module
    result = CliRunner().invoke(
        app, ["convert", str(path), "--to", "layernorm", "-o", str(tmp_path / "o.pt2")]
    )
    assert "0 changed, 1 skipped" in result.output and "inside a forward" in result.output, result.output


class _Rms(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _TwoInARow(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.proj = _Rms(), _Rms(), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(self.b(self.a(x)))


def test_a_norm_reading_another_norm_is_lifted_too(tmp_path):
    """The second norm reads the first one's output, which the first cut replaced by a call."""
    from normswap.load import load_model

    torch.manual_seed(0)
    x = torch.randn(2, 8)
    program = torch.export.export(_TwoInARow().eval(), (x,))
    torch.export.save(program, tmp_path / "two.pt2")
    model = load_model(str(tmp_path / "two.pt2")).model
    assert type(model.a).__name__ == type(model.b).__name__ == "LiftedNorm"
    assert torch.equal(model(x), program.module()(x))


def test_a_users_tied_gpt2_pt2_keeps_its_tie_and_recentres_exactly(tmp_path):
    """torch.export holds GPT-2's tied embedding and head once and reads it as ``lm_head.weight`` in the
    embedding too; its module gives each name its own Parameter over the one memory and calls no module.
    Loaded, the embedding and the head are torch's modules again over one Parameter, so the exact
    LayerNorm -> RMSNorm does what it does to the model directory: the embedding centres the rows it looks
    up and the matrix stays one (before: refused, "cannot be untied there", exit 1)."""
    import transformers

    import normswap
    from normswap.load import load_model
    from normswap.modules.centered import CenteredEmbedding

    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0,
        use_cache=False,
    )  # fmt: skip
    model = model_zoo.randomize_norms(transformers.GPT2LMHeadModel(config)).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, 64, (2, 8))
    path = tmp_path / "tied.pt2"
    torch.export.save(torch.export.export(model, (ids,), strict=False), path)

    loaded = load_model(str(path)).model
    wte, head = loaded.get_submodule("transformer.wte"), loaded.get_submodule("lm_head")
    assert (type(wte), type(head)) == (torch.nn.Embedding, torch.nn.Linear)
    assert wte.weight is head.weight
    with torch.no_grad():
        want = model(ids).logits
        assert torch.equal(loaded(ids).logits, want)

    written = tmp_path / "out.pt2"
    result = normswap.convert(path, normswap.ConvertConfig(to="rmsnorm", exact=True))
    assert result.ok
    recenter = next(r for r in result.report.passes if r.pass_name == "recenter_layernorm")
    assert len(recenter.changes) == 3 and not recenter.skips
    converted = result.model
    wte, head = converted.get_submodule("transformer.wte"), converted.get_submodule("lm_head")
    assert isinstance(wte, CenteredEmbedding) and wte.weight is head.weight
    assert torch.equal(head.weight, model.lm_head.weight)  # the matrix keeps its values, one copy
    assert result.size is not None and result.size[0].values == result.size[1].values
    with torch.no_grad():
        got = converted(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    normswap.save(result, written)
    reread = load_model(str(written)).model  # the written program holds the matrix once, tied again
    assert reread.get_submodule("transformer.wte").weight is reread.get_submodule("lm_head").weight
    with torch.no_grad():
        torch.testing.assert_close(reread(ids).logits, got, rtol=0, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_users_gpt2_pt2_folds_as_many_norms_as_the_model_it_was_exported_from(tmp_path, tied):
    """GPT-2's projections are Hugging Face ``Conv1D``s, which a program computes as ``view -> addmm ->
    view`` on a module that nothing calls: the exact affine fold saw "c_attn, which is not a Linear" and
    folded 0 of 5 norms (1 untied) where the model itself folds 4 (5). Loaded, each is a ``Conv1D``
    again over the same tensors, bit for bit, and the fold reaches as many norms as in the model."""
    import transformers

    import normswap
    from normswap.load import load_model

    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0,
        use_cache=False, tie_word_embeddings=tied,
    )  # fmt: skip
    model = model_zoo.randomize_norms(transformers.GPT2LMHeadModel(config)).eval()
    ids = torch.randint(0, 64, (2, 8))
    path = tmp_path / "gpt2.pt2"
    program = torch.export.export(model, (ids,), strict=False)
    torch.export.save(program, path)

    loaded = load_model(str(path)).model
    projections = [n for n, m in loaded.named_modules() if type(m).__name__ == "Conv1D"]
    assert len(projections) == 8  # c_attn, c_proj, c_fc, mlp.c_proj in each of the 2 blocks
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, program.module()(ids).logits)

    config = normswap.ConvertConfig(fold_norm_affine=True, exact=True)
    from_file = normswap.convert(path, config)
    from_model = normswap.convert(model, config, (ids,))
    assert from_file.ok and from_model.ok
    changed = [len(r.changes) for r in (from_file.report.passes[0], from_model.report.passes[0])]
    assert changed[0] == changed[1] == (4 if tied else 5)
    with torch.no_grad():
        want = model(ids).logits
        got = from_file.model(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))


def test_a_gpt2_pt2_with_free_batch_and_length_lifts_its_conv1d_and_takes_other_shapes(tmp_path):
    """In a program exported with free dims the Conv1D views are symbolic (``[s0*s1, nx]``): lifted the
    same, and the loaded model computes what the program computes at shapes other than the export's."""
    import transformers

    from normswap.load import load_model

    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0,
        use_cache=False,
    )  # fmt: skip
    model = model_zoo.randomize_norms(transformers.GPT2LMHeadModel(config)).eval()
    ids = torch.randint(0, 64, (2, 8))
    batch, length = torch.export.Dim("batch", max=16), torch.export.Dim("length", max=32)
    program = torch.export.export(model, (ids,), dynamic_shapes=({0: batch, 1: length},), strict=False)
    torch.export.save(program, tmp_path / "gpt2.pt2")
    loaded = load_model(str(tmp_path / "gpt2.pt2")).model
    assert sum(type(m).__name__ == "Conv1D" for m in loaded.modules()) == 4
    other = torch.randint(0, 64, (3, 5))
    with torch.no_grad():
        assert torch.equal(loaded(other).logits, program.module()(other).logits)
