"""Triton request parsing / response tensors (`nextn.serving.triton_io`) and the repository writer, without a server."""

from __future__ import annotations

import re

import numpy as np
import pytest

from nextn.cli.main import main
from nextn.runtime.outputs import CompletionOutput, RequestOutput
from nextn.serving import triton_io
from nextn.serving.triton_io import TritonRequestError, parse_request, response_tensors
from nextn.serving.triton_repo import config_pbtxt, write_model_repository


def i32(*v):
    return np.array([list(v)], dtype=np.int32)


def test_token_id_request_in_tensorrt_llm_names():
    parsed = parse_request({"input_ids": i32(5, 9, 13), "input_lengths": i32(3), "request_output_len": i32(7),
                            "runtime_top_k": i32(4), "runtime_top_p": np.array([[0.5]], np.float32),
                            "temperature": np.array([[0.7]], np.float32), "seed": np.array([[2**40]], np.uint64),
                            "end_id": i32(2), "streaming": np.array([[True]])}, decoupled=True)
    assert parsed.prompt == [5, 9, 13] and parsed.streaming
    sp = parsed.sampling_params
    assert (sp.max_tokens, sp.top_k, sp.top_p, sp.seed, sp.end_id) == (7, 4, 0.5, 2**40, 2)
    assert sp.temperature == pytest.approx(0.7)


def test_text_request_in_ensemble_names_with_defaults():
    parsed = parse_request({"text_input": np.array([["héllo".encode()]], dtype=np.object_), "max_tokens": i32(3)},
                           decoupled=False)
    assert parsed.prompt == "héllo" and not parsed.streaming
    sp = parsed.sampling_params
    assert (sp.temperature, sp.top_k, sp.seed) == (0, 0, None)
    unbatched = parse_request({"input_ids": np.array([1, 2], np.int32), "max_tokens": np.array([4], np.int32),
                               "stream": np.array([False])}, decoupled=False)
    assert unbatched.prompt == [1, 2] and unbatched.sampling_params.max_tokens == 4


@pytest.mark.parametrize("inputs, match", [
    ({"input_ids": i32(1)}, "missing input: give max_tokens"),
    ({"max_tokens": i32(3)}, "exactly one prompt"),
    ({"input_ids": i32(1), "text_input": np.array([[b"a"]], np.object_), "max_tokens": i32(3)}, "exactly one prompt"),
    ({"input_ids": i32(1), "max_tokens": i32(3), "request_output_len": i32(3)}, "either max_tokens or request_outp"),
    ({"input_ids": i32(1), "max_tokens": i32(3), "top_k": i32(1), "runtime_top_k": i32(1)}, "either top_k or runtime"),
    ({"input_ids": np.array([[1.0]], np.float32), "max_tokens": i32(3)}, "input_ids must be an integer"),
    ({"input_ids": i32(1), "max_tokens": np.array([[b"3"]], np.object_)}, "max_tokens must be an integer"),
    ({"input_ids": i32(1), "max_tokens": i32(3), "temperature": i32(1)}, "temperature must be a float"),
    ({"input_ids": np.array([[1, 2], [3, 4]], np.int32), "max_tokens": i32(3)}, "batch size 2"),
    ({"input_ids": i32(1), "max_tokens": i32(3, 4)}, "one value per request"),
    ({"input_ids": i32(1, 2), "input_lengths": i32(3), "max_tokens": i32(3)}, "input_lengths says 3"),
    ({"text_input": np.array([[b"\xff\xfe"]], np.object_), "max_tokens": i32(3)}, "not valid UTF-8"),
    ({"input_ids": i32(1), "max_tokens": i32(0)}, "max_tokens must be ≥ 1"),
    ({"input_ids": i32(1), "max_tokens": i32(3), "top_p": np.array([[0.0]], np.float32)}, "top_p"),
    ({"input_ids": i32(1), "max_tokens": i32(3), "temperature": np.array([[np.nan]], np.float32)}, "temperature"),
    ({"input_ids": i32(1), "max_tokens": i32(3), "seed": np.array([[2**63]], np.uint64)}, "seed must be in"),
    ({"input_ids": i32(1), "max_tokens": i32(3), "stream": np.array([[True]])}, "streaming needs a decoupled model"),
    ({"input_ids": i32(1), "max_tokens": i32(3), "beam_width": i32(2)}, r"unknown inputs \['beam_width'\]"),
])
def test_bad_requests_name_the_problem(inputs, match):
    with pytest.raises(TritonRequestError, match=match):
        parse_request(inputs, decoupled=False)


