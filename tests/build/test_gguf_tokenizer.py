"""GGUF tokenizers (`nextn.build.gguf_tokenizer`) against `transformers`' own GGUF loader, on the real prompt sets.

The engine's tokenizer is what `write_tokenizer_files` saves, reloaded the way the runtime loads it
(`EngineTokenizer.load`); the reference is `AutoTokenizer.from_pretrained(dir, gguf_file=name)`.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import gguf
import pytest

from nextn.build.checkpoint import CheckpointError
from nextn.build.gguf_tokenizer import GGUFTokenizerMetadata, build_tokenizer, write_tokenizer_files
from nextn.runtime.tokenizer import ChatTemplateError, ChatTemplateLimitError, EngineTokenizer, eos_token_ids

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "data"
SMOLLM2 = SHARED / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
STORIES = SHARED / "models" / "stories260K" / "stories260K.gguf"
QWEN = ROOT / "runs" / "models" / "qwen2.5-coder-0.5b" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
FETCH_QWEN = "python ../shared/models/fetch_models.py qwen2.5-coder-0.5b --dest runs/models"


def all_prompts() -> list[str]:
    """Every prompt of ../shared/data/prompts: MT-bench and Spec-Bench turns, GSM8K questions, HumanEval prompts."""
    d = SHARED / "prompts"
    rows = lambda name: [json.loads(line) for line in (d / name).read_text().splitlines() if line.strip()]  # noqa: E731
    prompts = [t for name in ("mt_bench.jsonl", "spec_bench.jsonl") for r in rows(name) for t in r["turns"]]
    prompts += [r["question"] for r in rows("gsm8k_test.jsonl")]
    with gzip.open(d / "humaneval.jsonl.gz", "rt") as f:
        prompts += [json.loads(line)["prompt"] for line in f if line.strip()]
    return prompts


def conversations(prompts: list[str]) -> list[list[dict]]:
    """One user turn, a system prompt, and a second turn after an assistant answer (MT-bench's two turns)."""
    d = SHARED / "prompts" / "mt_bench.jsonl"
    turns = [json.loads(line)["turns"] for line in d.read_text().splitlines() if line.strip()][:8]
    convs = [[{"role": "user", "content": p}] for p in prompts[:8]]
    convs += [[{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": t[0]}]
              for t in turns]
    convs += [[{"role": "user", "content": t[0]}, {"role": "assistant", "content": "Here is my answer."},
               {"role": "user", "content": t[1]}] for t in turns]
    return convs


class Pair:
    """The engine's tokenizer (saved, then loaded as the runtime loads it) and transformers' GGUF tokenizer."""

    def __init__(self, path: Path, out: Path) -> None:
        from transformers import AutoTokenizer

        reader = gguf.GGUFReader(str(path))
        self.meta = GGUFTokenizerMetadata(reader, path)
        self.files = write_tokenizer_files(reader, path, out)
        self.generation_config = json.loads((out / "generation_config.json").read_text())
        self.ours = EngineTokenizer.load(out, self.files)
        self.ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    if not (SHARED / "prompts" / "mt_bench.jsonl").is_file():
        pytest.skip(f"../shared/data is absent ({SHARED}): the prompt sets are not available")
    return all_prompts()


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Pair:
    if not SMOLLM2.is_file():
        pytest.skip(f"SmolLM2 GGUF is absent ({SMOLLM2}): ../shared/data is not checked out")
    return Pair(SMOLLM2, tmp_path_factory.mktemp("smollm2_tok"))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Pair:
    if not QWEN.is_file():
        pytest.skip(f"Qwen2.5-Coder-0.5B GGUF not fetched ({QWEN}): run `{FETCH_QWEN}`")
    return Pair(QWEN, tmp_path_factory.mktemp("qwen_tok"))


def check_equal_to_transformers(pair: Pair, prompts: list[str]) -> None:
    ours = pair.ours.tok(prompts)["input_ids"]
    ref = pair.ref(prompts)["input_ids"]
    bad = [i for i in range(len(prompts)) if ours[i] != ref[i]]
    assert not bad, f"{len(bad)}/{len(prompts)} prompts encode differently, first: {prompts[bad[0]][:80]!r}"
    assert [pair.ours.encode(p) for p in prompts[:20]] == ref[:20]  # the runtime's encode, one prompt at a time
    for p, ids in zip(prompts, ours):
        assert pair.ours.decode(ids) == p == pair.ref.decode(ids, skip_special_tokens=True)
    for conv in conversations(prompts):
        assert pair.ours.apply_chat_template(conv) == pair.ref.apply_chat_template(
            conv, add_generation_prompt=True, return_dict=False), conv


@pytest.mark.slow
def test_smollm2_bpe_equals_transformers_on_every_prompt(smollm2: Pair, prompts: list[str]) -> None:
    assert smollm2.meta.tokenizer_dict["tokenizer_type"] == "gpt2"  # byte-level BPE, pre-tokenizer "smollm"
    assert smollm2.files == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    assert len(prompts) > 2000
    check_equal_to_transformers(smollm2, prompts)


@pytest.mark.slow
def test_smollm2_chat_template_and_end_of_turn(smollm2: Pair) -> None:
    tok = smollm2.ours
    assert tok.chat_template == smollm2.ref.chat_template  # tokenizer.chat_template, stored in the engine
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    text = tok.tok.decode(ids)
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"), text
    assert ids.count(1) == 3  # <|im_start|> (id 1) opens the default system turn, the user's and the assistant's
    # EOS is <|im_end|> (tokenizer.ggml.eos_token_id 2); <|endoftext|> (0) ends generation too, as in llama.cpp.
    assert smollm2.generation_config["eos_token_id"] == [2, 0]
    assert tok.tok.convert_ids_to_tokens([2, 0]) == ["<|im_end|>", "<|endoftext|>"]


@pytest.mark.slow
def test_qwen_bpe_equals_transformers_on_every_prompt(qwen: Pair, prompts: list[str]) -> None:
    assert qwen.meta.tokenizer_dict["pre_tokenizer_type"] == "qwen2"
    check_equal_to_transformers(qwen, prompts)
    # HF's generation_config.json of Qwen2.5-Coder-Instruct: eos_token_id [151645, 151643].
    assert qwen.generation_config["eos_token_id"] == [151645, 151643]


def test_stories260k_sentencepiece(prompts: list[str], tmp_path: Path) -> None:
    """SentencePiece-style: merges recovered from the scores, BOS added; the padding id 0xFFFFFFFF is dropped
    (transformers' own GGUF tokenizer loader raises IndexError on it)."""
    if not STORIES.is_file():
        pytest.skip(f"stories260K GGUF is absent ({STORIES})")
    reader = gguf.GGUFReader(str(STORIES))
    files = write_tokenizer_files(reader, STORIES, tmp_path)
    assert files == ["tokenizer.json", "tokenizer_config.json"]
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": [2]}
    tok = EngineTokenizer.load(tmp_path, files)
    ids = tok.encode("Once upon a time, there was a little girl named Lily.\nShe said, \"Hi!\"")
    assert ids[:4] == [1, 403, 407, 261] and 13 in ids  # BOS, "Once", " upon", " a"; "\n" is byte token <0x0A>
    assert all(tok.decode(tok.encode(p)) == p for p in prompts)  # byte fallback: every prompt round-trips
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="{{ messages[0].content }}") \
        == tok.tok.encode("hi", add_special_tokens=False)


def write_metadata_gguf(path: Path, model: str, tokens: list[str], types: list[int], **ids: int) -> Path:
    """A GGUF holding only tokenizer metadata (no tensors), as llama.cpp's gguf writer lays it out."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores([0.0] * len(tokens))
    for key, value in ids.items():
        w.add_uint32(f"tokenizer.ggml.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_tokenizer_kind_names_the_supported_ones(tmp_path: Path) -> None:
    path = write_metadata_gguf(tmp_path / "m.gguf", "bert", ["[PAD]", "a"], [3, 1])
    with pytest.raises(CheckpointError, match=r"m\.gguf.*'bert'.*gpt2.*llama"):
        build_tokenizer(gguf.GGUFReader(str(path)), path)


def test_end_of_generation_ids_follow_llama_cpp(tmp_path: Path) -> None:
    """EOS first, then EOT, then control tokens spelled as an end of turn; "no such token" and normal tokens not."""
    tokens = ["<unk>", "<s>", "</s>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|im_end|>x", "▁a"]
    types = [2, 3, 3, 3, 3, 1, 3, 1]  # <|eot_id|> here is a normal token: not an end of generation
    path = write_metadata_gguf(tmp_path / "m.gguf", "llama", tokens, types, bos_token_id=1, eos_token_id=2,
                               eot_token_id=4, padding_token_id=2**32 - 1)
    meta = GGUFTokenizerMetadata(gguf.GGUFReader(str(path)), path)
    assert meta.eos_token_ids() == [2, 4, 3]
    assert "pad_token" not in meta.tokenizer_config and meta.tokenizer_config["eos_token"] == "</s>"


def test_no_tokenizer_metadata_is_a_clear_error(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    with pytest.raises(CheckpointError, match="no tokenizer"):
        GGUFTokenizerMetadata(gguf.GGUFReader(str(tmp_path / "m.gguf")), tmp_path / "m.gguf")


def test_eos_ids_are_the_union_of_config_and_generation_config(tmp_path: Path) -> None:
    assert eos_token_ids(tmp_path, 2) == {2}  # no generation_config.json
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [151645, 151643]}')
    assert eos_token_ids(tmp_path, 151645) == {151645, 151643}
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 7}')
    assert eos_token_ids(tmp_path, [1, 2]) == {1, 2, 7}
    (tmp_path / "generation_config.json").write_text("not json")
    assert eos_token_ids(tmp_path, None) == frozenset()


def write_template_gguf(path: Path, template: str) -> Path:
    """A SentencePiece-style tokenizer-only GGUF whose `tokenizer.chat_template` is `template`."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>", "▁a", "a"])
    w.add_token_types([2, 3, 3, 1, 1])
    w.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0])
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_chat_template(template)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    return path


