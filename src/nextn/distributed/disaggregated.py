"""Disaggregated prefill/decode: a context engine and a generation engine in separate processes, the request's KV
blocks, first token and drafts (or the hidden state they come from) moved over `torch.distributed`.

Sources: TensorRT-LLM's disaggregated serving (`trtllm-serve disaggregated -c disagg.yaml`: `context_servers`,
`generation_servers`, each with `num_instances` and LLM arguments); the MindIE-LLM MTP design for the decode side's
first MTP step. Flow, per batch of prompts (`DisaggregatedLLM.generate`):

    context (this process, rank 0)        prefill each prompt (target + MTP module over the prompt): first token,
                                          first drafts, KV rows 0..L−1 of every layer (target and MTP), and the
                                          final hidden state of row L−1; its blocks are freed at once
        ── send ──>                       `KvTransfer` (tokens, seed, sampling, drafts), KV [layers, L, kv dim],
                                          hidden [H] (first_mtp_step "hidden_state" only)
    generation (a started process, rank 1)  admit straight into decode (`Scheduler.admit_prefilled`), write the KV
                                          rows into its own blocks, take the first drafts (below), decode to the end
        <── send ──                       the `RequestOutput`s and each request's first-step accepted drafts

The first drafts on the generation side (`first_mtp_step`):
- "drafts": the context engine's drafts, sent as they are (the single engine's drafts exactly);
- "hidden_state": the context engine sends h_{L−1}; the generation side runs the first MTP step itself from it and
  the first token (the same drafts; its MTP KV row L−1 rewritten with the same values);
- "zero_hidden" (MindIE-LLM): no hidden state is sent; the first MTP step runs with h = 0 and writes its MTP KV to
  the null block (the dummy block), so the MTP KV row L−1 received from the context engine is not overwritten;
  its drafts are worse, the output is the same (drafts are verified).
Every mode is lossless; what differs is the first decode step's acceptance (measured: docs/PERFORMANCE.md).
Supported drafters: none and MTP Eagle (their per-request state lives in the KV cache that moves); MTP Vanilla's
hidden-state pools, the n-gram history and a draft model's own KV are not moved yet (refused by name).
"""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from nextn.config.llm_args import LlmArgs, LlmArgsError, parse_llm_args
from nextn.distributed.comm import require_free_default_group
from nextn.models.attention_metadata import AttentionMetadata, slots_for_positions
from nextn.runtime.outputs import RequestOutput
from nextn.runtime.sampling_params import SamplingParams
from nextn.speculative.chain_step import prefill_groups

FirstMtpStep = Literal["drafts", "hidden_state", "zero_hidden"]
SHUTDOWN = "shutdown"


class ServerGroup(BaseModel):
    """One side of `trtllm-serve disaggregated`'s YAML: `num_instances` (1 here) and `urls` (ignored: nextn starts
    the processes), the rest LLM arguments for that side's engine."""

    model_config = ConfigDict(extra="allow")
    num_instances: int = Field(default=1, ge=1, le=1)
    urls: list[str] = []

    def llm_args(self, **overrides: Any) -> LlmArgs:
        return parse_llm_args(dict(self.model_extra or {}), **overrides)


class DisaggregatedConfig(BaseModel):
    """`context_servers`, `generation_servers` (TensorRT-LLM's names) and nextn's `first_mtp_step`."""

    model_config = ConfigDict(extra="forbid")
    context_servers: ServerGroup = ServerGroup()
    generation_servers: ServerGroup = ServerGroup()
    first_mtp_step: FirstMtpStep = "hidden_state"
    hostname: str | None = None  # accepted (trtllm-serve's front end), unused
    port: int | None = None


@dataclass(frozen=True)
class KvTransfer:
    """What the generation engine needs of one prefilled request besides its KV rows (and hidden state).

    Attributes:
        index: the prompt's index in the batch; token_ids: prompt + the first token; num_rows: L, KV rows sent.
        drafts: the context engine's first drafts; seed: the request's sampling seed (its first token used it).
    """

    index: int
    token_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    drafts: tuple[int, ...]
    num_rows: int
    kv_shape: tuple[int, ...]
    kv_dtype: torch.dtype
    hidden_size: int
    with_hidden: bool


def _check_drafter(drafter: Any, mode: FirstMtpStep) -> None:
    if not drafter.traits.disaggregation:
        raise LlmArgsError(f"disaggregated serving moves KV, first token and drafts; the {drafter.name} drafter keeps "
                           "per-request state outside the KV cache: use MTP Eagle or no speculation")
    if mode != "drafts" and drafter.num_draft_tokens == 0:
        raise LlmArgsError(f"first_mtp_step {mode!r} needs an MTP drafter")


