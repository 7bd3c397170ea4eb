"""Every launcher registers as a `torch.library.triton_op` (what CUDA machines do at import, for torch.compile and
CUDA graphs) and runs through the op; the package imports and dispatches to references without triton."""

from __future__ import annotations

import subprocess
import sys

import torch


def test_launchers_register_as_triton_ops_and_run(kernels):
    # Importing the kernel modules registers their launchers in dispatch.OPS.
    from nextn.plugins.kernels import medusa_tree, mla_attention, slot_mapping  # noqa: F401
    from nextn.speculative import acceptance_kernels  # noqa: F401
    from nextn.plugins.kernels import dispatch

    expected = {"strict_acceptance", "relaxed_acceptance", "rejection_sampling", "rejection_sampling_draft_probs",
                "slot_mapping", "slot_mapping_valid", "rewind_kv_lens",
                "tree_visibility", "tree_candidates", "mla_attention", "mla_tree_attention"}
    assert set(dispatch.OPS) == expected
    ops = {name: torch.library.triton_op(f"nextn_test::{name}", fn, mutates_args=mut)
           for name, (fn, mut) in dispatch.OPS.items()}
    logits = torch.randn(2, 3, 20, generator=torch.Generator().manual_seed(0))
    drafts = logits.argmax(-1)[:, :2]
    drafts[1, 0] += 1
    tokens, n = ops["strict_acceptance"](logits, drafts)
    assert n.tolist() == [3, 1] and tokens.tolist() == logits.argmax(-1).tolist()
    tables = torch.tensor([[2, 3]])
    assert ops["slot_mapping"](tables, torch.tensor([[1, 4]]), 4).tolist() == [[9, 12]]


def test_package_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from nextn.plugins.kernels import dispatch, slot_mapping\n"
            "import nextn.speculative.medusa, nextn.models.deepseek_v3.model\n"
            "assert not dispatch.HAS_TRITON\n"
            "t = torch.tensor([[2, 3]])\n"
            "assert slot_mapping.slot_mapping(t, torch.tensor([[1, 4]]), 4).tolist() == [[9, 12]]\n")
    subprocess.run([sys.executable, "-c", code], check=True)