@pytest.mark.parametrize("template, fragment", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "within 5 s"),
    ("{{ 'x' * (2*10**9) }}", "cap of"),
    ("{% set ns = namespace(s='x') %}{% for i in range(31) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "cap"),
])
def test_a_chat_template_that_passes_the_render_budget_is_refused_before_writing(tmp_path, template, fragment):
    """build-engine renders the GGUF's template once with sample conversations under the runtime's budget (5 s,
    16 Mi characters, 1 GiB): one that passes it is a ChatTemplateLimitError naming the file, and no tokenizer file
    is written."""
    path = write_template_gguf(tmp_path / "m.gguf", template)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ChatTemplateLimitError, match=rf"m\.gguf \(tokenizer\.chat_template\).*{fragment}"):
        write_tokenizer_files(gguf.GGUFReader(str(path)), path, out)
    assert list(out.iterdir()) == []


def test_a_chat_template_that_refuses_the_sample_is_still_built(tmp_path):
    """Only the budget is enforced at build time: a template's own checks (here: no system role) are its business."""
    template = ("{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    path = write_template_gguf(tmp_path / "m.gguf", template)
    files = write_tokenizer_files(gguf.GGUFReader(str(path)), path, tmp_path)
    tok = EngineTokenizer.load(tmp_path, files)
    assert tok.render_chat([{"role": "user", "content": "a a"}]) == "a a"