def _check_model(model: Any) -> None:
    if model.has_recurrent_state:
        raise LlmArgsError("disaggregated serving moves KV; this model's linear-attention layers keep a recurrent "
                           "state per request outside the KV cache (Qwen3.5's Gated DeltaNet): serve it on one engine")


def _slots(block_table: list[int], num_rows: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(num_rows)
    return torch.tensor(block_table)[pos // block_size] * block_size + pos % block_size


def _row_slots(engine: Any, req: Any, num_rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The cache slots of `req`'s first `num_rows` positions: the pool's, and where the sliding-window layers' rows
    have blocks of their own (runtime/sliding_blocks.py) theirs (positions behind the window: the null block)."""
    slots = _slots(req.block_table, num_rows, engine.block_size)
    sliding = engine.pool.sliding
    if sliding is None:
        return slots, None
    table = sliding.block_map[torch.tensor(req.block_table, dtype=torch.int64)].tolist()
    return slots, _slots(table, num_rows, engine.block_size)


def _read_rows(engine: Any, req: Any, num_rows: int) -> torch.Tensor:
    kv, rows = engine.runner.kv_cache, engine.pool.sliding.rows if engine.pool.sliding is not None else ()
    slots, own = _row_slots(engine, req, num_rows)
    out = kv[:, slots].contiguous()
    for r in rows:
        out[r] = kv[r, own]
    return out


def _write_rows(engine: Any, req: Any, num_rows: int, values: torch.Tensor) -> None:
    kv, rows = engine.runner.kv_cache, engine.pool.sliding.rows if engine.pool.sliding is not None else ()
    slots, own = _row_slots(engine, req, num_rows)
    values = values.to(kv.device)
    for r in range(kv.shape[0]):
        kv[r, own if r in rows else slots] = values[r]


class ContextSide:
    """The context (prefill) engine: prefills prompts and hands each one's state over, its blocks freed at once."""

    def __init__(self, engine: Any, mode: FirstMtpStep) -> None:
        _check_drafter(engine.drafter, mode)
        _check_model(engine.model)
        self.engine, self.mode = engine, mode
        self._plan = None
        self._groups: list[tuple[list[int], int]] = []
        self.hidden: dict[int, torch.Tensor] = {}  # request id → final hidden state of its last prompt row [H]
        engine.runner.on_launch = self._on_launch
        engine.model.model.norm.register_forward_hook(self._on_norm)

    def _on_launch(self, plan, from_previous: bool) -> None:
        self._plan = plan
        # a prefill's target forwards, one per group of rows (model_runner: `prefill_groups` of the chunk lengths)
        self._groups = (prefill_groups([e - s for s, e in zip(plan.chunk_starts, plan.chunk_ends)])
                        if plan.kind == "prefill" else [])

    def _on_norm(self, module, inputs, output) -> None:
        plan = self._plan
        if plan is None or plan.kind != "prefill" or not self._groups:
            return
        rows, width = self._groups.pop(0)
        if tuple(output.shape[:2]) != (len(rows), width):
            raise RuntimeError(f"a prefill forward of {tuple(output.shape[:2])} rows × tokens where its group is "
                               f"{(len(rows), width)}: the context side cannot tell whose hidden states these are")
        for j, i in enumerate(rows):
            if plan.is_last_chunk(i):
                self.hidden[plan.request_ids[i]] = output[j, plan.chunk_ends[i] - plan.chunk_starts[i] - 1].clone()

    def prefill(self, prompts: list, params: list[SamplingParams]) -> list[tuple[KvTransfer, torch.Tensor, Any]]:
        """Prefill every prompt; per prompt (transfer, KV rows [layers, L, kv dim], hidden [H] or None).

        A request the prefill already finishes (first token a stop token, max_tokens 1) is sent with num_rows 0.
        """
        engine = self.engine
        reqs = {}
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            req = engine.make_request(prompt, sp)
            engine.add_request(req)
            reqs[req.request_id] = (i, req)
        out = []
        while reqs:
            engine.step()
            for rid, (i, req) in list(reqs.items()):
                if not (req.progress.prefill_done or req.finished):
                    continue
                del reqs[rid]
                hidden = self.hidden.pop(rid, None)
                if req.finished:  # nothing to decode
                    out.append((KvTransfer(i, tuple(req.all_token_ids), req.params, req.seed, (), 0, (), torch.float32,
                                           0, False), torch.empty(0), None))
                    continue
                rows = _read_rows(engine, req, req.kv_len)
                send_hidden = self.mode == "hidden_state"
                out.append((KvTransfer(i, tuple(req.all_token_ids), req.params, req.seed, tuple(req.draft_tokens),
                                       req.kv_len, tuple(rows.shape), rows.dtype, hidden.shape[-1], send_hidden),
                            rows, hidden if send_hidden else None))
                engine.abort_request(rid)  # its KV lives on in the generation engine
        return out


class GenerationSide:
    """The generation (decode) engine: admits transferred requests straight into decode and runs them."""

    def __init__(self, engine: Any, mode: FirstMtpStep) -> None:
        _check_drafter(engine.drafter, mode)
        _check_model(engine.model)
        self.engine, self.mode = engine, mode

    @torch.inference_mode()
    def admit(self, t: KvTransfer, rows: torch.Tensor, hidden: torch.Tensor | None):
        """A `Request` in decode with the transferred KV and its first drafts; None when no slot or blocks are free."""
        engine = self.engine
        req = engine.make_request(list(t.token_ids[:-1]), t.params)
        req.seed = t.seed
        if not engine.scheduler.admit_prefilled(req):
            return None
        _write_rows(engine, req, t.num_rows, rows)
        req.append([t.token_ids[-1]], engine.max_seq_len)
        req.draft_tokens = list(t.drafts) if self.mode == "drafts" else self._first_drafts(req, t, hidden)
        return req

    def _first_drafts(self, req, t: KvTransfer, hidden: torch.Tensor | None) -> list[int]:
        """The first MTP step at position L−1 over (h_{L−1}, first token): from the sent hidden state, or from zeros
        with its MTP KV written to the null (dummy) block."""
        engine = self.engine
        dev, bs = engine.device, engine.block_size
        table = torch.tensor([req.block_table], device=dev)
        pos = torch.tensor([[t.num_rows - 1]], device=dev)
        slots = slots_for_positions(table, pos, bs) if hidden is not None else torch.zeros_like(pos)
        meta = AttentionMetadata.create(pos, slots, table, bs)
        dtype = next(engine.model.parameters()).dtype
        h = (hidden.to(dev, dtype) if hidden is not None else torch.zeros(t.hidden_size, dtype=dtype, device=dev))
        first = torch.tensor([[t.token_ids[-1]]], device=dev)
        drafts, _ = engine.drafter.after_prefill(engine.model, engine.runner.kv_cache, meta, h.view(1, 1, -1), first,
                                                 torch.zeros(1, dtype=torch.int64, device=dev), input_ids=first,
                                                 state=())
        return drafts[0].tolist()

    def run(self, transfers: list[tuple[KvTransfer, torch.Tensor, Any]]) -> list[tuple[int, RequestOutput, int]]:
        """Decode every transferred request to the end: (index, output, drafts accepted in its first step)."""
        engine = self.engine
        pending = list(transfers)
        running: dict[int, tuple[int, Any]] = {}
        first_step: dict[int, int] = {}
        results = []
        while pending or running:
            while pending and (t := pending[0])[0].num_rows == 0:
                pending.pop(0)
                results.append((t[0].index, _finished_output(engine, t[0]), 0))
            while pending:
                req = self.admit(*pending[0])
                if req is None:
                    break
                running[req.request_id] = (pending.pop(0)[0].index, req)
            if not running:
                if pending:
                    raise LlmArgsError("the generation engine's KV cache cannot hold one transferred request: raise "
                                       "its kv_cache_config.max_tokens")
                continue
            engine.step()
            for rid, (i, req) in list(running.items()):
                if req.num_decode_steps >= 1 and rid not in first_step:
                    first_step[rid] = req.num_accepted_draft_tokens
                if req.finished:
                    del running[rid]
                    results.append((i, req.to_output(), first_step.get(rid, 0)))
        return results


def _finished_output(engine: Any, t: KvTransfer) -> RequestOutput:
    req = engine.make_request(list(t.token_ids[:-1]), t.params)
    req.append([t.token_ids[-1]], engine.max_seq_len)
    if not req.finished:
        req.finish("length")
    return req.to_output()


def _send_transfer(t: KvTransfer, rows: torch.Tensor, hidden: Any, dst: int) -> None:
    dist.send_object_list([t], dst=dst)
    if t.num_rows:
        dist.send(rows, dst=dst)
        if t.with_hidden:
            dist.send(hidden.float().contiguous(), dst=dst)  # fp32 on the wire; cast back to the model dtype


def _recv_transfer(src: int) -> tuple[KvTransfer, torch.Tensor, Any]:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src)
    t: KvTransfer = box[0]
    rows = hidden = None
    if t.num_rows:
        rows = torch.empty(t.kv_shape, dtype=t.kv_dtype)
        dist.recv(rows, src=src)
        if t.with_hidden:
            hidden = torch.empty(t.hidden_size, dtype=torch.float32)
            dist.recv(hidden, src=src)
    return t, rows, hidden


def serve_generation(engine_dir: str, args: LlmArgs, spec: Any, mode: FirstMtpStep, init_method: str) -> None:
    """The generation process: receive batches of transfers from rank 0, decode them, send the results back."""
    from nextn.runtime.engine import Engine

    dist.init_process_group("gloo", init_method=init_method, world_size=2, rank=1)
    try:
        side = GenerationSide(Engine(engine_dir, args, spec, "cpu"), mode)
        dist.send_object_list([None], dst=0)  # loaded
        while True:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=0)
            if box[0] == SHUTDOWN:
                return
            transfers = [_recv_transfer(0) for _ in range(box[0])]
            dist.send_object_list([side.run(transfers)], dst=0)
    except Exception as e:
        if dist.is_initialized():
            try:
                dist.send_object_list([f"{type(e).__name__}: {e}"], dst=0)
            except RuntimeError:
                pass
        raise
    finally:
        dist.destroy_process_group()


class DisaggregatedLLM:
    """A context engine in this process and a generation engine in a started process (gloo, CPU).

    Args:
        engine_dir: the engine both sides load.
        config: a `DisaggregatedConfig` or its dict (the YAML of `trtllm-serve disaggregated`).
        speculative_config: both sides' speculative config (a dict with TensorRT-LLM names, or None).
    Raises:
        LlmArgsError: invalid arguments or an unsupported drafter; RuntimeError: the generation process failed.
    """

    def __init__(self, engine_dir: str | Path, config: DisaggregatedConfig | dict | None = None,
                 speculative_config: Any = None) -> None:
        from nextn.runtime.engine import Engine

        cfg = config if isinstance(config, DisaggregatedConfig) else DisaggregatedConfig.model_validate(config or {})
        spec = parse_llm_args({"speculative_config": speculative_config}).speculative_config
        ctx_args = cfg.context_servers.llm_args(disable_overlap_scheduler=True, enable_chunked_prefill=False)
        gen_args = cfg.generation_servers.llm_args()
        self.mode = cfg.first_mtp_step
        require_free_default_group("DisaggregatedLLM")
        self._dir = tempfile.mkdtemp(prefix="nextn-disagg-")
        init_method = f"file://{self._dir}/rendezvous"
        spec_file = Path(self._dir) / "generation.pkl"
        spec_file.write_bytes(pickle.dumps((str(engine_dir), gen_args, spec, self.mode, init_method)))
        self._proc = subprocess.Popen([sys.executable, "-m", "nextn.distributed.disaggregated", str(spec_file)])
        try:
            dist.init_process_group("gloo", init_method=init_method, world_size=2, rank=0)
            self.context = ContextSide(Engine(engine_dir, ctx_args, spec, "cpu"), self.mode)
            self._expect_ok()
        except BaseException:  # nothing left behind: the generation process, the group, the rendezvous
            self._proc.kill()
            self._proc.wait()
            if dist.is_initialized():
                dist.destroy_process_group()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise

    def _expect_ok(self) -> Any:
        box: list[Any] = [None]
        dist.recv_object_list(box, src=1)
        if isinstance(box[0], str):
            raise RuntimeError(f"the generation process failed: {box[0]}")
        return box[0]

    def generate(self, prompts: list, sampling_params: SamplingParams | None = None
                 ) -> tuple[list[RequestOutput], list[int]]:
        """Prefill here, decode in the generation process.

        Returns:
            The outputs in prompt order, and per prompt the drafts accepted in its first decode step.
        """
        sp = sampling_params or SamplingParams()
        transfers = self.context.prefill(prompts, [sp] * len(prompts))
        dist.send_object_list([len(transfers)], dst=1)
        for t, rows, hidden in transfers:
            _send_transfer(t, rows, hidden, dst=1)
        results = sorted(self._expect_ok())
        return [out for _, out, _ in results], [n for _, _, n in results]

    def close(self) -> None:
        if self._proc.poll() is None:
            dist.send_object_list([SHUTDOWN], dst=1)
            self._proc.wait(30)
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._dir, ignore_errors=True)


if __name__ == "__main__":
    serve_generation(*pickle.loads(Path(sys.argv[1]).read_bytes()))
