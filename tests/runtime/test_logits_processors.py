"""Logit processing (penalties, logit bias, min_tokens, grammar masks): a verify step's position j, processed from
the state after drafts d1..dj, equals what plain decoding processes after emitting d1..dj — the property that keeps
speculation lossless with processing on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nextn.runtime.logits_processors import RequestProcessor, build_processing
from nextn.runtime.sampling_params import GuidedDecodingParams, SamplingParams
from nextn.speculative.logits_processing import apply_bitmask

V = 64
PENALTIES = SamplingParams(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.5, min_tokens=3,
                           logit_bias={5: 2.0, 9: -1.0})


def _plain(params, prompt, emitted, logits_row, matcher_factory=None):
    """Plain decoding's processed logits [V] after `emitted` tokens: a fresh processor advanced token by token."""
    proc = RequestProcessor(params, prompt, [0], V, matcher_factory() if matcher_factory else None)
    for t in emitted:
        proc.advance([t])
    out = build_processing([(0, proc, [])], 1)
    return logits_row[None, None] if out is None else out.apply(logits_row[None, None])[0, 0]


def test_each_position_is_processed_as_plain_decoding_would():
    gen = torch.Generator().manual_seed(0)
    prompt, generated, drafts = [3, 4, 5, 5], [7, 5], [9, 7, 2]
    logits = torch.randn(1, 4, V, generator=gen)
    proc = RequestProcessor(PENALTIES, prompt, [0], V)
    proc.advance(generated)
    got = build_processing([(0, proc, drafts)], 4).apply(logits)[0]
    for j in range(4):
        want = _plain(PENALTIES, prompt, generated + drafts[:j], logits[0, j])
        torch.testing.assert_close(got[j], want)
    assert got[0, 0] == float("-inf") and got[1, 0] > float("-inf")  # min_tokens 3: EOS masked while 2 + j < 3
    # the processor's own state is unchanged by a step's drafts
    assert proc.num_generated == 2 and proc.counts == {7: 1, 5: 1}


def test_each_term_does_what_its_definition_says():
    logits = torch.linspace(-2, 2, V).view(1, 1, V)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    proc = RequestProcessor(p, [1], [0], V)
    proc.advance([10, 10, 60])
    out = build_processing([(0, proc, [])], 1).apply(logits)[0, 0]
    assert out[10] == pytest.approx(logits[0, 0, 10] - 2 * 0.5 - 0.25)
    assert out[60] == pytest.approx(logits[0, 0, 60] - 0.5 - 0.25)
    assert torch.equal(out[11:60], logits[0, 0, 11:60])
    r = RequestProcessor(SamplingParams(repetition_penalty=2.0), [3, 60], [0], V)  # 3: negative logit, 60: positive
    out = build_processing([(0, r, [])], 1).apply(logits)[0, 0]
    assert out[3] == pytest.approx(2 * logits[0, 0, 3]) and out[60] == pytest.approx(logits[0, 0, 60] / 2)
    assert build_processing([(0, RequestProcessor(SamplingParams(), [1], [0], V), [])], 1) is None


def test_rows_of_a_batch_are_processed_independently():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 2, V, generator=gen)
    a = RequestProcessor(PENALTIES, [1, 2], [0], V)
    a.advance([4, 4, 4])
    out = build_processing([(2, a, [6])], 2).apply(logits)
    assert torch.equal(out[:2], logits[:2])  # rows without processing untouched
    for j, emitted in enumerate([[4, 4, 4], [4, 4, 4, 6]]):
        torch.testing.assert_close(out[2, j], _plain(PENALTIES, [1, 2], emitted, logits[2, j]))


def test_bitmask_masks_exactly_the_clear_bits():
    mask = torch.zeros(1, 2, dtype=torch.int32)
    mask[0, 0] = (1 << 3) - (1 << 31)  # bits 3 and 31 (int32's sign bit)
    mask[0, 1] = 1  # token 32
    out = apply_bitmask(torch.zeros(1, 40), mask)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [3, 31, 32]
    # clear bits past V in one row's last word do not reach the next row (xgrammar's CPU kernel alone masks its
    # token 0)
    rows = torch.tensor([[-1, -1, -1, 15], [-1, -1, -1, -1]], dtype=torch.int32)
    assert torch.isfinite(apply_bitmask(torch.zeros(2, 100), rows)).all()


