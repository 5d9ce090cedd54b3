"""Workloads: seeded shuffle, multi-turn conversations, the long default, local files, bad input."""

import json

import pytest

from moecache.config import compose
from moecache.errors import MoecacheError
from moecache.models.tokenizer import build_byte_tokenizer
from moecache.workloads import build_conversations, encode_messages


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def _wcfg(*overrides):
    return compose(list(overrides)).workload


def test_multi_request_is_seeded_and_multi_turn(tok):
    w = _wcfg("workload=multi_request", "workload.num_requests=5")
    a = build_conversations(w, 0, tok)
    assert a == build_conversations(w, 0, tok)
    assert [c.conversation_id for c in a] != [c.conversation_id for c in build_conversations(w, 1, tok)]
    assert len(a) == 5 and all(len(c.turns) == 2 for c in a)  # MT-Bench has two turns each
    single = build_conversations(_wcfg("workload.num_requests=5", "workload.multi_turn=false"), 0, tok)
    assert all(len(c.turns) == 1 for c in single)


def test_long_single_context_is_cut_to_its_token_budget(tok):
    w = _wcfg("workload=long_single", "workload.context_tokens=300")
    (conv,) = build_conversations(w, 0, tok)
    assert conv == build_conversations(w, 0, tok)[0]
    context, question = conv.turns[0].rsplit("\n\n", 1)
    assert len(tok(context, add_special_tokens=False)["input_ids"]) <= 300
    assert question.startswith("Summarise")


def test_local_jsonl_sharegpt_and_long_fields(tmp_path, tok):
    share = tmp_path / "share.jsonl"
    share.write_text(
        "\n".join(
            json.dumps(
                {
                    "id": f"c{i}",
                    "conversations": [
                        {"from": "human", "value": f"hi {i}"},
                        {"from": "gpt", "value": "yo"},
                        {"from": "human", "value": f"more {i}"},
                    ],
                }
            )
            for i in range(3)
        )
    )
    w = _wcfg(
        f"workload.source={share}",
        "workload.fields.id=id",
        "workload.num_requests=10",
        "workload.shuffle=false",
    )
    convs = build_conversations(w, 0, tok)
    assert [c.conversation_id for c in convs] == ["c0", "c1", "c2"]
    assert convs[0].turns == ("hi 0", "more 0")

    longf = tmp_path / "long.json"
    longf.write_text(json.dumps([{"_id": "d1", "context": "abc " * 200, "input": "What?"}]))
    (conv,) = build_conversations(
        _wcfg("workload=long_single", f"workload.source={longf}", "workload.context_tokens=40"), 0, tok
    )
    assert conv.conversation_id == "d1" and conv.turns[0].endswith("\n\nWhat?")


def test_bad_sources_are_named(tmp_path, tok):
    with pytest.raises(MoecacheError, match="no such file"):
        build_conversations(_wcfg(f"workload.source={tmp_path / 'missing.jsonl'}"), 0, tok)
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(MoecacheError, match="workload.fields.turns"):
        build_conversations(_wcfg(f"workload.source={wrong}"), 0, tok)
    with pytest.raises(MoecacheError, match="unknown bundled set"):
        build_conversations(_wcfg("workload.source=bundled:nope"), 0, tok)


def test_prompt_keeps_the_last_tokens(tok):
    msgs = [{"role": "user", "content": "x" * 1000}]
    ids = encode_messages(tok, msgs, 64)
    assert len(ids) == 64
    assert ids == encode_messages(tok, msgs, 10_000)[-64:]
