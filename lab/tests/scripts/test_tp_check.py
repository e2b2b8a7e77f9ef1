"""lab/gpu/tp_check.py (lives here, not under tests/lab/gpu/: a "gpu" path part marks a test
GPU-only): the random checkpoint, rank-file merging and the TP comparisons."""

import json
import random
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "lab" / "gpu"))

import tp_check  # noqa: E402

TINY = REPO / "configs" / "minimax-m3.1-tiny" / "config.json"


def test_checkpoint_names_and_shapes_follow_the_config():
    cfg = json.loads(TINY.read_text())
    shapes = tp_check.checkpoint_shapes(cfg)
    d, hq, hkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (hq * hd, d)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (hkv * hd, d)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (cfg["dense_intermediate_size"], d)
    assert "model.layers.0.self_attn.index_q_proj.weight" not in shapes  # dense layer
    assert shapes["model.layers.1.self_attn.index_q_proj.weight"] == (4 * 128, d)
    assert shapes["model.layers.1.self_attn.index_k_proj.weight"] == (128, d)  # one shared index key
    assert "model.layers.1.self_attn.index_v_proj.weight" not in shapes  # index value disabled
    assert shapes["model.layers.3.block_sparse_moe.experts.3.w2.weight"] == (d, cfg["intermediate_size"])
    assert shapes["model.layers.3.block_sparse_moe.shared_experts.down_proj.weight"] == (d, cfg["intermediate_size"])
    assert shapes["model.layers.3.block_sparse_moe.e_score_correction_bias"] == (cfg["num_local_experts"],)
    assert shapes["lm_head.weight"] == (cfg["vocab_size"], d)


def test_random_checkpoint_is_seeded_per_tensor(tmp_path):
    from safetensors.torch import load_file

    cfg_text = TINY.read_text()
    dirs = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(cfg_text)
        dirs.append(load_file(str(tp_check.write_random_checkpoint(tmp_path / name, seed=seed))))
    a, b, c = dirs
    assert a.keys() == b.keys() == tp_check.checkpoint_shapes(json.loads(cfg_text)).keys()
    assert all(torch.equal(a[k], b[k]) for k in a) and not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert all(t.dtype == torch.bfloat16 for t in a.values())
    norm = a["model.layers.1.self_attn.index_q_norm.weight"].float()  # Gemma norm: 1 + w, w near 0
    assert norm.abs().max() < 0.5 and norm.std() > 0
    assert 0.015 < a["model.layers.1.self_attn.index_k_proj.weight"].float().std() < 0.025


def _entry(heads, selected, scores=None, positions=(300,), n_visible=(3,), layer=1, mode="extend"):
    e = {"mode": mode, "layer": layer, "positions": list(positions), "heads": heads, "n_visible": list(n_visible),
         "selected": selected}
    if scores is not None:
        e["scores"] = scores
    return e


def test_rank_files_merge_in_head_order(tmp_path):
    path = tmp_path / "sel.jsonl"
    r0 = _entry([0, 1], [[[0, 1, 2]], [[1, 0, 2]]], [[[0.1, 0.2, 0.3]], [[0.4, 0.5, 0.6]]])
    r1 = _entry([2, 3], [[[2, 1, 0]], [[0, 2, 1]]], [[[0.7, 0.8, 0.9]], [[1.0, 1.1, 1.2]]])
    (tmp_path / "sel.jsonl.rank1").write_text(json.dumps(r1) + "\n")
    (tmp_path / "sel.jsonl.rank0").write_text(json.dumps(r0) + "\n")
    assert [p.name for p in tp_check.rank_files(path)] == ["sel.jsonl.rank0", "sel.jsonl.rank1"]
    assert tp_check.line_counts(path) == [1, 1]
    (merged,) = tp_check.read_records(path)
    assert merged["heads"] == [0, 1, 2, 3]
    assert merged["selected"] == r0["selected"] + r1["selected"]
    assert merged["scores"] == r0["scores"] + r1["scores"]


def test_rank_merge_rejects_disagreeing_ranks():
    with pytest.raises(ValueError, match="positions"):
        tp_check.merge_rank_entries([_entry([0], [[[0]]]), _entry([1], [[[0]]], positions=(301,))])
    with pytest.raises(ValueError, match="replicas of index head 0"):
        tp_check.merge_rank_entries([_entry([0], [[[0, 1]]]), _entry([0], [[[0, 2]]])])


def _rows(selected, scores, n_visible, mode="extend", pos=3000, layer=1):
    return {(mode, layer, pos): {"heads": list(range(len(selected))), "selected": selected, "n_visible": n_visible,
                                 "scores": scores}}


def test_selection_swap_inside_the_score_error_is_explained():
    # topk 2 of 4 blocks; the runs' scores differ by up to 0.05, blocks 1 and 2 are 0.06 apart.
    ref = _rows([[1, 3]], [[0.0, 0.56, 0.50, 0.9]], 4)
    got = _rows([[2, 3]], [[0.0, 0.51, 0.55, 0.9]], 4)
    st = tp_check.compare_selections(ref, got, topk=2)["layers"][1]
    assert (st["choice_head_rows"], st["choice_equal"], st["explained"], st["unexplained"]) == (1, 0, 1, 0)
    assert st["max_score_diff"] == pytest.approx(0.05)


def test_selection_swap_beyond_the_score_error_is_unexplained():
    ref = _rows([[1, 3]], [[0.0, 0.9, 0.2, 0.9]], 4)
    got = _rows([[2, 3]], [[0.0, 0.9, 0.21, 0.9]], 4)  # got picked 2 although its own scores rank 1 higher
    st = tp_check.compare_selections(ref, got, topk=2)["layers"][1]
    assert st["unexplained"] == 1 and st["first_unexplained"]["ref"] == [1, 3]


def test_decode_rows_past_the_token_divergence_are_not_compared():
    ref = {**_rows([[0, 1]], None, 2, "decode", 5000), **_rows([[0, 1]], None, 2, "decode", 5001)}
    got = {**_rows([[0, 1]], None, 2, "decode", 5000), **_rows([[1, 0, 2]], None, 2, "decode", 5001)}
    assert tp_check.compare_selections(ref, got, topk=2, last_decode_pos=5000)["layers"][1]["rows"] == 1
    assert tp_check.compare_selections(ref, got, topk=2)["layers"][1]["equal"] == 1


def test_head_mapping_finds_swapped_heads():
    s = [[0.1, 0.5, 0.9], [0.9, 0.1, 0.3]]
    ref = _rows([[0], [0]], s, 3)
    assert tp_check.head_mapping(ref, _rows([[0], [0]], [[x + 0.01 for x in h] for h in s], 3), 1)["ok"]
    swapped = tp_check.head_mapping(ref, _rows([[0], [0]], [s[1], s[0]], 3), 1)
    assert not swapped["ok"] and swapped["closest"] == [1, 0]


def _body(ids, tops, prompt_lp):
    prompt = [[None, 5, None]] + [[x, 5, None] for x in prompt_lp]
    return {"output_ids": ids, "meta_info": {"output_top_logprobs": tops, "input_token_logprobs": prompt}}


def test_token_comparison_and_near_tie_verdict():
    tops_a = [[[-0.1, 7, None], [-2.0, 8, None]], [[-1.00, 9, None], [-1.02, 4, None]]]
    tops_b = [[[-0.1, 7, None], [-2.0, 8, None]], [[-1.01, 4, None], [-1.03, 9, None]]]
    cmp = tp_check.compare_tokens(_body([7, 9], tops_a, [-3.0, -4.0]), _body([7, 4], tops_b, [-3.0, -4.5]))
    assert cmp["first_divergence"] == 1 and not cmp["equal"]
    assert cmp["margin_ref"] == pytest.approx(0.02) and cmp["margin_got"] == pytest.approx(0.02)
    assert cmp["prompt_logprob_max_abs_diff"] == pytest.approx(0.5)
    assert tp_check.tokens_verdict(cmp, tie_margin=0.05) and not tp_check.tokens_verdict(cmp, tie_margin=0.01)
    same = tp_check.compare_tokens(_body([7, 9], tops_a, [-3.0]), _body([7, 9], tops_a, [-3.0]))
    assert same["equal"] and tp_check.tokens_verdict(same, 0.0)


