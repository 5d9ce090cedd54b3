"""`moecache collect`: run the unmodified model on a workload with the routing logger on.

Writes a trace artifact: `trace.parquet` and/or `trace.jsonl` (docs/trace-format.md),
`run_metadata.json` (model revision, versions, machine, seed, workload, logger counters, timings)
and, only with `logging.log_text=true`, `texts.jsonl` with prompts and generated text.

With `logging.logit_lens.rate > 0` the trace's `lens_token` column holds the logit lens of the sampled
tokens (moecache/trace/lens.py). The projection runs inside the generation, in decoder-layer hooks; its
time is measured there (`LogitLens.take_seconds`: hook wall time on the CPU; on CUDA per call the larger
of the host time and the kernels' CUDA-event time) and subtracted from each request's generation time.
So per request `seconds` (and the summary's generation seconds and tokens/s) exclude it, while
`wall_seconds` includes it and `logit_lens_seconds` is the difference; run_metadata's
`logit_lens_seconds` is the total over the run (0.0 with the lens off).
"""

from __future__ import annotations

import json
import time

import torch
from omegaconf import DictConfig
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from moecache.artifacts import artifact_id
from moecache.env_info import machine_info, package_versions
from moecache.errors import MoecacheError
from moecache.generation import transformers_generate
from moecache.models import load_model
from moecache.stages.base import StageResult, prepare, reusable, store_for, torch_device
from moecache.trace.hooks import RoutingRecorder
from moecache.trace.lens import LogitLens
from moecache.trace.logger import LoggerConfig, RoutingLogger
from moecache.trace.schema import TraceMeta
from moecache.workloads import build_conversations, encode_messages

STAGE = "collect"
SCHEMA_VERSION = 1


def _lens_rate(c: dict) -> float:
    rate = (c["logging"].get("logit_lens") or {}).get("rate", 0.0)
    try:
        rate = float(rate)
    except (TypeError, ValueError):
        raise MoecacheError(f"logging.logit_lens.rate={rate!r}: expected a number in [0, 1]") from None
    if not 0.0 <= rate <= 1.0:
        raise MoecacheError(f"logging.logit_lens.rate={rate}: must be in [0, 1]")
    return rate


def _artifact_config(c: dict, device: str, revision: str) -> dict:
    """The part of the config that decides the trace's content. The logit lens is named only when it
    is on, so that traces collected without it keep their artifact ids."""
    logging = {k: c["logging"][k] for k in ("formats", "log_text")}
    if _lens_rate(c) > 0:
        logging["logit_lens"] = {"rate": _lens_rate(c)}
    return {
        "model": c["model"],
        "model_revision": revision,
        "workload": c["workload"],
        "generation": c["generation"],
        "logging": logging,
        "seed": c["seed"],
        "device": device,
    }


def _generate(model, ids: list[int], gen: dict, max_new_tokens: int, device: str, pad_id: int) -> list[int]:
    input_ids = torch.tensor([ids], device=device)
    out = transformers_generate(model, input_ids, max_new_tokens, gen=gen, pad_token_id=pad_id)
    return out[0, input_ids.shape[1] :].tolist()


