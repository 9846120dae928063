"""Which input shapes a written program takes, against the shapes its conversion was verified on.

A ``.pt2`` (and the program inside a graph's ``.pt``) is a torch.export program: it takes the shapes its
export left free and raises on any other. A conversion is verified on its example inputs and on variants
along the model's free dims (:mod:`normswap.verify.variants`); the file written from it is loaded back
and run on each of those shapes before it takes its name, so the report can say which it takes, and an
exact conversion can refuse a file that would not take a batch or a length that was verified (an image
size other than the example's is named: a saved program's image size is fixed by design).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from normswap.errors import CheckFailedError, NormswapError
from normswap.verify.variants import InputVariant, candidate_variants, describe_error, format_shapes

# Variants along the dims every saved program keeps free where the model does (batch, sequence length:
# normswap.graph.capture's _free_dim). Image sizes are left free too (_saved_free_dim), but export fixes
# one wherever the model's code branches on it (Swin's padding to its window), so a program that rejects
# another image size is named, not refused.
FREE_DIM_LABELS = ("batch ", "length ")


@dataclass
class WrittenShapes:
    """Each verified shape, and whether the written program took it (with the error where it did not)."""

    accepted: list[str] = field(default_factory=list)
    rejected: list[dict[str, str]] = field(default_factory=list)  # {"shapes", "label", "error"}

    @property
    def rejected_free(self) -> list[dict[str, str]]:
        """The rejected variants along a free dim (batch, length): what an exact conversion refuses."""
        return [r for r in self.rejected if r["label"] == "example" or r["label"].startswith(FREE_DIM_LABELS)]

    @property
    def verified(self) -> list[str]:
        return [*self.accepted, *(r["shapes"] for r in self.rejected)]

    def to_dict(self) -> dict[str, Any]:
        return {"verified": self.verified, "accepted": self.accepted, "rejected": self.rejected}

    def summary(self) -> str:
        """One sentence: what the program takes of what was verified."""
        if not self.rejected:
            return f"takes every shape it was verified on: {', '.join(self.accepted)}"
        rejected = "; ".join(f"{r['shapes']} ({r['error']})" for r in self.rejected)
        taken = ", ".join(self.accepted) or "none of them"
        return f"takes {taken} of the shapes it was verified on, and rejects {rejected}"


def verified_variants(
    example_args: tuple | None, example_kwargs: dict[str, Any] | None, input_variants: dict[str, Any] | None
) -> list[InputVariant]:
    """The example and the variants a conversion was verified on (``ConversionReport.input_variants``'s
    accepted ones), rebuilt: the variants are made deterministically from the example."""
    args, kwargs = tuple(example_args or ()), dict(example_kwargs or {})
    accepted = {(v["label"], format_shapes(v["shapes"])) for v in (input_variants or {}).get("accepted", [])}
    variants = [InputVariant("example", args, kwargs)]
    variants += [v for v in candidate_variants(args, kwargs) if (v.label, v.describe()) in accepted]
    return variants


def shapes_taken(run: Callable[[tuple, dict[str, Any]], Any], variants: list[InputVariant]) -> WrittenShapes:
    """Run ``run(args, kwargs)`` (the loaded program) on each variant; which shapes it took."""
    found = WrittenShapes()
    for variant in variants:
        try:
            run(copy.deepcopy(variant.args), copy.deepcopy(variant.kwargs))
        except NormswapError:  # the caller's own verdict (a disagreement, wrong inputs), not a shape
            raise
        except Exception as exc:  # a guard on a fixed dim, or anything else the program raises
            found.rejected.append(
                {"shapes": variant.describe(), "label": variant.label, "error": describe_error(exc)}
            )
            continue
        found.accepted.append(variant.describe())
    return found


def refuse_untaken(path: Any, shapes: WrittenShapes, fallbacks: list[str]) -> None:
    """The one rule of an exact conversion's written program (``.pt2``, ``.onnx``, a graph's ``.pt``):
    refused when it rejects a batch or a length the conversion was verified on, saying why the export
    fixed it (``fallbacks``) and how to accept fixed shapes."""
    if not shapes.rejected_free:
        return
    # no fallback: the export with free dims succeeded and kept these fixed, because the model's code ties
    # them to the example's sizes (Mamba's scan: torch.export specialized the length)
    why = (
        f" ({fallbacks[0]})"
        if fallbacks
        else " (torch.export kept these dims fixed: the model's code ties them to the example's sizes)"
    )
    raise CheckFailedError(
        f"{path} would not take every input shape the conversion was verified on: it {shapes.summary()}"
        f"{why}; nothing written (an exact conversion is written only for the shapes it was proven on: "
        "--static-shapes writes it for the example's shapes, as the report then says)"
    )


__all__ = ["FREE_DIM_LABELS", "WrittenShapes", "refuse_untaken", "shapes_taken", "verified_variants"]
