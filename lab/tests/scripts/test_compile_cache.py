"""lab/gpu/compile_cache.py: a real Triton cache (a kernel of ours compiled for sm_90 with Triton's own
ptxas, no GPU) packed without its intermediate IRs and unpacked under another path is a cache hit there;
JIT modules travel as their .so only; an Inductor cache (a torch.compile function compiled on the CPU) is an FX
graph cache hit under another path; filled caches are kept; weights carried as xz come back byte for byte."""

import json
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "lab" / "gpu"))
import compile_cache  # noqa: E402
from m3_kernels.testing import compile_sm90, triton_module  # noqa: E402


def _compile_selector(monkeypatch, cache: Path) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    sel = triton_module("m3_kernels.ops.select.triton", "_select_kernel")
    sig = dict(s_ptr="*fp32", nvis_ptr="*i32", out_ptr="*i32", nb="i32", stride_s_h="i32", stride_s_r="i32",
               stride_o_h="i32", stride_o_r="i32")
    const = dict(TOPK=16, LOCAL=1, INIT=0, BLOCK=256, TOPK_P2=16, USE_PDL=False, ID_BITS=sel._ID_BITS,
                 MAX_ID=sel._MAX_ID, MAX_UNROLLED=sel.MAX_UNROLLED)
    compile_sm90("m3_kernels.ops.select.triton", "_select_kernel", sig, const, num_warps=1)


def _files(d: Path) -> dict:
    return {str(f.relative_to(d)): f.read_bytes() for f in d.rglob("*") if f.is_file()}


def _fake_jit(d: Path) -> Path:
    """A TVM-FFI cache folder as SGLang's load_jit leaves it: the module's .so beside build leftovers."""
    build = d / "sgl_kernel_jit_m3_score_decode_mxfp4_0123abcd__arch_9.0a__tvmffi_0.1.11"
    build.mkdir(parents=True)
    (build / "sgl_kernel_jit_m3_score_decode_mxfp4_0123abcd.so").write_bytes(os.urandom(4096))
    (build / "build.ninja").write_text("rule cxx\n")
    (build / "cuda.cuda.o").write_bytes(os.urandom(512))
    return d


@pytest.mark.timeout(300)
def test_a_packed_triton_cache_is_a_hit_under_another_path(tmp_path, monkeypatch):
    built = tmp_path / "machine1" / "triton"
    _compile_selector(monkeypatch, built)
    assert any(f.suffix == ".ptx" for f in built.rglob("*")) and any(f.suffix == ".cubin" for f in built.rglob("*"))
    jit = _fake_jit(tmp_path / "machine1" / "jit")
    archive = tmp_path / "compile-cache.tar.xz"
    stats = compile_cache.pack(built, jit, archive)
    assert stats["jit_modules"] == 1 and stats["bytes"] == archive.stat().st_size > 0

    triton2, jit2 = tmp_path / "machine2" / "cache" / "triton", tmp_path / "machine2" / "jit"
    filled = compile_cache.unpack(archive, triton2, jit2)
    assert filled == {"triton_files": stats["triton_files"], "jit_modules": 1, "inductor_files": 0, "extra_files": 0}
    kept = _files(triton2)
    assert {Path(n).suffix for n in kept} <= {".cubin", ".json"} and any(n.endswith(".cubin") for n in kept)
    for grp in triton2.glob("*/__grp__*.json"):
        paths = json.loads(grp.read_text())["child_paths"].values()
        assert paths and all(p.startswith(str(triton2)) and os.path.exists(p) for p in paths)
    assert sorted(_files(jit2)) == ["sgl_kernel_jit_m3_score_decode_mxfp4_0123abcd__arch_9.0a__tvmffi_0.1.11/"
                                    "sgl_kernel_jit_m3_score_decode_mxfp4_0123abcd.so"]
    so = [b for n, b in _files(jit).items() if n.endswith(".so")]
    assert next(iter(_files(jit2).values())) == so[0]

    # the same compile under the new path, the first machine's cache gone, reads the cache and writes nothing;
    # an empty cache gets written
    shutil.rmtree(built)
    _compile_selector(monkeypatch, triton2)
    assert _files(triton2) == kept
    empty = tmp_path / "machine3" / "triton"
    _compile_selector(monkeypatch, empty)
    assert any(f.suffix == ".ptx" for f in empty.rglob("*"))

    # a machine's own caches are kept
    before = _files(empty)
    assert compile_cache.unpack(archive, empty, jit2) == {"triton_files": 0, "jit_modules": 0, "inductor_files": 0,
                                                          "extra_files": 0}
    assert _files(empty) == before


