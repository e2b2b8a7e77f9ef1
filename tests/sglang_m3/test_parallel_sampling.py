"""The parallel-sampling hooks without a server (tests/sglang_m3/test_shutdown.py runs them in one)."""

import asyncio
from types import SimpleNamespace

import pytest

from sglang_m3.parallel_sampling import abort_unfinished_samples, note_sent_rid, release_unsent_states


@pytest.mark.parametrize("request_args,kept", [
    ({"text": "one prompt", "rid": "x", "sampling_params": {"n": 4}}, ["x_0"]),
    ({"text": ["a", "b"], "sampling_params": {"n": 3}}, 2),  # generated rids: the first batch_size stay
    ({"text": ["a", "b"], "rid": ["p", "q"], "sampling_params": {"n": 3}}, ["p", "q"]),  # one rid per prompt
    ({"text": ["a", "b"], "sampling_params": {"n": 1}}, 2),
    ({"text": "one prompt", "sampling_params": {"max_new_tokens": 2}}, 1),
])
def test_parallel_sampling_keeps_only_the_states_of_its_prompts(request_args, kept):
    """SGLang's normalization gives an n > 1 request batch_size * n rids, one state each; its batch
    handler sends only obj[:batch_size] (the distinct prompts) and deletes only their states. The
    hook drops the rest before the handler runs and leaves other requests alone."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(**request_args)
    obj.normalize_batch_and_arguments()
    rids = [obj.rid] if obj.is_single else list(obj.rid)
    other = object()
    manager = SimpleNamespace(rid_to_state={**{rid: object() for rid in rids}, "other": other})
    assert release_unsent_states(manager, obj, None) is None
    prompts = rids[:kept] if isinstance(kept, int) else kept
    assert list(manager.rid_to_state) == [*prompts, "other"] and manager.rid_to_state["other"] is other
    if not obj.is_single:
        texts = request_args["text"] if isinstance(request_args["text"], list) else [request_args["text"]]
        assert [obj[i].text for i in range(obj.batch_size)] == texts
        assert [obj[i].rid for i in range(obj.batch_size)] == prompts


class Manager:
    """What the hooks use of SGLang's TokenizerManager; ``send`` is ``_send_one_request`` with the hook."""

    def __init__(self):
        self.rid_to_state, self.aborted = {}, []

    def send(self, rid: str):
        note_sent_rid(self, SimpleNamespace(rid=rid))
        self.rid_to_state[rid] = object()

    def finish(self, rid: str):
        del self.rid_to_state[rid]

    def abort_request(self, rid: str):
        self.aborted.append(rid)


async def _handler(manager, obj, request=None):
    """SGLang's handler in short: a prefix request that finishes, then the samples, streamed."""
    manager.send(f"{obj.name}-prefix")
    await asyncio.sleep(0)
    manager.finish(f"{obj.name}-prefix")
    samples = [f"{obj.name}-{i}" for i in range(obj.parallel_sample_num)]
    for rid in samples:
        manager.send(rid)
    for step in range(3):
        await asyncio.sleep(0)
        yield step
    for rid in samples:
        manager.finish(rid)


def _request(name: str, n: int = 2):
    return SimpleNamespace(name=name, parallel_sample_num=n)


def test_a_handler_closed_early_aborts_the_samples_it_sent_and_no_others():
    manager = Manager()

    async def cut(name: str, chunks: int):
        handler = abort_unfinished_samples(_handler, manager, _request(name))
        for _ in range(chunks):
            await handler.__anext__()
        await handler.aclose()

    async def both():
        await asyncio.gather(cut("a", 1), cut("b", 2))
        manager.send("outside")  # no handler running: nothing noted

    asyncio.run(both())
    assert sorted(manager.aborted) == ["a-0", "a-1", "b-0", "b-1"]


def test_a_handler_run_to_its_end_aborts_nothing():
    manager = Manager()

    async def run():
        return [out async for out in abort_unfinished_samples(_handler, manager, _request("a", n=3))]

    assert asyncio.run(run()) == [0, 1, 2]
    assert manager.aborted == [] and manager.rid_to_state == {}


def test_a_failing_handler_aborts_its_live_samples_and_raises():
    manager = Manager()

    async def failing(manager, obj):
        manager.send("done")
        manager.finish("done")
        manager.send("live")
        yield 0
        raise ValueError("one sample failed")

    async def run():
        return [out async for out in abort_unfinished_samples(failing, manager, _request("a"))]

    with pytest.raises(ValueError, match="one sample failed"):
        asyncio.run(run())
    assert manager.aborted == ["live"]


def test_single_sample_requests_keep_sglangs_handler():
    manager, sentinel = Manager(), object()
    assert abort_unfinished_samples(lambda *a: sentinel, manager, _request("a", n=1)) is sentinel
    assert abort_unfinished_samples(lambda *a: sentinel, manager, SimpleNamespace()) is sentinel  # no n at all
