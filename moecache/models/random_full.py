"""A full-size MoE model with random weights, built in memory from a model yaml (no checkpoint).

Real Qwen3.6-35B-A3B weights cannot be fetched here, and the disk of the H200 machine (64 GiB) cannot
hold its bf16 checkpoint (69 GB): the real shape is built with random weights directly on the compute
device and driven with trace-forced routing (docs/runtime.md, "Trace-forced routing"). A model yaml of
conf/model/ (its `model_type`, `architecture` and `dtype`) with a `random:` block instead of a path:

    moecache validate model=deepseek_v2_lite model.path=null model.random.seed=0 device=cuda

| `model.random.` | meaning |
| --- | --- |
| `seed` | torch.manual_seed before the initialisation (null: no random model; give model.path) |
| `vocab_size` | the vocabulary (null: the real model's) |
| `num_layers` | decoder layers kept (null: all); the architecture check then skips what it changes |
| `config_json` | the real model's config.json to take the text fields from (null: the built-in ones) |
| `overrides` | text config fields to change (tests cut the hidden size etc.); skipped by the check likewise |

The text config: the `config_json` when given (a Qwen3.5-MoE one's `text_config`), else the built-in
fields of the real model (`QWEN3_6_TEXT` + the yaml's architecture; `DEEPSEEK_V2_LITE_TEXT`). The
product needs nothing from ../shared. Token ids are the byte tokenizer's (moecache/models/tokenizer.py),
which is the LoadedModel's tokenizer (a random model has no real one; its vocabulary must cover it).

The model is built under `torch.device(device)` in the yaml's dtype (no CPU copy of a 35B model), with
the RNG of that device seeded: the same seed, device and code give the same weights. The built model's
`adapter.describe()` is checked against the yaml's `architecture` (expert_bytes at the yaml's dtype,
keys changed by `num_layers` / `overrides` skipped), one line naming the keys when they disagree.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import transformers

from moecache.artifacts import config_hash
from moecache.errors import MoecacheError

RANDOM_KEYS = ("seed", "vocab_size", "num_layers", "config_json", "overrides")

# Qwen3.6-35B-A3B's text fields beyond the yaml's `architecture` (its config.json), for a machine without
# ../shared: the layer pattern and the partial multimodal RoPE follow from qwen3_5_moe's tiny_config.
QWEN3_6_TEXT = {
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "vocab_size": 248320,
}  # fmt: skip

# DeepSeek-V2-Lite's text fields (its config.json): 27 decoder layers, the first dense; MLA attention.
DEEPSEEK_V2_LITE_TEXT = {
    "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 27, "first_k_dense_replace": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "num_experts_per_tok": 6, "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "norm_topk_prob": False, "max_position_embeddings": 163840, "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6, "hidden_act": "silu",
}  # fmt: skip

# Architecture keys (moecache/models/loading.py ARCHITECTURE_KEYS) that a changed text field changes:
# the architecture check skips them for a cut model.
CHANGES = {
    "num_hidden_layers": ("num_layers", "model_layer_indices"),
    "first_k_dense_replace": ("num_layers", "model_layer_indices"),
    "layer_types": (),
    "hidden_size": ("hidden_size", "expert_bytes"),
    "moe_intermediate_size": ("moe_intermediate_size", "expert_bytes", "shared_expert_intermediate_size"),
    "num_experts": ("num_experts",),
    "n_routed_experts": ("num_experts",),
    "num_experts_per_tok": ("top_k",),
    "shared_expert_intermediate_size": ("shared_expert_intermediate_size",),
    "n_shared_experts": ("shared_expert_intermediate_size", "has_shared_experts"),
}


def is_random(model_cfg: dict) -> bool:
    """Whether the `model` group asks for a random model (`random.seed` set)."""
    block = model_cfg.get("random")
    return isinstance(block, dict) and block.get("seed") is not None


def random_options(model_cfg: dict) -> dict:
    """The checked `model.random` block (module docstring); one line naming the bad key."""
    block = model_cfg.get("random")
    if not isinstance(block, dict):
        raise MoecacheError(f"model.random={block!r}: expected a mapping with seed, vocab_size, ...")
    unknown = sorted(set(block) - set(RANDOM_KEYS))
    if unknown:
        raise MoecacheError(
            f"model.random.{unknown[0]}: unknown key; model.random takes {', '.join(RANDOM_KEYS)}"
        )
    out = {k: block.get(k) for k in RANDOM_KEYS}
    for key in ("seed", "vocab_size", "num_layers"):
        value, low = out[key], 0 if key == "seed" else 1
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise MoecacheError(f"model.random.{key}={value!r}: expected an integer >= {low}")
    if out["config_json"] is not None and not isinstance(out["config_json"], str):
        raise MoecacheError(f"model.random.config_json={out['config_json']!r}: expected a file path")
    overrides = out["overrides"] or {}
    if not isinstance(overrides, dict):
        raise MoecacheError(f"model.random.overrides={overrides!r}: expected a mapping of config fields")
    out["overrides"] = dict(overrides)
    if model_cfg.get("path") is not None:
        raise MoecacheError(
            f"model.random.seed={out['seed']} and model.path={model_cfg['path']}: a random model has no "
            "checkpoint; give one of them"
        )
    return out


# ---- the config ----------------------------------------------------------------------------------


def text_config(model_cfg: dict, options: dict) -> transformers.PretrainedConfig:
    """The text config of the random model (module docstring), cut by `num_layers` / `overrides`."""
    from moecache.models import ADAPTERS
    from moecache.models.tokenizer import tiny_token_ids

    model_type = model_cfg.get("model_type")
    name = model_cfg.get("name", model_type)
    if options["config_json"] is not None:
        fields, cls = _from_json(Path(options["config_json"]).expanduser(), model_type)
    elif model_type == "qwen3_5_moe":
        a = _architecture(model_cfg)
        config = ADAPTERS["qwen3_5_moe"].tiny_config(
            num_hidden_layers=a["num_layers"], num_experts=a["num_experts"], num_experts_per_tok=a["top_k"],
            hidden_size=a["hidden_size"], moe_intermediate_size=a["moe_intermediate_size"],
            shared_expert_intermediate_size=a["shared_expert_intermediate_size"], **QWEN3_6_TEXT,
        ).text_config  # fmt: skip
        fields, cls = config.to_dict(), transformers.Qwen3_5MoeTextConfig
    elif model_type == "deepseek_v2":
        fields, cls = dict(DEEPSEEK_V2_LITE_TEXT), transformers.DeepseekV2Config
    else:
        raise MoecacheError(
            f"model.random: no built-in full config for model_type {model_type!r} (model {name}); "
            "give model.random.config_json=/path/to/config.json"
        )
    for key in ("model_type", "dtype", "torch_dtype", "architectures", "transformers_version"):
        fields.pop(key, None)
    fields.update(tiny_token_ids())  # the byte tokenizer's ids (the LoadedModel's tokenizer)
    if options["vocab_size"] is not None:
        fields["vocab_size"] = options["vocab_size"]
    cut = dict(options["overrides"])
    if options["num_layers"] is not None:
        full = fields.get("num_hidden_layers")
        if isinstance(full, int) and options["num_layers"] > full:
            raise MoecacheError(
                f"model.random.num_layers={options['num_layers']}: {name} has {full} decoder layers; "
                f"keep at most {full}"
            )
        cut["num_hidden_layers"] = options["num_layers"]
    if (
        "num_hidden_layers" in cut
        and isinstance(fields.get("layer_types"), list)
        and "layer_types" not in cut
    ):
        cut["layer_types"] = fields["layer_types"][: cut["num_hidden_layers"]]
    known = set(fields) | set(getattr(cls, "attribute_map", {}))
    unknown = sorted(set(options["overrides"]) - known)
    if unknown:
        raise MoecacheError(f"model.random.overrides.{unknown[0]} is not a field of {cls.__name__}")
    fields.update(cut)
    try:
        return cls(**fields)
    except (TypeError, ValueError) as exc:
        raise MoecacheError(f"model.random: invalid {cls.__name__}: {' '.join(str(exc).split())}") from exc


def _architecture(model_cfg: dict) -> dict:
    a = model_cfg.get("architecture")
    need = ("num_layers", "num_experts", "top_k", "hidden_size", "moe_intermediate_size",
            "shared_expert_intermediate_size")  # fmt: skip
    missing = [k for k in need if not isinstance(a, dict) or a.get(k) is None]
    if missing:
        raise MoecacheError(
            f"model.architecture.{missing[0]} is not set: a built-in random qwen3_5_moe takes its shape there"
        )
    return a


def _from_json(path: Path, model_type: str | None) -> tuple[dict, type]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MoecacheError(f"model.random.config_json={path}: {' '.join(str(exc).split())}") from exc
    got = raw.get("model_type") if isinstance(raw, dict) else None
    if got != model_type:
        raise MoecacheError(
            f"model.random.config_json={path}: model_type {got!r}, model.model_type {model_type}"
        )
    if model_type == "qwen3_5_moe":
        return dict(raw["text_config"]), transformers.Qwen3_5MoeTextConfig
    return dict(raw), type(transformers.AutoConfig.for_model(model_type))


# ---- the model -----------------------------------------------------------------------------------


def instantiate(cls, text: transformers.PretrainedConfig, device, dtype: torch.dtype, seed: int):
    """`cls(text)` in eval mode, every weight but the routed experts made directly on `device` in
    `dtype` from `seed`; the routed experts left on the meta device for `fill_experts` (the caller's
    random state and default dtype are left as they were)."""
    from moecache.models.skeleton import build_skeleton, routed_experts

    target = torch.device(device)
    rng_devices = [target.index if target.index is not None else torch.cuda.current_device()] if (
        target.type == "cuda"
    ) else []  # fmt: skip
    with torch.random.fork_rng(devices=rng_devices, device_type="cuda"):
        torch.manual_seed(seed)
        return build_skeleton(lambda: cls(text), dtype, target, routed_experts)


def random_experts(
    adapter, layer_id: int, seed: int, std: float, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up_EIH, down_EHI) of one MoE layer: normal(0, std) from a generator seeded by (seed,
    layer), made on `device` in the model's dtype. The same seed, layer and device give the same
    weights, whether they go to the model or to the expert store."""
    E, H, inter = adapter.num_experts, adapter.hidden_size, adapter.moe_intermediate_size
    generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + layer_id)
    gate_up_EIH = torch.empty((E, 2 * inter, H), dtype=adapter.dtype, device=device)
    down_EHI = torch.empty((E, H, inter), dtype=adapter.dtype, device=device)
    gate_up_EIH.normal_(0.0, std, generator=generator)
    down_EHI.normal_(0.0, std, generator=generator)
    return gate_up_EIH, down_EHI