def test_pack_refuses_past_its_limit_and_writes_nothing(tmp_path):
    jit = _fake_jit(tmp_path / "jit")
    (next(jit.glob("*/*.so"))).write_bytes(os.urandom(3 * 2**20))  # random bytes do not compress
    out = tmp_path / "c.tar.xz"
    with pytest.raises(SystemExit, match="over --max-mib 2"):
        compile_cache.pack(tmp_path / "no-triton", jit, out, max_mib=2)
    assert not out.exists()
    proc = subprocess.run([sys.executable, str(ROOT / "lab" / "gpu" / "compile_cache.py"), "unpack",
                           str(out), str(tmp_path / "t"), str(tmp_path / "j")], capture_output=True, text=True)
    assert proc.returncode == 2 and "is not a file" in proc.stderr


def test_unxz_restores_carried_weights_once(tmp_path):
    data = os.urandom(10000) + bytes(50000)
    z = tmp_path / "model-00001-of-00001.safetensors.xz"
    z.write_bytes(lzma.compress(data))
    proc = subprocess.run([sys.executable, str(ROOT / "lab" / "gpu" / "compile_cache.py"), "unxz", str(z)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "model-00001-of-00001.safetensors"
    assert out.read_bytes() == data and not list(tmp_path.glob("*.part"))
    out.write_bytes(b"kept")  # present: left alone
    assert compile_cache.unxz(z) == out and out.read_bytes() == b"kept"


def _fake_triton(d: Path, cubin_kib: dict) -> Path:
    """Triton cache entries as Triton writes them: a cubin, its metadata and a group file naming both."""
    for key, kib in cubin_kib.items():
        entry = d / key
        entry.mkdir(parents=True)
        (entry / "k.cubin").write_bytes(os.urandom(kib * 1024))
        (entry / "k.ptx").write_text("// ptx\n" * 100)
        (entry / "k.json").write_text(json.dumps({"name": "k", "hash": key}))
        (entry / "__grp__k.json").write_text(json.dumps({"child_paths": {
            n: str(entry / n) for n in ("k.cubin", "k.ptx", "k.json")}}))
    return d


def test_extra_caches_travel_whole_and_every_unpacked_file_keeps_the_archives_time(tmp_path):
    """--extra NAME=DIR folders (the CUDA driver's PTX cache, torch's NVRTC kernels) come back byte for byte under
    new folders; nothing unpacked, not even a rewritten group file, looks built on the new machine; a filled
    folder is kept; trim keeps every Triton entry before an extra cache."""
    cuda = tmp_path / "m1" / "cuda"
    (cuda / "ComputeCache" / "a" / "b").mkdir(parents=True)
    (cuda / "ComputeCache" / "index").write_bytes(os.urandom(300))
    (cuda / "ComputeCache" / "a" / "b" / "c0ffee").write_bytes(os.urandom(5000))
    kernels = tmp_path / "m1" / "torch-kernels"
    kernels.mkdir()
    (kernels / "nvrtc_abs_kernel").write_bytes(os.urandom(700))
    triton = _fake_triton(tmp_path / "m1" / "triton", {"k1": 1, "k2": 2})
    archive = tmp_path / "cc.tar.xz"
    stats = compile_cache.pack(triton, tmp_path / "no-jit", archive, extra={"cuda": cuda, "torch-kernels": kernels})
    assert stats["extra_files"] == 3 and stats["triton_files"] == 6

    dst = {"cuda": tmp_path / "m2" / "cuda", "torch-kernels": tmp_path / "m2" / "tk"}
    filled = compile_cache.unpack(archive, tmp_path / "m2" / "triton", tmp_path / "m2" / "jit", extra=dst)
    assert filled == {"triton_files": 6, "jit_modules": 0, "inductor_files": 0, "extra_files": 3}
    assert _files(dst["cuda"]) == _files(cuda) and _files(dst["torch-kernels"]) == _files(kernels)
    unpacked = [f for f in (tmp_path / "m2").rglob("*") if f.is_file()]
    assert len(unpacked) == 9 and all(f.stat().st_mtime < 365 * 86400 for f in unpacked)
    assert all(str(tmp_path / "m2") in p for g in (tmp_path / "m2" / "triton").glob("*/__grp__*.json")
               for p in json.loads(g.read_text())["child_paths"].values())

    (tmp_path / "m3" / "cuda").mkdir(parents=True)
    (tmp_path / "m3" / "cuda" / "own").write_bytes(b"built here")
    again = compile_cache.unpack(archive, tmp_path / "m3" / "triton", tmp_path / "m3" / "jit",
                                 extra={"cuda": tmp_path / "m3" / "cuda", "torch-kernels": tmp_path / "m3" / "tk"})
    assert again["extra_files"] == 1 and _files(tmp_path / "m3" / "cuda") == {"own": b"built here"}

    kib = archive.stat().st_size / 2**10
    trimmed = compile_cache.trim(archive, tmp_path / "t.tar.xz", max_mib=(kib - 0.5) / 2**10)
    assert trimmed["triton_files"] == 6 and trimmed["extra_files"] == 1 and trimmed["dropped_units"] == 1


@pytest.mark.parametrize("bad", ["cuda", "=dir", "Cuda=dir", "cuda=", "../x=dir"])
def test_extra_is_name_equals_folder(tmp_path, bad):
    proc = subprocess.run([sys.executable, str(ROOT / "lab" / "gpu" / "compile_cache.py"), "pack",
                           str(tmp_path / "t"), str(tmp_path / "j"), str(tmp_path / "o.tar.xz"), "--extra", bad],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--extra" in proc.stderr and "NAME=DIR" in proc.stderr
    assert not (tmp_path / "o.tar.xz").exists()


def test_trim_keeps_jit_modules_then_the_smallest_triton_entries_that_fit(tmp_path):
    rng_sizes = [50, 100, 400, 800, 1500]
    triton = _fake_triton(tmp_path / "triton", {f"key{kib:04d}": kib for kib in rng_sizes})
    jit = _fake_jit(tmp_path / "jit")
    full = tmp_path / "full.tar.xz"
    compile_cache.pack(triton, jit, full)
    small = tmp_path / "small.tar.xz"
    proc = subprocess.run([sys.executable, str(ROOT / "lab" / "gpu" / "compile_cache.py"), "trim", str(full),
                           str(small), "--max-mib", "0.6"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert small.stat().st_size <= 0.6 * 2**20 and "2 units dropped" in proc.stdout  # 4 KiB jit + 50 + 100 + 400 KiB
    filled = compile_cache.unpack(small, tmp_path / "t2", tmp_path / "j2")
    assert filled["jit_modules"] == 1
    assert sorted(p.name for p in (tmp_path / "t2").iterdir()) == ["key0050", "key0100", "key0400"]
    for grp in (tmp_path / "t2").glob("*/__grp__*.json"):  # whole entries, group files pointing at them
        children = json.loads(grp.read_text())["child_paths"].values()
        assert sorted(Path(p).name for p in children) == ["k.cubin", "k.json"]
    tiny = tmp_path / "tiny.tar.xz"
    assert compile_cache.trim(full, tiny, max_mib=0.001)["dropped_units"] == len(rng_sizes) + 1


def test_trim_keeps_units_that_only_fit_together(tmp_path):
    """Variants of one kernel share most bytes: six entries of 200 KiB each, alike but for their key, pack to
    about 200 KiB together though each alone is 200 KiB. A limit of 0.5 MiB keeps all six, as the whole
    archive fits; with a seventh, different entry of 400 KiB it keeps the six and drops that one."""
    shared = os.urandom(200 * 1024)
    triton = _fake_triton(tmp_path / "triton", {f"v{i}": 1 for i in range(6)})
    for entry in triton.iterdir():
        (entry / "k.cubin").write_bytes(shared)
    full = tmp_path / "full.tar.xz"
    compile_cache.pack(triton, tmp_path / "no-jit", full)
    out = tmp_path / "out.tar.xz"
    stats = compile_cache.trim(full, out, max_mib=0.5)
    assert stats["dropped_units"] == 0 and stats["triton_files"] == 6 * 3 and out.stat().st_size <= 0.5 * 2**20

    _fake_triton(triton, {"other": 400})
    compile_cache.pack(triton, tmp_path / "no-jit", full)
    stats = compile_cache.trim(full, out, max_mib=0.5)
    assert stats["dropped_units"] == 1 and out.stat().st_size <= 0.5 * 2**20
    kept = compile_cache.unpack(out, tmp_path / "t2", tmp_path / "j2")
    assert kept["triton_files"] == 6 * 3 and sorted(p.name for p in (tmp_path / "t2").iterdir()) == [
        f"v{i}" for i in range(6)]


def test_trim_packs_a_bounded_number_of_times(tmp_path, monkeypatch):
    """A machine's cache holds 100-130 Triton variants and packing them takes seconds: trim bisects over how many
    to keep, so 100 units cost at most 1 + ceil(log2 100) = 8 packings, and it keeps the most that fit."""
    sizes = {f"k{i:03d}": 4 + i % 7 for i in range(100)}  # KiB of random cubin each
    full = tmp_path / "full.tar.xz"
    compile_cache.pack(_fake_triton(tmp_path / "triton", sizes), tmp_path / "no-jit", full)
    packings = []
    real = compile_cache._xz_tar
    monkeypatch.setattr(compile_cache, "_xz_tar", lambda members: packings.append(len(members)) or real(members))
    out = tmp_path / "out.tar.xz"
    stats = compile_cache.trim(full, out, max_mib=0.25)
    assert len(packings) <= 8 and out.stat().st_size <= 0.25 * 2**20
    kept = 100 - stats["dropped_units"]
    order = sorted(sizes, key=lambda k: sizes[k])  # smallest first, as trim keeps them
    names = {compile_cache._unit(n) for n, _ in compile_cache._read(out)}
    assert 0 < kept < 100 and names == {f"triton/{k}" for k in order[:kept]}
    one_more = {f"triton/{k}" for k in order[:kept + 1]}  # and no more would fit: one unit more overflows
    members = compile_cache._read(full)
    assert len(real([m for m in members if compile_cache._unit(m[0]) in one_more])) > 0.25 * 2**20


def test_sglang_load_jit_loads_a_carried_module_without_building(tmp_path, monkeypatch):
    """The scorer's module as SGLang's load_jit names and finds it: built on one machine (nvcc stubbed: the build
    writes the .so where load_jit asked for it), packed, unpacked elsewhere, then loaded there with building
    forbidden."""
    compile_mod = pytest.importorskip("sglang.jit_kernel.utils.compile")  # SGLang 0.5.16's load_jit
    import tvm_ffi
    import tvm_ffi.cpp

    from m3_kernels.ops.score.backends import cuda as cuda_backend

    monkeypatch.setattr(compile_mod, "get_jit_cuda_arch", lambda: type("Arch", (), {"target_name": "9.0a"})())
    built = []

    def fake_build(name, *args, build_directory, **kwargs):
        out = Path(build_directory) / f"{name}.so"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(os.urandom(2048))
        (out.parent / "build.ninja").write_text("rule nvcc\n")
        built.append(out)
        return "built"

    monkeypatch.setattr(tvm_ffi.cpp, "load_inline", fake_build)
    monkeypatch.setenv("TVM_FFI_CACHE_DIR", str(tmp_path / "machine1"))
    assert cuda_backend.load_module() == "built" and len(built) == 1

    archive = tmp_path / "c.tar.xz"
    assert compile_cache.pack(tmp_path / "no-triton", tmp_path / "machine1", archive)["jit_modules"] == 1
    assert compile_cache.unpack(archive, tmp_path / "t2", tmp_path / "machine2")["jit_modules"] == 1

    def no_build(*args, **kwargs):
        raise AssertionError("load_jit built the module instead of loading the carried one")

    loaded = []
    monkeypatch.setattr(tvm_ffi.cpp, "load_inline", no_build)
    monkeypatch.setattr(tvm_ffi, "load_module", lambda path: loaded.append(Path(path)) or "loaded")
    monkeypatch.setenv("TVM_FFI_CACHE_DIR", str(tmp_path / "machine2"))
    assert cuda_backend.load_module() == "loaded"
    assert loaded == [tmp_path / "machine2" / built[0].relative_to(tmp_path / "machine1")]
    assert loaded[0].read_bytes() == built[0].read_bytes()


_COMPILED = """
import torch
from torch._dynamo.utils import counters

@torch.compile(dynamic=False)
def swiglu(x, limit: float):  # the shape of SGLang's compiled activations
    gate, up = x.chunk(2, -1)
    return gate.clamp(max=limit) * torch.sigmoid(gate) * (up.clamp(-limit, limit) + 1)

x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
gate, up = x.chunk(2, -1)
want = gate.clamp(max=7.0) * torch.sigmoid(gate) * (up.clamp(-7.0, 7.0) + 1)
torch.testing.assert_close(swiglu(x, 7.0), want)
print("hits", counters["inductor"]["fxgraph_cache_hit"], "misses", counters["inductor"]["fxgraph_cache_miss"])
"""


def _run_compiled(cache: Path) -> str:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _COMPILED], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.timeout(900)
def test_an_inductor_cache_is_a_graph_cache_hit_under_another_path(tmp_path):
    built = tmp_path / "machine1" / "inductor"
    assert _run_compiled(built) == "hits 0 misses 1"
    assert (built / "locks").is_dir()
    (built / "triton" / "0").mkdir(parents=True)  # a GPU machine's: Triton's own cache holds those kernels
    (built / "triton" / "0" / "k.cubin").write_bytes(b"x")
    (built / "precompiled_headers").mkdir(exist_ok=True)  # a CPU build's, often tens of MiB
    (built / "precompiled_headers" / "h.gch").write_bytes(b"x")
    archive = tmp_path / "cc.tar.xz"
    stats = compile_cache.pack(tmp_path / "no-triton", tmp_path / "no-jit", archive, inductor_dir=built)
    assert stats["inductor_files"] > 0 and stats["triton_files"] == stats["jit_modules"] == 0
    moved = tmp_path / "machine2" / "inductor"
    filled = compile_cache.unpack(archive, tmp_path / "t2", tmp_path / "j2", inductor_dir=moved)
    assert filled == {"triton_files": 0, "jit_modules": 0, "inductor_files": stats["inductor_files"], "extra_files": 0}
    assert not any((moved / skipped).exists() for skipped in ("locks", "triton", "precompiled_headers"))
    assert _run_compiled(moved) == "hits 1 misses 0"
    # trim keeps Inductor's folders before any Triton entry, and a machine's own Inductor cache is kept
    triton = _fake_triton(tmp_path / "triton", {"key0400": 400})
    full = tmp_path / "full.tar.xz"
    compile_cache.pack(triton, tmp_path / "no-jit", full, inductor_dir=built)
    kib = full.stat().st_size / 2**10
    trimmed = compile_cache.trim(full, tmp_path / "trimmed.tar.xz", max_mib=(kib - 100) / 2**10)
    assert trimmed["inductor_files"] == stats["inductor_files"] and trimmed["triton_files"] == 0
    before = _files(moved)
    assert compile_cache.unpack(full, tmp_path / "t3", tmp_path / "j3", inductor_dir=moved)["inductor_files"] == 0
    assert _files(moved) == before


def test_pack_keeps_binaries_metadata_and_launchers_only(tmp_path):
    """From a Triton entry: the cubin, its json files and the compiled launcher (.so), none of the IRs; from a JIT
    build folder: the module named after the folder, not another .so built beside it."""
    entry = tmp_path / "triton" / "KEY"
    entry.mkdir(parents=True)
    for name in ("k.cubin", "k.json", "__grp__k.json", "__triton_launcher.so", "k.ptx", "k.llir", "k.ttir",
                 "k.ttgir", "k.source"):
        (entry / name).write_bytes(os.urandom(64))
    jit = _fake_jit(tmp_path / "jit")
    build = next(jit.iterdir())
    (build / "libhelper.so").write_bytes(os.urandom(256))  # a build by-product, not what load_jit loads
    archive = tmp_path / "c.tar.xz"
    stats = compile_cache.pack(tmp_path / "triton", jit, archive)
    assert sorted(n for n, _ in compile_cache._read(archive)) == [
        f"jit/{build.name}/sgl_kernel_jit_m3_score_decode_mxfp4_0123abcd.so",
        "triton/KEY/__grp__k.json", "triton/KEY/__triton_launcher.so", "triton/KEY/k.cubin", "triton/KEY/k.json"]
    assert stats["triton_files"] == 4 and stats["jit_modules"] == 1


def test_pack_limit_is_in_mib(tmp_path):
    """1,010,000 random bytes pack to more than 1 MB and less than 1 MiB: --max-mib 1 takes them."""
    jit = _fake_jit(tmp_path / "jit")
    next(jit.glob("*/*.so")).write_bytes(os.urandom(1_010_000))
    out = tmp_path / "c.tar.xz"
    stats = compile_cache.pack(tmp_path / "no-triton", jit, out, max_mib=1)
    assert 10**6 < stats["bytes"] == out.stat().st_size <= 2**20


def test_trim_keeps_a_jit_module_before_smaller_triton_entries(tmp_path):
    """A JIT module (a nvcc build of 10-20 s) is kept before Triton entries, even ones smaller than it."""
    triton = _fake_triton(tmp_path / "triton", {"a": 20, "b": 20, "c": 20})
    jit = _fake_jit(tmp_path / "jit")
    next(jit.glob("*/*.so")).write_bytes(os.urandom(100 * 1024))
    full = tmp_path / "full.tar.xz"
    compile_cache.pack(triton, jit, full)
    stats = compile_cache.trim(full, tmp_path / "t.tar.xz", max_mib=130 / 1024)  # the module and one entry
    assert stats["jit_modules"] == 1 and stats["triton_files"] == 3 and stats["dropped_units"] == 2


@pytest.mark.parametrize("argv,msg", [
    (["trim", "{d}/none.tar.xz", "{d}/out.tar.xz", "--max-mib", "1"], "trim: archive {d}/none.tar.xz is not a file"),
    (["unpack", "{d}/none.tar.xz", "{d}/t", "{d}/j"], "unpack: archive {d}/none.tar.xz is not a file"),
    (["unxz", "{d}/w.safetensors.xz"], "unxz: {d}/w.safetensors.xz is not an existing .xz file"),
    (["unxz", "{d}/plain"], "unxz: {d}/plain is not an existing .xz file"),
])
def test_a_missing_input_is_named(tmp_path, capsys, argv, msg):
    (tmp_path / "plain").write_bytes(b"x")
    with pytest.raises(SystemExit) as e:
        compile_cache.main([a.format(d=tmp_path) for a in argv])
    assert e.value.code == 2 and msg.format(d=tmp_path) in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]
