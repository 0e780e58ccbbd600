"""protocol.py and the error mapping, without a server."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from leaplm.server.errors import validation_error
from leaplm.server.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, chat_prompt,
                                    plain_chat_prompt)


def msgs(*pairs):
    return [ChatMessage(role=r, content=c) for r, c in pairs]


def test_plain_template_is_the_documented_one():
    m = msgs(("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "bye"))
    assert plain_chat_prompt(m) == "system: be brief\nuser: hi\nassistant: hello\nuser: bye\nassistant:"


def test_chat_prompt_prefers_the_tokenizers_template():
    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return "|".join(m["content"] for m in messages)

    class NoTemplate:
        chat_template = None

    m = msgs(("user", "a"), ("user", "b"))
    assert chat_prompt(Tok(), m) == "a|b"
    assert chat_prompt(NoTemplate(), m) == plain_chat_prompt(m)


def test_text_parts_are_joined():
    m = ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    assert m.text() == "ab"


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"model": "m", "prompt": "x", "nope": 1}, "nope"),
    ({"model": "m", "prompt": "x", "presence_penalty": 1}, "presence_penalty"),
    ({"model": "m", "prompt": "", "n": 1}, "prompt"),
    ({"prompt": "x"}, "model"),
])
def test_validation_errors_name_the_field(body, param):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate(body)
    err = validation_error(e.value.errors())
    assert err.status == 400 and err.param == param and param in err.message


def test_nested_locations_are_rendered_like_openai_params():
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "a"},
                                                                         {"role": "robot", "content": "b"}]})
    err = validation_error(e.value.errors())
    assert err.param == "messages[1].role" and "robot" in err.message


def test_sampling_params_come_from_the_request():
    r = CompletionRequest.model_validate({"model": "m", "prompt": "x", "temperature": 0, "top_k": 5, "stop": "\n",
                                          "repetition_penalty": 1.1, "ignore_eos": True})
    p = r.sampling_params(7, 2, 42)
    assert (p.max_new_tokens, p.temperature, p.top_k, p.stop, p.repetition_penalty, p.ignore_eos, p.logprobs,
            p.seed) == (7, 0, 5, ["\n"], 1.1, True, 2, 42)