def fill_experts(model, adapter, seed: int, device, store=None, advance=None) -> None:
    """Generate every MoE layer's routed experts (`random_experts`, one layer at a time) into the
    model's own expert parameters on `device`, or into `store` (an ExpertStore: no full model is ever
    materialised, on the host or the device). `advance(nbytes)` reports progress."""
    std = float(getattr(model.config.get_text_config(), "initializer_range", 0.02))
    E = adapter.num_experts
    for layer in adapter.moe_layers():
        gate_up_EIH, down_EHI = random_experts(adapter, layer.layer_id, seed, std, device)
        if store is None:
            layer.experts._parameters["gate_up_proj"] = torch.nn.Parameter(gate_up_EIH, requires_grad=False)
            layer.experts._parameters["down_proj"] = torch.nn.Parameter(down_EHI, requires_grad=False)
        else:  # the layer's rows laid out as the store's (w13 then w2 per expert), then one copy
            rows = slice(layer.layer_id * E, (layer.layer_id + 1) * E)
            n13 = gate_up_EIH[0].numel()
            rows_EN = torch.empty((E, n13 + down_EHI[0].numel()), dtype=adapter.dtype, device=device)
            rows_EN[:, :n13] = gate_up_EIH.reshape(E, -1)
            rows_EN[:, n13:] = down_EHI.reshape(E, -1)
            store.flat_GB[rows].copy_(rows_EN.view(torch.uint8))
            del gate_up_EIH, down_EHI, rows_EN
        if advance is not None:
            advance(E * adapter.expert_bytes)


