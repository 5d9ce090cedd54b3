"""The requests of one workload for `moecache validate`, as collect builds them (conf/workload/<name>).

Every run of a workload must see the same prompts, but a multi-turn conversation's later turn contains
the answer to the earlier one. So the prompts are made once, during the unmodified model's run: the
request stream yields a turn, and builds the next turn of the conversation from the answer the
unmodified model gave (read from its outputs, filled in before the next request is drawn). The requests
it made are then replayed by every other run.
"""

from __future__ import annotations

from collections.abc import Iterator

from omegaconf import DictConfig, OmegaConf

from moecache.errors import MoecacheError
from moecache.validation.runs import Outputs, Request
from moecache.workloads import build_conversations, encode_messages


def load_workload(name: str, conf_dir, key: str = "validate.workloads") -> DictConfig:
    """conf/workload/<name>.yaml; an unknown name is one line listing the known ones."""
    path = conf_dir / "workload" / f"{name}.yaml"
    if not isinstance(name, str) or not path.is_file():
        known = sorted(p.stem for p in (conf_dir / "workload").glob("*.yaml"))
        raise MoecacheError(f"{key}: no workload {name!r} (conf/workload/ has {', '.join(known)})")
    return OmegaConf.load(path)


def request_stream(
    wcfg: DictConfig, seed: int, tokenizer, limit: int | None, answers: Outputs, made: list[Request]
) -> Iterator[Request]:
    """The workload's first `limit` requests (None: all); a later turn reads the previous turn's answer
    from `answers` (module docstring). Each request yielded is appended to `made`."""
    n = 0
    for conv in build_conversations(wcfg, seed, tokenizer):
        messages: list[dict] = []
        for turn_index, turn in enumerate(conv.turns):
            if limit is not None and n >= limit:
                return
            request_id = f"{conv.conversation_id}/t{turn_index}"
            messages.append({"role": "user", "content": turn})
            ids = encode_messages(tokenizer, messages, int(wcfg.max_prompt_tokens))
            request = Request(request_id, tuple(ids))
            made.append(request)
            n += 1
            yield request
            answer = tokenizer.decode(answers.tokens[request_id], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
