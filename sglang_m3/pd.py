"""PD disaggregation: a decode server takes index-K pages only from a prefill server that writes them the same way.

SGLang moves a MiniMax-M3.1 request's index-K pages from the prefill server to the decode server byte for byte, by
page id (``MiniMaxM31SparseKVPool.get_index_k_state_buf_infos``, ``StateType.MINIMAX_INDEX_K``). Of the two sides'
caches it compares only page size and KV cache dtype (``CommonKVManager.try_ensure_parallel_info``). Pages of another
format would be mis-copied (fp8 has 128 B a token, MXFP4 68 B) or, for ``mxfp4`` against ``mxfp4_rot`` (the same
bytes), scored as the wrong keys without any error.

Two hooks, on the decode side only:

- after ``DecodePreallocQueue._init_kv_manager``: when the decode server's pool is ``MiniMaxM31SparseKVPool``, its
  KV manager gets a ``DecodeIndexK`` (attribute ``DECODE_INDEX_K``). Any other pool: nothing is added, and the
  second hook passes every call through.
- around ``CommonKVReceiver.init`` (each request's receiver, before any page moves): the prefill server's
  ``m3_index_k`` is read from its ``/model_info`` (``server_info``), at the HTTP port the prefill server registered
  with its bootstrap server, once per ``PrefillServerInfo`` SGLang fetched (a prefill server seen down and back is
  read again; one that could not be read, after ``UNREAD_RETRY_S``). A request whose prefill server writes index-K
  another way fails the way SGLang 0.5.23 fails one whose prefill server has another decode allocation policy:
  ``record_failure`` with the reason, ``KVPoll.Failed``; the client gets the reason, nothing is transferred, and the
  decode server serves on. (SGLang raises for a page-size mismatch, which ends the decode scheduler.)
"""

import dataclasses
import logging
from time import monotonic

from .config import IndexKSettings
from .server_info import M3_INDEX_K

logger = logging.getLogger(__name__)

DECODE_INDEX_K = "sglang_m3_index_k"  # attribute of a decode KV manager whose pool is MiniMaxM31SparseKVPool
INFO_TIMEOUT_S = 5  # SGLang's timeout for the bootstrap server's /route
UNREAD_RETRY_S = 10  # a prefill server whose /model_info could not be read is read again after this long
ALIGN = ("Both servers must use the same --index-k-format, index_k_scale_rule and index_k_sign_seed "
         "(config.json or --json-model-override-args).")


def transfer_fields(fmt: str, scale_rule: str | None, sign_seed: int | None) -> dict:
    """The settings two servers must share to hand index-K pages over: the format; the e8m0 scale rule of the MXFP4
    formats (the decode server appends rows to the prefill server's pages); the sign seed of ``mxfp4_rot`` (the
    rotation the keys were stored under)."""
    from m3_kernels.formats import parse_format

    parsed = parse_format(fmt, "index_k_format")
    fields = {"index_k_format": parsed.value}
    if parsed.is_mxfp4:
        fields["index_k_scale_rule"] = scale_rule
    if parsed.is_rotated:
        fields["index_k_sign_seed"] = sign_seed
    return fields


def settings_fields(settings: IndexKSettings) -> dict:
    """``transfer_fields`` of a served model's settings."""
    return transfer_fields(settings.fmt.value, settings.scale_rule.value, settings.sign_seed)


def describe(fields: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in fields.items())


def peer_refusal(own: IndexKSettings, peer: dict | None, bootstrap_addr: str, where: str) -> str | None:
    """Why a decode server with ``own`` settings must not take pages from the prefill server at ``bootstrap_addr``
    whose ``/model_info`` (at ``where``) holds ``m3_index_k`` ``peer`` (None: no such key), or None when they agree."""
    mine = settings_fields(own)
    if not isinstance(peer, dict) or not isinstance(peer.get("format"), str):
        return (f"Index-K format unknown: prefill server {bootstrap_addr} reports no m3_index_k at {where} (not an "
                f"sglang-m3 MiniMax-M3.1 index-K server), but decode server has {describe(mine)}. {ALIGN}")
    try:
        theirs = transfer_fields(peer["format"], peer.get("scale_rule"), peer.get("sign_seed"))
    except ValueError:
        theirs = {"index_k_format": peer["format"]}
    if theirs == mine:
        return None
    return (f"Index-K format mismatch: prefill server {bootstrap_addr} has {describe(theirs)}, "
            f"but decode server has {describe(mine)}. {ALIGN}")


