"""Small Hugging Face model directories for the tests, made by transformers' own ``save_pretrained``
from configs of GPT-2 (tied embeddings), Llama (untied), OPT, Phi (one LayerNorm per parallel block) and
Gemma: random weights, norm parameters
far from (1, 0) so that exactness is not a coincidence of identity norms, sharded into about four files
with an index, and a tokenizer file beside them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers


def randomize_norms(model: torch.nn.Module) -> None:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "ln" in name or "norm" in name.lower():  # BERT's are LayerNorm
                offset = (
                    1.0 if name.endswith("weight") and "gemma" not in type(model).__name__.lower() else 0.0
                )
                param.copy_(offset + 0.5 * torch.randn(param.shape, generator=generator))


def configs() -> dict[str, tuple[type, object]]:
    small = {"vocab_size": 300, "use_cache": False}
    return {
        "gpt2": (
            transformers.GPT2LMHeadModel,
            transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, bos_token_id=0, eos_token_id=0, **small),
        ),
        "llama": (
            transformers.LlamaForCausalLM,
            transformers.LlamaConfig(
                num_hidden_layers=2,
                hidden_size=64,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                tie_word_embeddings=False,
                **small,
            ),
        ),
        "opt": (
            transformers.OPTForCausalLM,
            transformers.OPTConfig(
                num_hidden_layers=2,
                hidden_size=64,
                ffn_dim=128,
                num_attention_heads=4,
                word_embed_proj_dim=64,
                **small,
            ),
        ),
        "phi": (
            transformers.PhiForCausalLM,
            transformers.PhiConfig(
                num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, **small
            ),
        ),
        "gemma": (
            transformers.GemmaForCausalLM,
            transformers.GemmaConfig(
                num_hidden_layers=2,
                hidden_size=64,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                **small,
            ),
        ),
    }


def make_directory(root: Path, name: str, dtype: torch.dtype = torch.float32) -> Path:
    cls, config = configs()[name]
    torch.manual_seed(0)
    model = cls(config).eval()
    randomize_norms(model)
    model = model.to(dtype)
    path = root / f"{name}-{str(dtype).split('.')[-1]}"
    # about four shards: several files and an index, as real checkpoints come
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(path, max_shard_size=total // 4 + 1)
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    return path


def with_cache_on(directory: Path) -> Path:
    """``directory`` with ``use_cache: true`` in its config, as Hugging Face's configs come."""
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "use_cache": True}))
    return directory


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.double()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


def token_ids() -> torch.Tensor:
    return torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(3))


def stored_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory's safetensors shards, by name."""
    from safetensors.torch import load_file

    found: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        found.update(load_file(shard))
    return found


def stream(source: Path, output: Path, **options: Any) -> Any:
    """The streamed route of ``normswap.convert`` (a model directory into a model directory, one rewrite
    that streams): what it wrote (a StreamedConversion); its refusal raised as the CLI exits on it."""
    from normswap import ConvertConfig, convert
    from normswap.errors import CheckFailedError

    result = convert(source, ConvertConfig(output=output, **options))
    assert result.route == "streamed", result.notes
    if not result.ok:
        raise CheckFailedError(result.refusal)
    return result.written_directory


def convert_in_memory(source: Path, options: dict, output: Path) -> Any:
    """What the in-memory route does with ``source`` (loaded, converted with ``options``, saved to the
    directory ``output``), for comparison with a stream: its ConversionResult."""
    from normswap import ConvertConfig, convert, save
    from normswap.load import load_model

    loaded = load_model(str(source))
    result = convert(loaded.model, ConvertConfig(**options), loaded.example_args, loaded.example_kwargs)
    save(result, output, source=loaded.checkpoint)
    return result


def wav2vec2_config(**changes: Any) -> transformers.Wav2Vec2Config:
    """A tiny wav2vec2 config (2 layers, hidden 32, a grouped weight-normed positional conv)."""
    small: dict[str, Any] = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "conv_dim": (16, 16),
        "conv_stride": (5, 2),
        "conv_kernel": (10, 3),
        "num_conv_pos_embeddings": 16,
        "num_conv_pos_embedding_groups": 4,
    }
    return transformers.Wav2Vec2Config(**{**small, **changes})
