"""nextn's suffix trie in C++ (`suffix_tree_cpu.cpp`), loaded as a small Python extension on first use;
`speculative/suffix_tree.py`'s `NativeSuffixTree` puts it behind the interface of the Python reference
(`SuffixTree`): the same node ids, counts, matches and proposals, operation for operation
(tests/speculative/test_suffix_tree.py checks them against each other on random sequences with removals).

Built with `torch.utils.cpp_extension` (g++, no CPU-specific flags: any x86-64 or Arm host with a compiler; ~15 s
once per machine, cached under `TORCH_EXTENSIONS_DIR`). Where it cannot build, `native_module()` is None with
the reason in `unavailable_reason()`, one warning is logged, and suffix decoding keeps the Python tree (slower on
the host, the same drafts).
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

_NAME = "nextn_suffix_tree"
SOURCE = Path(__file__).with_name("suffix_tree_cpu.cpp")


@functools.cache
def _load():
    """(the compiled module, None) or (None, why it is unavailable); built once per process."""
    try:
        from torch.utils import cpp_extension

        from nextn.plugins.cpu_kernels import _ninja_on_path

        build_dir = Path(cpp_extension._get_build_directory(_NAME, verbose=False))
        if not any(build_dir.glob(f"{_NAME}*.so")):
            print("compiling nextn's suffix tree for this machine (once, ~15 s)", file=sys.stderr, flush=True)
        with _ninja_on_path():
            module = cpp_extension.load(name=_NAME, sources=[str(SOURCE)], extra_cflags=["-O3"], verbose=False)
        return module, None
    except Exception as e:  # no compiler, no headers, a failed build: the Python tree stays
        first = str(e).splitlines()[0] if str(e) else ""
        reason = f"building {SOURCE.name} failed ({type(e).__name__}: {first})"
        logger.warning("nextn: the C++ suffix tree is unavailable, suffix decoding uses the Python one: %s", reason)
        return None, reason


def unavailable_reason() -> str | None:
    """Why the C++ tree is unavailable (None when it is loaded)."""
    return _load()[1]


def native_module():
    """The compiled module (its `SuffixTreeCpu` class; built on the first call), or None where it cannot load."""
    return _load()[0]
