"""Load an MoE checkpoint (or build the tiny random one) exactly as a real checkpoint is loaded.

`load_model(cfg.model, cfg.output_root, device)` takes the `model` config group (conf/model/*.yaml):
with `path: null` and a `build:` block it first builds a deterministic tiny random-weight model under
`<output_root>/models/tiny-<hash>/` (reused when it exists); otherwise it loads `path`. Either way
the folder goes through `AutoConfig` / `AutoModelForCausalLM` / `AutoTokenizer` with
`local_files_only=True`. A checkpoint's `revision` is its git commit when it has one, else the
SHA-256 of its safetensors files (cached under `<output_root>/models/.revisions/`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from omegaconf import DictConfig, OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

from moecache.artifacts import (
    canonical_json,
    config_hash,
    remove_stale,
    terminating_signals_raise,
    tmp_name,
    write_json_atomic,
)
from moecache.errors import MoecacheError
from moecache.models.adapter import ADAPTERS, MoEAdapter, adapter_for, supported_model_types
from moecache.models.tokenizer import build_byte_tokenizer

TINY_BUILD_SCHEMA = 1  # bump when build_tiny's output changes for the same build config
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}
# Keys of a model config's `architecture:` block, checked against the loaded adapter's describe().
ARCHITECTURE_KEYS = (
    "model_type",
    "num_layers",
    "num_experts",
    "top_k",
    "hidden_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "expert_bytes",
    "has_shared_experts",
    "model_layer_indices",
)
_HASH_CHUNK = 16 << 20


@dataclass
class LoadedModel:
    """A model ready for inference: eval mode, on its device, generation needing no network."""

    model: PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase
    adapter: MoEAdapter
    path: Path
    # "git:<commit>", "files:<hash of the files' names, sizes, headers and sampled bytes>", "sha256:<hash of the
    # safetensors files>" (model.hash_weights=true) or "random:<hash of the random model's config>"
    revision: str
    store: object = None  # the ExpertStore holding the routed experts (an offloaded load), else None
    fit: object = None  # its memory_fit.OffloadFit: the slot count and what goes where
    times: object = None  # load_progress.LoadTimes


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _model_dict(model_cfg: DictConfig | dict) -> dict:
    if isinstance(model_cfg, DictConfig):
        if OmegaConf.is_missing(model_cfg, "path"):
            raise MoecacheError(
                "model.path is not set: pass model.path=/local/checkpoint (a folder with config.json)"
            )
        return OmegaConf.to_container(model_cfg, resolve=True)
    return dict(model_cfg)


def _configured_adapter(cfg: dict) -> type[MoEAdapter]:
    """The adapter class that `model.model_type` names."""
    model_type = cfg.get("model_type")
    if not model_type:
        raise MoecacheError("model.model_type is not set (e.g. model.model_type=qwen3_5_moe)")
    if model_type not in ADAPTERS:
        raise MoecacheError(
            f"model.model_type={model_type} is not supported (supported: {', '.join(supported_model_types())})"
        )
    return ADAPTERS[model_type]


# ----------------------------------------------------------------------------------------- build


def build_tiny(model_cfg: DictConfig | dict, output_root: str | Path) -> Path:
    """Build (or reuse) the tiny random-weight model that `model_cfg.build` describes; return its folder.

    The folder holds config.json, model.safetensors, generation_config.json, the byte tokenizer and
    build.json; it is written into a temporary folder and renamed into place. The same build config
    gives byte-identical files.
    """
    cfg = _model_dict(model_cfg)
    build = cfg.get("build")
    if not build:
        raise MoecacheError(
            "model.build is not set: a tiny model needs model.build.seed and model.build.overrides"
        )
    adapter_cls = _configured_adapter(cfg)
    model_type = cfg["model_type"]
    seed = int(build.get("seed", 0))
    overrides = dict(build.get("overrides") or {})
    key = {"schema": TINY_BUILD_SCHEMA, "model_type": model_type, "seed": seed, "overrides": overrides}
    final = Path(output_root) / "models" / f"tiny-{config_hash(key)[:12]}"
    if final.is_dir():
        return final

    config = adapter_cls.tiny_config(**overrides)
    model_class = getattr(transformers, config.architectures[0])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).eval()

    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(final.parent)  # what a killed builder left
    tmp = final.parent / tmp_name(final.name)
    # SIGTERM / SIGHUP raise here as SIGINT does, so the temporary folder is removed on every signal
    with terminating_signals_raise():
        progress = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()  # a tiny model's one shard needs no bar
        try:
            model.save_pretrained(tmp)
            build_byte_tokenizer().save_pretrained(tmp)
            write_json_atomic(tmp / "build.json", key)
            os.rename(tmp, final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not final.is_dir():  # not a lost race with another builder: a real error
                raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if progress:
                transformers.utils.logging.enable_progress_bar()
    return final


# ------------------------------------------------------------------------------- checkpoint checks


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise MoecacheError(f"{path} is not valid JSON: {exc}") from exc
    except OSError as exc:
        raise MoecacheError(f"cannot read {path}: {_one_line(exc)}") from exc
    if not isinstance(data, dict):
        raise MoecacheError(f"{path} is not a JSON object")
    return data


def check_checkpoint(path: Path) -> dict:
    """Refuse a folder that is not a loadable checkpoint; return its parsed config.json."""
    if not path.exists():
        raise MoecacheError(f"model.path={path} does not exist")
    if not path.is_dir():
        raise MoecacheError(f"model.path={path} is not a folder")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise MoecacheError(f"model.path={path} has no config.json")
    config = _read_json(config_file)
    model_type = config.get("model_type")
    if model_type is None:
        raise MoecacheError(f"{config_file} has no model_type")
    if model_type not in ADAPTERS:
        raise MoecacheError(
            f"{config_file}: model_type '{model_type}' is not supported "
            f"(supported: {', '.join(supported_model_types())})"
        )
    weight_files(path)
    return config


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files; a MoecacheError naming what is missing."""
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = _read_json(index_file).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise MoecacheError(f"{index_file} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise MoecacheError(
                    f"model.path={path}: weights file {file.name} (listed in {index_file.name}) is missing"
                )
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise MoecacheError(f"model.path={path} has no weights files (*.safetensors)")
    return files


