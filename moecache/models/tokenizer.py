"""A deterministic byte-level tokenizer for the tiny random-weight models, built offline.

Every UTF-8 byte is one token (id = byte value, 0..255), after NFC normalisation (as Qwen's own
tokenizer does, so the tokenizer built here and the one `AutoTokenizer` loads for a `qwen3_5_moe`
folder encode identically). Special tokens follow at ids 256.. and a ChatML chat template makes
`apply_chat_template` work as it does for a real chat checkpoint.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

NUM_BYTE_TOKENS = 256
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = range(NUM_BYTE_TOKENS, NUM_BYTE_TOKENS + len(SPECIAL_TOKENS))

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tiny_token_ids() -> dict[str, int]:
    """Token-id fields for a tiny model config that uses this tokenizer."""
    return {"bos_token_id": ENDOFTEXT_ID, "eos_token_id": IM_END_ID, "pad_token_id": ENDOFTEXT_ID}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters (ByteLevel's alphabet)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(NUM_BYTE_TOKENS):
        if b not in chars:
            chars[b] = chr(NUM_BYTE_TOKENS + extra)
            extra += 1
    return chars


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens, then <|endoftext|> (256), <|im_start|> (257), <|im_end|> (258)."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )
