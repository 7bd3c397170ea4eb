"""nextn's Triton Python-backend model (`nextn triton-repo` copies this file to `<repo>/<model>/1/model.py`).

A thin adapter over the public `LLM` API. The engine directory and options come from config.pbtxt `parameters`.
`execute` returns at once, handing each request to a thread that parses it with `nextn.serving.triton_io`, submits
it with `LLM.generate_async` and sends its responses through the request's response sender. All requests go through
the one background engine loop, so concurrent requests share engine steps (in-flight batching) in both modes:
- decoupled (`model_transaction_policy { decoupled: true }`): with `stream` true, one response per engine step
  holding the tokens that step accepted (the last one flagged final); otherwise one response with every token;
- non-decoupled: one response with every token.
A watcher thread polls `request.is_cancelled()` and aborts cancelled requests (their KV blocks are freed). A bad
request gets an error response; the model keeps serving.
"""

import json
import threading

import triton_python_backend_utils as pb_utils

from nextn import LLM
from nextn.serving import triton_io

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_CANCEL_POLL_S = 0.05


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.llm = LLM(params["engine_dir"], device=params.get("device") or None,
                       extra_llm_api_options=params.get("extra_llm_api_options") or None)
        self._active = {}  # RequestHandle -> InferenceRequest, for the cancellation watcher
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._watcher = threading.Thread(target=self._watch_cancellations, name="nextn-cancel-watcher", daemon=True)
        self._watcher.start()

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._serve, args=(request,), daemon=True).start()
        return None  # responses go through each request's response sender

    def _serve(self, request):
        """Run one request on its own thread (no event loop here, so the handle is a plain iterator)."""
        sender = request.get_response_sender()
        try:
            inputs = {name: t.as_numpy() for name in triton_io.INPUT_NAMES
                      if (t := pb_utils.get_input_tensor_by_name(request, name)) is not None}
            parsed = triton_io.parse_request(inputs, self.decoupled, self.llm.vocab_size,
                                             self.llm.max_seq_len)
            prompt = triton_io.render_prompt(parsed, self.llm.tokenizer)  # the chat template, when asked
            handle = self.llm.generate_async(prompt, parsed.sampling_params, streaming=parsed.streaming)
        except Exception as e:  # RequestError, TritonRequestError: the client's mistake, said plainly
            code = getattr(pb_utils.TritonError, "INVALID_ARG", None) if isinstance(e, ValueError) else None
            sender.send(_error(f"{type(e).__name__}: {e}", code), flags=_FINAL)
            return
        want_kv = triton_io.KV_FREE_BLOCKS in request.requested_output_names()
        with self._lock:
            self._active[handle] = request
        try:
            for out in handle:  # streaming: one output per engine step; else only the final one
                c = out.outputs[0]
                if out.finished:  # the server frees the request with its final response: stop watching it first
                    self._unwatch(handle)
                if c.finish_reason in ("cancelled", "error"):
                    code = getattr(pb_utils.TritonError, "CANCELLED", None) if c.finish_reason == "cancelled" else None
                    sender.send(_error(c.error or "request cancelled", code), flags=_FINAL)
                    break
                kv = self.llm.num_free_kv_blocks if want_kv else None  # a snapshot; finished requests are freed
                tensors = triton_io.response_tensors(out, delta=parsed.streaming, kv_free_blocks=kv)
                response = pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(k, v) for k, v in tensors.items()])
                sender.send(response, flags=_FINAL if out.finished else 0)
        except Exception as e:  # the client went away mid-stream: nothing left to tell it
            self._unwatch(handle)
            pb_utils.Logger.log_warn(f"nextn: response for request {handle.request_id} not sent: {e}")
            handle.abort()

    def _unwatch(self, handle):
        with self._lock:
            self._active.pop(handle, None)

    def _watch_cancellations(self):
        while not self._stopped.wait(_CANCEL_POLL_S):
            with self._lock:  # held while asking: a request is unwatched before its final response frees it
                cancelled = [handle for handle, request in self._active.items() if request.is_cancelled()]
                for handle in cancelled:
                    del self._active[handle]
            for handle in cancelled:
                handle.abort()  # the engine frees its KV blocks; `_serve` sends the final response

    def finalize(self):
        self._stopped.set()
        self.llm.shutdown()


def _error(message, code=None):
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(error=error)