def _checkpoint_dtype(config: dict) -> torch.dtype | None:
    """The dtype config.json records for the weights (top level, else text_config)."""
    for scope in (config, config.get("text_config") or {}):
        name = scope.get("dtype") or scope.get("torch_dtype")
        if isinstance(name, str) and isinstance(DTYPES.get(name), torch.dtype):
            return DTYPES[name]
    return None


def check_architecture(
    adapter: MoEAdapter, expected: dict, path: Path, checkpoint_dtype: torch.dtype | None
) -> None:
    """Compare the loaded model with the config's `architecture:` block, naming the first mismatch.

    `expert_bytes` is compared at the checkpoint's own dtype, so loading with another `model.dtype`
    does not count as a mismatch.
    """
    actual = adapter.describe()
    if checkpoint_dtype is not None:
        actual["expert_bytes"] = adapter.expert_params * checkpoint_dtype.itemsize
    for key, value in expected.items():
        if key not in ARCHITECTURE_KEYS:
            raise MoecacheError(
                f"model.architecture.{key} is not a known architecture key (known: {', '.join(ARCHITECTURE_KEYS)})"
            )
        if key == "model_type":
            if ADAPTERS.get(value) is not type(adapter):
                raise MoecacheError(
                    f"model.architecture.model_type={value} but {path} is a {adapter.model_type} model"
                )
        elif value is not None and actual[key] != value:
            raise MoecacheError(
                f"model.architecture.{key}={value} but the checkpoint at {path} has {key}={actual[key]}"
            )


# ---------------------------------------------------------------------------------------- revision


def _git_revision(path: Path) -> str | None:
    """The commit of a git clone at `path`, or of a Hugging Face cache snapshot (`snapshots/<commit>`)."""
    head_file = path / ".git" / "HEAD"
    if head_file.is_file():
        head = head_file.read_text().strip()
        if not head.startswith("ref:"):
            return head
        ref = head.split(None, 1)[1]
        ref_file = path / ".git" / ref
        if ref_file.is_file():
            return ref_file.read_text().strip()
        packed = path / ".git" / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[1] == ref:
                    return parts[0]
        return None
    if path.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", path.name):
        return path.name
    return None


def weights_sha256(path: Path, cache_dir: Path | None = None) -> str:
    """SHA-256 over the safetensors files (names and bytes, in name order), cached by name/size/mtime."""
    files = weight_files(path)
    stamp = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    cache_file = None
    if cache_dir is not None:
        key = hashlib.sha256(canonical_json([str(path.resolve()), stamp]).encode()).hexdigest()[:24]
        cache_file = Path(cache_dir) / f"{key}.json"
        if cache_file.is_file():
            return json.loads(cache_file.read_text())["sha256"]
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
    sha = digest.hexdigest()
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(cache_file, {"path": str(path.resolve()), "files": stamp, "sha256": sha})
    return sha


def weights_revision(path: Path, cache_dir: Path | None = None) -> str:
    commit = _git_revision(path)
    return f"git:{commit}" if commit else f"sha256:{weights_sha256(path, cache_dir)}"