def test_lazy_rows_keep_the_masked_argmax_and_are_masked_only_where_it_is_refused():
    """A greedy row without log-probabilities needs only the argmax: its masks are asked for after the logits, given
    the unmasked argmax, and applied where returned. Control: every position's argmax equals that of the fully
    masked logits; a row whose argmax is refused everywhere ends up fully masked, one whose argmax stands unmasked."""
    from nextn.speculative.logits_processing import LogitsProcessing

    g = torch.Generator().manual_seed(0)
    b, t, v = 4, 3, 100
    logits = torch.randn(b, t, v, generator=g)
    bits = torch.randint(0, 2, (b, t, v), generator=g, dtype=torch.int64)
    bits[0] = 1  # row 0 allows everything: its unmasked argmax always stands
    bits[1].scatter_(-1, logits[1].argmax(-1)[:, None], 0)  # row 1 refuses its argmax everywhere
    words = (v + 31) // 32
    packed = torch.zeros(b, t, words * 32, dtype=torch.int64)
    packed[..., :v] = bits
    bitmask = (packed.view(b, t, words, 32) << torch.arange(32)).sum(-1).to(torch.int32)  # wraps into int32
    full = logits.masked_fill(bits == 0, float("-inf"))
    assert torch.equal(apply_bitmask(logits, bitmask), full)
    asked = {}

    def masks_for(row):
        def fn(top):
            asked[row] = top
            refused = [j for j in range(len(top)) if bits[row, j, top[j]] == 0]
            if not refused:
                return None
            out = torch.full((t, words), -1, dtype=torch.int32)
            out[refused] = bitmask[row, refused]
            return out
        return fn

    empty = torch.zeros(0, 3, dtype=torch.int64), torch.zeros(0)
    proc = LogitsProcessing(*empty, *empty, torch.zeros(0, dtype=torch.int64), torch.zeros(0, t, words, dtype=torch.int32),
                            tuple((r, masks_for(r)) for r in range(b)))
    out = proc.apply(logits)
    assert torch.equal(out.argmax(-1), full.argmax(-1)) and asked[1] == logits[1].argmax(-1).tolist()
    assert torch.equal(out[1], full[1]) and torch.equal(out[0], logits[0]) and not torch.equal(full[1], logits[1])


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    """xgrammar over the DeepSeek-V3 tokenizer (the tiny checkpoints' own, 129,280-row vocabulary)."""
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from nextn.runtime.guided_decoding import GrammarCompiler
    from nextn.train.tiny_checkpoint import TinyDeepseekSpec, write_tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, TinyDeepseekSpec())
    return GrammarCompiler(AutoTokenizer.from_pretrained(str(d)), 129280, [1])


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}


def test_grammar_masks_of_a_step_equal_the_masks_after_emitting_its_drafts(compiler):
    guided = GuidedDecodingParams(json=SCHEMA)
    text_ids = _encode(compiler, '{"name": "Ada", "n": 36}')
    v = compiler.vocab_size
    params = SamplingParams(guided_decoding=guided)
    step = RequestProcessor(params, [], [1], v, compiler.matcher(guided))
    step.advance(text_ids[:2])
    drafts = text_ids[2:5]
    _, _, masks = step.positions(drafts, 4)
    for j in range(4):
        plain = RequestProcessor(params, [], [1], v, compiler.matcher(guided))
        plain.advance(text_ids[:2 + j])
        _, _, want = plain.positions([], 1)
        assert torch.equal(masks[j], want[0]), j
    # the step left the matcher where it was: the next step sees the same state
    _, _, again = step.positions(drafts, 4)
    assert torch.equal(again, masks)


