"""training.train on the CPU: a micro config, 3 dense + 2 sparse steps at T=512; an interrupted run
resumed from its checkpoint gives the same losses as an uninterrupted one; plan checks; export."""

import json
import random
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from training import data, train

MICRO = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "rotary_dim": 16, "dense_intermediate_size": 128, "intermediate_size": 128, "moe_layer_freq": [0, 0],
    "max_position_embeddings": 4096,
}


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> str:
    base = json.loads((Path(train.__file__).parent / "configs" / "msa-small.json").read_text())
    base.update(MICRO)
    # topk 2 of the 4 blocks at T=512, so the sparse steps really drop blocks
    base["sparse_attention_config"].update(sparse_attention_freq=[0, 1], sparse_disable_index_value=[0, 1],
                                           sparse_num_index_heads=2, sparse_topk_blocks=2)
    path = tmp_path_factory.mktemp("cfg") / "micro.json"
    path.write_text(json.dumps(base))
    return str(path)


def _plan(config):
    return ["--config", config, "--steps", "5", "--dense-steps", "3", "--short-steps", "5", "--short-lengths", "512",
            "--long-lengths", "512", "--token-budget", "1024", "--lm-rows", "16", "--kl-rows", "16",
            "--warmup-steps", "2"]


CALL = ["--eval-samples", "0", "--log-every", "1", "--budget-s", "600", "--reserve-s", "0"]


def _complete(config, *args) -> dict:
    """The completed plan of ``--config config`` and ``args`` (train.main's ``_plan_from`` then ``_complete_plan``)."""
    return train._complete_plan(train._plan_from(train.parse_args(["--out", "x", "--config", config, *args])))


def test_resume_continues_exactly(config, tmp_path):
    straight = train.main(_plan(config) + CALL + ["--out", str(tmp_path / "a"), "--no-export"])
    first = train.main(_plan(config) + CALL + ["--out", str(tmp_path / "b"), "--stop-at-step", "3", "--no-export"])
    rest = train.main(CALL + ["--out", str(tmp_path / "b"), "--resume", str(tmp_path / "b")])
    assert straight["step"] == rest["step"] == 5 and first["step"] == 3
    assert len(straight["losses"]) == 5
    assert first["losses"] + rest["losses"] == straight["losses"]  # bitwise: same data, same state
    log = (tmp_path / "b" / "train.log").read_text()
    assert "resume exact" in log and " sparse " in log and " dense " in log
    export = tmp_path / "b" / "export"
    state = json.loads((export / train.TRAINER_STATE).read_text())
    assert state["step"] == 5 and (export / "config.json").is_file() and list(export.glob("model-*.safetensors"))

    with pytest.raises(ValueError, match="--lr"):
        train.main(CALL + ["--out", str(tmp_path / "b"), "--resume", str(tmp_path / "b"), "--lr", "0.5"])

    # From the export alone: the plan and step carry on, the optimizer does not (said in the log).
    done = train.main(CALL + ["--out", str(tmp_path / "c"), "--resume", str(export), "--no-export"])
    assert done["step"] == 5 and done["losses"] == []
    assert "resume NOT exact" in (tmp_path / "c" / "train.log").read_text()


def test_eval_reports_exact_match_and_recall(config, tmp_path):
    train.main(_plan(config) + ["--out", str(tmp_path), "--stop-at-step", "1", "--eval-samples", "1",
                                "--eval-lengths", "512", "--eval-tasks", "single,vt", "--no-export"])
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    final = [e for e in evals if e.get("final")][0]["eval"]
    assert set(final) == {"dense/single/512", "dense/vt/512", "sparse/single/512", "sparse/vt/512",
                          "recall/L1/single/512", "recall/L1/vt/512"}
    assert all(0.0 <= v <= 1.0 for v in final.values())


