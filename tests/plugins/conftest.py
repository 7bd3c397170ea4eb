"""The kernel tests run once per ISA variant this CPU runs (`cpu_kernels.runnable()`: on an AVX512-BF16 machine
avx512_bf16, avx512, avx2_vnni (its EVEX stand-in: only the int8 dot products' tests, tests/conftest.py), avx2 and
generic), each against the PyTorch references: the `kernel_variant` fixture forces the variant as NEXTN_CPU_ISA would
and fails the test if the loaded kernels were compiled for another."""

import pytest

from nextn.plugins import cpu_kernels


@pytest.fixture(params=cpu_kernels.runnable())
def kernel_variant(request):
    with cpu_kernels.use(request.param):
        assert cpu_kernels.variant() == request.param
        assert cpu_kernels.ops().isa() == request.param  # the compiled-in variant, not only the name it was loaded as
        yield request.param