def _output(token_ids, diff, text, text_diff, finished, logprobs=None):
    c = CompletionOutput(token_ids=token_ids, text=text, num_draft_tokens=6, num_accepted_draft_tokens=3,
                         token_ids_diff=diff, text_diff=text_diff, finish_reason="length" if finished else None,
                         logprobs=logprobs)
    return RequestOutput(0, None, [1], [c], finished=finished)


def test_response_tensors_final_and_delta():
    from nextn.runtime.outputs import TokenLogprob

    lps = [TokenLogprob(4, -0.5), TokenLogprob(5, -0.25), TokenLogprob(6, -2.0)]
    out = _output([4, 5, 6], [5, 6], "abc", "bc", True, lps)  # a step that accepted a draft emits two tokens
    full = response_tensors(out, delta=False)
    assert full["output_log_probs"].dtype == np.float32 and full["output_log_probs"].tolist() == [[[-0.5, -0.25, -2.0]]]
    assert "output_log_probs" not in response_tensors(_output([4], [4], "a", "a", False), delta=False)
    assert full["output_ids"].dtype == np.int32 and full["output_ids"].tolist() == [[[4, 5, 6]]]
    assert full["sequence_length"].tolist() == [[3]] and full["text_output"].tolist() == [[b"abc"]]
    assert full["acceptance_rate"].dtype == np.float32 and full["acceptance_rate"].tolist() == [[0.5]]
    assert full["total_accepted_draft_tokens"].tolist() == [[3]] and full["total_draft_tokens"].tolist() == [[6]]
    assert triton_io.KV_FREE_BLOCKS not in full
    delta = response_tensors(out, delta=True, kv_free_blocks=17)
    assert delta["output_ids"].tolist() == [[[5, 6]]] and delta["sequence_length"].tolist() == [[2]]
    assert delta["text_output"].tolist() == [[b"bc"]] and delta[triton_io.KV_FREE_BLOCKS].tolist() == [[17]]
    assert delta["output_log_probs"].tolist() == [[[-0.25, -2.0]]]
    assert set(delta) == {s.name for s in triton_io.OUTPUTS}  # every declared output is produced


def test_penalties_log_probs_and_guided_decoding_inputs():
    def req(**extra):
        base = dict(input_ids=np.array([[5, 6]], np.int32), request_output_len=np.array([[4]], np.int32))
        return parse_request({**base, **extra}, decoupled=False)

    sp = req(presence_penalty=np.array([[0.5]], np.float32), frequency_penalty=np.array([[0.25]], np.float32),
             repetition_penalty=np.array([[1.5]], np.float32), min_tokens=np.array([[2]], np.int32),
             return_log_probs=np.array([[True]])).sampling_params
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_tokens, sp.logprobs) == (
        0.5, 0.25, 1.5, 2, 0)
    guided = req(guided_decoding_guide_type=np.array([[b"json_schema"]], np.object_),
                 guided_decoding_guide=np.array([[b'{"type": "object"}']], np.object_)).sampling_params
    assert guided.guided_decoding.json_schema == '{"type": "object"}'
    assert req(guided_decoding_guide_type=np.array([[b"json"]], np.object_)).sampling_params.guided_decoding.json_object
    with pytest.raises(TritonRequestError, match="is not one of"):
        req(guided_decoding_guide_type=np.array([[b"xml"]], np.object_))
    with pytest.raises(TritonRequestError, match="needs guided_decoding_guide_type"):
        req(guided_decoding_guide=np.array([[b"a"]], np.object_))
    with pytest.raises(TritonRequestError, match="presence_penalty"):
        req(presence_penalty=np.array([[5.0]], np.float32))


def test_config_pbtxt_declares_tensorrt_llm_names():
    text = config_pbtxt("m", {"engine_dir": '/a "b"'}, decoupled=True, max_batch_size=8)
    assert 'backend: "python"' in text and "max_batch_size: 8" in text and "decoupled: true" in text
    assert "kind: KIND_CPU" in text and 'string_value: "/a \\"b\\""' in text
    for spec in triton_io.INPUTS:
        assert re.search(rf'name: "{spec.name}", data_type: {spec.data_type}, dims: \[ [-0-9, ]+ \], optional: true',
                         text), spec.name
    assert 'name: "output_ids", data_type: TYPE_INT32, dims: [ -1, -1 ]' in text
    assert "decoupled: false" in config_pbtxt("m", {})
    with pytest.raises(ValueError, match="max_batch_size"):
        config_pbtxt("m", {}, max_batch_size=0)


def test_triton_repo_cli_writes_the_repository(checkpoints, tmp_path, capsys):
    engine = checkpoints.engine(distill_steps=0)
    assert main(["triton-repo", "--engine_dir", str(engine), "--output_dir", str(tmp_path / "repo"), "--model_name",
                 "llm", "--decoupled", "--device", "cpu", "--python_env", "none"]) == 0
    config = (tmp_path / "repo" / "llm" / "config.pbtxt").read_text()
    assert f'key: "engine_dir" value {{ string_value: "{engine.resolve()}" }}' in config
    assert "decoupled: true" in config and 'key: "device"' in config and "EXECUTION_ENV_PATH" not in config
    model_py = (tmp_path / "repo" / "llm" / "1" / "model.py").read_text()
    assert "class TritonPythonModel" in model_py and "generate_async" in model_py
    assert "--http-restricted-api=inference,metadata" in capsys.readouterr().out  # the API-key hint (issue 12)
    assert main(["triton-repo", "--engine_dir", str(tmp_path), "--output_dir", str(tmp_path / "r2")]) == 2
    assert "triton-repo: error" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="bin/activate"):
        write_model_repository(engine, tmp_path / "r3", python_env=tmp_path)
    with pytest.raises(ValueError, match="invalid model name"):
        write_model_repository(engine, tmp_path / "r3", model_name="a/b")


@pytest.mark.parametrize("inputs, match", [
    ({"input_ids": i32(1), "max_tokens": i32(3), "top_k": i32(2**31 - 1)}, "top_k=2147483647 exceeds the vocabulary"),
    ({"input_ids": i32(1), "max_tokens": i32(3), "runtime_top_k": i32(513)}, "top_k=513 exceeds the vocabulary"),
    ({"input_ids": i32(1), "max_tokens": i32(3), "end_id": i32(-2)}, r"end_id=-2 is outside the vocabulary \[0, 512\)"),
    ({"input_ids": i32(1), "max_tokens": i32(3), "end_id": i32(512)}, "end_id=512 is outside the vocabulary"),
    ({"input_ids": i32(1, -5, 512), "max_tokens": i32(3)}, r"token ids \[-5, 512\] are outside the vocabulary"),
    ({"input_ids": np.zeros((1, 64), np.int32), "max_tokens": i32(3)}, "64 tokens but max_seq_len is 64"),
    ({"text_input": np.array([[b"a" * (32 * 64 + 1)]], np.object_), "max_tokens": i32(3)}, "2049 characters"),
    ({"text_input": np.array([["\ud800"]], np.str_), "max_tokens": i32(3)}, "not valid UTF-8"),
    ({"text_input": np.array([["x\ud800".encode("utf-8", "surrogatepass")]], np.object_), "max_tokens": i32(3)},
     "not valid UTF-8"),
    ({"input_ids": i32(1), "max_tokens": i32(3), "seed": np.array([[2**64 - 1]], np.uint64)}, "seed must be in"),
    ({"input_ids": i32(1), "max_tokens": i32(3), "top_p": np.array([[np.inf]], np.float32)}, "top_p"),
])
def test_engine_limits_are_checked_before_the_engine(inputs, match):
    """Issue 12 items 2 and 8: every field bounded by the engine's vocabulary and max_seq_len, by name."""
    with pytest.raises(TritonRequestError, match=match):
        parse_request(inputs, decoupled=False, vocab_size=512, max_seq_len=64)
    ok = parse_request({"input_ids": i32(0, 511), "max_tokens": i32(3), "top_k": i32(512), "end_id": i32(511)},
                       decoupled=False, vocab_size=512, max_seq_len=64)
    assert ok.prompt == [0, 511] and ok.sampling_params.top_k == 512


def test_end_id_minus_one_means_no_end_token():
    """TensorRT-LLM's convention (the Triton tests' long requests rely on it): end_id -1 → stop at max_tokens only."""
    sp = parse_request({"input_ids": i32(1), "max_tokens": i32(3), "end_id": i32(-1)}, decoupled=False,
                       vocab_size=512).sampling_params
    assert sp.ignore_eos and sp.end_id is None