def test_a_forbidden_draft_is_masked_and_ends_the_walk(compiler):
    guided = GuidedDecodingParams(choice=["yes", "no"])
    proc = RequestProcessor(SamplingParams(guided_decoding=guided), [], [1], compiler.vocab_size,
                            compiler.matcher(guided))
    bad = _encode(compiler, "maybe")[0]
    _, _, masks = proc.positions([bad, bad], 3)
    logits = torch.zeros(1, 3, compiler.vocab_size)
    first = apply_bitmask(logits[0, :1], masks[:1])[0]
    assert first[bad] == float("-inf") and torch.isfinite(first).sum() >= 2
    assert torch.all(masks[1:] == -1)  # unreachable positions: all allowed


def test_a_grammar_that_cannot_compile_is_a_named_error(compiler):
    from nextn.runtime.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError, match="cannot be compiled"):
        compiler.compile(GuidedDecodingParams(grammar="root ::= ("))


def _encode(compiler, text):
    return compiler.hf_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("schema, found", [
    ({"type": "string", "anyOf": [{"maxLength": 2}, {"minLength": 4}]}, "anyOf beside ['type'] at /"),
    ({"allOf": [{"type": "number"}]}, "allOf at /"),
    ({"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}]}}}, "oneOf at /properties/a"),
    ({"required": ["__proto__"]}, "required ['__proto__'] not in properties at /"),
    ({"$ref": "urn:uuid:deadbeef", "$defs": {}}, "non-local $ref 'urn:uuid:deadbeef' at /"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems at /"),
])
def test_schemas_the_grammar_would_under_enforce_are_refused_by_name(compiler, schema, found):
    from nextn.runtime.guided_decoding import unenforced_keywords
    from nextn.runtime.sampling_params import SamplingParamsError

    assert found in unenforced_keywords(schema)
    with pytest.raises(SamplingParamsError, match="cannot enforce"):
        compiler.compile(GuidedDecodingParams(json=schema))


def test_enforced_schemas_pass_the_check():
    from nextn.runtime.guided_decoding import unenforced_keywords

    ok = {"type": "object", "properties": {"allOf": {"type": "string"}, "tags": {"type": "array", "items": {
        "anyOf": [{"type": "string"}, {"type": "integer"}]}}, "kind": {"enum": [{"oneOf": 1}]}},
          "required": ["allOf", "tags"], "$defs": {"x": {"type": "integer"}}}
    assert unenforced_keywords(ok) == []
    assert any("nesting deeper" in f for f in unenforced_keywords(json.loads("[" * 70 + "]" * 70)))


def test_lazy_masks_are_the_step_masks_where_the_argmax_is_refused(compiler):
    """`masks_where_refused` walks the states `positions` does: where a position's argmax is refused its mask is the
    eager one, elsewhere all allowed; the matcher is left where it was."""
    guided = GuidedDecodingParams(json=SCHEMA)
    text_ids = _encode(compiler, '{"name": "Ada", "n": 36}')
    proc = RequestProcessor(SamplingParams(guided_decoding=guided), [], [1], compiler.vocab_size,
                            compiler.matcher(guided))
    assert proc.argmax_only
    proc.advance(text_ids[:2])
    drafts = text_ids[2:5]
    _, _, eager = proc.positions(drafts, 4)
    bad = _encode(compiler, "}")[0]  # refused inside the string
    top = [text_ids[2], bad, text_ids[4], bad]
    allowed = [bool((eager[j, tok // 32] >> (tok % 32)) & 1) for j, tok in enumerate(top)]
    assert allowed[0] and not all(allowed)
    lazy = proc.masks_where_refused(drafts, 4, top)
    for j in range(4):
        assert torch.equal(lazy[j], torch.full_like(lazy[j], -1) if allowed[j] else eager[j]), j
    assert proc.masks_where_refused(drafts, 4, list(text_ids[2:6])) is None  # the text itself: nothing refused
    _, _, again = proc.positions(drafts, 4)
    assert torch.equal(again, eager)