def test_plan_validation(config, tmp_path):
    with pytest.raises(ValueError, match="dense-steps"):
        train.main(_plan(config)[:-2] + ["--dense-steps", "9", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="multiples"):
        train.main(["--config", config, "--short-lengths", "500", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="token-budget"):
        train.main(["--config", config, "--long-lengths", "131072", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--config"):
        train.main(["--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--steps"):  # was a ZeroDivisionError in the stage fractions
        train.main(["--config", config, "--steps", "0", "--dense-steps", "0", "--out", str(tmp_path)])


def test_schedule():
    plan = {"lr": 1.0, "warmup_steps": 10, "steps": 110, "min_lr_frac": 0.1, "dense_steps": 30}
    assert train.learning_rate(plan, 0) == pytest.approx(0.1)
    assert train.learning_rate(plan, 9) == pytest.approx(1.0)
    assert train.learning_rate(plan, 60) == pytest.approx(0.55)
    assert train.learning_rate(plan, 110) == pytest.approx(0.1)
    assert [train.stage(plan, s) for s in (0, 29, 30, 109)] == ["dense", "dense", "sparse", "sparse"]
    assert data.BLOCK == 128


def test_time_plan_schedule():
    """A time plan runs stages, curriculum and cosine on trained seconds, whatever the step."""
    plan = {"lr": 1.0, "warmup_steps": 10, "steps": 100, "min_lr_frac": 0.1, "dense_steps": 60,
            "short_steps": 25, "train_s": 200.0}
    assert train.learning_rate(plan, 5, trained_s=150.0) == pytest.approx(0.6)  # warm-up is by step
    assert train.learning_rate(plan, 50, trained_s=100.0) == pytest.approx(0.55)
    assert train.learning_rate(plan, 5000, trained_s=200.0) == pytest.approx(0.1)
    assert [train.stage(plan, 10**6, t) for t in (0.0, 119.0, 120.0)] == ["dense", "dense", "sparse"]
    assert [train.phase(plan, 0, t) for t in (49.0, 50.0)] == ["short", "long"]


def test_time_plan_run_stops_on_trained_seconds(config, tmp_path, monkeypatch):
    """--train-s ends the run on trained seconds, before --steps, and reaches the sparse stage. The run reads a
    clock that moves 0.05 s per reading: on the real clock one slow step on a busy box (1.7 s, seen in CI) could
    carry the run from the dense stage past its end."""
    import types

    now = [1.0e9]

    def tick() -> float:
        now[0] += 0.05
        return now[0]

    clock = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    clock.time = tick
    monkeypatch.setattr(train, "time", clock)
    out = train.main(["--config", config, "--out", str(tmp_path), "--steps", "10000", "--dense-steps", "5000",
                      "--short-steps", "100", "--train-s", "3", "--short-lengths", "256", "--long-lengths", "512",
                      "--token-budget", "512", "--warmup-steps", "2", "--no-export", "--no-final-eval",
                      "--eval-samples", "0", "--log-every", "1", "--lm-rows", "16", "--kl-rows", "16"])
    assert 0 < out["step"] < 10000
    log = (tmp_path / "train.log").read_text()
    assert " sparse " in log and " dense " in log


def test_init_from_an_export_starts_a_new_plan_from_its_weights(config, tmp_path):
    import torch

    from training.export import load_checkpoint

    train.main(_plan(config) + CALL + ["--out", str(tmp_path / "a"), "--stop-at-step", "2"])
    export = tmp_path / "a" / "export"
    out = train.main(_plan(config) + CALL + ["--out", str(tmp_path / "b"), "--init-from", str(export),
                                             "--stop-at-step", "0", "--no-export"])
    assert out["step"] == 0 and "from the weights of" in (tmp_path / "b" / "train.log").read_text()
    started = torch.load(tmp_path / "b" / "ckpt" / train.STATE_FILE, weights_only=False)
    assert started["plan"]["init_from"] == str(export)
    exported = load_checkpoint(export).state_dict()
    assert started["model"].keys() == exported.keys()
    for name, value in exported.items():
        assert torch.equal(started["model"][name].float(), value), name
    fresh = train.main(_plan(config) + CALL + ["--out", str(tmp_path / "c"), "--stop-at-step", "0", "--no-export"])
    assert fresh["step"] == 0
    random_init = torch.load(tmp_path / "c" / "ckpt" / train.STATE_FILE, weights_only=False)["model"]
    assert not all(torch.equal(random_init[n].float(), v) for n, v in exported.items())

    with pytest.raises(ValueError, match="--init-from"):  # a resumed run keeps its plan
        train.main(CALL + ["--out", str(tmp_path / "b"), "--resume", str(tmp_path / "b"), "--init-from", "x"])


def test_curriculum_phases_and_validation(config, tmp_path):
    plan = {"steps": 100, "short_steps": 0, "curriculum": "0:256,512;0.5:1024;0.8:2048,4096"}
    assert [(s, n) for s, n, _ in train.curriculum(plan)] == [(0.0, "c0"), (0.5, "c1"), (0.8, "c2")]
    assert [train.phase(plan, s) for s in (0, 49, 50, 79, 80, 100)] == ["c0", "c0", "c1", "c1", "c2", "c2"]
    assert train.plan_lengths(plan) == [256, 512, 1024, 2048, 4096]
    assert train._spec(plan | {"token_budget": 4096, "task_weights": "single=1", "lm_rows": 1, "kl_rows": 1},
                       80).lengths == (2048, 4096)
    legacy = {"steps": 10, "short_steps": 4, "short_lengths": "256", "long_lengths": "512"}
    assert [train.phase(legacy, s) for s in (3, 4)] == ["short", "long"] and train.plan_lengths(legacy) == [256, 512]
    for bad in ("0.1:256", "0:256;0.5:512;0.4:1024", "0:256;1.0:512", "256", "0:250", "x:256"):
        with pytest.raises(ValueError, match="--curriculum"):
            train.main(["--config", config, "--out", str(tmp_path), "--curriculum", bad])
    with pytest.raises(ValueError, match="--curriculum: 2048 exceeds --token-budget 1024"):
        train.main(["--config", config, "--out", str(tmp_path), "--token-budget", "1024", "--short-lengths", "512",
                    "--long-lengths", "512", "--curriculum", "0:512;0.5:2048"])


def test_curriculum_run_trains_each_phase(config, tmp_path):
    train.main(["--config", config, "--out", str(tmp_path), "--steps", "6", "--dense-steps", "4", "--curriculum",
                "0:256;0.33:512;0.66:768", "--token-budget", "768", "--lm-rows", "16", "--kl-rows", "16",
                "--warmup-steps", "1", *CALL, "--no-export"])
    lengths = [json.loads(line)["T"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lengths == [256, 256, 512, 512, 768, 768]


@pytest.fixture(scope="module")
def interrupted(config, tmp_path_factory):
    """An uninterrupted 5-step run's losses and the exact checkpoint of the same plan stopped at step 3."""
    root = tmp_path_factory.mktemp("interrupted")
    straight = train.main(_plan(config) + CALL + ["--out", str(root / "a"), "--no-export"])
    train.main(_plan(config) + CALL + ["--out", str(root / "b"), "--stop-at-step", "3", "--no-export"])
    return straight["losses"], root / "b" / "ckpt" / train.STATE_FILE


@pytest.mark.parametrize("moments", ["both", "second", "none"])
def test_portable_resume_from_split_parts(interrupted, tmp_path, moments):
    """Weights come back exactly (the first resumed loss is bitwise the uninterrupted run's); Adam
    moments as bf16 (or restarted); the state file is smaller than the exact one; parts are joined."""
    import torch

    losses, exact_path = interrupted
    exact = torch.load(exact_path, weights_only=False)
    model, *_ = train.build_model(exact["plan"], "cpu")
    opt = train.build_optimizer(model, exact["plan"])
    model.load_state_dict(exact["model"])
    opt.load_state_dict(exact["optimizer"])
    torch.set_rng_state(exact["torch_rng"])
    train.save_portable(tmp_path / train.PORTABLE_FILE, model, opt, exact["plan"], exact["step"], exact["trained_s"],
                        moments)
    blob = (tmp_path / train.PORTABLE_FILE).read_bytes()
    assert len(blob) < ({"both": 8, "second": 6, "none": 4}[moments] / 12 + 0.03) * exact_path.stat().st_size
    carried = tmp_path / "carried"
    carried.mkdir()
    cuts = [0, len(blob) // 3, 2 * len(blob) // 3, len(blob)]
    for i, suffix in enumerate(("aa", "ab", "ac")):
        (carried / f"{train.PORTABLE_FILE}.part-{suffix}").write_bytes(blob[cuts[i]:cuts[i + 1]])
    rest = train.main(CALL + ["--out", str(tmp_path / "c"), "--resume", str(carried), "--no-export"])
    assert rest["step"] == 5
    assert rest["losses"][0] == losses[3]
    assert rest["losses"][1] == pytest.approx(losses[4], rel=0.05)
    log = (tmp_path / "c" / "train.log").read_text()
    assert "resume from portable state" in log and "fp32 weights exact" in log
    portable = train.load_portable(carried / train.PORTABLE_FILE)
    for name, value in exact["model"].items():
        assert torch.equal(portable["model"][name], value.float()), name
    kept = {"both": {"exp_avg", "exp_avg_sq"}, "second": {"exp_avg_sq"}, "none": set()}[moments]
    params = dict(model.named_parameters())
    for key in ("exp_avg", "exp_avg_sq"):
        assert set(portable[key]) == (set(params) if key in kept else set())
        for name, t in portable[key].items():
            assert torch.equal(t, opt.state[params[name]][key].bfloat16()), name
    with pytest.raises(ValueError, match="--lr"):
        train.main(CALL + ["--out", str(tmp_path / "d"), "--resume", str(carried), "--lr", "0.5"])


# -- gaps a hand mutation run of lab/training/train.py found ---------------------------------------------------
def test_schedule_peaks_at_the_end_of_warm_up_and_ends_at_the_floor():
    plan = {"lr": 1.0, "warmup_steps": 10, "steps": 110, "min_lr_frac": 0.1, "dense_steps": 30}
    lrs = [train.learning_rate(plan, s) for s in range(120)]
    assert lrs[10] == pytest.approx(1.0) and max(lrs) == pytest.approx(1.0)  # the cosine starts at the peak
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10])) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[115] == pytest.approx(0.1)  # past the plan: the floor, not back up the cosine
    timed = plan | {"train_s": 200.0}
    assert train.learning_rate(timed, 50, trained_s=300.0) == pytest.approx(0.1)  # past train_s: the floor


def test_plan_bounds(config):
    assert _complete(config, "--steps", "10", "--dense-steps", "10")["dense_steps"] == 10  # dense only: allowed
    assert _complete(config, "--steps", "10", "--dense-steps", "0")["dense_steps"] == 0  # sparse only: allowed
    for args, match in ((["--short-steps", "-1"], "--short-steps"), (["--train-s", "-5"], "--train-s"),
                        (["--steps", "10", "--dense-steps", "11"], "--dense-steps"),
                        (["--curriculum", "0:512;0.5:1024;0.5:2048"], "--curriculum")):
        with pytest.raises(ValueError, match=match):
            _complete(config, *args)
    assert train._spec(_complete(config, "--query-weight", "0"), 0).query_rows is False
    assert train._spec(_complete(config, "--query-weight", "0.5"), 0).query_rows is True


def _batch(samples, T, **kw):
    return data.collate(samples, T, random.Random(0), lm_rows=kw.get("lm_rows", 16), kl_random_rows=0,
                        query_rows=kw.get("query_rows", False))


@pytest.fixture(scope="module")
def heldout_gen():
    return data.TaskGenerator(data.load_tokenizer(), data.HELDOUT_HAYSTACK_SEED, num_sentences=2048)


@pytest.mark.parametrize("query_rows", [False, True])
def test_batch_losses_are_means_over_their_rows(heldout_gen, query_rows):
    """Each loss is the mean CE over the rows of its mask (0 without rows), accuracy the share of answer rows
    whose argmax is the target: checked row by row against random logits right on a random half of the rows."""
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed {seed}")
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    samples = [heldout_gen.sample(t, rng, 512, queries=3) for t in ("single", "kv", "copy")]
    b = _batch(samples, 512, query_rows=query_rows)
    logits = torch.randn(*b.loss_rows.shape, 64, generator=g)
    targets = torch.randint(64, b.loss_targets.shape, generator=g)
    right = torch.rand(targets.shape, generator=g) < 0.5
    logits[right] += 20 * F.one_hot(targets[right], 64)
    b.loss_targets = targets
    got = train.batch_losses(logits, b)
    rows = {"answer_loss": [], "lm_loss": [], "query_loss": [], "answer_acc": []}
    for i, j in torch.nonzero(torch.ones_like(targets, dtype=torch.bool)).tolist():
        ce = float(F.cross_entropy(logits[i, j], targets[i, j]))
        for key, mask in (("answer_loss", b.answer_mask), ("lm_loss", b.lm_mask), ("query_loss", b.query_mask)):
            if mask[i, j]:
                rows[key].append(ce)
        if b.answer_mask[i, j]:
            rows["answer_acc"].append(float(int(logits[i, j].argmax()) == int(targets[i, j])))
    assert bool(rows["query_loss"]) == query_rows
    for key, values in rows.items():
        want = sum(values) / len(values) if values else 0.0
        assert float(got[key]) == pytest.approx(want, rel=1e-5, abs=1e-6), key


def test_optimizer_decays_matrices_only(config):
    plan = _complete(config)
    model, *_ = train.build_model(plan, "cpu")
    opt = train.build_optimizer(model, plan)
    decay = {id(p) for g in opt.param_groups if g["weight_decay"] == plan["weight_decay"] for p in g["params"]}
    plain = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    names = dict(model.named_parameters())
    assert {n for n, p in names.items() if id(p) in plain} == {n for n in names if n.endswith("norm.weight")}
    assert {n for n, p in names.items() if id(p) in decay} == {n for n in names if not n.endswith("norm.weight")}


def test_portable_second_moments_restart_the_first_at_zero(config, tmp_path):
    plan = _complete(config)
    model, *_ = train.build_model(plan, "cpu")
    opt = train.build_optimizer(model, plan)
    ids = torch.randint(3, 2048, (1, 256))
    model(ids)[0].logsumexp(-1).mean().backward()
    opt.step()
    train.save_portable(tmp_path / "p.pt", model, opt, plan, 1, 0.0, "second")
    fresh, *_ = train.build_model(plan | {"seed": 1}, "cpu")
    fresh_opt = train.build_optimizer(fresh, plan)
    assert "first moments restarted" in train.restore_portable(train.load_portable(tmp_path / "p.pt"), fresh, fresh_opt)
    old = dict(model.named_parameters())
    stepped = [n for n, p in old.items() if p in opt.state]  # the index branch got no gradient
    assert stepped and {n for n, p in fresh.named_parameters() if p in fresh_opt.state} == set(stepped)
    for name, p in fresh.named_parameters():
        assert torch.equal(p, old[name]), name
        if name not in stepped:
            continue
        st = fresh_opt.state[p]
        assert (st["exp_avg"] == 0).all(), name
        assert torch.equal(st["exp_avg_sq"], opt.state[old[name]]["exp_avg_sq"].bfloat16().float()), name


class _Oracle(torch.nn.Module):
    """Logits on ``input_ids[row + 1]`` (every answer right) and, in sparse mode, a selection holding exactly
    the evidence blocks at each sample's first answer row (-1 elsewhere)."""

    def __init__(self, batches):
        super().__init__()
        self.sel = {id(b.input_ids): b for b in batches}

    def forward(self, input_ids, attention, logit_rows, return_selection=False):
        target = input_ids.gather(1, (logit_rows + 1).clamp(max=input_ids.shape[1] - 1))
        aux = {}
        if return_selection:
            b = self.sel[id(input_ids)]
            sel = torch.full((input_ids.shape[0], 2, input_ids.shape[1], 4), -1, dtype=torch.int32)
            for i, blocks in enumerate(b.evidence_blocks):
                sel[i, :, int(b.first_answer_row[i]), :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            aux["selected"] = {1: sel}
        return F.one_hot(target, 2048).float(), aux


def test_evaluate_scores_exact_match_and_evidence_recall(heldout_gen):
    """Samples with answers of different lengths share a batch (padded answer rows): an oracle model scores 1,
    and recall reads the selection at the first answer row."""
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed {seed}")
    rng = random.Random(seed)
    batches = [_batch([heldout_gen.sample(t, rng, 512) for t in ("single", "copy")], 512),
               _batch([heldout_gen.sample(t, rng, 512) for t in ("vt", "kv")], 512)]
    assert any(not b.answer_mask.all(-1).all() for b in batches)  # some answer rows are padding
    result = train.evaluate(_Oracle(batches), batches, torch.device("cpu"), None)
    assert set(result) == {f"{m}/{t}/512" for m in ("dense", "sparse") for t in ("single", "copy", "vt", "kv")} | {
        f"recall/L1/{t}/512" for t in ("single", "copy", "vt", "kv")}
    assert all(v == 1.0 for v in result.values()), result


def test_heldout_batches_are_whole_training_batches():
    tok = data.load_tokenizer()
    plan = {"token_budget": 1024, "seed": 3}
    batches = train.heldout_batches(plan, tok, [256, 512], ["single", "kv", "vt"], 1)
    by_len = {}
    for b in batches:
        assert b.input_ids.shape[0] == 1024 // b.input_ids.shape[1]
        by_len.setdefault(b.input_ids.shape[1], []).extend(b.tasks)
    assert by_len == {256: ["single", "kv", "vt", "single"], 512: ["single", "kv", "vt", "single"]}


def test_a_run_sums_its_weighted_losses_and_follows_the_plan(config, tmp_path):
    """A dense-only plan run past --stop-at-step: it ends at --steps; each step's loss is the weighted sum of its
    terms; the optimizer ran at the schedule's learning rate; the export records the stage of the last step."""
    out = tmp_path / "run"
    args = _plan(config)
    args[args.index("--dense-steps") + 1] = "4"
    args[args.index("--steps") + 1] = "4"
    done = train.main(args + CALL + ["--out", str(out), "--stop-at-step", "99", "--lm-weight", "0.5",
                                     "--query-weight", "2", "--kl-weight", "3"])
    assert done["step"] == 4 and len(done["losses"]) == 4
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        want = r["answer_loss"] + 0.5 * r["lm_loss"] + 2 * r["query_loss"] + 3 * r["index_kl"]
        assert r["loss"] == pytest.approx(want, rel=1e-5) and r["lm_loss"] > 0 and r["index_kl"] > 0
    state = torch.load(out / "ckpt" / train.STATE_FILE, weights_only=False)
    lr = train.learning_rate(state["plan"], 3)
    assert lr != state["plan"]["lr"] and all(g["lr"] == pytest.approx(lr) for g in state["optimizer"]["param_groups"])
    assert json.loads((out / "export" / train.TRAINER_STATE).read_text())["stage"] == "dense"
    with pytest.raises(ValueError, match="--seed"):
        train.main(CALL + ["--out", str(out), "--resume", str(out), "--seed", "7"])


def test_gradient_clipping_bounds_the_update(config, tmp_path):
    """--grad-clip 1e-12 leaves Adam a gradient far below its eps: one step moves no weight by more than 1e-6
    (an unclipped step moves them by about the learning rate, 1e-3 here)."""
    train.main(_plan(config) + CALL + ["--out", str(tmp_path), "--stop-at-step", "1", "--grad-clip", "1e-12",
                                       "--weight-decay", "0", "--no-export"])
    state = torch.load(tmp_path / "ckpt" / train.STATE_FILE, weights_only=False)
    init, *_ = train.build_model(state["plan"], "cpu")
    moved = max(float((state["model"][n] - p).abs().max()) for n, p in init.state_dict().items())
    assert moved < 1e-6