def test_checkpoint_shapes_follow_the_optional_keys():
    """What a config leaves out: head_dim (hidden / heads), the index-value flags (every sparse layer has them),
    the MoE pattern (every layer MoE), the routing bias (none); more shared experts widen the shared MLP."""
    cfg = json.loads(TINY.read_text())
    for key in ("head_dim", "moe_layer_freq", "use_routing_bias"):
        cfg.pop(key)
    cfg["sparse_attention_config"] = {k: v for k, v in cfg["sparse_attention_config"].items()
                                      if k != "sparse_disable_index_value"}
    cfg["n_shared_experts"] = 3
    shapes = tp_check.checkpoint_shapes(cfg)
    d, inter, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = d // cfg["num_attention_heads"]
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (cfg["num_attention_heads"] * hd, d)
    assert "model.layers.0.self_attn.index_v_proj.weight" not in shapes  # layer 0 is dense
    for i in range(1, n):
        assert shapes[f"model.layers.{i}.self_attn.index_v_proj.weight"] == (128, d)
        assert shapes[f"model.layers.{i}.self_attn.index_o_proj.weight"] == (d, 4 * 128)
    for i in range(n):
        m = f"model.layers.{i}.block_sparse_moe."
        assert shapes[m + "shared_experts.gate_proj.weight"] == (3 * inter, d)
        assert shapes[m + "shared_experts.up_proj.weight"] == (3 * inter, d)
        assert shapes[m + "shared_experts.down_proj.weight"] == (d, 3 * inter)
        assert f"model.layers.{i}.mlp.gate_proj.weight" not in shapes
    assert not any(k.endswith("e_score_correction_bias") for k in shapes)
    with pytest.raises(ValueError, match="qk_norm_type must be 'per_head'"):
        tp_check.checkpoint_shapes({**cfg, "qk_norm_type": "per_layer"})


def test_random_tensor_norms_and_per_name_streams():
    norm = tp_check.random_tensor("model.norm.weight", (4096,), 0, 0.02, gemma_norm=False).float()
    assert abs(norm.mean() - 1) < 0.01 and 0.03 < norm.std() < 0.07
    gemma = tp_check.random_tensor("model.norm.weight", (4096,), 0, 0.02, gemma_norm=True).float()
    assert abs(gemma.mean()) < 0.01 and torch.allclose(gemma + 1, norm, atol=0.01)
    q = tp_check.random_tensor("model.layers.1.self_attn.q_proj.weight", (64, 64), 0, 0.02, False)
    k = tp_check.random_tensor("model.layers.1.self_attn.k_proj.weight", (64, 64), 0, 0.02, False)
    assert not torch.equal(q, k)  # one stream per name, not one per shape
    assert torch.equal(q, tp_check.random_tensor("model.layers.1.self_attn.q_proj.weight", (64, 64), 0, 0.02, False))


def test_rank_files_in_rank_order_and_only_those(tmp_path):
    path = tmp_path / "sel.jsonl"
    ranks = list(range(12))
    random.shuffle(ranks)
    for r in ranks:  # rank10 and rank11 sort before rank2 as names
        (tmp_path / f"sel.jsonl.rank{r}").write_text(json.dumps(_entry([r], [[[r]]])) + "\n" * (1 + r % 2))
    for other in ("sel.jsonl.rank1.tmp", "sel.jsonl.rank", "sel.jsonl.rankx", "xsel.jsonl.rank3"):
        (tmp_path / other).write_text("not a rank file\n")
    assert [p.name for p in tp_check.rank_files(path)] == [f"sel.jsonl.rank{r}" for r in range(12)]
    assert tp_check.line_counts(path) == [1 + r % 2 for r in range(12)]  # blank lines are lines too
    (merged,) = tp_check.read_records(path)
    assert merged["heads"] == list(range(12)) and merged["selected"] == [[[r]] for r in range(12)]