def build_random_model(
    model_cfg: dict, device: str | torch.device, dtype: torch.dtype | None = None, experts: bool = True
):
    """(model, options): the random model of `model_cfg` (module docstring) on `device` ("meta" gives
    the shapes without memory), in `dtype` (default: model.dtype), eval mode, architecture checked.
    `experts=False` leaves the routed experts on the meta device (`fill_experts` puts them in a store)."""
    from moecache.models.adapter import adapter_for
    from moecache.models.loading import DTYPES

    options = random_options(model_cfg)
    if dtype is None:
        name = str(model_cfg.get("dtype") or "float32")
        if not isinstance(DTYPES.get(name), torch.dtype):
            raise MoecacheError(f"model.dtype={name}: a random model needs float32, bfloat16 or float16")
        dtype = DTYPES[name]
    text = text_config(model_cfg, options)
    cls = (
        transformers.Qwen3_5MoeForCausalLM
        if model_cfg.get("model_type") == "qwen3_5_moe"
        else transformers.DeepseekV2ForCausalLM
        if model_cfg.get("model_type") == "deepseek_v2"
        else transformers.AutoModelForCausalLM.from_config
    )
    model = instantiate(cls, text, device, dtype, int(options["seed"]))
    adapter = adapter_for(model)
    check_built(model_cfg, adapter.describe(), dtype, options)
    if experts and torch.device(device).type != "meta":
        fill_experts(model, adapter, int(options["seed"]), device)
    return model, options


