"""Building the tiny model, loading checkpoints as real ones are loaded, and the loader's errors.

Shapes: B batch, S sequence, V vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from moecache.config import CONF_DIR, compose
from moecache.errors import MoecacheError
from moecache.models import ADAPTERS, build_byte_tokenizer, build_tiny, load_model
from moecache.models.tokenizer import ENDOFTEXT_ID, IM_END_ID, IM_START_ID

TRICKY_TEXTS = ["héllo wörld 🙂\n", "e\u0301 composed?", "<|im_start|>user\nhi<|im_end|>", "  tabs\tand\r\n"]


def file_digests(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()
    }


def tiny_cfg(output_root: Path, *overrides: str):
    return compose(["model=tiny", f"output_root={output_root}", *overrides])


def other_type_cfg(model_type: str) -> dict:
    """A tiny model of another architecture, as a plain dict (load_model takes a dict or a DictConfig)."""
    build = {"seed": 0, "overrides": {}}
    return {
        "name": f"tiny-{model_type}",
        "model_type": model_type,
        "path": None,
        "dtype": "float32",
        "build": build,
    }


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """The default tiny model, built once for this module."""
    root = tmp_path_factory.mktemp("out")
    return build_tiny(tiny_cfg(root).model, root)


def broken_copy(tiny_dir: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, folder)
    return folder


def cfg_with_path(tmp_path: Path, path, *overrides: str):
    cfg = tiny_cfg(tmp_path, *overrides)
    cfg.model.path = str(path)
    return cfg


# ------------------------------------------------------------------------------------------ build


def test_build_tiny_is_deterministic_and_reused(tmp_path, tiny_dir):
    cfg = tiny_cfg(tmp_path)
    folder = build_tiny(cfg.model, tmp_path)
    assert folder.parent == tmp_path / "models" and folder.name.startswith("tiny-")
    assert folder.name == tiny_dir.name  # the name is a hash of the build config
    assert file_digests(folder) == file_digests(tiny_dir)  # byte-identical, built twice
    assert {"config.json", "model.safetensors", "tokenizer.json", "build.json"} <= set(file_digests(folder))
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert build_tiny(cfg.model, tmp_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".tmp-")]

    other = build_tiny(tiny_cfg(tmp_path, "model.build.seed=1").model, tmp_path)
    assert (
        other != folder
        and file_digests(other)["model.safetensors"] != file_digests(folder)["model.safetensors"]
    )


def test_tiny_checkpoint_looks_like_the_real_one(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe"
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert set(config["text_config"]["layer_types"]) == {"linear_attention", "full_attention"}
    assert "vision_config" in config


# ------------------------------------------------------------------------------------------- load


def test_load_model_round_trip_matches_the_in_memory_model(tmp_path, tiny_dir):
    cfg = tiny_cfg(tmp_path)
    loaded = load_model(cfg.model, tiny_dir.parent.parent, "cpu")
    assert loaded.path == tiny_dir
    assert type(loaded.model).__name__ == "Qwen3_5MoeForCausalLM"  # AutoModelForCausalLM: the text part
    assert not loaded.model.training
    assert loaded.adapter.describe()["num_layers"] == 4 and loaded.adapter.top_k == 4
    assert loaded.adapter.num_experts == 32

    overrides = OmegaConf.to_container(cfg.model.build.overrides)
    config = ADAPTERS["qwen3_5_moe"].tiny_config(**overrides)
    torch.manual_seed(cfg.model.build.seed)
    reference = transformers.Qwen3_5MoeForConditionalGeneration(config).eval()
    input_ids_BS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected_BSV = reference(input_ids=input_ids_BS).logits
        logits_BSV = loaded.model(input_ids=input_ids_BS).logits
    torch.testing.assert_close(logits_BSV, expected_BSV, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "olmoe", "deepseek_v2"])
def test_every_architecture_builds_and_loads(tmp_path, model_type):
    loaded = load_model(other_type_cfg(model_type), tmp_path, "cpu")
    assert type(loaded.adapter) is ADAPTERS[model_type]
    config = ADAPTERS[model_type].tiny_config()
    torch.manual_seed(0)
    reference = getattr(transformers, config.architectures[0])(config).eval()
    input_ids_BS = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.model(input_ids=input_ids_BS).logits,
            reference(input_ids=input_ids_BS).logits,
            rtol=1e-5,
            atol=1e-5,
        )
    # Whatever tokenizer class AutoTokenizer picks for the model type, it encodes as the built one does.
    for text in TRICKY_TEXTS:
        assert loaded.tokenizer(text)["input_ids"] == build_byte_tokenizer()(text)["input_ids"]


def test_loaded_model_generates_offline_from_a_chat_prompt(tmp_path, tiny_dir):
    loaded = load_model(tiny_cfg(tmp_path).model, tiny_dir.parent.parent, "cpu")
    assert loaded.model.generation_config.eos_token_id == IM_END_ID
    assert loaded.model.generation_config.pad_token_id == ENDOFTEXT_ID
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert prompt["input_ids"][0, 0].item() == IM_START_ID
    out = loaded.model.generate(**prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.shape == (1, prompt["input_ids"].shape[1] + 6)


def test_dtype_and_revision(tmp_path, tiny_dir):
    output_root = tiny_dir.parent.parent
    loaded = load_model(tiny_cfg(tmp_path, "model.dtype=bfloat16").model, output_root, "cpu")
    assert loaded.model.dtype == torch.bfloat16
    assert loaded.adapter.expert_bytes == 3 * 64 * 32 * 2
    # by default the files' identity (names, sizes, headers, sampled bytes): no pass over the data
    assert loaded.revision.startswith("files:")
    assert load_model(tiny_cfg(tmp_path).model, output_root, "cpu").revision == loaded.revision
    copy = broken_copy(tiny_dir, tmp_path)  # a copy is the same checkpoint
    assert load_model(cfg_with_path(tmp_path, copy).model, tmp_path, "cpu").revision == loaded.revision
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-4:] = bytes(4 - i for i in range(4)) if data[-4:] != bytes([4, 3, 2, 1]) else b"\0\0\0\0"
    (copy / "model.safetensors").write_bytes(bytes(data))  # the last weight changed, the same shapes
    assert load_model(cfg_with_path(tmp_path, copy).model, tmp_path, "cpu").revision != loaded.revision
    # model.hash_weights=true: the SHA-256 of every byte, cached
    hashed = load_model(tiny_cfg(tmp_path, "model.hash_weights=true").model, output_root, "cpu")
    expected = hashlib.sha256(
        b"model.safetensors\0" + (tiny_dir / "model.safetensors").read_bytes()
    ).hexdigest()
    assert hashed.revision == f"sha256:{expected}"
    assert list((output_root / "models" / ".revisions").glob("*.json"))  # cached


def test_git_revision_is_preferred(tmp_path, tiny_dir):
    folder = broken_copy(tiny_dir, tmp_path)
    commit = "0123456789abcdef0123456789abcdef01234567"
    (folder / ".git" / "refs" / "heads").mkdir(parents=True)
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (folder / ".git" / "refs" / "heads" / "main").write_text(commit + "\n")
    assert load_model(cfg_with_path(tmp_path, folder).model, tmp_path, "cpu").revision == f"git:{commit}"


def test_byte_tokenizer_saves_and_loads(tmp_path):
    tokenizer = build_byte_tokenizer()
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [256, 257, 258]
    assert tokenizer("hé")["input_ids"] == list("hé".encode())
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    for text in TRICKY_TEXTS:
        ids = loaded(text)["input_ids"]
        assert ids == tokenizer(text)["input_ids"]
        assert loaded.decode(ids) == tokenizer.decode(ids)
    chat = [{"role": "user", "content": "hi"}]
    assert loaded.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


# ----------------------------------------------------------------------------------------- configs


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))
def test_every_model_config_composes(name):
    model = compose([f"model={name}"]).model
    assert model.name == name and model.model_type in ADAPTERS
    assert model.dtype in ("float32", "bfloat16", "float16", "auto")
    if OmegaConf.is_missing(model, "path"):
        assert model.architecture.num_layers > 0
        assert (
            model.architecture.expert_bytes
            == 3 * model.architecture.hidden_size * (model.architecture.moe_intermediate_size) * 2
        )
    else:
        assert model.path is None and "build" in model


# ------------------------------------------------------------------------------------------ errors


def test_real_model_config_needs_a_path(tmp_path):
    cfg = compose(["model=qwen3_6_35b_a3b", f"output_root={tmp_path}"])
    with pytest.raises(MoecacheError, match=r"model\.path is not set"):
        load_model(cfg.model, tmp_path, "cpu")


def test_architecture_mismatch_names_the_key(tmp_path, tiny_dir):
    cfg = compose(["model=qwen3_6_35b_a3b", f"model.path={tiny_dir}", f"output_root={tmp_path}"])
    with pytest.raises(MoecacheError, match=r"model\.architecture\.num_layers=40 but .* has num_layers=4"):
        load_model(cfg.model, tmp_path, "cpu")
    ok = cfg_with_path(
        tmp_path, tiny_dir, "+model.architecture.top_k=4", "+model.architecture.expert_bytes=24576"
    )
    assert load_model(ok.model, tmp_path, "cpu").adapter.top_k == 4
    bad = cfg_with_path(tmp_path, tiny_dir, "+model.architecture.num_layers=4", "+model.architecture.top_k=8")
    with pytest.raises(MoecacheError, match=r"model\.architecture\.top_k=8 .* has top_k=4"):
        load_model(bad.model, tmp_path, "cpu")
    unknown = cfg_with_path(tmp_path, tiny_dir, "+model.architecture.num_expertz=4")
    with pytest.raises(
        MoecacheError, match=r"model\.architecture\.num_expertz is not a known architecture key"
    ):
        load_model(unknown.model, tmp_path, "cpu")


def break_missing(folder: Path) -> Path:
    return folder / "nowhere"


def break_file(folder: Path) -> Path:
    return folder / "config.json"


def break_no_config(folder: Path) -> Path:
    (folder / "config.json").unlink()
    return folder


def break_malformed_config(folder: Path) -> Path:
    (folder / "config.json").write_text('{"model_type": "qwen3_5_moe",')
    return folder


def break_unknown_model_type(folder: Path) -> Path:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    return folder


def break_no_weights(folder: Path) -> Path:
    (folder / "model.safetensors").unlink()
    return folder


def break_missing_shard(folder: Path) -> Path:
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def break_bad_config_value(folder: Path) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["num_experts"] = "many"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


ERROR_CASES = {
    break_missing: r"model\.path=.*nowhere does not exist",
    break_file: r"model\.path=.*config\.json is not a folder",
    break_no_config: r"model\.path=.*ckpt has no config\.json",
    break_malformed_config: r"ckpt/config\.json is not valid JSON",
    break_unknown_model_type: r"config\.json: model_type 'llama' is not supported \(supported: deepseek_v2,",
    break_no_weights: r"model\.path=.*ckpt has no weights files",
    break_missing_shard: r"weights file model-00002-of-00002\.safetensors .* is missing",
    break_bad_config_value: r"ckpt/config\.json: .*num_experts",
}


@pytest.mark.parametrize("breaker", list(ERROR_CASES), ids=[f.__name__ for f in ERROR_CASES])
def test_bad_checkpoints_raise_one_line_errors(tmp_path, tiny_dir, breaker):
    path = breaker(broken_copy(tiny_dir, tmp_path))
    with pytest.raises(MoecacheError, match=ERROR_CASES[breaker]) as info:
        load_model(cfg_with_path(tmp_path, path).model, tmp_path, "cpu")
    assert "\n" not in str(info.value)


def test_model_type_mismatch_and_bad_dtype(tmp_path, tiny_dir):
    with pytest.raises(
        MoecacheError, match=r"model\.model_type=mixtral but .*config\.json has model_type=qwen3_5_moe"
    ):
        load_model(cfg_with_path(tmp_path, tiny_dir, "model.model_type=mixtral").model, tmp_path, "cpu")
    with pytest.raises(
        MoecacheError, match=r"model\.model_type=llama is not supported \(supported: deepseek_v2,"
    ):
        load_model(cfg_with_path(tmp_path, tiny_dir, "model.model_type=llama").model, tmp_path, "cpu")
    with pytest.raises(MoecacheError, match=r"model\.dtype=float8 is not one of"):
        load_model(cfg_with_path(tmp_path, tiny_dir, "model.dtype=float8").model, tmp_path, "cpu")


def test_truncated_weights_are_refused(tmp_path, tiny_dir):
    from safetensors.torch import load_file, save_file

    folder = broken_copy(tiny_dir, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    dropped = sorted(k for k in tensors if "layers.1.mlp.gate.weight" in k)
    save_file(
        {k: v for k, v in tensors.items() if k not in dropped}, folder / "model.safetensors", {"format": "pt"}
    )
    with pytest.raises(MoecacheError, match=r"no tensor for model\.layers\.1\.mlp\.gate\.weight"):
        load_model(cfg_with_path(tmp_path, folder).model, tmp_path, "cpu")


def test_build_removes_what_a_killed_builder_left(tmp_path):
    import subprocess
    import sys

    from moecache.artifacts import TMP_PREFIX, owner_tag

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    models = tmp_path / "models"
    models.mkdir()
    left = models / f"{TMP_PREFIX}tiny-0123456789ab-{owner_tag()}-{dead.pid}-0badc0de"
    (left / "sub").mkdir(parents=True)
    build_tiny(tiny_cfg(tmp_path).model, tmp_path)
    assert not left.exists()
    assert not [p for p in models.iterdir() if p.name.startswith(TMP_PREFIX)]
