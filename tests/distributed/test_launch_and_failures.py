"""Launching under torchrun, and ranks that die: the others fail fast with a clear error instead of hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

from nextn import LLM, SamplingParams

SP = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], list(range(20, 40))]


def test_torchrun_runs_the_same_script_on_two_ranks(llama_engine, tmp_path):
    """Every process runs the script; LLM(...) serves the steps on rank 1 and exits there; rank 0 generates."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        from nextn import LLM, SamplingParams
        llm = LLM({str(llama_engine)!r}, speculative_config=None, tensor_parallel_size=2)
        out = llm.generate({PROMPTS!r}, SamplingParams(max_tokens=8, ignore_eos=True))
        json.dump([o.outputs[0].token_ids for o in out], open(sys.argv[1], "w"))
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # Known, not fixed here: rank 0 (the user's process) sometimes aborts in the interpreter's C++ teardown after its
    # work is done ("terminate called without an active exception", exit -6; ~1 run in 10 on 2 cores, at commit
    # 5b9d012 too; three in a row once in a loaded CI run). Only that abort is retried, at most four times; any other
    # failure fails.
    for attempt in range(5):
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                              str(script), str(tmp_path / "out.json")], timeout=300, env=env, capture_output=True,
                             text=True)
        if run.returncode == 0:
            break
        assert "terminate called without an active exception" in run.stderr and attempt < 4, run.stderr[-3000:]
    ref = [o.outputs[0].token_ids for o in LLM(llama_engine, speculative_config=None).generate(PROMPTS, SP)]
    assert json.loads((tmp_path / "out.json").read_text()) == ref


def test_a_dead_worker_fails_the_next_step_at_once(llama_engine):
    llm = LLM(llama_engine, speculative_config=None, tensor_parallel_size=2)
    worker = llm._workers.processes[0]
    worker.kill()
    worker.wait()
    t0 = time.monotonic()
    out = llm.generate(PROMPTS, SP)
    assert time.monotonic() - t0 < 30
    for o in out:
        assert o.outputs[0].finish_reason == "error"
        assert "worker rank(s) 1" in o.outputs[0].error and "exited" in o.outputs[0].error
    llm._workers.close()


def test_a_worker_exits_when_rank_0_dies(llama_engine, tmp_path):
    """Rank 0 (a child process here) dies abruptly between steps: its worker's wait for the next plan fails."""
    script = tmp_path / "die.py"
    script.write_text(textwrap.dedent(f"""
        import os
        from nextn import LLM, SamplingParams
        llm = LLM({str(llama_engine)!r}, speculative_config=None, tensor_parallel_size=2)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
        print(llm._workers.processes[0].pid, flush=True)
        os._exit(3)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr
    pid = int(proc.stdout.split()[-1])
    deadline = time.monotonic() + 60
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        try:  # a zombie (exited, its parent gone) is reaped by init; status Z counts as exited
            if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.5)
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert "RankFailure" in proc.stderr or "rank 1" in proc.stderr


def test_sizes_that_do_not_divide_the_model_are_named(llama_engine):
    """3 ranks for 2 KV heads: every rank refuses at load, rank 0 raises the named error, the workers are gone."""
    import pytest

    from nextn.distributed.mapping import Mapping, MappingError

    with pytest.raises(MappingError, match="num_key_value_heads = 2 is not divisible by 3"):
        LLM(llama_engine, speculative_config=None, tensor_parallel_size=3)
    with pytest.raises(MappingError, match="must divide tensor_parallel_size"):
        Mapping(world_size=4, tp_size=4, moe_ep_size=3)
