"""Chat templates with a thinking switch (Qwen3's enable_thinking) are rendered with it off, by the harness's prompts
and by the server's chat endpoint; templates without the switch get no extra variable."""
from __future__ import annotations

import pytest

from systems.openai_api import chat_prompt
from tasks.base import chat_prompt_ids, chat_template_kwargs

# Qwen3's rule in miniature: with enable_thinking false the assistant turn opens with an empty, closed think block
THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
            "{% endif %}")
PLAIN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture()
def tok(tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_a_thinking_template_renders_with_thinking_off(tok):
    tok.chat_template = THINKING
    assert chat_template_kwargs(tok) == {"enable_thinking": False}
    text = tok.decode(chat_prompt_ids(tok, "What is two plus two?"))
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    served = tok.decode(chat_prompt({"messages": [{"role": "user", "content": "What is two plus two?"}]}, tok))
    assert served == text


def test_a_template_without_the_switch_is_rendered_as_before(tok):
    tok.chat_template = PLAIN
    assert chat_template_kwargs(tok) == {}
    text = tok.decode(chat_prompt_ids(tok, "Hello"))
    assert text.endswith("<|im_start|>assistant\n") and "<think>" not in text
