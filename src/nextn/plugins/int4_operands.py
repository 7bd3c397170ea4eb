"""The operands nextn's fused CPU ops take for a `WeightOnlyLinear` on the int4 kernel: which linears qualify (one
group size, one activation format), and their tensors — alone, or several concatenated along the output channels with
each module's buffers made views of the concatenation (one copy in memory). Shared by the fused decoder layer
(`decoder_layer.py`) and the MoE experts' op (`moe_experts.py`: every expert's, stacked)."""

from __future__ import annotations

import torch
from torch import nn

from nextn.plugins import page_release


def int4_linears(*linears: nn.Module) -> tuple[int, bool] | None:
    """(the common group size, W4A8) when every module is a W4A16 (or every one a W4A8) `WeightOnlyLinear` on
    nextn's kernel, else None."""
    kinds = set()
    for lin in linears:
        if getattr(lin, "kernel", None) != "nextn" or not getattr(lin, "int4", False):
            return None
        kinds.add((lin.group_size, lin.int8_activations))
    return kinds.pop() if len(kinds) == 1 else None


def concat_rows(linears: list[nn.Module]) -> list[torch.Tensor]:
    """Concatenate the linears' int4 tensors along the output channels and make each module's buffers views of the
    concatenation (same values, no second copy). Returns [w, scale, zero8] (+ [bias])."""
    names = ["qweight", "scales", "zeros"]
    if all(lin.bias is not None for lin in linears):
        names.append("bias")
    fused = []
    for name in names:
        parts = [getattr(lin, name) for lin in linears]
        cat = torch.cat(parts).contiguous()  # along dim 0: rows, or blocks of 16 rows (`woq_linear.block_scales`)
        row = 0
        for lin, part in zip(linears, parts):
            setattr(lin, name, cat[row:row + part.shape[0]])
            row += part.shape[0]
        page_release.release(parts)  # the engine file's pages of the parts: not resident beside the copy
        fused.append(cat)
    return fused


def stack_rows(groups: list[list[nn.Module]]) -> list[torch.Tensor]:
    """`concat_rows` of each group (an expert's linears, the same shapes in every group), stacked along a new first
    dimension: [w [E, N, K / 2], scale [E, ...], zero8 [E, ...]] (+ [bias [E, N]]), one allocation each, every
    module's buffers made views of them (one copy in memory). An op takes the E experts as these three tensors
    rather than 3 E: with 128 experts the op call converted 768 tensors, ~50 µs on every call. Where a field's parts
    lie back to back in the engine file's mapping (the experts stored in the kernel's layout: `kernel_layout`), the
    stacked tensor is a view of them (no copy: the pages stay the page cache's, shared between processes)."""
    names = ["qweight", "scales", "zeros"]
    if all(lin.bias is not None for group in groups for lin in group):
        names.append("bias")
    fused = []
    for name in names:
        first = [getattr(lin, name) for lin in groups[0]]
        rows = sum(part.shape[0] for part in first)
        stacked = _adjacent([getattr(lin, name) for group in groups for lin in group])
        if stacked is not None:  # side by side in the engine file (`kernel_layout.file_order`): read in place
            fused.append(stacked.view(len(groups), rows, *first[0].shape[1:]))
            continue
        stacked = first[0].new_empty((len(groups), rows, *first[0].shape[1:]))
        for e, group in enumerate(groups):
            row = 0
            for lin in group:
                part = getattr(lin, name)
                stacked[e, row:row + part.shape[0]] = part
                setattr(lin, name, stacked[e, row:row + part.shape[0]])
                page_release.release([part])
                row += part.shape[0]
        fused.append(stacked)
    return fused


def _adjacent(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The parts as one flat tensor without a copy where they lie back to back in one storage (contiguous, one
    dtype, each starting where the one before ends), else None."""
    head = parts[0]
    storage, end = head.untyped_storage(), head.data_ptr()
    for part in parts:
        if (part.dtype != head.dtype or not part.is_contiguous() or part.data_ptr() != end
                or part.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
        end += part.numel() * part.element_size()
    numel = sum(part.numel() for part in parts)
    return head.new_empty(0).set_(storage, head.storage_offset(), (numel,))


def one_linear(lin: nn.Module) -> list[torch.Tensor]:
    """A linear's int4 operands: [w, scale, zero8] (+ [bias])."""
    return [lin.qweight, lin.scales, lin.zeros] + ([lin.bias] if lin.bias is not None else [])
