"""Parallel sampling (``n > 1``) in SGLang's tokenizer manager: two gaps of older releases closed.

For ``n > 1`` SGLang normalizes the request to ``batch_size * n`` rids (``GenerateReqInput.
_normalize_rid``) and ``TokenizerManager._init_req_state`` registers one request state per rid.
``TokenizerManager._handle_batch_request`` then sends, per prompt (``obj[i]`` for ``i <
batch_size``), one prefix-caching request and ``n`` samples, each under a fresh rid with a state
of its own, and so the states of the first ``batch_size`` rids are deleted again.

1. Until 0.5.22 only those ``batch_size`` states were deleted; the other ``batch_size * (n - 1)``
   stayed in ``rid_to_state`` for the server's life. SIGTERM's drain (``sigterm_watchdog``) counts
   ``rid_to_state`` and so waited on them forever ("Remaining number of requests 3" after one
   ``n = 4`` request), and a request id given with ``n > 1`` could never be used again ("Duplicate
   request ID detected: x_1"). ``release_unsent_states`` drops them before the handler runs: no
   request was or will be sent under them, and the handler reads only ``obj[:batch_size]``.
2. Until 0.5.20 a handler that ended early (its client cut the stream, or one sample failed)
   aborted none of the samples it had sent: a cut ``n > 1`` stream decoded every sample to
   ``max_new_tokens`` (``create_abort_task`` aborts ``obj.rid``, the initial rids, which the
   scheduler never saw). ``abort_unfinished_samples`` wraps the handler and aborts, when it ends
   unfinished, each request it sent that is still live, as 0.5.20's handler does itself;
   ``note_sent_rid`` records those rids (a context variable set only while the wrapped handler runs,
   so concurrent requests stay apart). 0.5.17 alone already aborted them, through its map of
   sample rids by request rid; the row applies there too and at worst sends a second abort.

Read in the source of every release 0.5.16 through 0.5.23; run on 0.5.16 only.
"""

import contextvars

_sent_rids: contextvars.ContextVar = contextvars.ContextVar("sglang_m3_parallel_sampling_sent_rids", default=None)


def _samples(obj) -> int:
    return getattr(obj, "parallel_sample_num", 1) or 1


def release_unsent_states(tokenizer_manager, obj, *args, **kwargs):
    """BEFORE ``TokenizerManager._handle_batch_request``: drop the states of ``obj.rid[batch_size:]``
    (``n > 1`` only; a rid list given by the client has one rid per prompt, nothing to drop)."""
    rids = getattr(obj, "rid", None)
    if _samples(obj) > 1 and isinstance(rids, list):
        for rid in rids[obj.batch_size:]:
            tokenizer_manager.rid_to_state.pop(rid, None)
    return None


def note_sent_rid(tokenizer_manager, tokenized_obj, *args, **kwargs):
    """BEFORE ``TokenizerManager._send_one_request``: the rid, while a wrapped handler is sending."""
    sent = _sent_rids.get()
    if sent is not None:
        sent.append(tokenized_obj.rid)
    return None


def abort_unfinished_samples(original, tokenizer_manager, obj, *args, **kwargs):
    """AROUND ``TokenizerManager._handle_batch_request`` (an async generator function)."""
    handler = original(tokenizer_manager, obj, *args, **kwargs)
    if _samples(obj) <= 1:
        return handler
    return _aborting_when_unfinished(tokenizer_manager, handler)


async def _aborting_when_unfinished(tokenizer_manager, handler):
    sent: list[str] = []
    finished = False
    try:
        while True:
            token = _sent_rids.set(sent)
            try:
                out = await handler.__anext__()
            except StopAsyncIteration:
                finished = True
                return
            finally:
                _sent_rids.reset(token)
            yield out
    finally:
        if not finished:
            # Finished requests left rid_to_state with their last output (a non-streamed handler is
            # closed after its one yield, all samples finished); the rest are aborted and leave it
            # when the scheduler's abort comes back, their pool slots freed there.
            for rid in sent:
                if rid in tokenizer_manager.rid_to_state:
                    tokenizer_manager.abort_request(rid)
            await handler.aclose()
