"""Triton kernels for the verify-and-draft step's own operations, each with its launcher and PyTorch reference (the
acceptance kernels sit beside their rules in `nextn.speculative.acceptance_kernels`).

One module per noun: `slot_mapping` (slots through the block table, KV-length rewind), `medusa_tree`
(tree attention mask, candidate gather) and `mla_attention` (absorbed MLA over the paged latent cache, causal or
tree-masked). Each module exposes `xxx_kernel` (`@triton.jit`, built on first use), `xxx_triton` (the launcher),
`xxx_reference` (PyTorch) and `xxx` (the dispatcher: the kernel where it can run, else the reference; see
`dispatch`). The package imports without triton; kernels are defined only when first launched, so that
`TRITON_INTERPRET=1` set by a test before that point takes effect.
"""
