"""Checkpoint-coverage report for the TP checks (an SGLang ``sglang.srt.plugins`` entry point).

SGLang's MiniMax-M3 ``load_weights`` skips unknown names with a warning and says nothing about
parameters the checkpoint never filled (they keep their uninitialised memory). When
``M3_LOAD_REPORT`` names a file, every model process appends one JSON line after loading::

    {"pid": int, "rank": int, "checkpoint_tensors": int, "params": int, "missing": [names]}

``missing``: parameters of the model as constructed that no checkpoint tensor was loaded into
(parameters ``load_weights`` derives at its end from loaded ones are not counted). Registered by
``lab/gpu/bundle_env.sh`` (GPU) and by ``tests/sglang_m3/test_tp.py`` (CPU); does nothing
unless the variable is set.
"""

import json
import os

REPORT_ENV = "M3_LOAD_REPORT"


def _wrap(original):
    def load_weights(self, weights):
        seen = []

        def counted():
            for name, tensor in weights:
                seen.append(name)
                yield name, tensor

        # Parameters as constructed: load_weights may add derived ones at its end (MiniMax-M3's
        # fused_qkv_index_proj, concatenated from the loaded qkv_proj and index_qkv_proj).
        params = set(dict(self.named_parameters()))
        loaded = original(self, counted())
        try:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else 0
        except Exception:  # noqa: BLE001 - a report without a rank is still useful
            rank = -1
        line = {"pid": os.getpid(), "rank": rank, "checkpoint_tensors": len(seen), "params": len(params),
                "missing": sorted(params - set(loaded or ()))}
        with open(os.environ[REPORT_ENV], "a") as f:
            f.write(json.dumps(line) + "\n")
        return loaded

    load_weights._m3_load_check = True
    return load_weights


def register() -> None:
    """Wrap SGLang's ``MiniMaxM3SparseForCausalLM.load_weights`` when ``M3_LOAD_REPORT`` is set."""
    if not os.environ.get(REPORT_ENV):
        return
    from sglang.srt.models import minimax_m3

    cls = minimax_m3.MiniMaxM3SparseForCausalLM
    if not getattr(cls.load_weights, "_m3_load_check", False):
        cls.load_weights = _wrap(cls.load_weights)