@dataclasses.dataclass
class DecodeIndexK:
    """A decode KV manager's own index-K settings, the API key its server takes (sent to the prefill server's
    ``/model_info``, which wants the same key in a deployment that sets one), and the verdict on each prefill server."""

    settings: IndexKSettings
    api_key: str | None = None
    # bootstrap_addr -> (PrefillServerInfo, refusal | None, monotonic time to read again | None)
    verdicts: dict = dataclasses.field(default_factory=dict)

    def refusal(self, kv_mgr, receiver) -> str | None:
        """Why ``receiver``'s prefill server must not send it index-K pages, or None. Reads the prefill server's
        ``/model_info`` once per ``PrefillServerInfo``; after a read that fails, its requests fail with that reason
        for ``UNREAD_RETRY_S`` (a blocking read per request would stall the decode loop), then it is read again."""
        info = kv_mgr.prefill_info_table.get(receiver.bootstrap_addr)
        if info is None:
            return None  # SGLang's init fails a request whose prefill server it has no info for
        known = self.verdicts.get(receiver.bootstrap_addr)
        if known is not None and known[0] is info and (known[2] is None or monotonic() < known[2]):
            return known[1]
        url = kv_mgr._resolve_rebootstrap_prefill_url(receiver)  # http://<bootstrap host>:<prefill_http_port>
        if url is None:
            refusal = peer_refusal(self.settings, None, receiver.bootstrap_addr, "its bootstrap registration "
                                   "(no prefill_http_port)")
        else:
            where = f"{url}/model_info"
            try:
                peer = read_model_info(where, self.api_key).get(M3_INDEX_K)
            except (OSError, ValueError, TypeError) as e:  # unreachable, refused (requests' errors), not a JSON object
                mine = describe(settings_fields(self.settings))
                refusal = (f"Index-K format unverified: could not read {where} of prefill server "
                           f"{receiver.bootstrap_addr} ({e}); decode server has {mine}.")
                self.verdicts[receiver.bootstrap_addr] = (info, refusal, monotonic() + UNREAD_RETRY_S)
                logger.error(refusal)
                return refusal
            refusal = peer_refusal(self.settings, peer, receiver.bootstrap_addr, where)
        self.verdicts[receiver.bootstrap_addr] = (info, refusal, None)
        if refusal is not None:
            logger.error(refusal)
        return refusal


def read_model_info(url: str, api_key: str | None) -> dict:
    """The JSON object at ``url``; raises on a connection error, a status other than 200 or an answer not an object."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = requests.get(url, timeout=INFO_TIMEOUT_S, headers=headers)
    response.raise_for_status()
    body = response.json()
    if not isinstance(body, dict):
        raise TypeError(f"expected a JSON object, got {type(body).__name__}")
    return body


def note_decode_index_k(kv_manager, queue):
    """After ``DecodePreallocQueue._init_kv_manager``: a decode KV manager over a ``MiniMaxM31SparseKVPool`` gets its
    ``DecodeIndexK``; any other is returned as it is."""
    from .pool import MiniMaxM31SparseKVPool

    pool = getattr(queue, "token_to_kv_pool", None)
    if isinstance(pool, MiniMaxM31SparseKVPool):
        server_args = getattr(getattr(queue, "scheduler", None), "server_args", None)
        setattr(kv_manager, DECODE_INDEX_K, DecodeIndexK(pool.settings, getattr(server_args, "api_key", None)))
    return kv_manager


def check_prefill_index_k(original, receiver, prefill_dp_rank, *args, **kwargs):
    """Around ``CommonKVReceiver.init``: a request whose prefill server writes index-K pages another way than this
    decode server fails with the reason (``DecodeIndexK.refusal``) before any page moves; any other goes on to
    SGLang's ``init``. Receivers of a KV manager without ``DecodeIndexK`` (any other model) pass straight through."""
    own = getattr(receiver.kv_mgr, DECODE_INDEX_K, None)
    checked = own is not None and receiver.conclude_state is None  # SGLang's init ends a failed receiver at once
    refusal = own.refusal(receiver.kv_mgr, receiver) if checked else None
    if refusal is None:
        return original(receiver, prefill_dp_rank, *args, **kwargs)
    from sglang.srt.disaggregation.base.conn import KVPoll

    receiver.kv_mgr.record_failure(receiver.bootstrap_room, refusal)
    receiver.conclude_state = KVPoll.Failed
    receiver.kv_mgr.update_status(receiver.bootstrap_room, KVPoll.Failed)
    return None
