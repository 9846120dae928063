"""One capture per graph state: the pipeline hands a graph on while the passes keep it valid, and
captures again after a pass that changed what the graph shows."""

from __future__ import annotations

import pytest
import torch
import torchvision
import transformers

from normswap.passes import FoldBatchNorm, FuseNorm, Pipeline, RecenterLayerNorm, SwapNorm
from normswap.passes.core.base import Pass


@pytest.fixture
def exports(monkeypatch):
    calls: list[int] = []
    real = torch.export.export

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    return calls


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.75, 1.25)
                m.bias.uniform_(-0.5, 0.5)
    return model, {"input_ids": torch.randint(0, 128, (1, 12)), "use_cache": False}


def _summary(report):
    return [
        (p.pass_name, sorted(c.site for c in p.changes), sorted(s.site for s in p.skips))
        for p in report.passes
    ]


def test_passes_that_keep_the_graph_share_one_capture(exports, monkeypatch):
    model, kwargs = _gpt2()
    passes = [RecenterLayerNorm(), FuseNorm()]
    _, report = Pipeline(passes)(model, None, kwargs)
    assert len(exports) == 1
    assert [len(p.changes) for p in report.passes] == [5, 5] and report.ok
    # the same run capturing afresh for every pass finds and changes the same sites
    exports.clear()
    monkeypatch.setattr(Pass, "keeps_capture", False)
    monkeypatch.setattr(RecenterLayerNorm, "keeps_capture", False)
    monkeypatch.setattr(FuseNorm, "keeps_capture", False)
    _, fresh = Pipeline(passes)(model, None, kwargs)
    assert len(exports) == 2
    assert _summary(fresh) == _summary(report)


def test_the_exact_route_then_the_lossy_swap_reuse_the_capture_the_caller_made(exports):
    from normswap.graph.capture import capture_graph

    model, kwargs = _gpt2()
    captured = capture_graph(model, None, kwargs)
    exports.clear()
    _, report = Pipeline([RecenterLayerNorm(), SwapNorm("rmsnorm")])(model, None, kwargs, captured=captured)
    assert exports == []
    assert len(report.passes[0].changes) == 5 and report.passes[1].changes == []


def test_a_pass_that_removes_modules_makes_the_next_one_capture_again(exports):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    x = torch.rand(1, 3, 64, 64)
    _, report = Pipeline([FoldBatchNorm(), SwapNorm("groupnorm", ("batch",), groups=1)])(model, (x,))
    # the folded BNs are Identity modules now: a stale graph would still show them normalizing. The fold
    # reads module-level facts, which resnet18's fx graph has (no export); the swap reads norm patterns
    # and gets a new export of the folded model
    assert [p.graph_method for p in report.passes] == ["fx", "export"]
    assert len(exports) == 1
    assert len(report.passes[0].changes) == 20
    assert report.passes[1].changes == [] and report.passes[1].skips == []


def test_one_index_per_capture(monkeypatch):
    """Discovery and every pass a capture is handed to read one GraphView of it."""
    from normswap.graph import analysis

    built: list[int] = []
    real = analysis.GraphView.__init__

    def counted(self, captured):
        built.append(1)
        real(self, captured)

    monkeypatch.setattr(analysis.GraphView, "__init__", counted)
    model, kwargs = _gpt2()
    _, report = Pipeline([RecenterLayerNorm(), FuseNorm()])(model, None, kwargs)
    assert [len(p.changes) for p in report.passes] == [5, 5]
    assert len(built) == 1