# -------------------------------------------------------------------------------------------- load


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def _generation_config(path: Path, model: PreTrainedModel, tokenizer) -> GenerationConfig:
    """The checkpoint's generation_config.json (else one from the model config), with a pad token."""
    if (path / "generation_config.json").is_file():
        try:
            generation = GenerationConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, TypeError) as exc:
            raise MoecacheError(f"{path / 'generation_config.json'}: {_one_line(exc)}") from exc
    else:
        generation = GenerationConfig.from_model_config(model.config)
    if generation.pad_token_id is None:
        eos = generation.eos_token_id
        generation.pad_token_id = (
            tokenizer.pad_token_id
            if tokenizer.pad_token_id is not None
            else (eos[0] if isinstance(eos, list) else eos)
        )
    return generation


@dataclass(frozen=True)
class OffloadRequest:
    """Load for the offloaded runtime: the routed experts go to a host expert store, not the model.
    `capacity` (the one syntax, or "auto") and `headroom` (bytes kept free on the device) size the slot
    pool before anything is read (moecache/models/memory_fit.py); `pin` is the store's pin mode."""

    capacity: object
    headroom: int
    pin: str = "auto"


def _keep_fp32(cls, dtype: torch.dtype):
    """The parameter-name test for modules the model class keeps in float32 under a half dtype, as
    `from_pretrained` keeps them (`_keep_in_fp32_modules`, `_keep_in_fp32_modules_strict`)."""
    modules = list(getattr(cls, "_keep_in_fp32_modules", None) or [])
    if dtype in (torch.float16, torch.bfloat16):
        modules += list(getattr(cls, "_keep_in_fp32_modules_strict", None) or [])
    if not modules:
        return lambda name: False
    pattern = re.compile("|".join(rf"((^|\.){re.escape(m)}($|\.))" for m in modules))
    return lambda name: pattern.search(name) is not None


def _dense_bytes(model: PreTrainedModel, skip_experts: bool, dtype: torch.dtype) -> int:
    """Bytes of the model's weights at `dtype` (without the routed experts with `skip_experts`)."""
    from moecache.models.skeleton import routed_experts

    total, seen = 0, set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen or (skip_experts and routed_experts(module, name, param)):
                continue
            seen.add(id(param))
            total += param.numel() * dtype.itemsize
    return total


REVISION_SAMPLES = 8  # byte ranges of each file's data hashed into its revision
REVISION_SAMPLE_BYTES = 256 << 10


def _files_revision(headers) -> str:
    """The checkpoint's identity without a pass over its data: every file's name, size and header (the
    tensors' names, dtypes, shapes and offsets) and `REVISION_SAMPLES` evenly spaced ranges of its data
    (2 MiB a file). A copy of the same files has the same identity; new weights of the same shapes
    differ in the sampled bytes."""
    digest = hashlib.sha256()
    for header in headers:
        digest.update(canonical_json([header.file.name, header.size]).encode())
        digest.update(header.header)
        start = 8 + len(header.header)
        span = max(header.size - start - REVISION_SAMPLE_BYTES, 0)
        with open(header.file, "rb") as f:
            for i in range(REVISION_SAMPLES):
                f.seek(start + span * i // max(REVISION_SAMPLES - 1, 1))
                digest.update(f.read(REVISION_SAMPLE_BYTES))
    return digest.hexdigest()


def _skeleton(cfg: dict, output_root, target: torch.device):
    """The checkpoint's folder, config.json, dtype and files, and its model built without weights
    (moecache/models/skeleton.py) with its adapter, the architecture checked; nothing is read."""
    from moecache.models.skeleton import build_skeleton, everything

    if cfg.get("path") is None:
        if not cfg.get("build"):
            raise MoecacheError(
                "model.path is null and model.build is not set: give model.path=/local/checkpoint"
            )
        path = build_tiny(cfg, output_root)
    else:
        path = Path(str(cfg["path"])).expanduser()
    raw_config = check_checkpoint(path)
    if cfg.get("model_type") and _configured_adapter(cfg) is not ADAPTERS[raw_config["model_type"]]:
        raise MoecacheError(
            f"model.model_type={cfg['model_type']} but {path / 'config.json'} has model_type={raw_config['model_type']}"
        )
    dtype_name = str(cfg.get("dtype", "auto"))
    if dtype_name not in DTYPES:
        raise MoecacheError(f"model.dtype={dtype_name} is not one of {', '.join(DTYPES)}")
    dtype = DTYPES[dtype_name]
    if not isinstance(dtype, torch.dtype):
        dtype = _checkpoint_dtype(raw_config) or torch.float32
    files = weight_files(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError, StrictDataclassError) as exc:
        raise MoecacheError(f"{path / 'config.json'}: {_one_line(exc)}") from exc
    try:
        model = build_skeleton(
            lambda: AutoModelForCausalLM.from_config(config, dtype=dtype), dtype, target, everything
        )
    except (ValueError, TypeError, KeyError, StrictDataclassError) as exc:
        raise MoecacheError(f"{path / 'config.json'}: cannot build the model: {_one_line(exc)}") from exc
    # The per-expert loop ("eager") on the CPU; transformers' default (grouped_mm) elsewhere.
    experts_impl = cfg.get("experts_implementation") or ("eager" if target.type == "cpu" else None)
    if experts_impl:
        model.set_experts_implementation(experts_impl)
    adapter = adapter_for(model)
    if cfg.get("architecture"):
        check_architecture(adapter, dict(cfg["architecture"]), path, _checkpoint_dtype(raw_config))
    return path, raw_config, dtype, files, model, adapter


def describe_model(model_cfg: DictConfig | dict, output_root: str | Path) -> tuple[dict, int]:
    """(the adapter's describe(), the vocabulary size) of the model `model_cfg` names, from its config
    alone (the model built on the meta device; no weight read): what a stage checks its inputs against
    before it loads the model."""
    from moecache.models import random_full

    cfg = _model_dict(model_cfg)
    if random_full.is_random(cfg):
        model, _ = random_full.build_random_model(cfg, "meta")
        adapter = adapter_for(model)
    else:
        *_, model, adapter = _skeleton(cfg, output_root, torch.device("meta"))
    return adapter.describe(), int(model.config.get_text_config().vocab_size)


def load_model(
    model_cfg: DictConfig | dict,
    output_root: str | Path,
    device: str,
    offload: OffloadRequest | None = None,
    progress: bool | None = None,
) -> LoadedModel:
    """Load the model that `model_cfg` (the `model` config group) names, in eval mode on `device`.

    Every weight is read once, straight to where it is used (moecache/models/streaming.py): with
    `offload`, the routed experts into a host expert store (`LoadedModel.store`, its slot count checked
    and resolved in `LoadedModel.fit`), else into the model on `device`. `progress`: draw progress bars
    (None: on a terminal)."""
    from moecache.models.load_progress import LoadProgress

    cfg = _model_dict(model_cfg)
    from moecache.models import random_full

    target = torch.device(_resolve_device(device))
    if random_full.is_random(cfg):  # random weights, no checkpoint (random_full.py)
        with LoadProgress(f"random {cfg.get('name', '')}".strip(), progress) as bars:
            loaded = random_full.load_random(cfg, str(target), offload, bars)
        loaded.times = bars.times
        return loaded
    path, raw_config, dtype, files, model, adapter = _skeleton(cfg, output_root, target)

    from moecache.models.memory_fit import fit_dense, fit_offload
    from moecache.models.streaming import stream_checkpoint

    store = fit = None
    if offload is not None:
        from moecache.models.expert_store import ExpertStore

        fit = fit_offload(
            offload.capacity, num_keys=adapter.num_layers * adapter.num_experts,
            expert_bytes=adapter.expert_bytes, dense_bytes=_dense_bytes(model, True, dtype), device=target,
            headroom=offload.headroom,
        )  # fmt: skip
        E, H, inter = adapter.num_experts, adapter.hidden_size, adapter.moe_intermediate_size
        store = ExpertStore.allocate(adapter.num_layers, E, H, inter, adapter.dtype)
    else:
        fit_dense(_dense_bytes(model, False, dtype), target)

    keep_fp32 = _keep_fp32(type(model), dtype)
    buffers = dict(model.named_buffers())

    def dtype_of(name: str) -> torch.dtype:
        if name in buffers:
            return buffers[name].dtype
        return torch.float32 if keep_fp32(name) else dtype

    total = sum(f.stat().st_size for f in files)
    with LoadProgress(path.name, progress) as bars:
        with bars.phase("read", total) as advance:
            _, headers = stream_checkpoint(path, files, model, adapter, store, target, dtype_of, advance)
        if store is not None and target.type == "cuda":
            with bars.phase("pin", store.nbytes):
                store.pin(offload.pin)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise MoecacheError(f"model.path={path}: cannot load the tokenizer: {_one_line(exc)}") from exc
    model.generation_config = _generation_config(path, model, tokenizer)
    adapter = adapter_for(model)
    commit = _git_revision(path)
    if commit:
        revision = f"git:{commit}"
    elif cfg.get("hash_weights"):
        revision = f"sha256:{weights_sha256(path, Path(output_root) / 'models' / '.revisions')}"
    else:
        revision = f"files:{_files_revision(headers)}"
    return LoadedModel(
        model=model, tokenizer=tokenizer, adapter=adapter, path=path, revision=revision, store=store, fit=fit,
        times=bars.times,
    )  # fmt: skip
