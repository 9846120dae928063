"""What recentering a residual stream changes, stated once for every route.

A stream found on the graph (:class:`~normswap.graph.stream_params.Stream`) is recentred by editing the
tensors that write into it. :func:`stream_edits` says which, as :class:`WriterEdit` records by name:

- each writer centred along the dim it writes (``W - mean_out(W)``, its LayerScale folded in first,
  :func:`center_along`);
- a token embedding that readers outside the stream share (GPT-2's LM head reads the embedding matrix)
  keeps its matrix, one tensor still tied, and centres the rows it looks up instead
  (:class:`~normswap.modules.centered.CenteredEmbedding`, or the same ops on a graph);
- the untie, for any other shared writer: the names that readers outside the stream hold keep the
  original values, the others get the centred ones;
- each LayerScale folded into its writer set to ones.

Three executors run these same edits on what they hold: the in-memory pass on the model's modules
(:mod:`.layernorm`), the streamed checkpoint on stored tensors (:mod:`.stream`), and pre-CRMSNorm on an
exported graph, narrowing as it goes (:mod:`.compress`). :func:`untie_problem` is the untie's legality.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from normswap.graph.stream_params import CenteredParam, Stream
from normswap.modules.centered import plain_embedding


@dataclass(frozen=True)
class WriterEdit:
    """One tensor of a recentred stream: ``param`` centred (``param`` None: a folded LayerScale set to
    ones). ``names`` are every name the tensor has; ``readers`` the modules that read it outside the
    stream, and ``keep_original`` the names they hold, which keep the original values (the untie)."""

    name: str
    names: tuple[str, ...]
    param: CenteredParam | None = None
    readers: frozenset[str] = frozenset()
    keep_original: tuple[str, ...] = ()
    # the tensor stays as it is and its embedding centres what it looks up (a tied token embedding)
    center_output: bool = False

    @property
    def rewritten(self) -> tuple[str, ...]:
        """The names that get the new values."""
        return tuple(n for n in self.names if n not in self.keep_original)

    def describe(self) -> str:
        if self.param is None:
            return f"{self.name} (folded into the layer before it, now ones)"
        if self.center_output:
            return f"{self.name} (its rows centred as they are looked up; still tied to {', '.join(self.keep_original)})"
        return f"{self.name} (dim {self.param.dim}, via {self.param.via})"


def named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``model`` under every name it has (tied tensors more than once)."""
    return [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]


