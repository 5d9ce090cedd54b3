"""Read prompt records from a bundled set, a local JSON/JSONL/Parquet file or a Hugging Face hub id.

Everything goes through `datasets.load_dataset`, so a user with a network can name a hub dataset and
a user without one a local file; the bundled sets work offline.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from moecache.errors import MoecacheError

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
MT_BENCH = DATA_DIR / "prompts" / "mt-bench"
LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def load_records(source: str, split: str) -> list[dict]:
    """All records of `source` as plain dicts, in file order."""
    if source == "bundled:mt-bench":
        return _read_jsonl(MT_BENCH / "mt_bench_question.jsonl")
    if source == "bundled:long-context":
        raise MoecacheError("bundled:long-context is built by the long_single workload, not loaded")
    if source.startswith("bundled:"):
        raise MoecacheError(
            f"workload.source={source}: unknown bundled set (have bundled:mt-bench, bundled:long-context)"
        )
    path = Path(source)
    if path.suffix in LOCAL_BUILDERS or path.exists():
        return _load_local(path)
    return _load_hub(source, split)


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise MoecacheError(f"{path}:{lineno}: not JSON ({exc.msg})") from exc
    return records


def _load_local(path: Path) -> list[dict]:
    if not path.is_file():
        raise MoecacheError(f"workload.source={path}: no such file")
    builder = LOCAL_BUILDERS.get(path.suffix)
    if builder is None:
        raise MoecacheError(f"workload.source={path}: expected a .json, .jsonl or .parquet file")
    import datasets

    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # datasets raises many types for a malformed file
        raise MoecacheError(
            f"workload.source={path}: cannot read it as {path.suffix} ({type(exc).__name__}: {exc})"
        ) from exc
    return [dict(row) for row in ds]


def _load_hub(name: str, split: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as exc:
        raise MoecacheError(
            f"workload.source={name}: not a local file and could not be loaded from the Hugging Face hub "
            f"(split {split}): {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from exc
    return [dict(row) for row in ds]


def long_context_text(seed: int) -> str:
    """The offline long document: the shipped MT-Bench / Vicuna questions and reference answers,
    in a seeded order, as numbered sections. Same seed, same text."""
    pieces = []
    for rec in _read_jsonl(MT_BENCH / "mt_bench_question.jsonl"):
        pieces.append(("Question", rec["category"], " ".join(rec["turns"])))
    for rec in _read_jsonl(MT_BENCH / "mt_bench_reference_answer_gpt-4.jsonl"):
        pieces.append(("Answer", str(rec["question_id"]), " ".join(rec["choices"][0]["turns"])))
    for rec in _read_jsonl(MT_BENCH / "vicuna_bench_question.jsonl"):
        pieces.append(("Question", rec["category"], " ".join(rec["turns"])))
    random.Random(seed).shuffle(pieces)
    return "\n\n".join(
        f"Section {i + 1} ({kind}, {tag}): {text}" for i, (kind, tag, text) in enumerate(pieces)
    )
