"""The PD decode side's index-K check (sglang_m3.pd): a decode server takes a request's index-K pages only from a
prefill server that writes them the same way; any other model's receivers are left to SGLang.

Real SGLang code where it runs on a CPU: SGLang's bootstrap server (the prefill server registers with it as
``CommonKVManager.register_to_bootstrap`` does, and the decode reads ``/route`` into ``PrefillServerInfo`` as
``try_ensure_parallel_info`` does), ``CommonKVManager``'s failure bookkeeping and prefill URL, ``CommonKVReceiver``,
and this package's pool and ``/model_info`` entry (``server_info.index_k_info``). No transfer backend runs here."""

import json
import socket
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import torch

from m3_kernels.formats import IndexKFormat, ScaleRule
from sglang_m3 import pd, plugin, server_info
from sglang_m3.config import IndexKSettings, MiniMaxM31Config
from sglang_m3.pool import MiniMaxM31SparseKVPool

REPO = Path(__file__).resolve().parents[2]
ROOM = 12345


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _m3_index_k(fmt, scale_rule="rceil", sign_seed=None) -> dict:
    """What a prefill server of the tiny config in ``fmt`` reports as ``m3_index_k``."""
    cfg = json.loads((REPO / "configs" / "minimax-m3.1-tiny" / "config.json").read_text())
    cfg.pop("model_type", None)
    cfg.update(index_k_format=fmt, index_k_scale_rule=scale_rule, index_k_sign_seed=sign_seed)
    return server_info.index_k_info(MiniMaxM31Config(**cfg))


