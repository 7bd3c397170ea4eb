"""A real Triton server (2.51) over the repository `nextn triton-repo` writes, queried with `tritonclient`.

One server holds two models over the same tiny DeepSeek-V3 engine (MTP, with its tokenizer): `nextn` (non-decoupled,
HTTP) and `nextn_stream` (decoupled, gRPC streaming). Outputs must equal `LLM.generate` for the same requests.
"""

from __future__ import annotations

import queue
import sys
import time

import numpy as np
import pytest

from nextn import LLM, SamplingParams
from nextn.serving.triton_repo import write_model_repository

http = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is not installed")
grpc = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed")
from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: E402

PROMPTS = [[5, 9, 13], [7, 1, 2, 8, 30, 4], [11] * 9]
TEXT = "Hello world"
MAX_TOKENS = 8
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def engine_dir(checkpoints):
    return checkpoints.engine(distill_steps=0)


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory, triton_server_cls):
    root = tmp_path_factory.mktemp("triton")
    env = sys.prefix if sys.prefix != sys.base_prefix else None  # the venv nextn is installed in
    write_model_repository(engine_dir, root / "repo", "nextn", device="cpu", python_env=env)
    write_model_repository(engine_dir, root / "repo", "nextn_stream", decoupled=True, device="cpu", python_env=env)
    srv = triton_server_cls(root / "repo", root)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(engine_dir):
    """LLM.generate's greedy outputs: token-id prompts then the text prompt."""
    llm = LLM(engine_dir, device="cpu")
    return [o.outputs[0] for o in llm.generate(PROMPTS + [TEXT], SamplingParams(max_tokens=MAX_TOKENS))]


def _inputs(client_mod, **arrays):
    out = []
    for name, value in arrays.items():
        arr = np.asarray(value)
        t = client_mod.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def _ids(prompt, max_tokens=MAX_TOKENS, **extra):
    return dict(input_ids=np.array([prompt], np.int32), request_output_len=np.array([[max_tokens]], np.int32), **extra)


class _Stream:
    """One gRPC stream: `send` requests, `get` (result, error, final) in arrival order."""

    def __init__(self, url: str) -> None:
        self.client = grpc.InferenceServerClient(url)
        self.q: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.q.put((result, error)))

    def send(self, model: str, **arrays) -> None:
        self.client.async_stream_infer(model, _inputs(grpc, **arrays), enable_empty_final_response=True)

    def get(self):
        result, error = self.q.get(timeout=TIMEOUT_S)
        final = error is not None or result.get_response().parameters["triton_final_response"].bool_param
        return result, error, final

    def until_final(self) -> list:
        items = [self.get()]
        while not items[-1][2]:
            items.append(self.get())
        return items

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def test_http_token_ids_and_text_equal_generate(server, reference):
    client = http.InferenceServerClient(server.http_url, concurrency=4)
    try:
        pending = [client.async_infer("nextn", _inputs(http, **_ids(p))) for p in PROMPTS]  # concurrent requests
        text = client.async_infer("nextn", _inputs(http, text_input=np.array([[TEXT.encode()]], np.object_),
                                                   max_tokens=np.array([[MAX_TOKENS]], np.int32)))
        for req, ref in zip(pending + [text], reference):
            res = req.get_result(timeout=TIMEOUT_S)
            assert res.as_numpy("output_ids").tolist() == [[ref.token_ids]]
            assert res.as_numpy("sequence_length").tolist() == [[len(ref.token_ids)]]
            assert res.as_numpy("total_draft_tokens").item() == ref.num_draft_tokens > 0  # MTP drafted
            assert res.as_numpy("total_accepted_draft_tokens").item() == ref.num_accepted_draft_tokens
            assert res.as_numpy("acceptance_rate").item() == pytest.approx(ref.draft_acceptance_rate)
        assert ref.text and res.as_numpy("text_output").tolist() == [[ref.text.encode()]]
    finally:
        client.close()


def test_grpc_stream_concatenates_to_generate(server, reference):
    stream = _Stream(server.grpc_url)
    try:
        stream.send("nextn_stream", **_ids(PROMPTS[1], streaming=np.array([[True]])))
        chunks = stream.until_final()
        assert all(err is None for _, err, _ in chunks) and len(chunks) > 1  # one response per engine step
        ids = [t for res, _, _ in chunks for t in res.as_numpy("output_ids")[0, 0].tolist()]
        assert ids == reference[1].token_ids
        assert chunks[-1][0].as_numpy("total_draft_tokens").item() == reference[1].num_draft_tokens
        stream.send("nextn_stream", text_input=np.array([[TEXT.encode()]], np.object_),
                    max_tokens=np.array([[MAX_TOKENS]], np.int32), stream=np.array([[True]]))
        chunks = stream.until_final()
        assert b"".join(res.as_numpy("text_output")[0, 0] for res, _, _ in chunks).decode() == reference[-1].text
        stream.send("nextn_stream", **_ids(PROMPTS[0]))  # decoupled model, stream off: one response
        (res, err, final), = stream.until_final()
        assert err is None and res.as_numpy("output_ids").tolist() == [[reference[0].token_ids]]
    finally:
        stream.close()


