"""Checkpoints of ``training.model.MSAForCausalLM`` as HF-style directories SGLang serves.

``export_checkpoint`` writes what ``python -m sglang.launch_server --model-path <dir>`` loads with
its default load format: bf16 safetensors shards (``model-0000i-of-0000n.safetensors``, each under
``max_shard_bytes`` of tensor data), ``model.safetensors.index.json``, ``config.json`` and the
tokenizer files. Tensor names are the model's ``state_dict()`` names, which are the checkpoint
names SGLang's MiniMax-M3 ``load_weights`` reads (``q_proj``/``k_proj``/``v_proj`` and
``gate_proj``/``up_proj`` are stacked by SGLang itself). ``load_checkpoint`` reads one back.
"""

import json
import shutil
from pathlib import Path

import torch

from .model import MSAConfig, MSAForCausalLM

INDEX_FILE = "model.safetensors.index.json"
SHARD_PATTERN = "model-{:05d}-of-{:05d}.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
DEFAULT_MAX_SHARD_BYTES = 15 * 2**20


def _shards(tensors: dict, max_shard_bytes: int) -> list:
    """Names grouped in order into shards of at most ``max_shard_bytes`` tensor bytes."""
    shards, current, size = [], [], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if n > max_shard_bytes:
            raise ValueError(f"tensor {name} has {n} bytes, more than max_shard_bytes={max_shard_bytes}; "
                             "raise max_shard_bytes (a tensor cannot span shards)")
        if current and size + n > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        shards.append(current)
    return shards


def export_checkpoint(model: MSAForCausalLM, config_dict: dict, tokenizer_dir, out_dir,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write ``model`` as a bf16 HF checkpoint directory; returns ``out_dir``.

    Args:
        model: the model to save (any device/dtype; weights are rounded to bf16).
        config_dict: its ``config.json`` (validated: ``MSAConfig.from_dict(config_dict)`` must equal
            ``model.config``); written with ``torch_dtype`` bfloat16.
        tokenizer_dir: directory holding ``tokenizer.json`` and friends (``TOKENIZER_FILES``), copied.
        out_dir: created if missing; earlier ``model*.safetensors`` files and the index are replaced.
        max_shard_bytes: tensor bytes per shard (default 15 MiB, so files stay under 16 MB).
    """
    cfg = MSAConfig.from_dict(config_dict)
    if cfg != model.config:
        raise ValueError(f"config_dict describes {cfg}, but the model was built from {model.config}")
    tokenizer_dir, out_dir = Path(tokenizer_dir), Path(out_dir)
    tok_files = [tokenizer_dir / f for f in TOKENIZER_FILES if (tokenizer_dir / f).is_file()]
    if not any(f.name in ("tokenizer.json", "tokenizer.model", "vocab.json") for f in tok_files):
        raise ValueError(f"tokenizer_dir {tokenizer_dir} holds no tokenizer.json, tokenizer.model or vocab.json")
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu", torch.bfloat16).contiguous() for name, t in model.state_dict().items()}
    groups = _shards(tensors, max_shard_bytes)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in list(out_dir.glob("model*.safetensors")) + [out_dir / INDEX_FILE]:
        old.unlink(missing_ok=True)
    weight_map = {}
    for i, names in enumerate(groups):
        fname = SHARD_PATTERN.format(i + 1, len(groups))
        save_file({n: tensors[n] for n in names}, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out_dir / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps({**config_dict, "torch_dtype": "bfloat16"}, indent=2) + "\n")
    for f in tok_files:
        shutil.copyfile(f, out_dir / f.name)
    return out_dir


def load_checkpoint(path, device="cpu", dtype: torch.dtype = torch.float32) -> MSAForCausalLM:
    """The model saved in directory ``path`` (``export_checkpoint``'s layout, or one ``model.safetensors``),
    its bf16 weights cast to ``dtype`` on ``device``. Missing or unexpected tensors raise."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = MSAConfig.from_json(path / "config.json")
    index = path / INDEX_FILE
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path} holds neither {INDEX_FILE} nor model.safetensors")
    state = {}
    for f in files:
        state.update(load_file(str(path / f)))
    model = MSAForCausalLM(cfg)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model.to(device=device, dtype=dtype)


def export_state(state_path, out_dir, tokenizer_dir=None) -> Path:
    """Export the weights of a training state (``training.train``'s ``ckpt/state.pt`` or ``portable.pt``)
    to ``out_dir`` with ``trainer_state.json``; for a call whose trainer was stopped before its own export."""
    from . import data

    state = torch.load(state_path, map_location="cpu", weights_only=False)
    plan = state["plan"]
    config_dict = json.loads(Path(plan["config"]).read_text())
    model = MSAForCausalLM(MSAConfig.from_dict(config_dict))
    model.load_state_dict(state["model"])
    out = export_checkpoint(model, config_dict, tokenizer_dir or plan.get("tokenizer") or data.TOKENIZER_DIR, out_dir)
    trainer_state = {"step": state["step"], "trained_s": state["trained_s"], "plan": plan,
                     "exported_from": Path(state_path).name}
    (out / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2) + "\n")
    return out


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="export a training state's weights as an SGLang checkpoint")
    parser.add_argument("state", help="ckpt/state.pt or portable.pt of a training run")
    parser.add_argument("out", help="export directory")
    args = parser.parse_args()
    print(f"exported {args.state} to {export_state(args.state, args.out)}")
