"""Generation through either decode loop, for every caller: `moecache generate` and `collect`, validate's
runs and calibrate's timings.

- `transformers_generate`: transformers' own loop (`model.generate`: a DynamicCache, eager);
- `fast_generate`: moecache's decode loop (`FastDecoder`, moecache/runtime/decode_loop.py: a StaticCache,
  static buffers, CUDA graphs between the expert path's host points), given a model (a decoder sized for
  the call) or a decoder that is reused.

Both take (model, input_ids [1, T], max_new_tokens, stamp) and keywords. What a caller gets per token:
- `stamp`: a token clock (moecache/token_clock.py `TokenStamps`, or a subclass), called as each generated
  token is ready: transformers' loop calls it as a logits processor once the token's logits exist; the
  fast loop once the token is read back to the host (`StampStreamer`);
- `streamer`: transformers' put/end protocol (`moecache generate` streams the text).
Without `gen` the generation is greedy and runs exactly `max_new_tokens` tokens (no EOS stop); with the
`generation` config group (`gen`) it samples or not and stops at EOS as that group says
(`sampling_kwargs`).

Legend: T prompt tokens, N generated tokens.
"""

from __future__ import annotations

import torch

LOOPS = ("transformers", "fast")


def sampling_kwargs(gen: dict) -> dict:
    """`model.generate` keywords of the `generation` group's sampling keys: temperature and top-p when
    sampling, the model's own sampling defaults switched off otherwise, and no EOS stop under
    `ignore_eos`."""
    if gen["do_sample"]:
        kwargs = dict(temperature=float(gen["temperature"]), top_p=float(gen["top_p"]))
    else:
        kwargs = dict(temperature=None, top_p=None, top_k=None)
    if gen["ignore_eos"]:
        kwargs["eos_token_id"] = None
    return kwargs


def transformers_generate(
    model,
    input_ids_1T: torch.Tensor,
    max_new_tokens: int,
    stamp=None,
    *,
    gen: dict | None = None,
    streamer=None,
    pad_token_id: int = 0,
):
    """`model.generate` of `max_new_tokens` tokens after `input_ids_1T` (module docstring); returns its
    output, the sequences [1, T + new]."""
    from transformers import LogitsProcessorList

    kwargs = dict(
        input_ids=input_ids_1T, attention_mask=torch.ones_like(input_ids_1T), max_new_tokens=max_new_tokens,
        pad_token_id=pad_token_id,
    )  # fmt: skip
    if gen is None:
        kwargs.update(
            min_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
            eos_token_id=None,
        )  # fmt: skip
    else:
        kwargs.update(do_sample=bool(gen["do_sample"]), **sampling_kwargs(gen))
    if stamp is not None:
        kwargs["logits_processor"] = LogitsProcessorList([stamp])
    if streamer is not None:
        kwargs["streamer"] = streamer
    with torch.inference_mode():
        return model.generate(**kwargs)


class StampStreamer:
    """A streamer (transformers' put/end protocol) calling `stamp(None, None)` as each generated token is
    put; the decoder puts the prompt first, which is skipped."""

    def __init__(self, stamp):
        self._stamp, self._prompt_seen = stamp, False

    def put(self, value) -> None:
        if self._prompt_seen:
            self._stamp(None, None)
        self._prompt_seen = True

    def end(self) -> None:
        pass


def fast_generate(
    model_or_decoder,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    stamp=None,
    *,
    streamer=None,
    eos_token_id=None,
    **decoder_options,
):
    """Greedy, through moecache's fast decode loop: a `FastDecoder` given (reused: it keeps its graphs),
    else one sized for this call over the model given (`decoder_options`: FastDecoder's, e.g. graphs,
    compile, keep_logits, forced). Returns the decoder's `DecodeResult`. `stamp` and `streamer` exclude
    each other."""
    from moecache.runtime.decode_loop import FastDecoder

    if stamp is not None:
        if streamer is not None:
            raise ValueError("fast_generate: a stamp or a streamer, not both")
        streamer = StampStreamer(stamp)
    decoder = model_or_decoder
    if not isinstance(decoder, FastDecoder):
        length = int(torch.as_tensor(input_ids).shape[-1]) + int(max_new_tokens)
        decoder = FastDecoder(model_or_decoder, max_cache_len=length, **decoder_options)
    elif decoder_options:
        raise ValueError(f"fast_generate: decoder options {sorted(decoder_options)} given with a decoder")
    return decoder.generate(input_ids, max_new_tokens, eos_token_id=eos_token_id, streamer=streamer)
