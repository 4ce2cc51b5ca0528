"""Chat templates are sandboxed; detokenization never emits broken UTF-8."""
import pytest

from chat.detok import IncrementalDecoder
from chat.template import ChatTemplate, TemplateError


def test_renders_chatml():
    t = ChatTemplate(None)
    assert t.render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_sandbox_blocks_attribute_escape():
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TemplateError):
        ChatTemplate(evil).render([])


def test_raise_exception_is_a_clean_error():
    with pytest.raises(TemplateError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}").render([])


def test_syntax_error_names_line():
    with pytest.raises(TemplateError, match="line 2"):
        ChatTemplate("ok\n{% for %}")


@pytest.mark.slow
def test_incremental_decoder_holds_partial_characters(smollm2):
    text = "emoji 😀🎉 naïve 日本語 done"
    ids = smollm2.tokenizer.encode(text, add_special_tokens=False).ids
    dec = IncrementalDecoder(smollm2.tokenizer)
    chunks = [dec.push(i) for i in ids] + [dec.flush()]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == text