class _ModelInfo(ThreadingHTTPServer):
    """Stand-in for a prefill server's HTTP API: ``GET /model_info`` answers ``body`` (SGLang's keys, plus
    ``m3_index_k`` when given) and counts the reads."""

    def __init__(self, m3_index_k: dict | None, api_key: str | None = None):
        self.body = {"model_path": "prefill", "model_type": "minimax_m3_1"}
        if m3_index_k is not None:
            self.body[server_info.M3_INDEX_K] = m3_index_k
        self.reads, self.api_key = 0, api_key
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                outer.reads += 1
                key = outer.api_key
                allowed = key is None or self.headers.get("Authorization") == f"Bearer {key}"
                found = self.path == "/model_info"
                data = json.dumps(outer.body).encode() if found and allowed else b"{}"
                self.send_response(401 if not allowed else 200 if found else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def prefill():
    """``make(m3_index_k)``: SGLang's bootstrap server with one prefill rank registered, whose HTTP API (the stand-in
    ``_ModelInfo``, taking ``api_key`` if given) answers ``m3_index_k``; returns ``(bootstrap_addr, api)``."""
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

    made = []

    def make(m3_index_k, http_port=None, api_key=None):
        api = _ModelInfo(m3_index_k, api_key)
        port = _free_port()
        bootstrap = CommonKVBootstrapServer("127.0.0.1", port)
        made.append((bootstrap, api))
        addr = f"127.0.0.1:{port}"
        payload = {  # the keys CommonKVManager.register_to_bootstrap sends, for one rank
            "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0, "attn_dp_size": 1,
            "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
            "rank_ip": "127.0.0.1", "rank_port": _free_port(), "page_size": 128, "kv_cache_dtype": "auto",
            "load_balance_method": "follow_bootstrap_room", "enable_dsa_cache_layer_split": False,
            "prefill_http_port": api.server_address[1] if http_port is None else http_port,
        }
        if http_port is False:  # a prefill server that registers no HTTP port
            del payload["prefill_http_port"]
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.put(f"http://{addr}/route", json=payload, timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        return addr, api

    yield make
    for bootstrap, api in made:
        bootstrap.close()
        api.shutdown()


def _pool(fmt, scale_rule="rceil", sign_seed=None):
    return MiniMaxM31SparseKVPool(
        size=256, page_size=128, dtype=torch.bfloat16, head_num=1, head_dim=128, idx_head_dim=128,
        dense_layer_ids=[0], sparse_layer_ids=[1], device="cpu",
        settings=IndexKSettings(IndexKFormat(fmt), ScaleRule(scale_rule), sign_seed),
        disable_value_sparse_layer_ids=[1],
    )


def _decode_manager(pool, api_key=None):
    """SGLang's ``CommonKVManager`` of a decode server, without its ``__init__`` (which binds sockets and reads the
    process's parallel state): the attributes its receiver and failure bookkeeping use. ``pool`` goes through the
    plugin's hook after ``DecodePreallocQueue._init_kv_manager`` (the queue: a stand-in with the two attributes
    it reads)."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    mgr = CommonKVManager.__new__(CommonKVManager)
    mgr.prefill_info_table = {}
    mgr.request_status = {}
    mgr.failure_records = {}
    mgr.failure_lock = threading.Lock()
    mgr.addr_to_rooms_tracker = defaultdict(set)
    mgr.prefill_response_tracker = defaultdict(set)
    # SGLang 0.5.23's receiver and status bookkeeping also read these
    mgr.defer_decode_allocation, mgr.deferred_bootstrap = False, None
    mgr._deferred_ack_targets, mgr._deferred_ack_poisoned_rooms, mgr._staging_outstanding = {}, set(), {}
    server_args = SimpleNamespace(api_key=api_key)
    queue = SimpleNamespace(token_to_kv_pool=pool, scheduler=SimpleNamespace(server_args=server_args))
    assert pd.note_decode_index_k(mgr, queue) is mgr
    return mgr


def _fetch_prefill_info(mgr, addr):
    """What ``try_ensure_parallel_info`` keeps for ``addr``: the bootstrap server's ``/route`` answer."""
    from sglang.srt.disaggregation.common.conn import PrefillServerInfo

    url = f"http://{addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    mgr.prefill_info_table[addr] = PrefillServerInfo(**requests.get(url, timeout=5).json())


def _init(mgr, addr, room=ROOM):
    """A receiver's ``init(0)`` through the plugin's hook; returns ``(receiver, whether SGLang's init ran)``."""
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    class Receiver(CommonKVReceiver):  # SGLang's receiver with the one abstract method a backend adds
        def poll(self):
            return self.conclude_state

    receiver = Receiver(mgr, addr, room)
    ran = []
    pd.check_prefill_index_k(lambda r, rank: ran.append((r, rank)), receiver, 0)
    assert ran in ([], [(receiver, 0)])
    return receiver, bool(ran)


def _assert_refused(mgr, receiver, message):
    from sglang.srt.disaggregation.base.conn import KVPoll

    assert mgr.check_status(receiver.bootstrap_room) == KVPoll.Failed
    assert receiver.conclude_state == KVPoll.Failed
    assert mgr.failure_records[receiver.bootstrap_room] == message


def _mismatch(addr, prefill, decode) -> str:
    return (f"Index-K format mismatch: prefill server {addr} has {prefill}, but decode server has {decode}. "
            "Both servers must use the same --index-k-format, index_k_scale_rule and index_k_sign_seed "
            "(config.json or --json-model-override-args).")


@pytest.mark.parametrize("fmt,rule,seed", [("bf16", "rceil", None), ("fp8", "rceil", None), ("mxfp4", "floor", None),
                                           ("mxfp4_rot", "rceil", None), ("mxfp4_rot", "rceil", 7)])
def test_the_same_settings_pass_to_sglangs_init(prefill, fmt, rule, seed):
    from sglang.srt.disaggregation.base.conn import KVPoll

    addr, api = prefill(_m3_index_k(fmt, rule, seed))
    mgr = _decode_manager(_pool(fmt, rule, seed))
    _fetch_prefill_info(mgr, addr)
    for room in (ROOM, ROOM + 1):
        receiver, ran = _init(mgr, addr, room)
        assert ran and receiver.conclude_state is None and mgr.check_status(room) == KVPoll.Bootstrapping
    assert api.reads == 1 and not mgr.failure_records  # read once per prefill server info


def test_a_rule_the_format_does_not_use_is_not_compared(prefill):
    addr, _ = prefill(_m3_index_k("fp8", "floor", 3))
    mgr = _decode_manager(_pool("fp8", "rceil", None))
    _fetch_prefill_info(mgr, addr)
    assert _init(mgr, addr)[1]


def test_mxfp4_pages_are_refused_by_an_mxfp4_rot_decode_server(prefill):
    """The same 68 B a token: SGLang would copy them and score the wrong keys without an error."""
    addr, api = prefill(_m3_index_k("mxfp4"))
    mgr = _decode_manager(_pool("mxfp4_rot"))
    _fetch_prefill_info(mgr, addr)
    message = _mismatch(addr, "index_k_format=mxfp4, index_k_scale_rule=rceil",
                        "index_k_format=mxfp4_rot, index_k_scale_rule=rceil, index_k_sign_seed=None")
    for room in (ROOM, ROOM + 1):
        receiver, ran = _init(mgr, addr, room)
        assert not ran
        _assert_refused(mgr, receiver, message)
    assert api.reads == 1


@pytest.mark.parametrize("prefill_fmt,decode_fmt", [("fp8", "mxfp4"), ("mxfp4", "fp8"), ("bf16", "fp8")])
def test_another_format_is_refused(prefill, prefill_fmt, decode_fmt):
    addr, _ = prefill(_m3_index_k(prefill_fmt))
    mgr = _decode_manager(_pool(decode_fmt))
    _fetch_prefill_info(mgr, addr)
    receiver, ran = _init(mgr, addr)
    assert not ran
    _assert_refused(mgr, receiver, _mismatch(addr, pd.describe(pd.transfer_fields(prefill_fmt, "rceil", None)),
                                             pd.describe(pd.transfer_fields(decode_fmt, "rceil", None))))


@pytest.mark.parametrize("prefill_kw,decode_kw,prefill_says,decode_says", [
    ({"fmt": "mxfp4", "scale_rule": "floor"}, {"fmt": "mxfp4"},
     "index_k_format=mxfp4, index_k_scale_rule=floor", "index_k_format=mxfp4, index_k_scale_rule=rceil"),
    ({"fmt": "mxfp4_rot", "sign_seed": 7}, {"fmt": "mxfp4_rot", "sign_seed": 8},
     "index_k_format=mxfp4_rot, index_k_scale_rule=rceil, index_k_sign_seed=7",
     "index_k_format=mxfp4_rot, index_k_scale_rule=rceil, index_k_sign_seed=8"),
])
def test_another_scale_rule_or_sign_seed_is_refused(prefill, prefill_kw, decode_kw, prefill_says, decode_says):
    addr, _ = prefill(_m3_index_k(**prefill_kw))
    mgr = _decode_manager(_pool(**decode_kw))
    _fetch_prefill_info(mgr, addr)
    receiver, ran = _init(mgr, addr)
    assert not ran
    _assert_refused(mgr, receiver, _mismatch(addr, prefill_says, decode_says))


def test_a_prefill_server_without_m3_index_k_is_refused(prefill):
    """SGLang's own MiniMax-M3 path (or an older sglang-m3) reports no ``m3_index_k``: its pages are not ours."""
    addr, api = prefill(None)
    mgr = _decode_manager(_pool("mxfp4"))
    _fetch_prefill_info(mgr, addr)
    receiver, ran = _init(mgr, addr)
    assert not ran
    where = f"http://127.0.0.1:{api.server_address[1]}/model_info"
    _assert_refused(mgr, receiver, (
        f"Index-K format unknown: prefill server {addr} reports no m3_index_k at {where} (not an sglang-m3 "
        "MiniMax-M3.1 index-K server), but decode server has index_k_format=mxfp4, index_k_scale_rule=rceil. "
        "Both servers must use the same --index-k-format, index_k_scale_rule and index_k_sign_seed "
        "(config.json or --json-model-override-args)."))


def test_an_unreadable_prefill_server_fails_its_requests_and_is_read_again_later(prefill, monkeypatch):
    addr, api = prefill(_m3_index_k("mxfp4"), api_key="not the decode server's")  # every read: 401
    mgr = _decode_manager(_pool("mxfp4"))
    _fetch_prefill_info(mgr, addr)
    for room in (ROOM, ROOM + 1):  # the second within UNREAD_RETRY_S: the first read's reason, no read
        receiver, ran = _init(mgr, addr, room)
        assert not ran
        _assert_refused(mgr, receiver, mgr.failure_records[ROOM])
        assert mgr.failure_records[room].startswith("Index-K format unverified: could not read http://127.0.0.1:")
    assert api.reads == 1
    later = time.monotonic() + pd.UNREAD_RETRY_S + 1
    monkeypatch.setattr(pd, "monotonic", lambda: later)
    assert not _init(mgr, addr, ROOM + 2)[1] and api.reads == 2  # read again once that time has passed
    api.api_key = None  # the prefill server answers now
    later += pd.UNREAD_RETRY_S + 1
    assert _init(mgr, addr, ROOM + 3)[1] and api.reads == 3


def test_a_prefill_server_whose_http_port_is_closed_fails_its_requests(prefill):
    addr, _ = prefill(_m3_index_k("mxfp4"), http_port=_free_port())  # nothing listens there
    mgr = _decode_manager(_pool("mxfp4"))
    _fetch_prefill_info(mgr, addr)
    _, ran = _init(mgr, addr)
    assert not ran
    assert mgr.failure_records[ROOM].startswith("Index-K format unverified: could not read http://127.0.0.1:")


def test_a_prefill_server_that_registered_no_http_port_is_refused(prefill):
    addr, api = prefill(_m3_index_k("mxfp4"), http_port=False)
    mgr = _decode_manager(_pool("mxfp4"))
    _fetch_prefill_info(mgr, addr)
    _, ran = _init(mgr, addr)
    assert not ran and api.reads == 0
    assert mgr.failure_records[ROOM].startswith(f"Index-K format unknown: prefill server {addr} reports no m3_index_k "
                                                "at its bootstrap registration (no prefill_http_port)")


@pytest.mark.parametrize("decode_key", ["k3y", None])
def test_the_read_carries_the_decode_servers_api_key(prefill, decode_key):
    addr, _ = prefill(_m3_index_k("mxfp4"), api_key="k3y")
    mgr = _decode_manager(_pool("mxfp4"), api_key=decode_key)
    _fetch_prefill_info(mgr, addr)
    _, ran = _init(mgr, addr)
    assert ran == (decode_key is not None)
    if not ran:
        assert "401 Client Error: Unauthorized" in mgr.failure_records[ROOM]


def test_a_prefill_server_seen_again_is_read_again(prefill):
    """SGLang drops a prefill server's info when it is seen down and fetches it anew: the format is read anew."""
    addr, api = prefill(_m3_index_k("mxfp4"))
    mgr = _decode_manager(_pool("mxfp4"))
    _fetch_prefill_info(mgr, addr)
    assert _init(mgr, addr, ROOM)[1]
    api.body[server_info.M3_INDEX_K] = _m3_index_k("fp8")  # restarted with another format
    mgr.prefill_info_table.pop(addr)
    _fetch_prefill_info(mgr, addr)
    _, ran = _init(mgr, addr, ROOM + 1)
    assert not ran and api.reads == 2
    assert mgr.failure_records[ROOM + 1].startswith(f"Index-K format mismatch: prefill server {addr} has "
                                                    "index_k_format=fp8,")


def test_a_decode_server_of_another_model_is_left_to_sglang(prefill):
    """No ``MiniMaxM31SparseKVPool``: nothing is added to the manager, nothing is read, SGLang's init runs (even for a
    prefill server whose format would not match any)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    addr, api = prefill(_m3_index_k("mxfp4"))
    other = MHATokenToKVPool.__new__(MHATokenToKVPool)  # SGLang's pool class, unbuilt: only its type is read
    mgr = _decode_manager(other)
    assert not hasattr(mgr, pd.DECODE_INDEX_K)
    _fetch_prefill_info(mgr, addr)
    assert _init(mgr, addr)[1] and api.reads == 0 and not mgr.failure_records


def test_the_plugin_registers_both_hooks():
    rows = {row.target: row for row in plugin.hook_table()}
    queue_row = rows["sglang.srt.disaggregation.decode.DecodePreallocQueue._init_kv_manager"]
    receiver_row = rows["sglang.srt.disaggregation.common.conn.CommonKVReceiver.init"]
    assert (queue_row.hook, queue_row.kind) == (pd.note_decode_index_k, "AFTER")
    assert (receiver_row.hook, receiver_row.kind) == (pd.check_prefill_index_k, "AROUND")
    assert queue_row.since is queue_row.until is receiver_row.since is receiver_row.until is None
