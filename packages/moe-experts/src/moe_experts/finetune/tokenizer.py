"""The built-in model's tokenizer as a real Hugging Face tokenizer with a small chat template.

Ids 0-255 are the UTF-8 bytes themselves and 256-258 are BOS, EOS and PAD, so the tokenizer
needs no vocabulary file or download and agrees with :class:`ByteTokenizer` token for token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["TINY_CHAT_TEMPLATE", "build_byte_tokenizer", "save_byte_tokenizer"]

# Role markers are plain bytes, so the template adds no tokens to the 259-entry vocabulary; an
# assistant turn ends with EOS, which is what generation stops on.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def build_byte_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast`` over bytes (ids 0-255) plus ``<s>``, ``</s>``, ``<pad>``.

    Encoding prepends BOS (as :meth:`ByteTokenizer.encode` does); callers append EOS.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    vocab.update({"<s>": 256, "</s>": 257, "<pad>": 258})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no merges: every byte is one token, whatever the text.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 256)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def save_byte_tokenizer(directory: Path) -> None:
    """Write the byte tokenizer (with its chat template) into a model directory."""
    build_byte_tokenizer().save_pretrained(directory)
