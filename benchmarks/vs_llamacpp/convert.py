"""Convert a moecache random checkpoint (Hugging Face layout) to a bf16 GGUF with llama.cpp's own converter.

    python benchmarks/vs_llamacpp/convert.py --llama .vendor/llama.cpp CHECKPOINT OUT.gguf

Runs the vendored `convert_hf_to_gguf.py` (its `main`, with `--outtype bf16`) unchanged, except for the
vocabulary of moecache's byte tokenizer (moecache/models/tokenizer.py: 256 byte tokens and 3 special tokens,
a byte-level BPE with no merges), which the converter cannot write as it stands:

- `get_vocab_base_pre` identifies the pre-tokenizer by hashing the tokens of a test text and raises
  NotImplementedError for any hash it does not list; the byte tokenizer's is not listed. Its
  pre-tokenizer (ByteLevel, no splitting regex) is written as llama.cpp's "default".
- llama.cpp refuses a BPE ("gpt2") vocabulary without a `tokenizer.ggml.merges` array, and GGUF cannot
  store an empty array; the byte tokenizer has no merges. One inert merge is written: a pair whose result
  is no token of the vocabulary (llama.cpp's BPE emits the bytes of a merged symbol it cannot find as byte
  tokens), so text still encodes byte by byte, as moecache's tokenizer does.

Only a checkpoint whose tokenizer is exactly that byte tokenizer is written this way; any other goes through
the converter's own `_set_vocab_gpt2`. llama-bench itself never tokenizes text (it feeds random token ids),
so the vocabulary only has to load.

A converter class that exports multi-token-prediction layers (Qwen3.5 / 3.6) is run with `--no-mtp`: the
random checkpoint has none (`takes_mtp`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# The merge written for the byte tokenizer: the GPT-2 byte alphabet's characters for bytes 0x00 and 0x01;
# their concatenation is not a token of the byte vocabulary, so where it applies the bytes come out as before.
INERT_MERGE = "\u0100 \u0101"
BYTE_TOKENS = 256
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def is_byte_tokenizer(folder: Path) -> bool:
    """Whether `folder`'s tokenizer.json is moecache's byte tokenizer: a BPE of 256 single-character
    tokens with no merges, plus its three special tokens."""
    try:
        spec = json.loads((folder / "tokenizer.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    model = spec.get("model") or {}
    vocab = model.get("vocab") or {}
    added = [t.get("content") for t in spec.get("added_tokens") or []]
    return (
        model.get("type") == "BPE"
        and not model.get("merges")
        and len(vocab) == BYTE_TOKENS
        and all(len(token) == 1 for token in vocab)
        and sorted(vocab.values()) == list(range(BYTE_TOKENS))
        and tuple(added) == SPECIAL_TOKENS
    )


def patch_converter(gguf) -> None:
    """Make the converter's BPE vocabulary step write the byte tokenizer (module docstring)."""
    from conversion.base import TextModel

    original = TextModel._set_vocab_gpt2

    def set_vocab_gpt2(self) -> None:
        if not is_byte_tokenizer(Path(self.dir_model)):
            original(self)
            return
        base_pre = TextModel.get_vocab_base_pre
        TextModel.get_vocab_base_pre = lambda model, tokenizer: "default"
        try:
            tokens, toktypes, tokpre = self.get_vocab_base()
        finally:
            TextModel.get_vocab_base_pre = base_pre
        self.gguf_writer.add_tokenizer_model("gpt2")
        self.gguf_writer.add_tokenizer_pre(tokpre)
        self.gguf_writer.add_token_list(tokens)
        self.gguf_writer.add_token_types(toktypes)
        self.gguf_writer.add_token_merges([INERT_MERGE])
        # bos / eos / pad ids and the chat template, as the converter writes them for any checkpoint
        gguf.SpecialVocab(self.dir_model, load_merges=False).add_to_gguf(self.gguf_writer)

    TextModel._set_vocab_gpt2 = set_vocab_gpt2


def takes_mtp(folder: Path) -> bool:
    """Whether the converter's class for this checkpoint exports multi-token-prediction layers (Qwen3.5 /
    3.6: it then expects them, and stops when the config names none). A random checkpoint has none, and
    moecache loads none, so such a class is run with `--no-mtp`."""
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    hparams = ModelBase.load_hparams(folder, False)
    architecture = get_model_architecture(hparams, ModelType.TEXT)
    return bool(getattr(get_model_class(architecture), "supports_mtp_export", False))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--llama", type=Path, required=True, help="the vendored llama.cpp tree (.vendor/llama.cpp)"
    )
    ap.add_argument(
        "checkpoint", type=Path, help="a Hugging Face checkpoint folder (config.json, safetensors)"
    )
    ap.add_argument("out", type=Path, help="the GGUF file to write")
    args = ap.parse_args(argv)
    script = args.llama / "convert_hf_to_gguf.py"
    if not script.is_file():
        print(f"convert: {script} not found (run benchmarks/vs_llamacpp/fetch_llamacpp.sh)", file=sys.stderr)
        return 2
    if not (args.checkpoint / "config.json").is_file():
        print(
            f"convert: {args.checkpoint} has no config.json (not a Hugging Face checkpoint)", file=sys.stderr
        )
        return 2
    # The converter's own imports: its `conversion` package and the in-tree gguf-py (as the script does).
    sys.path[:0] = [str(args.llama), str(args.llama / "gguf-py")]
    import convert_hf_to_gguf
    import gguf

    patch_converter(gguf)
    sys.argv = [str(script), str(args.checkpoint), "--outfile", str(args.out), "--outtype", "bf16"]
    if takes_mtp(args.checkpoint):
        sys.argv.append("--no-mtp")
    convert_hf_to_gguf.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
