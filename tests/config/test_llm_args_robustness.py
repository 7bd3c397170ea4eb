"""Issue 12 item 8: LLM-argument YAML that is deeply nested, not UTF-8, a device file or a pipe, huge, or holds
non-finite floats or absurd ints gets a named error (never a RecursionError, a hang or a later crash)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nextn.config.llm_args import LlmArgsError, load_llm_args_yaml, parse_llm_args


def _write(tmp_path: Path, data: bytes | str) -> Path:
    p = tmp_path / "opts.yaml"
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return p


@pytest.mark.parametrize("text,fragment", [
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nested"),
    ("max_batch_size: " + "[" * 40 + "1" + "]" * 40 + "\n", "nested more than 32"),
    ("kv_cache_config: {free_gpu_memory_fraction: .nan}\n", "free_gpu_memory_fraction"),
    ("speculative_config: {decoding_type: MTP, relaxed_delta: .inf}\n", "relaxed_delta"),
    ("max_seq_len: 100000000000000000000\n", "max_seq_len"),
    ("cuda_graph_config: {batch_sizes: [1, 4294967296]}\n", "out of range"),
    ("max_batch: 4\n", "unknown key 'max_batch'"),
    ("a: &a [1, 2]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
     "d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n"
     "f: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n", "more than 100000"),
])
def test_bad_yaml_content_is_a_named_error(tmp_path, text, fragment):
    with pytest.raises(LlmArgsError, match=fragment):
        load_llm_args_yaml(_write(tmp_path, text))


def test_yaml_that_is_not_utf8_is_named(tmp_path):
    with pytest.raises(LlmArgsError, match="not UTF-8.*0xff"):
        load_llm_args_yaml(_write(tmp_path, b"max_seq_len: 64\n# \xff\xfe\n"))


def test_huge_yaml_is_refused_without_reading_it_all(tmp_path):
    with pytest.raises(LlmArgsError, match="larger than 1048576 bytes"):
        load_llm_args_yaml(_write(tmp_path, "# " + "x" * (2 << 20) + "\n"))


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/null", "/dev/stdin"])
def test_device_files_are_refused_without_reading(path):
    if not os.path.exists(path) or Path(path).is_file():
        pytest.skip(f"{path} is absent or a regular file here")
    with pytest.raises(LlmArgsError, match="not a regular file"):
        load_llm_args_yaml(path)


def test_a_fifo_and_a_directory_are_refused(tmp_path):
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(LlmArgsError, match="not a regular file"):
        load_llm_args_yaml(fifo)  # would block forever if opened
    with pytest.raises(LlmArgsError, match="not a regular file"):
        load_llm_args_yaml(tmp_path)
    with pytest.raises(LlmArgsError, match="must be a path"):
        load_llm_args_yaml(3)


def test_programmatic_arguments_are_bounded_too():
    deep: dict = {}
    cur = deep
    for _ in range(2000):
        cur["x"] = {}
        cur = cur["x"]
    with pytest.raises(LlmArgsError, match="nested"):
        parse_llm_args({"speculative_config": deep})
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(LlmArgsError):
        parse_llm_args({"moe_config": loop})
    with pytest.raises(LlmArgsError, match="mapping"):
        parse_llm_args(["max_seq_len", 3])  # type: ignore[arg-type]
    assert parse_llm_args({"max_seq_len": 2048, "kv_cache_config": {"free_gpu_memory_fraction": 0.5}}).max_seq_len == 2048


def test_relaxed_delta_is_a_probability_gap():
    # issue 32: relaxed_delta 1e300 became inf in fp32 and failed every thinking request
    from nextn.config.llm_args import parse_llm_args

    spec = {"decoding_type": "MTP", "use_relaxed_acceptance_for_thinking": True}
    assert parse_llm_args({"speculative_config": {**spec, "relaxed_delta": 1.0}}).speculative_config.relaxed_delta == 1
    for bad in (1e300, 1.5):
        with pytest.raises(LlmArgsError, match="relaxed_delta"):
            parse_llm_args({"speculative_config": {**spec, "relaxed_delta": bad}})


def test_a_yaml_integer_of_over_4300_digits_is_a_named_error(tmp_path):
    # issue 32: a traceback (ValueError from int()) before
    from nextn.config.llm_args import load_llm_args_yaml

    f = tmp_path / "a.yaml"
    f.write_text("max_batch_size: " + "9" * 5000 + "\n")
    with pytest.raises(LlmArgsError, match="refuses to read"):
        load_llm_args_yaml(f)