def test_rank_merge_needs_agreeing_rows_and_equal_line_counts(tmp_path):
    with pytest.raises(ValueError, match="n_visible"):
        tp_check.merge_rank_entries([_entry([0], [[[0]]]), _entry([1], [[[0]]], n_visible=(4,))])
    merged = tp_check.merge_rank_entries([_entry([0], [[[0, 1]]], [[[0.1, 0.2, 0.3]]]), _entry([1], [[[1, 2]]])])
    assert merged["heads"] == [0, 1] and "scores" not in merged  # one rank without scores: none merged
    path = tmp_path / "sel.jsonl"
    (tmp_path / "sel.jsonl.rank0").write_text((json.dumps(_entry([0], [[[0]]])) + "\n") * 2)
    (tmp_path / "sel.jsonl.rank1").write_text(json.dumps(_entry([1], [[[0]]])) + "\n")
    with pytest.raises(ValueError, match=r"different line counts: \[2, 1\]"):
        tp_check.read_records(path)


def test_only_decode_rows_stop_at_the_token_divergence_and_choice_needs_more_than_topk():
    ref = {**_rows([[0, 1]], None, 2, "decode", 5001), **_rows([[0, 3]], None, 4, "extend", 6000)}
    got = {**_rows([[1, 0]], None, 2, "decode", 5001), **_rows([[3, -1]], None, 4, "extend", 6000)}  # -1: no block
    st = tp_check.compare_selections(ref, got, topk=2, last_decode_pos=5000)["layers"][1]
    assert st["rows"] == 1 and st["modes"] == {"extend": 1}
    assert st["equal"] == 0 and st["choice_rows"] == 1  # block 0 is a block: {0, 3} != {3}
    st = tp_check.compare_selections(ref, got, topk=4)["layers"][1]
    assert st["rows"] == 2 and st["choice_rows"] == 0 and st["equal"] == 1  # 4 visible of topk 4: no choice


def test_summarize_layers_adds_the_layers_and_fraction():
    rng = random.Random()
    layers = {}
    for layer in range(3):
        st = {k: rng.randrange(100) for k in ("head_rows", "equal", "choice_head_rows", "choice_equal",
                                               "scored_head_rows", "explained", "unexplained")}
        layers[layer] = {**st, "max_score_diff": rng.random(), "max_score_diff_rel": rng.random()}
    tot = tp_check.summarize_layers(layers)
    for k in ("head_rows", "equal", "explained", "unexplained"):
        assert tot[k] == sum(st[k] for st in layers.values())
    assert tot["max_score_diff"] == max(st["max_score_diff"] for st in layers.values())
    assert tp_check.summarize_layers({}) == {**{k: 0 for k in tot if not k.startswith("max")},
                                             "max_score_diff": 0.0, "max_score_diff_rel": 0.0}
    assert tp_check.fraction(3, 4) == "3/4 (75.0%)" and tp_check.fraction(0, 0) == "0/0"


def test_divergence_edges():
    assert tp_check.first_divergence([1, 2], [1, 2]) is None
    assert tp_check.first_divergence([1, 2], [1, 2, 3]) == 2 and tp_check.first_divergence([1, 2, 3], [1, 2]) == 2
    assert tp_check.first_divergence([], [4]) == 0 and tp_check.first_divergence([1, 3], [1, 2]) == 1
    tops = [[[-0.5, 7, None], [-1.0, 8, None]]]
    assert tp_check.divergence_margin({"output_top_logprobs": tops}, 7, 8, 0) == pytest.approx(0.5)
    assert tp_check.divergence_margin({"output_top_logprobs": tops}, 7, 8, 1) is None  # past the last step
    assert tp_check.divergence_margin({"output_top_logprobs": tops}, 7, 9, 0) is None  # not in the top
    # prompts of different lengths are not compared position by position
    cmp = tp_check.compare_tokens(_body([7], tops, [-3.0, -4.0]), _body([7], tops, [-3.0]))
    assert cmp["equal"] and "prompt_logprob_max_abs_diff" not in cmp
    # a margin exactly at the tie margin is a tie
    near = {"equal": False, "margin_ref": 0.5, "margin_got": 0.25}
    assert tp_check.tokens_verdict(near, 0.5) and not tp_check.tokens_verdict(near, 0.4)
    assert not tp_check.tokens_verdict({"equal": False, "margin_ref": None, "margin_got": 0.0}, 1.0)