def check_built(model_cfg: dict, arch: dict, dtype: torch.dtype, options: dict) -> None:
    """The built architecture against the yaml's (module docstring): one line naming every disagreement."""
    from moecache.models.loading import ARCHITECTURE_KEYS, DTYPES

    want = dict(model_cfg.get("architecture") or {})
    unknown = sorted(set(want) - set(ARCHITECTURE_KEYS))
    if unknown:
        raise MoecacheError(f"model.architecture.{unknown[0]} is not a known architecture key")
    skipped = {k for f in options["overrides"] for k in CHANGES.get(f, ())}
    if options["num_layers"] is not None:
        skipped |= set(CHANGES["num_hidden_layers"])
    got = dict(arch)
    yaml_dtype = DTYPES.get(str(model_cfg.get("dtype")))
    if isinstance(yaml_dtype, torch.dtype):  # expert_bytes as the yaml states it: at its own dtype
        got["expert_bytes"] = arch["expert_bytes"] // dtype.itemsize * yaml_dtype.itemsize
    wrong = {
        k: (got.get(k), v) for k, v in want.items() if k not in skipped and v is not None and got.get(k) != v
    }
    if wrong:
        shown = ", ".join(f"{k}: built {b}, yaml {y}" for k, (b, y) in wrong.items())
        raise MoecacheError(
            f"model {model_cfg.get('name')}: random model and model.architecture disagree: {shown}"
        )


def load_random(model_cfg: dict, device: str, offload=None, bars=None):
    """The LoadedModel of a random model (moecache/models/loading.py's `load_model` branch); with
    `offload` (a loading.OffloadRequest) its routed experts are generated into an expert store, checked
    against the machine's memory first, and the rest of the model is made on `device`."""
    from transformers import GenerationConfig

    from moecache.models.adapter import adapter_for
    from moecache.models.loading import LoadedModel, _dense_bytes
    from moecache.models.memory_fit import fit_dense, fit_offload
    from moecache.models.tokenizer import build_byte_tokenizer

    meta, options = build_random_model(model_cfg, "meta")
    adapter = adapter_for(meta)
    dtype = adapter.dtype
    if offload is not None:
        fit = fit_offload(
            offload.capacity, num_keys=adapter.num_layers * adapter.num_experts, expert_bytes=adapter.expert_bytes,
            dense_bytes=_dense_bytes(meta, True, dtype), device=torch.device(device), headroom=offload.headroom,
        )  # fmt: skip
    else:
        fit = None
        fit_dense(_dense_bytes(meta, False, dtype), torch.device(device))
    del meta, adapter
    model, options = build_random_model(model_cfg, device, experts=False)
    adapter = adapter_for(model)
    store = None
    if offload is not None:
        from moecache.models.expert_store import ExpertStore

        E, H, inter = adapter.num_experts, adapter.hidden_size, adapter.moe_intermediate_size
        store = ExpertStore.allocate(adapter.num_layers, E, H, inter, adapter.dtype)
    total = adapter.num_layers * adapter.num_experts * adapter.expert_bytes
    seed = int(options["seed"])
    on_cuda = torch.device(device).type == "cuda"
    if store is not None and on_cuda:
        # Pinned before it is filled, so the layers made on the device land with full-speed copies; the
        # pages are first touched by torch's threads (zero_), which registering alone does one by one.
        with contextlib.ExitStack() as phases:
            if bars is not None:
                phases.enter_context(bars.phase("pin", store.nbytes))
            store.flat_GB.zero_()
            store.pin(offload.pin)
    if bars is not None:
        with bars.phase("generate", total) as advance:
            fill_experts(model, adapter, seed, device, store, advance)
    else:
        fill_experts(model, adapter, seed, device, store)
    impl = model_cfg.get("experts_implementation") or ("eager" if str(device) == "cpu" else None)
    if impl:
        model.set_experts_implementation(impl)
    tokenizer = build_byte_tokenizer()
    vocab = model.config.get_text_config().vocab_size
    if vocab < len(tokenizer):
        raise MoecacheError(
            f"model.random.vocab_size={vocab}: smaller than the byte tokenizer's {len(tokenizer)} tokens"
        )
    model.generation_config = GenerationConfig.from_model_config(model.config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    key = {
        "model_type": model_cfg.get("model_type"), "architecture": model_cfg.get("architecture"),
        "dtype": str(model_cfg.get("dtype")), "random": options, "device_type": torch.device(device).type,
    }  # fmt: skip
    name = f"random-{model_cfg.get('name', model_cfg.get('model_type'))}-seed{options['seed']}"
    return LoadedModel(
        model=model, tokenizer=tokenizer, adapter=adapter_for(model), path=Path(name),
        revision=f"random:{config_hash(key)[:16]}", store=store, fit=fit,
    )  # fmt: skip
