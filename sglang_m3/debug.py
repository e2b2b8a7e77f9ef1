"""Opt-in recorder of MSA block selections, for tests and debugging (off by default).

Enabled by the model-config key ``index_k_debug_record`` (a file path; set it with
``--json-model-override-args '{"index_k_debug_record": "sel.jsonl"}'``). Each sparse-layer forward
appends one JSON line::

    {"mode": "extend"|"decode", "layer": int, "positions": [rows], "selected": [H][rows][topk],
     "n_visible": [rows], "scores": [H][rows][nb] (first sparse layer only)}

It copies tensors to the host, so it is for eager (CPU or --disable-cuda-graph) runs only.
"""

import json
import math

import torch


class SelectionRecorder:
    """Appends selections (and the first sparse layer's scores) to ``path``."""

    def __init__(self, path: str, score_layer: int):
        self.path = path
        self.score_layer = score_layer

    @classmethod
    def from_config(cls, hf_config, sparse_layer_ids):
        path = getattr(hf_config, "index_k_debug_record", None)
        return cls(path, min(sparse_layer_ids)) if path else None

    def record(self, mode: str, layer_id: int, positions: torch.Tensor, n_visible: torch.Tensor,
               selected: torch.Tensor, scores: torch.Tensor) -> None:
        entry = {
            "mode": mode,
            "layer": layer_id,
            "positions": positions.tolist(),
            "n_visible": n_visible.tolist(),
            "selected": selected.tolist(),
        }
        if layer_id == self.score_layer:
            nb = int(n_visible.max()) if n_visible.numel() else 0
            entry["scores"] = [[[s if math.isfinite(s) else None for s in row] for row in head]
                               for head in scores[:, :, :nb].tolist()]
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
