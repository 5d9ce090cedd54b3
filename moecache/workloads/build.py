"""Turn a workload config into conversations (lists of user turns) and prompts into token ids.

multi_request: shuffled (seeded), unrelated conversations; each user turn becomes one request whose
prompt holds the earlier turns and the model's own earlier answers. long_single: one (or a few)
long context + question requests, the context cut to a fixed number of tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from moecache.errors import MoecacheError
from moecache.workloads.sources import load_records, long_context_text

LONG_QUESTION = "Summarise the most important points of the sections above, in order, one line each."
USER_ROLES = ("human", "user")


@dataclass(frozen=True)
class Conversation:
    conversation_id: str
    turns: tuple[str, ...]  # user turns, in order


def build_conversations(wcfg, seed: int, tokenizer) -> list[Conversation]:
    kind = wcfg.kind
    if kind == "multi_request":
        convs = _multi_request(wcfg, seed)
    elif kind == "long_single":
        convs = _long_single(wcfg, seed, tokenizer)
    else:
        raise MoecacheError(f"workload.kind={kind!r}: expected multi_request or long_single")
    if not convs:
        raise MoecacheError(f"workload {wcfg.name}: source {wcfg.source} gave no usable conversations")
    return convs


def _take(records: list, wcfg, seed: int) -> list:
    records = list(records)
    if wcfg.shuffle:
        random.Random(seed).shuffle(records)
    n = int(wcfg.num_requests)
    if n < 1:
        raise MoecacheError(f"workload.num_requests={n}: must be at least 1")
    return records[:n]


def _record_id(rec: dict, field: str | None, index: int) -> str:
    return str(rec[field]) if field and field in rec and rec[field] is not None else f"row{index}"


def _user_turns(rec: dict, fields, where: str) -> list[str]:
    if fields.turns and fields.turns in rec:
        turns = rec[fields.turns]
        if isinstance(turns, str):
            turns = [turns]
    elif fields.conversations and fields.conversations in rec:
        turns = [
            m.get("value", m.get("content"))
            for m in rec[fields.conversations]
            if m.get("from", m.get("role")) in USER_ROLES
        ]
    else:
        raise MoecacheError(
            f"{where}: record has neither workload.fields.turns={fields.turns!r} nor "
            f"workload.fields.conversations={fields.conversations!r} (keys: {sorted(rec)})"
        )
    if not all(isinstance(t, str) for t in turns):
        raise MoecacheError(f"{where}: user turns must be strings")
    return [t for t in turns if t.strip()]


def _multi_request(wcfg, seed: int) -> list[Conversation]:
    indexed = list(enumerate(load_records(wcfg.source, wcfg.split)))
    convs = []
    for index, rec in _take(indexed, wcfg, seed):
        turns = _user_turns(rec, wcfg.fields, f"workload.source={wcfg.source} row {index}")
        if not wcfg.multi_turn:
            turns = turns[:1]
        if turns:
            convs.append(Conversation(_record_id(rec, wcfg.fields.id, index), tuple(turns)))
    return convs


def _truncate_tokens(tokenizer, text: str, max_tokens: int) -> str:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    return tokenizer.decode(ids)


def _long_single(wcfg, seed: int, tokenizer) -> list[Conversation]:
    n_ctx = int(wcfg.context_tokens)
    if wcfg.source == "bundled:long-context":
        pairs = [(f"long-context-seed{seed}", long_context_text(seed), LONG_QUESTION)]
    else:
        fields = wcfg.fields
        pairs = []
        for index, rec in _take(list(enumerate(load_records(wcfg.source, wcfg.split))), wcfg, seed):
            for key in (fields.context, fields.question):
                if key not in rec:
                    raise MoecacheError(
                        f"workload.source={wcfg.source} row {index}: no field {key!r} (keys: {sorted(rec)}); "
                        "set workload.fields.context / workload.fields.question"
                    )
            pairs.append((_record_id(rec, fields.id, index), rec[fields.context], rec[fields.question]))
    return [
        Conversation(cid, (_truncate_tokens(tokenizer, context, n_ctx) + "\n\n" + question,))
        for cid, context, question in pairs
    ]


def encode_messages(tokenizer, messages: list[dict], max_prompt_tokens: int) -> list[int]:
    """Token ids of a chat prompt, ending where the assistant's answer starts; keeps the last
    `max_prompt_tokens` tokens when the prompt is longer."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
    else:
        text = "\n\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\n\nassistant:"
        ids = tokenizer(text)["input_ids"]
    ids = list(ids)
    return ids[-int(max_prompt_tokens) :]
