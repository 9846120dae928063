"""Real third-party models built offline from small configs, with non-trivial norm parameters.

Each builder returns ``(model, example_args, example_kwargs)``; the ``*_factory`` functions return
``(model, example_args)`` or ``(model, args, kwargs)`` for the CLI's factory form
(``tests/model_zoo.py:gpt2_factory``). Exactness does not depend on the weights, so random weights
with norm statistics far from the identity prove it.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

warnings.filterwarnings("ignore", category=FutureWarning)


def randomize_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every norm affine parameters and running statistics far from their defaults."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            for name in ("running_mean",):
                t = getattr(m, name, None)
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            var = getattr(m, "running_var", None)
            if isinstance(var, torch.Tensor) and var.is_floating_point():
                var.copy_(torch.rand(var.shape, generator=g) * 1.5 + 0.5)
            is_norm = "norm" in type(m).__name__.lower() or hasattr(m, "running_var")
            if not is_norm:
                continue
            w, b = getattr(m, "weight", None), getattr(m, "bias", None)
            if isinstance(w, torch.Tensor) and w.ndim == 1:
                w.copy_(w + 0.3 * torch.randn(w.shape, generator=g))
            if isinstance(b, torch.Tensor) and b.ndim == 1:
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return model


def resnet18(size: int = 64) -> tuple[nn.Module, tuple, dict]:
    import torchvision

    torch.manual_seed(0)
    model = randomize_norms(torchvision.models.resnet18(num_classes=10)).eval()
    return model, (torch.randn(2, 3, size, size),), {}


def vit_b_16() -> tuple[nn.Module, tuple, dict]:
    import torchvision

    torch.manual_seed(0)
    model = randomize_norms(torchvision.models.vit_b_16(num_classes=10)).eval()
    return model, (torch.randn(1, 3, 224, 224),), {}


def convnext_tiny() -> tuple[nn.Module, tuple, dict]:
    import timm

    torch.manual_seed(0)
    model = randomize_norms(timm.create_model("convnext_tiny", num_classes=10)).eval()
    return model, (torch.randn(1, 3, 64, 64),), {}


def _token_ids(vocab: int, length: int = 12, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(1))


def gpt2(layers: int = 2) -> tuple[nn.Module, tuple, dict]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=layers, n_embd=64, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    model = randomize_norms(GPT2LMHeadModel(config)).eval()
    return model, (_token_ids(128),), {"use_cache": False}


def llama(layers: int = 2) -> tuple[nn.Module, tuple, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = randomize_norms(LlamaForCausalLM(config)).eval()
    return model, (_token_ids(128),), {"use_cache": False}


def bert(layers: int = 2) -> tuple[nn.Module, tuple, dict]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=128
    )
    model = randomize_norms(BertModel(config)).eval()
    return model, (_token_ids(128),), {}


def gpt2_factory() -> tuple[nn.Module, tuple, dict]:
    return gpt2()


def resnet18_factory() -> tuple[nn.Module, tuple]:
    model, args, _ = resnet18(size=32)
    return model, args


class HandLayerNorm(nn.Module):
    """A LayerNorm written out by hand, as research code does (var form)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.gain = nn.Parameter(1 + 0.3 * torch.randn(dim))
        self.shift = nn.Parameter(0.3 * torch.randn(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(
            x.var(-1, unbiased=False, keepdim=True) + self.eps
        ) * self.gain + self.shift


class HandRMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * w``, under a name no library uses."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.scale = nn.Parameter(1 + 0.3 * torch.randn(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


class HandWrittenNet(nn.Module):
    """Norms as classes, as a functional call, and inline in the root forward."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.ln = HandLayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.rms = HandRMSNorm(dim)
        self.gamma = nn.Parameter(1 + 0.3 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.rms(self.fc(self.ln(x)))
        x = nn.functional.layer_norm(x, self.gamma.shape, self.gamma)
        centered = x - x.mean(-1, keepdim=True)
        return centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + 1e-5)


def conv_bn_without_inputs() -> nn.Module:
    """A factory that returns only a model, so commands must be told the inputs."""
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))


def bert_factory() -> tuple[nn.Module, tuple, dict]:
    return bert()


def small_vit(num_classes: int = 10) -> tuple[nn.Module, tuple, dict]:
    """torchvision's VisionTransformer at a size that runs in milliseconds, head randomized too.

    torchvision initializes the classification head to zeros, which would make every output 0.
    """
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=2,
        num_heads=2,
        hidden_dim=64,
        mlp_dim=128,
        num_classes=num_classes,
    )
    with torch.no_grad():
        model.heads.head.weight.normal_(0, 0.2)
        model.class_token.normal_(0, 1.0)
    return randomize_norms(model).eval(), (torch.randn(2, 3, 32, 32),), {}


def timm_vit(**overrides) -> tuple[nn.Module, tuple, dict]:
    """timm's ViT (class token, or average pool with fc_norm and register tokens via ``overrides``)."""
    import timm

    torch.manual_seed(0)
    options = {"img_size": 32, "depth": 2, **overrides}
    model = randomize_norms(timm.create_model("vit_tiny_patch16_224", num_classes=10, **options)).eval()
    return model, (torch.randn(2, 3, 32, 32),), {}
