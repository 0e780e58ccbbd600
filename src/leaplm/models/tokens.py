"""Prompt text to token ids as the ecosystem does it: BOS added when the tokenizer's configuration says so
(`add_bos_token` in tokenizer_config.json, or `tokenizer.ggml.add_bos_token` in a GGUF file, which transformers
carries into the same setting), never twice, and never an EOS; chat messages through the model's template."""
from __future__ import annotations

from ..config import ConfigError


def bos_to_add(tokenizer) -> int | None:
    """The BOS id this tokenizer prepends to a prompt, or None when its configuration adds none.

    Read off the tokenizer itself (the post-processor of a fast tokenizer is the authority, whatever
    attributes say) by encoding one character with and without special tokens."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return bos if with_special[:1] == [bos] and plain[:1] != [bos] else None


def encode_prompt(tokenizer, text: str, bos_id: int | None) -> list[int]:
    """Token ids of `text` with `bos_id` prepended unless the text already starts with it (a chat template
    that writes BOS itself, or a user who typed it)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if bos_id is not None and ids[:1] != [bos_id]:
        ids = [bos_id] + ids
    return ids


PLAIN_TEMPLATE_DOC = """Used when the tokenizer has no chat_template: each message becomes "<role>: <content>" on its
own line, and the prompt ends with "assistant:" for the model to continue."""


def plain_chat_prompt(messages: list[dict]) -> str:
    """The plain template (PLAIN_TEMPLATE_DOC) over {role, content} messages."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def chat_prompt(tokenizer, message: str | list[dict], name: str = "model", plain: bool = False) -> str:
    """The model's chat template applied to one user message (or a list of {role, content} messages), with the
    assistant turn opened: the one place a chat becomes prompt text (the CLI, the Python API and the server call
    it). Without a template: the plain template when `plain` (the server's documented behaviour), else a
    ConfigError naming `chat`."""
    messages = [{"role": "user", "content": message}] if isinstance(message, str) else message
    if not getattr(tokenizer, "chat_template", None):
        if plain:
            return plain_chat_prompt(messages)
        raise ConfigError("chat", f"{name} has no chat template (tokenizer_config.json chat_template or "
                                  f"tokenizer.chat_template in a GGUF file); give a plain prompt instead")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_bos(tokenizer, model_type: str | None, config_bos: int | None = None) -> int | None:
    """bos_to_add, except that a family whose description says prompts must start with BOS (models/arch: Gemma)
    gets the tokenizer's BOS (else the model config's bos_token_id) even where the tokenizer's configuration adds
    none: the model was never trained without it."""
    from .arch import arch_of

    bos = bos_to_add(tokenizer)
    arch = arch_of(model_type)
    if bos is None and arch is not None and arch.bos_required:
        return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else config_bos
    return bos
