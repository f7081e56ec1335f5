"""rollout/async_feed.AsyncFeed with a fake engine: the lag bound under both policies, generation
overlapping training, pushes only between generations, errors reaching the trainer, and close()
ending a generation under way. No timing is asserted beyond "some wait was measured"."""
import threading
import time

import pytest

from megatron_cispo.rollout.async_feed import AsyncFeed


class FakeEngine:
    """Generation takes `gen_s`; records which version made each batch and whether the trainer's step
    was under way at its start or end (a push under way fails it)."""

    def __init__(self, gen_s=0.0):
        self.gen_s, self.version, self.pushing, self.training = gen_s, 0, False, False
        self.log = []  # (index, version, trainer training when it started)
        self.lock = threading.Lock()

    def generate(self, index, version):
        assert not self.pushing, "a generation ran during a push"
        assert version == self.version, (version, self.version)
        during = self.training
        time.sleep(self.gen_s)
        self.log.append((index, version, during or self.training))
        return index, version

    def finish(self, raw):
        return {"index": raw[0], "version": raw[1]}

    def push(self, version):
        def load():
            self.pushing = True
            time.sleep(0.001)
            self.version = version
            self.pushing = False
            return {"pushed": version}
        return load


def _train(engine, feed, steps, first=0, train_s=0.0):
    taken = []
    for step in range(first, first + steps):
        item, version, dropped, info = feed.take(step, timeout_s=30)
        assert item["version"] == version
        taken.append((step, item["index"], version, len(dropped), info))
        engine.training = True
        time.sleep(train_s)
        engine.training = False
        value, waited = feed.weights(step + 1, engine.push(step + 1))
        assert value == {"pushed": step + 1} and waited >= 0
    return taken


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_wait_policy_never_lags_more_than_staleness_and_trains_every_batch_in_order(staleness):
    engine = FakeEngine(gen_s=0.01)
    feed = AsyncFeed(engine.generate, engine.finish, staleness=staleness, policy="wait", first=0, last=8, version=0)
    try:
        taken = _train(engine, feed, 8, train_s=0.02)
    finally:
        feed.close()
    assert [t[1] for t in taken] == list(range(8))  # batch i trained at step i: none dropped, none twice
    assert all(t[3] == 0 and t[4]["rollout/dropped_batches"] == 0 for t in taken)
    lags = [step - version for step, _, version, _, _ in taken]
    assert max(lags) <= staleness and min(lags) >= 0, lags
    assert len(engine.log) == 8  # `last` stops it: no batch beyond the run
    if staleness == 0:  # each batch made by the weights of its own step: nothing can overlap
        assert lags == [0] * 8 and not any(training for _, _, training in engine.log)
    else:  # the engine generated while the trainer trained, and was one version behind doing so
        assert any(training for _, _, training in engine.log), engine.log
        assert max(lags) == staleness or staleness > 1, lags
    assert all(0 <= t[4]["rollout/trainer_wait_frac"] and 0 <= t[4]["rollout/engine_wait_frac"] <= 1 for t in taken)


def test_wait_policy_waits_for_weights_and_the_waits_are_measured():
    engine = FakeEngine(gen_s=0.0)
    engine.version = 3
    feed = AsyncFeed(engine.generate, engine.finish, staleness=0, policy="wait", first=3, last=None, version=3)
    try:
        taken = _train(engine, feed, 4, first=3, train_s=0.05)
    finally:
        feed.close()
    assert [t[1] for t in taken] == [3, 4, 5, 6]  # a resume at step 3 starts the batches there
    # an instant engine with staleness 0 idles through every step's training, waiting for its weights
    assert all(t[4]["rollout/engine_wait_frac"] > 0.3 for t in taken[1:]), [t[4] for t in taken]


def test_drop_policy_keeps_the_engine_busy_and_counts_the_batches_it_passes_over():
    engine = FakeEngine(gen_s=0.0)
    feed = AsyncFeed(engine.generate, engine.finish, staleness=0, policy="drop", first=0, last=None, version=0)
    try:
        taken = _train(engine, feed, 5, train_s=0.1)  # the instant engine makes the next batch during training
    finally:
        feed.close()
    assert all(step == version for step, _, version, _, _ in taken)  # what is trained never lags more
    dropped = sum(t[3] for t in taken)
    assert dropped >= 3 and sum(t[4]["rollout/dropped_batches"] for t in taken) == dropped
    indices = [t[1] for t in taken]
    assert indices == sorted(set(indices)) and indices[-1] == 4 + dropped  # dropped ones are passed over, once


def test_a_failed_generation_reaches_the_trainer_after_the_good_batches():
    engine = FakeEngine()

    def generate(index, version):
        if index == 2:
            raise RuntimeError("vLLM engine process died while generating")
        return engine.generate(index, version)

    feed = AsyncFeed(generate, engine.finish, staleness=2, policy="wait", first=0, last=10, version=0)
    try:
        assert feed.take(0, timeout_s=30)[0]["index"] == 0
        assert feed.take(1, timeout_s=30)[0]["index"] == 1
        with pytest.raises(RuntimeError, match="process died"):
            feed.take(2, timeout_s=30)
        assert len(engine.log) == 2  # nothing generated after the failure
    finally:
        feed.close()


def test_a_failed_push_stops_generation_and_take_raises_it():
    engine = FakeEngine()
    feed = AsyncFeed(engine.generate, engine.finish, staleness=0, policy="wait", first=0, last=10, version=0)
    try:
        feed.take(0, timeout_s=30)

        def load():
            raise RuntimeError("weight sync of policy version 1 failed: bucket 3")
        with pytest.raises(RuntimeError, match="bucket 3"):
            feed.weights(1, load)
        assert feed.version == 0  # the engine keeps its previous weights
        with pytest.raises(RuntimeError, match="bucket 3"):
            feed.take(1, timeout_s=30)
    finally:
        feed.close()


def test_take_times_out_in_one_line_and_close_kills_a_generation_under_way():
    release = threading.Event()

    def generate(index, version):
        release.wait(60)  # a hung engine
        return index, version

    feed = AsyncFeed(generate, lambda raw: raw, staleness=1, policy="wait", first=0, last=None, version=0)
    with pytest.raises(TimeoutError, match="no rollout batch within 0 s"):
        feed.take(0, timeout_s=0.2)
    killed = []
    t0 = time.monotonic()
    feed.close(kill=lambda: (killed.append(1), release.set()))
    assert killed == [1] and time.monotonic() - t0 < 10 and not feed._thread.is_alive()


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match="'wait' or 'drop'"):
        AsyncFeed(lambda i, v: None, lambda r: r, staleness=0, policy="later", first=0, last=None, version=0)


@pytest.mark.parametrize("kw, needle", [
    (dict(mode="async"), "rollout.mode='async' generates beside the trainer"),
    (dict(mode="async", engine="hf"), "the 'hf' engine samples inside the trainer's step: use rollout.mode: sync"),
    (dict(mode="async", engine="vllm", sync="disk"), "it needs rollout.sync: stream, got 'disk'"),
    (dict(stale_policy="drop", engine="vllm"), "rollout.stale_policy='drop' applies to rollout.mode: async only"),
])
def test_async_mode_is_refused_in_one_line_where_it_cannot_run(kw, needle):
    from megatron_cispo.runner.data import RolloutConfig

    with pytest.raises(ValueError) as e:
        RolloutConfig(**kw)
    assert needle in str(e.value) and "\n" not in str(e.value)
    RolloutConfig(mode="async", engine="vllm", stale_policy="drop")  # what it needs: accepted
