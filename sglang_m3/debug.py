"""Opt-in recorder of MSA block selections, for tests and debugging (off by default).

Enabled by the model-config key ``index_k_debug_record`` (a file path; set it with
``--json-model-override-args '{"index_k_debug_record": "sel.jsonl"}'``). Each sparse-layer forward
appends one JSON line::

    {"mode": "extend"|"decode", "layer": int, "positions": [rows], "heads": [H],
     "selected": [H][rows][topk], "n_visible": [rows], "scores": [H][rows][nb] (first sparse layer only)}

``nb`` is ``max(n_visible)``; a score is None where it is not finite or its block is at or past its
row's ``n_visible`` (not scored for that row).

``heads`` are the global index-head ids of this rank's rows of ``selected``/``scores``. Under
attention tensor parallelism each rank holds its own index-query heads and writes its own file,
``<path>.rank<attn_tp_rank>``; concatenating the ranks' ``selected`` in ``heads`` order gives what
one rank would select with every head.

``index_k_debug_rows`` (an int N, default unset = every row) keeps only the extend rows among the
last N tokens of their request at that forward (``position >= seq_len - N``: the end of the prompt
at its last chunk); decode rows are always last rows. Long prompts then record a bounded tail.

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

    def __init__(self, path: str, score_layer: int, heads: list[int], last_rows: int | None = None):
        if last_rows is not None and (isinstance(last_rows, bool) or not isinstance(last_rows, int) or last_rows < 1):
            raise ValueError(f"index_k_debug_rows must be an int >= 1 (or unset for every row), got {last_rows!r}")
        self.path = path
        self.score_layer = score_layer
        self.heads = heads
        self.last_rows = last_rows

    @classmethod
    def from_config(cls, hf_config, sparse_layer_ids):
        path = getattr(hf_config, "index_k_debug_record", None)
        if not path or not sparse_layer_ids:  # every layer dense (the dense control): no selection to record
            return None
        from sglang.srt.configs.model_config import get_minimax_sparse_attention_config
        from sglang.srt.runtime_context import get_parallel

        tp_size, tp_rank = get_parallel().attn_tp_size, get_parallel().attn_tp_rank
        total = get_minimax_sparse_attention_config(hf_config)["sparse_num_index_heads"]
        if tp_size > 1:
            path = f"{path}.rank{tp_rank}"
        return cls(path, min(sparse_layer_ids), index_heads_of_rank(total, tp_size, tp_rank),
                   getattr(hf_config, "index_k_debug_rows", None))

    def record(self, mode: str, layer_id: int, positions: torch.Tensor, n_visible: torch.Tensor,
               selected: torch.Tensor, scores: torch.Tensor, seq_lens: torch.Tensor | None = None,
               cu_rows: torch.Tensor | None = None) -> None:
        """One line for a forward's ``rows``: ``positions``/``n_visible [rows]``, ``selected [H, rows, topk]``,
        ``scores [H, rows, nb]``; with ``last_rows`` set, extend forwards pass ``seq_lens [batch]`` and
        ``cu_rows [batch + 1]`` (request ``b`` owns rows ``cu_rows[b]:cu_rows[b+1]``) to pick the rows kept."""
        if selected.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        if self.last_rows is not None and seq_lens is not None:
            row_seq_len = torch.repeat_interleave(seq_lens.long(), (cu_rows[1:] - cu_rows[:-1]).long())
            keep = torch.nonzero(positions.long() >= row_seq_len - self.last_rows).squeeze(1)
            if keep.numel() == 0:
                return
            positions, n_visible = positions[keep], n_visible[keep]
            selected, scores = selected[:, keep], scores[:, keep]
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
            # Columns at or past a row's n_visible were not written this forward (a preallocated decode
            # buffer keeps stale values there): None, like non-finite scores.
            seen = torch.arange(nb, device=n_visible.device)[None] < n_visible.long()[:, None]  # [rows, nb]
            shown = scores[:, :, :nb].float().masked_fill(~seen.to(scores.device), float("nan"))
            entry["scores"] = [[[s if math.isfinite(s) else None for s in row] for row in head]
                               for head in shown.tolist()]
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