def run(cfg: DictConfig) -> StageResult:
    c = prepare(cfg, STAGE)  # also refuses logging.enabled=false: logging is what collect is for
    device = torch_device(cfg)
    loaded = load_model(cfg.model, cfg.output_root, device)
    config = _artifact_config(c, device, loaded.revision)
    existing = reusable(cfg, STAGE, SCHEMA_VERSION, config, inputs=[])
    if existing is not None:
        return StageResult(
            existing, reused=True, summary=json.loads((existing / "run_metadata.json").read_text())["summary"]
        )

    wcfg = cfg.workload
    max_new = c["generation"]["max_new_tokens"] or wcfg.max_new_tokens
    if int(max_new) < 1:
        raise MoecacheError(f"generation.max_new_tokens={max_new}: must be at least 1")
    tokenizer = loaded.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    conversations = build_conversations(wcfg, int(cfg.seed), tokenizer)
    adapter = loaded.adapter
    run_id = artifact_id(STAGE, SCHEMA_VERSION, config, [])
    run_meta = {
        "run_id": run_id,
        "model": c["model"]["name"],
        "model_revision": loaded.revision,
        "adapter": adapter.describe(),
        "versions": package_versions(),
        "machine": machine_info(),
        "device": device,
        "seed": c["seed"],
        "warmup_requests": 0,
        "capacity": None,  # no cache runs while collecting
        "policy": None,
        "workload": c["workload"],
        "generation": {**c["generation"], "max_new_tokens": int(max_new)},
        "logit_lens": {"rate": _lens_rate(c), "seed": int(cfg.seed)},
    }
    meta = TraceMeta(
        num_layers=adapter.num_layers,
        num_experts=adapter.num_experts,
        top_k=adapter.top_k,
        expert_bytes=adapter.expert_bytes,
        model=c["model"]["name"],
        source=f"collect:{wcfg.name}",
        run=run_meta,
    )
    n_requests = sum(len(conv.turns) for conv in conversations)
    console = Console(stderr=True)
    per_request = []
    with store_for(cfg).create(
        STAGE, schema_version=SCHEMA_VERSION, config=config, inputs=[], seed=int(cfg.seed)
    ) as tmp:
        logger = RoutingLogger(tmp, meta, run_id, LoggerConfig.from_cfg(cfg.logging))
        lens = LogitLens(adapter, _lens_rate(c), int(cfg.seed)) if _lens_rate(c) > 0 else None
        texts = open(tmp / "texts.jsonl", "w") if cfg.logging.log_text else None  # noqa: SIM115
        try:
            with (
                RoutingRecorder(loaded.model, adapter, logger, lens) as recorder,
                Progress(
                    TextColumn("[bold]collect[/] {task.description}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TextColumn("{task.fields[tokens]} tokens, {task.fields[tps]:.1f} tok/s"),
                    TimeElapsedColumn(),
                    console=console,
                    transient=False,
                ) as progress,
            ):
                task = progress.add_task(wcfg.name, total=n_requests, tokens=0, tps=0.0)
                generated_total, gen_seconds = 0, 0.0
                for conv in conversations:
                    messages: list[dict] = []
                    for turn_index, turn in enumerate(conv.turns):
                        request_id = f"{conv.conversation_id}/t{turn_index}"
                        messages.append({"role": "user", "content": turn})
                        prompt_ids = encode_messages(tokenizer, messages, int(wcfg.max_prompt_tokens))
                        torch.manual_seed(int(cfg.seed))
                        recorder.start_request(request_id)
                        start = time.perf_counter()
                        new_ids = _generate(
                            loaded.model, prompt_ids, c["generation"], int(max_new), device, pad_id
                        )
                        wall_seconds = time.perf_counter() - start
                        lens_seconds = lens.take_seconds() if lens is not None else 0.0
                        seconds = wall_seconds - lens_seconds
                        answer = tokenizer.decode(new_ids, skip_special_tokens=True)
                        messages.append({"role": "assistant", "content": answer})
                        if texts is not None:
                            texts.write(
                                json.dumps(
                                    {
                                        "request_id": request_id,
                                        "messages": messages[:-1],
                                        "completion": answer,
                                    }
                                )
                                + "\n"
                            )
                        per_request.append(
                            {
                                "request_id": request_id,
                                "prompt_tokens": len(prompt_ids),
                                "new_tokens": len(new_ids),
                                "seconds": seconds,
                                "wall_seconds": wall_seconds,
                                "logit_lens_seconds": lens_seconds,
                            }
                        )
                        generated_total += len(new_ids)
                        gen_seconds += seconds
                        progress.update(
                            task,
                            advance=1,
                            tokens=generated_total,
                            tps=generated_total / max(gen_seconds, 1e-9),
                        )
        finally:
            stats = logger.close()
            if texts is not None:
                texts.close()
        prompt_tokens = sum(r["prompt_tokens"] for r in per_request)
        summary = {
            "requests": len(per_request),
            "prompt tokens": prompt_tokens,
            "generated tokens": generated_total,
            "rows logged": stats.rows_written,
            "layers x experts": f"{adapter.num_layers} x {adapter.num_experts} (top-{adapter.top_k})",
            "generation s": round(gen_seconds, 3),
            "tokens/s (incl. prefill)": round(generated_total / max(gen_seconds, 1e-9), 2),
            "log overflow events": stats.overflow_events,
        }
        if lens is not None:
            summary["logit lens rate"] = lens.rate
            summary["logit lens rows"] = lens.rows_projected
            summary["logit lens s"] = round(lens.total_seconds, 3)
        expected_rows = (prompt_tokens + generated_total - len(per_request)) * adapter.num_layers
        if stats.rows_written != expected_rows:
            raise MoecacheError(f"collect: logged {stats.rows_written} rows, expected {expected_rows}")
        run_meta_out = {
            **run_meta,
            "logger": logger.stats_dict(),
            "logit_lens_seconds": lens.total_seconds if lens is not None else 0.0,
            "requests": per_request,
            "summary": summary,
        }
        (tmp / "run_metadata.json").write_text(
            json.dumps(run_meta_out, indent=2, sort_keys=True, default=str) + "\n"
        )
    return StageResult(store_for(cfg).get(run_id).path, summary=summary)
