"""benchmarks/eval_policies.py --collect: the mechanisms judged on traces with real prefill steps.

Two small collect artifacts of two workloads (each request a prefill step of several tokens, then decode
steps) run through the whole evaluation; bad input (traces of one workload, a trace without a prefill
step, an unknown artifact id) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from moecache.artifacts import ArtifactStore
from tests.benchmarks.script_module import script_module
from tests.conftest import write_trace

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "eval_policies.py"
LAYERS, EXPERTS, TOP_K = 2, 8, 2


@pytest.fixture(scope="module")
def evaluation():
    """eval_policies.py as a module."""
    with script_module("eval_policies_script", SCRIPT) as module:
        yield module


def steps(seed: int, requests: int, prompt: int, decode: int):
    """Layer steps of `requests` requests: a prefill step of `prompt` tokens, then `decode` decode steps;
    routing skewed towards the low experts, so a cache hits."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, EXPERTS + 1)
    p /= p.sum()
    out = []
    for r in range(requests):
        for step, tokens in enumerate([prompt] + [1] * decode):
            for layer in range(LAYERS):
                chosen = [rng.choice(EXPERTS, TOP_K, replace=False, p=p).tolist() for _ in range(tokens)]
                out.append((f"r{r}", step, layer, chosen))
    return out


def collect_artifact(store: ArtifactStore, workload: str, trace_steps) -> str:
    """A published collect artifact of `workload` holding the trace of `trace_steps`; its id."""
    config = {"model": {"name": "synthetic"}, "workload": {"name": workload}, "seed": 0}
    with store.create("collect", schema_version=1, config=config, inputs=[], seed=0) as folder:
        write_trace(folder / "trace.parquet", trace_steps, LAYERS, EXPERTS, TOP_K)
    (art,) = [a for a in store.list("collect") if a.manifest["config"]["workload"]["name"] == workload]
    return art.id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("out")
    store = ArtifactStore(root)
    ids = {
        "multi_request": collect_artifact(store, "multi_request", steps(0, 8, 6, 12)),
        "long_single": collect_artifact(store, "long_single", steps(1, 1, 24, 40)),
    }
    return root, ids


def run(evaluation, monkeypatch, capsys, *args):
    monkeypatch.setattr(sys, "argv", ["eval_policies.py", *args])
    try:
        evaluation.main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_collect_traces_are_judged_with_their_real_prefill_steps(evaluation, store, monkeypatch, capsys):
    root, ids = store
    code, out, err = run(
        evaluation, monkeypatch, capsys, "--quick", "--output-root", str(root), "--collect",
        ids["multi_request"], str(root / "collect" / ids["long_single"]),
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["traces"] == ["multi_request", "long_single"]
    assert result["routing"]["long_single"]["requests"] == 1
    assert result["routing"]["long_single"]["decode_steps"] == 40
    # prefill_admit is a judged family here; profile_static is profiled on the other workload only
    mechanisms = {(r["trace"], r["mechanism"]) for r in result["judged"]}
    assert ("multi_request", "prefill_admit") in mechanisms and (
        "long_single",
        "profile_static",
    ) in mechanisms
    for r in result["judged"]:
        if r["mechanism"] == "profile_static":
            assert ids["long_single" if r["trace"] == "multi_request" else "multi_request"] in r["label"]
    # the prefill section: the recorded traces as they are, units = requests (8) or blocks (1 request)
    rows = result["prefill"]
    assert {r["prompt_fraction"] for r in rows} == {None}
    units = {r["trace"]: (r["unit"], r["units"]) for r in rows}
    assert units["multi_request"] == ("req", 8)
    assert units["long_single"] == ("blk", 3)  # 41 forward steps in blocks of 16
    assert "warm" not in result


@pytest.mark.parametrize(
    ("refs", "culprit"),
    [
        (["{multi_request}"], "traces of one workload (multi_request)"),
        (["collect-000000000000", "{long_single}"], "--collect: no artifact 'collect-000000000000'"),
        (["{one_token}", "{long_single}"], "has no prefill step"),
    ],
    ids=["one-workload", "unknown-id", "no-prefill"],
)
def test_bad_collect_input_is_one_line_exit_2(
    evaluation, store, tmp_path, monkeypatch, capsys, refs, culprit
):
    root, ids = store
    one_token = write_trace(tmp_path / "esft_like.parquet", steps(2, 2, 1, 8), LAYERS, EXPERTS, TOP_K)
    names = {**ids, "one_token": str(one_token)}
    args = [ref.format(**names) for ref in refs]
    code, out, err = run(evaluation, monkeypatch, capsys, "--output-root", str(root), "--collect", *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("eval_policies: error: --collect") and culprit in lines[0], lines[0]
