"""`python -m nextn.distributed.worker SPEC`: one worker rank of a tensor-parallel engine started by `LLM`.

SPEC is a pickle written by `launcher.start_workers` (engine directory, `LlmArgs`, speculative config, device,
`Mapping`, rendezvous URL, CPU threads). Exit status 0 after rank 0's shutdown, 1 when rank 0 died or the load
failed (the error is logged and was reported to rank 0).
"""

from __future__ import annotations

import logging
import pickle
import sys
from pathlib import Path

import torch


def main(argv: list[str]) -> int:
    spec = pickle.loads(Path(argv[0]).read_bytes())
    mapping = spec["mapping"]
    logging.basicConfig(level=logging.WARNING, format=f"[nextn rank {mapping.rank}] %(levelname)s %(message)s")
    torch.set_num_threads(spec["num_threads"])
    from nextn.distributed.launcher import run_worker

    try:
        run_worker(spec["engine_dir"], spec["args"], spec["spec"], spec["device"], mapping, spec["init_method"])
    except Exception as e:  # noqa: BLE001 - the process's last word
        logging.getLogger("nextn.distributed").error("%s: %s", type(e).__name__, e)
        return 1
    return 0


if __name__ == "__main__":
    from nextn.distributed.launcher import exit_now

    exit_now(main(sys.argv[1:]))
