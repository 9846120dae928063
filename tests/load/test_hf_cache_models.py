"""Models whose outputs or blocks carry a transformers Cache of a kind other than attention keys and
values: Mamba returns its convolution and recurrent states (its cache raises when iterated as an
attention cache), Gemma2's blocks are called with ``cache=`` (transformers 5's name). Both used to end
in a traceback (issue 30: "crashes on real architectures")."""

from __future__ import annotations

from pathlib import Path

import torch

import normswap
from normswap.verify.metrics import flatten_outputs


def _mamba():
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    model = MambaForCausalLM(MambaConfig(num_hidden_layers=2, hidden_size=64, vocab_size=128, state_size=8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.75, 1.25)
    return model.eval(), (torch.randint(0, 128, (1, 16)),)


def test_mamba_outputs_with_their_states_are_compared_and_converted():
    model, args = _mamba()
    with torch.no_grad():
        names = [name for name, _ in flatten_outputs(model(*args))]
    # the logits and every layer's states: a rewrite that changed a state would be caught
    assert names[0] == "output.logits"
    assert {n.split(".")[-2] for n in names[1:]} == {"conv_states", "recurrent_states"} and len(names) == 5
    fused = normswap.convert(model, normswap.ConvertConfig(to="fused"), args)
    assert fused.ok and fused.changes == 1, fused.refusal  # the final norm; the blocks' are inline
    skips = fused.report.passes[0].skips
    assert len(skips) == 2 and all(
        "computed inside" in s.reason and "graph rewrite" in s.reason for s in skips
    )
    folded = normswap.convert(model, normswap.ConvertConfig(fold_norm_affine=True), args)
    assert folded.ok and folded.changes == 0
    reasons = [s.reason for s in folded.report.passes[0].skips]
    assert len(reasons) == 3 and all(reasons), reasons  # every site not folded says why


def test_gemma2_directory_streams_its_affine_fold(tmp_path: Path):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
    )
    model = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():  # Gemma stores w with y = x * (1 + w): zeros would make the fold trivial
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.25, 0.25)
    model.save_pretrained(tmp_path / "src")
    result = normswap.convert(
        str(tmp_path / "src"), normswap.ConvertConfig(fold_norm_affine=True, output=tmp_path / "out")
    )
    assert result.ok and result.route == "streamed" and result.changes > 0, result.refusal
    reloaded = Gemma2ForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 128, (2, 20))
    with torch.no_grad():
        want, got = model(ids).logits, reloaded(ids).logits
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5


def test_olmos_weightless_layer_norms_say_there_is_nothing_to_fold():
    """OLMo's LayerNorm holds no weight or bias: each site says so (the directory sweep found 'the
    norm's weight and bias could not be located in the graph', which sent the user looking for them)."""
    from transformers import OlmoConfig, OlmoForCausalLM

    torch.manual_seed(0)
    config = OlmoConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=128
    )
    model = OlmoForCausalLM(config).eval()
    result = normswap.convert(
        model, normswap.ConvertConfig(fold_norm_affine=True), (torch.randint(0, 128, (1, 12)),)
    )
    assert result.ok and result.changes == 0
    reasons = {s.reason for s in result.report.passes[0].skips}
    assert reasons == {"norm has no elementwise affine: nothing to fold"}, reasons
    assert len(result.report.passes[0].skips) == 5  # 2 per block and the final one
