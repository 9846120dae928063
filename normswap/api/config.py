"""What a conversion is asked to do: :class:`ConvertConfig`, which checks itself and names its passes.

The messages name the command line's options (``--to``, ``--groups``): the config is what ``normswap
convert`` builds from them, and one wording serves both.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from normswap.errors import BadInputError, CheckFailedError
from normswap.passes.core.base import Needs, Pass
from normswap.passes.core.pipeline import ExactOnlyError, Pipeline
from normswap.rewrites import BY_FIELD, BY_OPTION, OPTIONS, REWRITES, TARGETS, graph_options

if TYPE_CHECKING:
    import torch

    from normswap.passes import AddWeightNorm


@dataclass(frozen=True)
class ConvertConfig:
    """The rewrites of one conversion, its policies, and where its result will be written.

    Every field defaults to "not asked"; at least one rewrite must be asked for.

    - ``to``: swap norms to this kind (``normswap.passes.SWAP_TARGETS``, or ``"fused"``). ``"rmsnorm"``
      is exact where the residual stream can be recentered and architectural (lossy) elsewhere.
    - ``from_kinds``: only replace norms of these kinds (``normswap.discover.site.NORM_KINDS``).
    - ``groups``: the groups of ``to="groupnorm"``.
    - ``layers``: with ``to="cosine"``, glob patterns of the Linear/Conv layers to convert (default: the
      layers whose output only norms read).
    - ``fold_bn``, ``fold_layerscale``, ``fold_norm_affine``, ``remove_weight_norm``: the exact folds.
    - ``fuse_add``, ``fuse_inline``: with ``to="fused"``, also fuse residual adds / norms written inline.
    - ``defer_rms``: fold the norms' affine, then apply each weightless RMSNorm's scale after the linear
      layers that read it (FlashNorm; a graph rewrite, so the result is a GraphModule).
    - ``add_weight_norm``: ``"all"``, module paths (a sequence, or one comma-separated string).
    - ``weight_norm_dim``: ``"output"``, an int, or ``None`` / ``"none"`` (one magnitude per tensor).
    - ``exact``: the exact-only policy: no architectural pass may run, and a norm that ``to`` asked for
      but that has no exact rewrite fails the conversion.
    - ``allow_lossy``: with ``to="rmsnorm"``, accept the lossy swap where the exact route failed for a
      reason other than the model's architecture (without it such a conversion is refused).
    - ``calibration_data``: fit the swapped norms to the original norms' outputs on this data: a folder
      of images, a ``.pt`` file or a factory spec (as ``--calibrate``), or an iterable of batches;
      ``calibration_batches`` keeps the first N, ``batch_size`` splits a folder or a single tensor.
    - ``output``: the file the result will be saved to (suffix .pt2, .pt/.pth or .onnx). When given, the
      conversion checks before any work that the converted model can be written there, and
      :func:`normswap.save` writes there by default.
    - ``overwrite``: replace ``output`` when it exists (atomically); without it an existing output is
      refused before the work (:func:`normswap.load.paths.check_output`).
    - ``portable``: a .pt2 ``output`` that plain ``torch.export.load`` reads with torch alone (its outputs
      plain containers, normswap's fused ops as torch's own); refused for any other output.
    - ``opset``: the ONNX opset of an .onnx ``output`` (default: the exporter's); refused for any other.
    - ``static_shapes``: a written program (.pt2, .onnx, a graph's .pt) fixed at the example's shapes; by
      default it takes any batch and sequence length the model leaves free, and an exact conversion is
      refused when its file would not take a shape it was verified on. With it, the report says which
      shapes the file takes.
    - ``dtype``: the floating dtype the output is written in ("float32", "float16", "bfloat16"; default:
      the model's): a copy of the converted model and of the example inputs cast to it is written and
      checked (a bf16 model written as float32 widens exactly). An .onnx output in bf16 is refused before
      the work (onnxruntime's CPU build cannot run it to check it).
    - ``sequential``: a model directory converted into a model directory with an architectural ``to`` and
      ``calibration_data`` is swapped and calibrated block by block (taken unasked when the model does
      not fit in memory); ``activation_memory``: GB of activations it holds before spilling to disk.
    """

    to: str | None = None
    from_kinds: Sequence[str] | None = None
    groups: int | None = None
    layers: Sequence[str] | None = None
    fold_bn: bool = False
    fold_layerscale: bool = False
    fold_norm_affine: bool = False
    defer_rms: bool = False
    fuse_add: bool = False
    fuse_inline: bool = False
    add_weight_norm: str | Sequence[str] | None = None
    weight_norm_dim: int | str | None = "output"
    remove_weight_norm: bool = False
    exact: bool = False
    allow_lossy: bool = False
    calibration_data: str | Path | Iterable[Any] | None = field(default=None, compare=False)
    calibration_batches: int | None = None
    batch_size: int | None = None
    output: str | Path | None = None
    overwrite: bool = False
    # a .pt2 output that torch.export.load reads with torch alone (normswap.load.pt2_file.portable_program)
    portable: bool = False
    static_shapes: bool = False
    opset: int | None = None
    dtype: str | None = None
    sequential: bool = False
    activation_memory: float | None = None

    def __post_init__(self) -> None:
        for switch in fields(self):  # a switch is True or False: "False" (a str) switched it on
            if switch.type == "bool" and not isinstance(getattr(self, switch.name), bool):
                raise BadInputError(f"{switch.name} is True or False, got {getattr(self, switch.name)!r}")
        if self.opset is not None and (isinstance(self.opset, bool) or not isinstance(self.opset, int)):
            raise BadInputError(f"opset is a whole number (an ONNX opset), got {self.opset!r}")
        if self.from_kinds is not None:
            # one kind as a str, or "layer,rms" as the command line takes it: not iterated letter by letter
            given = _names("from_kinds", self.from_kinds)
            kinds = tuple(k.strip() for text in given for k in str(text).split(",") if k.strip())
            object.__setattr__(self, "from_kinds", kinds or None)
        for option, value in (
            ("--groups", self.groups),
            ("--calibrate-batches", self.calibration_batches),
            ("--batch-size", self.batch_size),
        ):
            # counts, as the command line's own check makes them (a str, 0 or -2 raised TypeError or
            # ValueError deep in the run, or calibrated on nothing)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise BadInputError(f"{option} must be a whole number of at least 1, got {value!r}")
        if self.output is not None and not isinstance(self.output, str | os.PathLike):
            raise BadInputError(f"-o must be a path (a str or a Path), got a {type(self.output).__name__}")
        if self.layers is not None:
            given = _names("layers", self.layers)
            patterns = tuple(p.strip() for text in given for p in text.split(",") if p.strip())
            object.__setattr__(self, "layers", patterns or None)
        if self.output is not None:
            object.__setattr__(self, "output", Path(self.output))

    @property
    def output_path(self) -> Path | None:
        return None if self.output is None else Path(self.output)

    @property
    def output_dtype(self) -> torch.dtype | None:
        """The dtype ``dtype`` names (None: the model's own); BadInputError for an unknown name."""
        from normswap.util.dtypes import output_dtype

        return None if self.dtype is None else output_dtype(self.dtype)

    def validate(self) -> None:
        """Raise :class:`BadInputError` for options that contradict each other or name nothing known,
        and :class:`CheckFailedError` for an architectural rewrite under the exact policy."""
        self.passes()

    def passes(self) -> list[Pass]:
        """The passes of this conversion, in the order that lets each see what it needs (validated)."""
        passes = self._passes()
        has_swap = any(p.name in ("swap_norm", "cosine_layers") for p in passes)
        if self.calibration_data is not None and not has_swap:
            raise BadInputError("--calibrate fits swapped norms: give an architectural --to KIND")
        graph = [p for p in passes if p.needs is Needs.EXPORTED_GRAPH]
        if self.calibration_data is not None and graph:
            # the calibration fits the swapped norms as modules, and a graph rewrite has made the model
            # one exported program by then: on every route, refused before any work
            raise BadInputError(
                f"--calibrate fits swapped norms as modules, and {graph[0].name} makes the model an exported "
                "program first: convert in two steps (the swap with --calibrate, then the graph rewrite)"
            )
        if self.calibration_data is None:  # options of the calibration data, not of the conversion
            given = [
                o
                for o, v in (
                    ("--calibrate-batches", self.calibration_batches),
                    ("--batch-size", self.batch_size),
                )
                if v is not None
            ]
            if given:
                raise BadInputError(f"{' and '.join(given)} read the --calibrate data: give --calibrate DATA")
        if self.allow_lossy and self.exact:
            raise BadInputError("--allow-lossy and --exact contradict each other: give one")
        if self.allow_lossy and self.to != "rmsnorm":
            raise BadInputError(
                "--allow-lossy applies to --to rmsnorm, whose exact route can fall back to a lossy swap; "
                "an architectural --to KIND is lossy by request"
            )
        try:
            Pipeline(passes, exact_only=self.exact)
        except ExactOnlyError as exc:
            raise CheckFailedError(f"--exact: {exc}; nothing written") from None
        self._check_output()
        return passes

    def given(self, *flags: str) -> list[str]:
        """Those of ``flags`` (command-line spellings, in the order given) that this configuration sets:
        what each route checks for the options it cannot take. The rewrites' spellings are
        :data:`normswap.rewrites.REWRITES`' (``--fold-bn``, ``--to crmsnorm``); the policies' and data's
        are below."""
        on = {
            r.option: (self.to == r.field) if r in TARGETS else getattr(self, r.field) not in (None, False)
            for r in REWRITES
        }
        on.update(
            {
                "--exact": self.exact,
                "--allow-lossy": self.allow_lossy,
                "--calibrate": self.calibration_data is not None,
                "--from": self.from_kinds is not None,
                "--dtype": self.dtype is not None,
            }
        )
        return [flag for flag in flags if on[flag]]

    def rewrites(self) -> list[str]:
        """The rewrites this configuration asks for, by their command-line spelling."""
        return self.given(*BY_OPTION)

    def makes_graph(self) -> bool:
        """Whether a rewrite asked for makes the model an exported GraphModule (then a .pt holds its
        program)."""
        return self._graph_flag() is not None

    def _graph_flag(self) -> str | None:
        """The first option asking for a graph rewrite (whose result is a GraphModule), if any."""
        return next(iter(self.given(*graph_options())), None)

    def _check_output(self) -> None:
        from normswap.load import SAVE_FORMATS
        from normswap.load.checkpoint_write import is_directory_output
        from normswap.load.output_options import check_output_options
        from normswap.load.paths import check_output
        from normswap.load.save import check_output_format
        from normswap.util.dtypes import onnx_check_problem

        output = self.output_path
        if output is not None and not is_directory_output(output):
            check_output_format(output)  # an unknown suffix says so first
        # the one rule for output options the output does not use
        check_output_options(
            output, opset=self.opset, static_shapes=self.static_shapes, portable=self.portable
        )
        if self.dtype is not None and output is None:
            raise BadInputError("--dtype is the dtype of the written output: give -o")
        dtype = self.output_dtype  # an unknown name, before the model is read
        if output is None:
            return
        # the output rule, before the model is loaded: an existing path, a symlink, a missing folder
        check_output("-o", output, overwrite=self.overwrite, directory=is_directory_output(output))
        if is_directory_output(output):
            if (flag := self._graph_flag()) is not None:
                raise BadInputError(
                    f"{flag} makes the model an exported torch.fx GraphModule, which a model directory cannot "
                    f"hold: save {output} as .pt2, .onnx or .pt (its program pickled)"
                )
            return
        if SAVE_FORMATS[output.suffix] == "onnx" and (problem := onnx_check_problem(dtype)) is not None:
            raise BadInputError(f"-o {output}: {problem}")
        if SAVE_FORMATS[output.suffix] != "pickle":
            return
        if self.add_weight_norm is not None:
            raise BadInputError(
                f"--add-weight-norm makes parametrized modules, which torch.save cannot pickle to {output}: "
                "save as .pt2 or .onnx"
            )

    def _check_kinds(self) -> None:
        from normswap.modules.semantics import CONVERT_TARGETS, NORM_KINDS, NormKind, parse_target

        to = self.to
        if to is not None:
            try:
                to = parse_target(to)
            except ValueError:
                raise BadInputError(
                    f"--to {to!r} is not a norm kind normswap can swap to; choose from {', '.join(CONVERT_TARGETS)}"
                ) from None
            # one vocabulary: "rms" and "RMSNorm" name the target "rmsnorm" from here on
            object.__setattr__(self, "to", to)
        if to == "groupnorm" and self.groups is None:
            raise BadInputError("--to groupnorm needs --groups N")
        if self.groups is not None and to != "groupnorm":
            raise BadInputError("--groups applies to --to groupnorm only")
        kinds = []
        for kind in self.from_kinds or ():
            try:
                kinds.append(NormKind.parse(kind).value)
            except ValueError:
                raise BadInputError(f"--from {kind!r}: choose from {', '.join(NORM_KINDS)}") from None
        if self.from_kinds:
            object.__setattr__(self, "from_kinds", tuple(kinds))
        if self.from_kinds and to is None:
            raise BadInputError("--from picks which norms --to replaces: give --to KIND")
        if self.layers is not None and to != "cosine":
            raise BadInputError("--layers picks the layers --to cosine converts: give --to cosine")
        if self.from_kinds and to == "cosine":
            raise BadInputError(
                "--from picks norms; --to cosine converts Linear/Conv layers (pick them with --layers)"
            )
        if self.fuse_add and to != "fused":
            raise BadInputError("--fuse-add fuses residual adds into fused norms: give --to fused")
        if self.fuse_inline and to != "fused":
            raise BadInputError("--fuse-inline fuses norms inside other forwards: give --to fused")

    def weight_norm_pass(self) -> AddWeightNorm:
        """The AddWeightNorm pass ``add_weight_norm`` and ``weight_norm_dim`` ask for."""
        from normswap.passes import AddWeightNorm

        targets = self.add_weight_norm
        if isinstance(targets, str):
            paths = None if targets == "all" else [p.strip() for p in targets.split(",") if p.strip()]
        else:
            paths = list(targets or ())
        dim: Any = self.weight_norm_dim
        if dim == "none":
            dim = None
        elif isinstance(dim, str) and dim != "output":
            try:
                dim = int(dim)
            except ValueError:
                raise BadInputError(f"--weight-norm-dim {dim!r}: give output, an int or none") from None
        try:
            return AddWeightNorm(targets=paths, dim=dim)
        except ValueError as exc:  # a negative dim: torch would read -1 as the whole weight
            raise BadInputError(f"--weight-norm-dim {self.weight_norm_dim!r}: {exc}") from None

    def _passes(self) -> list[Pass]:
        """The passes of the rewrites asked for (and of those they run also), in the order of their
        stages (:mod:`normswap.rewrites`)."""
        self._check_kinds()
        asked = {r.field: r for r in REWRITES if r.option in self.rewrites()}
        for rewrite in list(asked.values()):
            if rewrite.runs_also is not None:
                asked.setdefault(rewrite.runs_also, BY_FIELD[rewrite.runs_also])
        passes = [p for r in sorted(asked.values(), key=lambda r: r.stage) for p in self._passes_of(r.field)]
        if not passes:
            options = [entry.option for entry in OPTIONS if entry.needs is None]
            raise BadInputError(f"nothing to do: give --to KIND, {', '.join(options[:-1])} or {options[-1]}")
        return passes

    def _passes_of(self, field: str) -> list[Pass]:
        """How the rewrite ``field`` (a registry entry's) is built under this configuration."""
        from normswap.passes import (
            FoldBatchNorm,
            FoldLayerScale,
            FoldNormAffine,
            RecenterLayerNorm,
            RemoveWeightNorm,
            SwapNorm,
        )

        kinds = tuple(self.from_kinds) if self.from_kinds else None
        if field == "rmsnorm" and (kinds is None or "layer" in kinds):
            # exact where the residual stream can be recentered; the generic swap takes the rest
            return [RecenterLayerNorm(), *([] if self.exact else [SwapNorm("rmsnorm", kinds)])]
        if field == "crmsnorm":
            from normswap.passes.recenter.compress import CompressStream

            return [CompressStream()]  # exact only: no lossy fallback for what it refuses
        if field == "fused":
            from normswap.passes.fuse.modules import FuseNorm

            return [FuseNorm()]
        if field == "cosine":
            from normswap.passes.swap.cosine_layers import CosineLayers

            return [CosineLayers(self.layers)]
        if field == "fuse_inline":
            from normswap.passes.fuse.graph import FuseGraphNorm

            return [FuseGraphNorm()]
        if field == "fuse_add":
            from normswap.passes.fuse.add_norm import FuseAddNorm

            return [FuseAddNorm()]
        if field == "defer_rms":
            from normswap.passes.affine.defer_rms import DeferRMS

            return [DeferRMS()]
        plain: dict[str, Callable[[], Pass]] = {
            "remove_weight_norm": RemoveWeightNorm,
            "fold_bn": FoldBatchNorm,
            "fold_layerscale": FoldLayerScale,
            "fold_norm_affine": FoldNormAffine,
            "add_weight_norm": self.weight_norm_pass,
        }
        if field in plain:
            return [plain[field]()]
        return [SwapNorm(field, kinds, groups=self.groups)]  # an architectural --to KIND


def _names(option: str, value: object) -> list[str]:
    """A str, or strs in a list or tuple: what ``option`` takes (an int raised TypeError deep inside)."""
    given = [value] if isinstance(value, str) else value
    if not isinstance(given, list | tuple) or not all(isinstance(v, str) for v in given):
        raise BadInputError(f"{option} is a name or a list of names, got {value!r}")
    return list(given)
