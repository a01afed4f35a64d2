"""No request can fail another: a step that raises fails only its own requests, a dead engine
loop answers 503 at once, cancelled submissions do not kill the loop, seeds are counter-based."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient

from baton import SamplingParams
from baton.config import EngineConfig, ServerConfig
from baton.engine.async_engine import AsyncEngine, RequestFailedError
from baton.engine.engine import LLMEngine
from baton.engine.sampler import noise_seed
from baton.engine.scheduler import SchedulerOutput
from baton.server.app import build_app
from tests.test_random_models import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM")[1]


def _engine(model_dir, stall_timeout_s: float = 60.0) -> AsyncEngine:
    config = EngineConfig.from_kwargs(model=str(model_dir), num_kv_blocks=64, block_size=4)
    return AsyncEngine(lambda: LLMEngine(config, progress=False), stall_timeout_s)


POISON = [7, 7, 7, 7, 7]  # a prompt the faulty runner below refuses


def _faulty(engine: LLMEngine) -> None:
    """Make the model raise in any step holding the POISON prompt: a stand-in for a kernel bug."""
    execute = engine.runner.execute

    def execute_or_raise(batch):
        if any(s.request.prompt_token_ids == POISON for s in batch.scheduled):
            raise IndexError("index 99999 is out of bounds")
        return execute(batch)

    engine.runner.execute = execute_or_raise


async def _collect(a: AsyncEngine, prompt: list[int], rid: str, max_tokens: int = 8) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    last = None
    async for out in a.generate({"prompt_token_ids": prompt}, params, rid):
        last = out
    return last.outputs[0].token_ids


def test_a_failing_step_fails_only_its_requests(model_dir):
    a = _engine(model_dir)
    a.start()
    try:
        expected = asyncio.run(_collect(a, [1, 2, 3], "clean"))
        _faulty(a.engine)
        with pytest.raises(RequestFailedError, match="IndexError"):
            asyncio.run(_collect(a, POISON, "poison"))
        assert a.step_failures == 1
        assert asyncio.run(_collect(a, [1, 2, 3], "after")) == expected
        assert a.engine.kv.all_free() and not a.engine.has_unfinished_requests()
        assert a.running and not a.dead
    finally:
        a.stop()


def test_a_poisoned_prefill_alone_leaves_a_running_decode_untouched(model_dir):
    """The victim is mid-decode; the poison arrives alone and fails in its own step."""
    a = _engine(model_dir)
    a.start()
    try:
        expected = asyncio.run(_collect(a, [5, 6, 7, 8], "ref", max_tokens=30))
        engine = a.engine
        execute = engine.runner.execute

        def execute_or_raise(batch):  # fail only steps whose batch is exactly the poison prefill
            if [s.request.prompt_token_ids for s in batch.scheduled] == [POISON]:
                raise IndexError("out of bounds")
            return execute(batch)

        engine.runner.execute = execute_or_raise
        engine.config.scheduler.max_num_seqs = 1  # one running request at a time: the poison waits its turn

        async def scenario():
            victim = asyncio.create_task(_collect(a, [5, 6, 7, 8], "victim", max_tokens=30))
            await asyncio.sleep(0.02)
            poison = asyncio.create_task(_collect(a, POISON, "poison"))
            results = await asyncio.gather(victim, poison, return_exceptions=True)
            return results

        victim_tokens, poison_result = asyncio.run(scenario())
        assert victim_tokens == expected
        assert isinstance(poison_result, RequestFailedError)
        assert a.step_failures == 1
        assert engine.kv.all_free()
    finally:
        a.stop()


def test_cancelled_submissions_do_not_kill_the_loop(model_dir):
    a = _engine(model_dir)
    a.start()
    try:

        async def cancel_many():
            tasks = [asyncio.create_task(_collect(a, [1, 2, 3, 4], f"c{i}", max_tokens=50)) for i in range(20)]
            await asyncio.sleep(0)  # submitted, not yet accepted
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(cancel_many())
        assert asyncio.run(_collect(a, [1, 2, 3], "after"))  # still serving
        deadline = 50
        while a.engine.has_unfinished_requests() and deadline:
            asyncio.run(asyncio.sleep(0.05))
            deadline -= 1
        assert a.engine.kv.all_free() and a.running and not a.dead
    finally:
        a.stop()


def test_a_dead_engine_loop_answers_503_at_once(model_dir):
    a = _engine(model_dir)
    app = build_app(a, ServerConfig(), "m")
    with TestClient(app) as client:
        body = {"prompt": [1, 2, 3], "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 200

        def broken():
            raise SystemError("a bug in the loop")

        a.engine.has_unfinished_requests = broken
        a._wake.set()
        for _ in range(100):
            if a.dead:
                break
            asyncio.run(asyncio.sleep(0.02))
        assert a.dead
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert "Retry-After" in r.headers
        assert "baton_engine_alive 0.0" in client.get("/metrics").text


def test_an_engine_that_stops_moving_says_so_on_health(model_dir):
    """Work pending and no step moving for --stall-timeout-s: /health answers 503 and the stall is
    counted, until the engine moves again."""
    a = _engine(model_dir, stall_timeout_s=0.3)
    app = build_app(a, ServerConfig(), "m")
    with TestClient(app) as client:
        schedule = a.engine.scheduler.schedule
        a.engine.scheduler.schedule = lambda: SchedulerOutput()  # an admission bug: nothing is ever scheduled
        body = {"prompt": [1, 2, 3], "max_tokens": 4}
        done: dict = {}
        waiter = threading.Thread(target=lambda: done.update(r=client.post("/v1/completions", json=body)))
        waiter.start()
        for _ in range(100):
            if a.stalled:
                break
            time.sleep(0.02)
        assert a.stalled and client.get("/health").status_code == 503
        assert "baton_engine_stalls_total 1.0" in client.get("/metrics").text
        a.engine.scheduler.schedule = schedule
        waiter.join(timeout=30)
        assert done["r"].status_code == 200 and not a.stalled
        assert client.get("/health").status_code == 200


def test_seeded_noise_depends_only_on_seed_index_and_position(model_dir):
    """Counter-based: the token at output position i is the same whatever came before it in
    this process (a PD handoff samples position 0 elsewhere; preemption recomputes)."""
    assert noise_seed(1, 0, 5) == noise_seed(1, 0, 5)
    assert len({noise_seed(1, 0, i) for i in range(1000)}) == 1000
    assert noise_seed(1, 0, 5) != noise_seed(1, 1, 5) != noise_seed(2, 0, 5)
    config = EngineConfig.from_kwargs(model=str(model_dir), num_kv_blocks=64, block_size=4)
    engine = LLMEngine(config, progress=False)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=2**64 - 1, ignore_eos=True)

    def run(prompt, p):
        rid = engine.add_request({"prompt_token_ids": prompt}, p)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    return out.outputs[0].token_ids

    full = run([9, 8, 7], params)
    torch.manual_seed(123)  # the global generator must not matter to a seeded request
    assert run([9, 8, 7], params) == full
    # the PD path in one process: prefill-only export (samples position 0), then import and decode
    rid = engine.add_request({"prompt_token_ids": [9, 8, 7]}, params, export_kv="grouped")
    span = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                span = out.kv_span
    rid = engine.add_request({"prompt_token_ids": [9, 8, 7]}, params, kv_span=span)
    imported = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                imported = out.outputs[0].token_ids
    assert imported == full
    assert engine.kv.all_free()