def tensor_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every tensor name of ``model`` -> all names of that same tensor (tied weights have several)."""
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in named_tensors(model):
        by_tensor.setdefault(id(tensor), []).append(name)
    return {name: names for names in by_tensor.values() for name in names}


def under_any(name: str, paths: set[str]) -> bool:
    return any(p == "" or name.startswith(p + ".") for p in paths)


def _kept_for_others(stream: Stream, name: str, names: list[str]) -> tuple[str, ...]:
    """The names of writer ``name`` held by modules that read it outside the stream."""
    return tuple(n for n in names if under_any(n, _readers(stream, name)))


def _readers(stream: Stream, name: str) -> frozenset[str]:
    return frozenset(stream.shared.get(name, set()) - {""})


def tied_embeddings(stream: Stream) -> set[str]:
    """The stream's writers that are a token embedding's matrix shared with readers outside the stream:
    those that centre their output rather than their matrix, where the executor can say so."""
    return {
        p.name for p in stream.params if p.via == "embedding" and p.scale is None and _readers(stream, p.name)
    }


def output_centring(
    stream: Stream,
    modules: Mapping[str, nn.Module],
    calls: Mapping[str, int],
    aliases: Mapping[str, list[str]],
) -> set[str]:
    """:func:`tied_embeddings` whose module can become a :class:`CenteredEmbedding`: torch's plain
    ``nn.Embedding`` whose weight is that matrix, called at one site only (every call's output is
    centred, so no call may feed anything but the stream)."""
    chosen, tied = set(), tied_embeddings(stream)
    for param in stream.params:
        if param.name not in tied:
            continue
        path = param.module_path
        holds = f"{path}.weight" in aliases.get(param.name, [param.name])
        if plain_embedding(modules.get(path)) and calls.get(path) == 1 and holds:
            chosen.add(param.name)
    return chosen


def stream_edits(
    stream: Stream, aliases: Mapping[str, list[str]], done: set[str], center_outputs: set[str] = frozenset()
) -> list[WriterEdit]:
    """The edits that recentre ``stream``, writers first (a folded scale is read before it becomes ones);
    tensors named in ``done`` (recentred with another stream) are left out and the new ones added; the
    writers in ``center_outputs`` centre their output (:func:`output_centring`)."""
    edits = []
    for param in stream.params:
        if param.name not in done:
            done.add(param.name)
            names = aliases.get(param.name, [param.name])
            kept = _kept_for_others(stream, param.name, names)
            readers, centred = _readers(stream, param.name), param.name in center_outputs
            edits.append(WriterEdit(param.name, tuple(names), param, readers, kept, centred))
    for name in stream.folded_scales:
        if name not in done:
            done.add(name)
            edits.append(WriterEdit(name, tuple(aliases.get(name, [name]))))
    return edits


def untie_problem(model: nn.Module, stream: Stream, center_outputs: set[str] = frozenset()) -> str | None:
    """Why a centred writer that other modules also read cannot be given its own copy, if so (a writer in
    ``center_outputs`` keeps its one tensor: nothing to untie)."""
    aliases = tensor_aliases(model)
    for param in stream.params:
        if param.name not in aliases:
            return f"parameter {param.name} of the graph is not found in the model"
    for name, readers in stream.shared.items():
        if name in center_outputs:
            continue
        holders = aliases[name]
        others = _kept_for_others(stream, name, holders)
        where = ", ".join(sorted(r or "<root>" for r in readers))
        if "" in readers or not others or len(others) == len(holders):
            return f"{name} is written into the stream and also read by {where}, and cannot be untied there"
        owners = {id(model.get_submodule(h.rpartition(".")[0])) for h in holders if h not in others}
        if owners & {id(model.get_submodule(h.rpartition(".")[0])) for h in others}:
            # one module registered under several names (encoder.embed_tokens = decoder.embed_tokens)
            return f"{name} is written into the stream and also read by {where} through the same module"
    return None


def center_along(
    tensor: torch.Tensor,
    dim: int,
    scale: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    chunk_elements: int = 1 << 19,
) -> torch.Tensor:
    """``tensor`` (first multiplied by ``scale`` along ``dim``, if given) minus its mean over ``dim``.

    fp64 inside, cast back to the tensor's dtype. ``scale`` is a LayerScale vector folded into the
    weight of the layer it scales: ``gamma * (W x + b) = (diag(gamma) W) x + gamma * b``.

    The fp64 work runs on slices of about ``chunk_elements`` values across another dim, so that a large
    weight (an embedding) costs one output tensor and not several fp64 copies of itself, and a slice's
    fp64 values stay in the CPU's cache (4 MB slices center a bf16 weight 4-10x faster than 32 MB ones
    on this project's machine); each slice holds whole lines along ``dim``, so the result is the same as
    on the whole tensor. ``out`` may be ``tensor`` itself: each slice is read whole before it is
    written, and no other slice reads it.
    """
    if tensor.ndim == 1:
        centered = _centered(tensor.detach(), 0, scale)
        return centered if out is None else out.detach().copy_(centered)
    dim %= tensor.ndim
    across = max((d for d in range(tensor.ndim) if d != dim), key=lambda d: tensor.shape[d])
    step = max(1, chunk_elements * tensor.shape[across] // max(1, tensor.numel()))
    if out is None:
        out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    out = out.detach()
    for start in range(0, tensor.shape[across], step):
        length = min(step, tensor.shape[across] - start)
        _centered(
            tensor.detach().narrow(across, start, length), dim, scale, out.narrow(across, start, length)
        )
    return out


def _centered(
    tensor: torch.Tensor, dim: int, scale: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """One slice of :func:`center_along`, into ``out`` (or a new tensor of ``tensor``'s dtype)."""
    # a copy even when the tensor is float64 already (.double() would return it, and the in-place ops
    # below would center the caller's tensor: a tied weight's other reader, a float64 model)
    t = tensor.to(torch.float64, copy=True)
    if scale is not None:
        shape = [1] * t.ndim
        shape[dim] = -1
        t.mul_(scale.detach().double().reshape(shape))
    t.sub_(t.mean(dim=dim, keepdim=True))
    return t.to(tensor.dtype) if out is None else out.copy_(t)