def _free_blocks(server, model: str = "nextn_stream") -> int:
    """The engine's free KV blocks, reported in the final response of a one-token request (its own blocks freed)."""
    if model == "nextn":
        with http.InferenceServerClient(server.http_url) as client:
            res = client.infer(model, _inputs(http, **_ids(PROMPTS[0], 1)),
                               outputs=[http.InferRequestedOutput("kv_cache_free_blocks")])
            return int(res.as_numpy("kv_cache_free_blocks").item())
    probe = _Stream(server.grpc_url)
    try:
        probe.client.async_stream_infer("nextn_stream", _inputs(grpc, **_ids(PROMPTS[0], 1)),
                                        outputs=[grpc.InferRequestedOutput("kv_cache_free_blocks")])
        res, err, _ = probe.get()
        assert err is None, err
        return int(res.as_numpy("kv_cache_free_blocks").item())
    finally:
        probe.close()


def test_cancelled_stream_frees_its_kv_blocks(server):
    all_free = _free_blocks(server)
    long = _Stream(server.grpc_url)
    try:  # end_id -1: never stops at EOS; it would run for minutes
        long.send("nextn_stream", **_ids(PROMPTS[1], 1500, streaming=np.array([[True]]),
                                                     end_id=np.array([[-1]], np.int32)))
        for _ in range(2):
            _, err, final = long.get()
            assert err is None and not final
        assert _free_blocks(server) < all_free  # the running stream holds blocks; the probe ran beside it
        _, err, final = long.get()
        assert err is None and not final  # the stream kept going after the probe finished: in-flight batching
    finally:
        long.close(cancel=True)
    deadline = time.monotonic() + 30
    while (free := _free_blocks(server)) != all_free and time.monotonic() < deadline:
        time.sleep(0.2)
    assert free == all_free


def test_bad_requests_get_errors_while_a_good_one_runs(server, reference):
    client = http.InferenceServerClient(server.http_url, concurrency=2)
    try:
        good = client.async_infer("nextn", _inputs(http, **_ids(PROMPTS[2])))
        bad = [
            (dict(input_ids=np.array([[5]], np.int32)), "missing input: give max_tokens"),
            (_ids([5] * 3000), "prompt has 3000 tokens but max_seq_len is"),
            (_ids([5, 10**7]), "outside the vocabulary"),
            (_ids([5], top_p=np.array([[0.0]], np.float32)), "top_p"),
            (_ids([5], temperature=np.array([[-1.0]], np.float32)), "temperature must be ≥ 0"),
            (_ids([5], stream=np.array([[True]])), "streaming needs a decoupled model"),
            (_ids([5], top_k=np.array([[2**31 - 1]], np.int32), temperature=np.array([[1.0]], np.float32)),
             "top_k=2147483647 exceeds the vocabulary"),
            (_ids([5], end_id=np.array([[-2]], np.int32)), "end_id=-2 is outside the vocabulary"),
            (_ids([5], seed=np.array([[2**64 - 1]], np.uint64)), "seed"),
            (dict(text_input=np.array([["x\ud800".encode("utf-8", "surrogatepass")]], np.object_),
                  max_tokens=np.array([[2]], np.int32)), "not valid UTF-8"),
            (dict(input_ids=np.array([[5.0]], np.float32), request_output_len=np.array([[2]], np.int32)), "INT32"),
        ]
        for arrays, match in bad:
            with pytest.raises(InferenceServerException, match=match):
                client.infer("nextn", _inputs(http, **arrays))
        assert good.get_result(timeout=TIMEOUT_S).as_numpy("output_ids").tolist() == [[reference[2].token_ids]]
    finally:
        client.close()
    stream = _Stream(server.grpc_url)
    try:
        stream.send("nextn_stream", **_ids([5], max_tokens=0, streaming=np.array([[True]])))
        (_, err, _), = stream.until_final()
        assert err is not None and "max_tokens must be ≥ 1" in str(err)
        stream.send("nextn_stream", **_ids(PROMPTS[0]))
        (res, err, _), = stream.until_final()
        assert err is None and res.as_numpy("output_ids").tolist() == [[reference[0].token_ids]]
    finally:
        stream.close()


def test_non_decoupled_requests_run_beside_each_other_and_cancel(server, reference):
    all_free = _free_blocks(server, "nextn")
    done: queue.Queue = queue.Queue()
    client = grpc.InferenceServerClient(server.grpc_url)
    try:  # a long unary request: were requests served one execute() at a time, everything below would wait for it
        call = client.async_infer("nextn", _inputs(grpc, **_ids(PROMPTS[1], 1500, end_id=np.array([[-1]], np.int32))),
                                  callback=lambda result, error: done.put((result, error)))
        deadline = time.monotonic() + TIMEOUT_S  # admitted (its blocks taken) before the short one is sent: under
        while _free_blocks(server, "nextn") == all_free and done.empty() and time.monotonic() < deadline:
            time.sleep(0.05)  # load the gRPC call may reach the server after a short HTTP request has finished
        assert done.empty() and _free_blocks(server, "nextn") < all_free, "the long request never ran"
        with http.InferenceServerClient(server.http_url) as short:
            res = short.infer("nextn", _inputs(http, **_ids(PROMPTS[0])))
        assert res.as_numpy("output_ids").tolist() == [[reference[0].token_ids]]
        assert _free_blocks(server, "nextn") < all_free and done.empty()  # the long one is still running
        call.cancel()
        _, error = done.get(timeout=TIMEOUT_S)
        assert error is not None and "CANCELLED" in str(error).upper()
    finally:
        client.close()
    deadline = time.monotonic() + 30
    while (free := _free_blocks(server, "nextn")) != all_free and time.monotonic() < deadline:
        time.sleep(0.2)
    assert free == all_free
