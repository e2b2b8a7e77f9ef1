"""Opt-in recorder of MSA block selections, for tests and debugging (off by default).

Enabled by the model-config key ``index_k_debug_record`` (a file path; set it with
``--json-model-override-args '{"index_k_debug_record": "sel.jsonl"}'``). Each sparse-layer forward
appends one JSON line::

    {"mode": "extend"|"decode", "layer": int, "positions": [rows], "heads": [H],
     "selected": [H][rows][topk], "n_visible": [rows], "scores": [H][rows][nb] (first sparse layer only)}

``heads`` are the global index-head ids of this rank's rows of ``selected``/``scores``. Under
attention tensor parallelism each rank holds its own index-query heads and writes its own file,
``<path>.rank<attn_tp_rank>``; concatenating the ranks' ``selected`` in ``heads`` order gives what
one rank would select with every head.

It copies tensors to the host, so it records eager forwards only: prefill always, decode on the CPU
or with ``--disable-cuda-graph``; decode steps inside CUDA-graph capture are skipped (replays do
not call it).
"""

import json
import math

import torch


def index_heads_of_rank(total_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    """Global index-head ids attention-TP rank ``tp_rank`` of ``tp_size`` computes.

    Mirrors SGLang's MiniMax-M3 sharding of ``index_qkv_proj``: heads split over
    ``min(tp_size, total_heads)`` groups of consecutive ranks (each group of
    ``tp_size // that`` ranks shares its heads); the single index key is replicated.
    """
    groups = min(tp_size, total_heads)
    per_group = total_heads // groups
    group = tp_rank // (tp_size // groups)
    return list(range(group * per_group, (group + 1) * per_group))


class SelectionRecorder:
    """Appends selections (and the first sparse layer's scores) to ``path``."""

    def __init__(self, path: str, score_layer: int, heads: list[int]):
        self.path = path
        self.score_layer = score_layer
        self.heads = heads

    @classmethod
    def from_config(cls, hf_config, sparse_layer_ids):
        path = getattr(hf_config, "index_k_debug_record", None)
        if not path:
            return None
        from sglang.srt.configs.model_config import get_minimax_sparse_attention_config
        from sglang.srt.runtime_context import get_parallel

        tp_size, tp_rank = get_parallel().attn_tp_size, get_parallel().attn_tp_rank
        total = get_minimax_sparse_attention_config(hf_config)["sparse_num_index_heads"]
        if tp_size > 1:
            path = f"{path}.rank{tp_rank}"
        return cls(path, min(sparse_layer_ids), index_heads_of_rank(total, tp_size, tp_rank))

    def record(self, mode: str, layer_id: int, positions: torch.Tensor, n_visible: torch.Tensor,
               selected: torch.Tensor, scores: torch.Tensor) -> None:
        if selected.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        entry = {
            "mode": mode,
            "layer": layer_id,
            "positions": positions.tolist(),
            "heads": self.heads,
            "n_visible": n_visible.tolist(),
            "selected": selected.tolist(),
        }
        if layer_id == self.score_layer:
            nb = int(n_visible.max()) if n_visible.numel() else 0
            entry["scores"] = [[[s if math.isfinite(s) else None for s in row] for row in head]
                               for head in scores[:, :, :nb].tolist()]
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
