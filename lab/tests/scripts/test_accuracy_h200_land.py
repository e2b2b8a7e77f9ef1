"""lab/scripts/accuracy_h200_land.py: returned H200 calls become the committed state, new dump rows and call logs,
and a call that would lose or change a committed row lands nothing."""

import json
import random
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "lab" / "scripts"))
import accuracy_h200_land as land  # noqa: E402

TASKS = ("m3_niah_single", "m3_kv_64")


def _rows(rng, fmt, start, stop) -> dict:
    """{(format, task, doc_id): row} for samples start..stop-1 of both tasks at 8k, scores drawn fresh."""
    return {(fmt, task, f"8192/{i}"): {"doc_id": f"8192/{i}", "length": 8192, "depth": round(rng.uniform(0, 100), 2),
                                       "target": str(rng.randrange(10**7)), "response": f" {rng.randrange(10**7)}.",
                                       "score": float(rng.random() < 0.9), "context": i // 4}
            for task in TASKS for i in range(start, stop)}


def _state(path: Path, rows: dict) -> Path:
    """A state archive like accuracy_h200.sh's: acc/samples/<format>/<task>.jsonl, run.json, acc/rates.json."""
    tree = path.parent / (path.name + ".d")
    for (fmt, task, _), row in rows.items():
        d = tree / "acc" / "samples" / fmt
        d.mkdir(parents=True, exist_ok=True)
        (d / "run.json").write_text(json.dumps({"questions": 4}))
        with open(d / f"{task}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    (tree / "acc" / "rates.json").write_text("{}")
    with tarfile.open(path, "w:gz") as tar:
        tar.add(tree / "acc", arcname="acc")
    return path


def _call(tmp_path, name, rows, log) -> Path:
    d = tmp_path / name
    d.mkdir()
    _state(d / "state.tgz", rows)
    (d / "call.log").write_text(log)
    return d


@pytest.fixture
def committed(tmp_path):
    """A perf_data folder holding fp8 and mxfp4 at 8 samples a task, their dump and call logs 1 and 16."""
    rng = random.Random()
    rows = {**_rows(rng, "fp8", 0, 8), **_rows(rng, "mxfp4", 0, 8)}
    perf = tmp_path / "perf_data"
    (perf / "accuracy_h200_resume").mkdir(parents=True)
    _state(perf / land.STATE, rows)
    dump = [json.dumps({"format": k[0], "task": k[1], **r}) for k, r in rows.items()]
    rng.shuffle(dump)
    (perf / land.SAMPLES).write_text("\n".join(dump) + "\n")
    (perf / "accuracy_h200_2026-12-02_q4_call1.log").write_text("call 1\n")
    (perf / "accuracy_h200_2026-12-03_q4_call16.log").write_text("call 16\n")
    return rng, rows, perf


def _files(perf) -> dict:
    """Every file under ``perf`` by its path there, with its bytes: what a refused landing must leave as it was."""
    return {str(p.relative_to(perf)): p.read_bytes() for p in perf.rglob("*") if p.is_file()}


def _dump(perf) -> list:
    return [json.loads(line) for line in (perf / land.SAMPLES).read_text().splitlines()]


def test_two_calls_land_as_state_appended_rows_and_numbered_logs(tmp_path, committed):
    rng, rows, perf = committed
    before = (perf / land.SAMPLES).read_text()
    a = {**rows, **_rows(rng, "fp8", 8, 20)}
    b = {**a, **_rows(rng, "mxfp4", 8, 12), **_rows(rng, "mxfp4_rot", 0, 4)}
    log_a = "accuracy_h200: start\n/srv/checkout/build/m3-site/torchao/x.py:1: SyntaxWarning\nreport /acc/report.md\n"
    calls = [_call(tmp_path, "6", a, log_a), _call(tmp_path, "7", b, "call 7\n")]
    whole = (calls[1] / "state.tgz").read_bytes()  # the second call's state came back in parts (over 15 MiB)
    for i, at in enumerate(range(0, len(whole), 1000)):
        (calls[1] / f"state.tgz.part-a{chr(97 + i)}").write_bytes(whole[at:at + 1000])
    (calls[1] / "state.tgz").unlink()
    out = land.land(calls, perf, "2026-12-04", report=False)

    assert out == {"rows_added": len(b) - len(rows), "rows": len(b),
                   "logs": ["accuracy_h200_2026-12-04_q4_call17.log", "accuracy_h200_2026-12-04_q4_call18.log"],
                   "calls": [17, 18]}
    assert (perf / land.SAMPLES).read_text().startswith(before)  # committed rows stay where they were
    dump = _dump(perf)
    assert len(dump) == len(b) and all(list(r)[:2] == ["format", "task"] for r in dump)
    assert {(r["format"], r["task"], r["doc_id"]): {k: v for k, v in r.items() if k not in ("format", "task")}
            for r in dump} == b
    assert land.read_state(perf / land.STATE) == b
    with tarfile.open(perf / land.STATE) as tar:
        names = tar.getnames()
        assert names == sorted(names) and {m.uid for m in tar.getmembers()} == {0}
    log17 = (perf / "accuracy_h200_2026-12-04_q4_call17.log").read_text()
    assert "build/m3-site/torchao/x.py:1" in log17 and "/srv/checkout" not in log17 and "/acc/report.md" in log17

    # landing the same calls again adds nothing and rewrites the state byte for byte
    state = (perf / land.STATE).read_bytes()
    again = land.land(calls, perf, "2026-12-04", report=False)
    assert again == {"rows_added": 0, "rows": len(b), "logs": [], "calls": [17, 18]} and len(_dump(perf)) == len(b)
    assert (perf / land.STATE).read_bytes() == state


@pytest.mark.parametrize("suffix", ["repeat", "repeat2", "dense_server"])
def test_a_kept_log_with_a_suffix_takes_its_number(tmp_path, committed, suffix):
    """A served-but-not-landed call kept as ``call17_repeat.log`` holds number 17: the next call lands as 18."""
    rng, rows, perf = committed
    (perf / f"accuracy_h200_2026-12-04_q4_call17_{suffix}.log").write_text("call 17, not landed\n")
    call = _call(tmp_path, "8", {**rows, **_rows(rng, "fp8", 8, 12)}, "call 8\n")
    out = land.land([call], perf, "2026-12-05", report=False)
    assert out["logs"] == ["accuracy_h200_2026-12-05_q4_call18.log"] and out["calls"] == [18]


def test_a_landing_cut_short_is_finished_by_landing_again(tmp_path, committed, monkeypatch):
    # The dump lost its last newline (an editor), the call's log holds a byte that is not UTF-8, and the landing
    # dies at its second file (a kill, a full disk): every file is whole, and landing again finishes the job.
    rng, rows, perf = committed
    (perf / land.SAMPLES).write_text((perf / land.SAMPLES).read_text().rstrip("\n"))
    grown = {**rows, **_rows(rng, "fp8", 8, 12)}
    call = _call(tmp_path, "6", grown, "")
    (call / "call.log").write_bytes(b"accuracy_h200: start\nclock \xb5s\n")
    writes = []

    def dies_at_the_second(path, data):
        writes.append(path.name)
        if len(writes) == 2:
            raise OSError(28, "No space left on device")
        atomic(path, data)

    atomic = land.write_atomic
    monkeypatch.setattr(land, "write_atomic", dies_at_the_second)
    with pytest.raises(OSError):
        land.land([call], perf, "2026-12-04", report=False)
    assert writes == ["state.tgz", land.SAMPLES]
    assert land.read_state(perf / land.STATE) == grown and len(_dump(perf)) == len(rows)  # both still readable
    monkeypatch.setattr(land, "write_atomic", atomic)
    out = land.land([call], perf, "2026-12-04", report=False)
    assert out["rows_added"] == len(grown) - len(rows) and out["calls"] == [17]
    assert {(r["format"], r["task"], r["doc_id"]) for r in _dump(perf)} == set(grown) and len(_dump(perf)) == len(grown)
    assert (perf / "accuracy_h200_2026-12-04_q4_call17.log").read_text() == "accuracy_h200: start\nclock \ufffds\n"
    assert not list(perf.rglob("*.tmp"))


@pytest.mark.parametrize("fault", ["lost", "changed", "out_of_order"])
def test_a_call_that_loses_or_changes_a_committed_row_lands_nothing(tmp_path, committed, fault):
    rng, rows, perf = committed
    snapshot = _files(perf)
    grown = {**rows, **_rows(rng, "fp8", 8, 12)}
    if fault == "lost":  # e.g. a fresh machine's call not resumed from the committed state
        victim = rng.choice(list(rows))
        calls = [_call(tmp_path, "6", {k: v for k, v in grown.items() if k != victim}, "6\n")]
        match = "lacks 1 rows of the committed state"
    elif fault == "changed":
        victim = rng.choice(list(rows))
        calls = [_call(tmp_path, "6", {**grown, victim: {**rows[victim], "score": 1.0 - rows[victim]["score"]}}, "6\n")]
        match = "1 rows differ from the committed state"
    else:  # the calls given newest first: the second state lacks the first's rows
        calls = [_call(tmp_path, "7", grown, "7\n"), _call(tmp_path, "6", rows, "6\n")]
        match = "6/state.tgz: lacks 8 rows of .*7/state.tgz"
    with pytest.raises(SystemExit, match=match):
        land.land(calls, perf, "2026-12-04", report=False)
    assert _files(perf) == snapshot


def test_cli_names_the_bad_argument(tmp_path):
    def cli(*argv):
        return subprocess.run([sys.executable, str(ROOT / "lab" / "scripts" / "accuracy_h200_land.py"), *argv],
                              capture_output=True, text=True, cwd=ROOT)

    proc = cli("--date", "3 Dec", str(tmp_path))
    assert proc.returncode == 2 and "--date must be YYYY-MM-DD" in proc.stderr
    proc = cli("--no-report", "--perf-data", str(tmp_path), str(tmp_path))
    assert proc.returncode == 1 and "needs call.log and state.tgz" in proc.stderr
    proc = cli("--perf-data", str(tmp_path), str(tmp_path))
    assert proc.returncode == 2 and "needs --no-report" in proc.stderr


def test_strip_paths_cuts_absolute_paths_into_the_repo_only():
    text = "/a/b/main/lab/gpu/x.sh: ok; /usr/lib/python3/site.py; /acc/report.md; rel build/y; /t/build/z"
    want = "lab/gpu/x.sh: ok; /usr/lib/python3/site.py; /acc/report.md; rel build/y; build/z"
    assert land.strip_paths(text) == want
    # URLs stay whole; hidden folders and installed packages are not the repo; a machine's own roots are hidden.
    cases = {"see https://pytorch.org/docs/stable/x.html": "see https://pytorch.org/docs/stable/x.html",
             "'/home/u/.cache/torch/kernels/ab.so'": "'<machine>/u/.cache/torch/kernels/ab.so'",
             "/usr/lib/python3.12/site-packages/kernels/x.py:3": "/usr/lib/python3.12/site-packages/kernels/x.py:3",
             "RESUME=/scratch/acc-state (/mnt/c/main/out/a)": "RESUME=<machine>/acc-state (out/a)",
             "~/scratch/x, a/scratch/y, /home/u/.triton/cache": "~/scratch/x, a/scratch/y, <machine>/u/.triton/cache"}
    for text, want in cases.items():
        assert land.strip_paths(text) == want and land.strip_paths(want) == want, text


def test_repack_gives_the_same_bytes_a_second_later(tmp_path):
    """A call's archive names acc/samples but not acc/ itself, so extracting it makes acc/ with the time of the
    extraction; the repacked state must not carry it (or any time), or every landing changes the file in git."""
    (tmp_path / "src" / "acc" / "samples" / "fp8").mkdir(parents=True)
    (tmp_path / "src" / "acc" / "samples" / "fp8" / "t.jsonl").write_text('{"doc_id": "8192/0"}\n')
    subprocess.run(["tar", "-C", str(tmp_path / "src"), "-czf", str(tmp_path / "call.tgz"), "acc/samples"],
                   check=True)
    land.repack(tmp_path / "call.tgz", tmp_path / "a.tgz")
    time.sleep(1.1)
    land.repack(tmp_path / "call.tgz", tmp_path / "b.tgz")
    assert (tmp_path / "a.tgz").read_bytes() == (tmp_path / "b.tgz").read_bytes()
    with tarfile.open(tmp_path / "a.tgz") as tar:
        assert tar.getnames() == ["acc", "acc/samples", "acc/samples/fp8", "acc/samples/fp8/t.jsonl"]
        assert {m.mtime for m in tar.getmembers()} == {0}


def _in_parts(call: Path, rng, size: int) -> None:
    """``call``'s state.tgz replaced by its ``size``-byte parts, written in a shuffled order: the order they are
    joined in must come from their names."""
    whole = (call / "state.tgz").read_bytes()
    chunks = [whole[at:at + size] for at in range(0, len(whole), size)]
    assert len(chunks) > 5
    order = list(range(len(chunks)))
    rng.shuffle(order)
    for i in order:
        (call / f"state.tgz.part-a{chr(97 + i)}").write_bytes(chunks[i])
    (call / "state.tgz").unlink()


def test_two_calls_both_in_parts_are_joined_apart_and_in_name_order(tmp_path, committed):
    rng, rows, perf = committed
    a = {**rows, **_rows(rng, "fp8", 8, 12)}
    b = {**a, **_rows(rng, "mxfp4", 8, 12)}
    c6, c7 = _call(tmp_path, "6", a, "call 6\n"), _call(tmp_path, "7", b, "call 7\n")
    size = max(200, (c7 / "state.tgz").stat().st_size // 12)
    _in_parts(c6, rng, size)
    _in_parts(c7, rng, size)
    snapshot = _files(perf)
    with pytest.raises(SystemExit, match="6/state.tgz: lacks 8 rows of .*7/state.tgz"):  # given newest first
        land.land([c7, c6], perf, "2026-12-04", report=False)
    assert _files(perf) == snapshot
    out = land.land([c6, c7], perf, "2026-12-04", report=False)
    assert out["rows"] == len(b) and out["rows_added"] == len(b) - len(rows)
    assert land.read_state(perf / land.STATE) == b


def test_a_dump_ahead_of_the_call_lands_nothing(tmp_path, committed):
    """The committed dump holds a row the call's state lacks (or holds differently): refused, naming the dump."""
    rng, rows, perf = committed
    grown = {**rows, **_rows(rng, "fp8", 8, 12)}
    extra = _rows(rng, "mxfp4", 8, 9)
    with open(perf / land.SAMPLES, "a") as f:
        f.writelines(json.dumps({"format": k[0], "task": k[1], **r}) + "\n" for k, r in extra.items())
    snapshot = _files(perf)
    with pytest.raises(SystemExit, match=f"lacks {len(extra)} rows of {land.SAMPLES}"):
        land.land([_call(tmp_path, "6", grown, "6\n")], perf, "2026-12-04", report=False)
    victim = rng.choice(list(extra))
    changed = {**grown, **extra, victim: {**extra[victim], "response": extra[victim]["response"] + "x"}}
    with pytest.raises(SystemExit, match=f"1 rows differ from {land.SAMPLES}"):
        land.land([_call(tmp_path, "7", changed, "7\n")], perf, "2026-12-04", report=False)
    assert _files(perf) == snapshot


def test_a_log_landed_with_its_machine_paths_is_still_recognised(tmp_path, committed):
    """A log committed before a path rule existed (or kept by hand) still holds machine paths; the same call landed
    again is that log, not a new one."""
    rng, rows, perf = committed
    text = "accuracy_h200: start\n/home/u/ckpt/main/lab/gpu/accuracy_h200.sh: ok, cache /scratch/x\n"
    (perf / "accuracy_h200_2026-12-03_q4_call17.log").write_text(text)
    call = _call(tmp_path, "6", {**rows, **_rows(rng, "fp8", 8, 10)}, text)
    out = land.land([call], perf, "2026-12-04", report=False)
    assert out["logs"] == [] and out["calls"] == [17]


def test_a_call_without_its_log_lands_nothing(tmp_path, committed):
    rng, rows, perf = committed
    call = _call(tmp_path, "6", {**rows, **_rows(rng, "fp8", 8, 10)}, "6\n")
    (call / "call.log").unlink()
    snapshot = _files(perf)
    with pytest.raises(SystemExit, match="needs call.log and state.tgz"):
        land.land([call], perf, "2026-12-04", report=False)
    assert _files(perf) == snapshot


@pytest.mark.parametrize("date", ["2026-12-041", "2026-12-4", "x2026-12-04", "2026-12-04 "])
def test_date_must_be_exactly_yyyy_mm_dd(tmp_path, capsys, date):
    with pytest.raises(SystemExit) as e:
        land.main(["--date", date, "--no-report", "--perf-data", str(tmp_path), str(tmp_path)])
    assert e.value.code == 2 and "--date must be YYYY-MM-DD" in capsys.readouterr().err
