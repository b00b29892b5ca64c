"""The bounded-staleness schedule (``rlhf.trainers.online.schedule``) on its own, with a generator that records which
weights it ran with: step t trains on samples of version max(0, t - 1 - k), each step's samples are generated once,
the generation of step t + k overlaps step t's training, a checkpoint resumes the same sequence, skipped steps and
errors behave. The real engines and trainer run it in tests/integration/test_async_rl.py."""

from __future__ import annotations

import threading

import pytest

from rlhf.trainers.online.schedule import RolloutSchedule, behaviour_version


class Engines:
    """Stands in for the engines: ``weights`` is the step whose update they hold; every generation is logged."""

    def __init__(self) -> None:
        self.weights = 0
        self.calls = []  # (step generated, weights used, on the driver's thread)

    def generate(self, step: int, pause=None):
        self.calls.append((step, self.weights, threading.current_thread() is threading.main_thread()))
        return ("samples of step", step, "by version", self.weights)


def _run(schedule: RolloutSchedule, engines: Engines, steps, skip=()):
    """The trainer's order: take the step's samples, train, settle the generation running ahead, push."""
    trained = {}
    for step in steps:
        if step in skip:
            continue
        trained[step] = schedule.take(step)
        schedule.settle()
        engines.weights = step  # the push of step's update
        schedule.pushed(step)
    return trained


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_step_t_trains_on_samples_of_version_t_minus_1_minus_k(k):
    engines = Engines()
    schedule = RolloutSchedule(k, total_steps=7, generate=engines.generate)
    trained = _run(schedule, engines, range(1, 8))
    assert trained == {t: ("samples of step", t, "by version", max(0, t - 1 - k)) for t in range(1, 8)}
    assert [step for step, _, _ in engines.calls] == sorted({step for step, _, _ in engines.calls})  # each once
    assert len(engines.calls) == 7  # nothing generated past the last step
    assert all(behaviour_version(t, k) == max(0, t - 1 - k) for t in range(1, 8))


def test_staleness_zero_generates_each_step_at_its_start_on_the_driver_thread():
    """k = 0 is the synchronous trainer: take(t) generates step t, now, with the weights step t - 1 left."""
    engines = Engines()
    _run(RolloutSchedule(0, total_steps=4, generate=engines.generate), engines, range(1, 5))
    assert engines.calls == [(1, 0, True), (2, 1, True), (3, 2, True), (4, 3, True)]


def test_the_generation_of_step_t_plus_k_runs_while_step_t_trains():
    """k = 1: the first two steps' samples come from the starting weights (step 1's generated at once, step 2's in
    the background); from then on each take starts the next step's generation on the background thread, which can
    only finish if it runs while the driver's thread "trains" (here: waits for it)."""
    engines = Engines()
    generated = {}

    def generate(step, pause=None):
        out = engines.generate(step)
        generated.setdefault(step, threading.Event()).set()
        return out

    schedule = RolloutSchedule(1, total_steps=4, generate=generate)
    for step in range(1, 5):
        schedule.take(step)
        if step < 4:  # training step t overlaps generating t + 1: wait for it from the "training" thread
            assert generated.setdefault(step + 1, threading.Event()).wait(timeout=30)
        schedule.settle()
        engines.weights = step
        schedule.pushed(step)
    assert engines.calls == [(1, 0, True), (2, 0, False), (3, 1, False), (4, 2, False)]


@pytest.mark.parametrize("k", [1, 2])
def test_a_checkpoint_resumes_the_same_samples(tmp_path, k):
    """Stopped after step 3 and resumed in a new schedule (a new process): the samples generated ahead come back
    from the checkpoint, so every step trains on what the uninterrupted run trained on."""
    uninterrupted = Engines()
    whole = _run(RolloutSchedule(k, 8, uninterrupted.generate), uninterrupted, range(1, 9))
    engines = Engines()
    first = RolloutSchedule(k, 8, engines.generate)
    before = _run(first, engines, range(1, 4))
    first.save_checkpoint(str(tmp_path / "rollouts"))
    resumed_engines = Engines()
    resumed_engines.weights = 3  # the restored policy's weights, pushed by the trainer's resume()
    second = RolloutSchedule(k, 8, resumed_engines.generate)
    second.load_checkpoint(str(tmp_path / "rollouts"))
    after = _run(second, resumed_engines, range(4, 9))
    assert {**before, **after} == whole
    assert [step for step, _, _ in resumed_engines.calls] == list(range(4 + k, 9))  # the rest came from the file


def test_skipped_steps_change_no_weights_and_their_samples_are_dropped():
    """Step 3 skipped (train.skip_steps): the weights after step 3 are those after step 2, so the samples of later
    steps keep the versions of the uninterrupted schedule's weights; step 3's own samples are never trained."""
    engines = Engines()
    trained = _run(RolloutSchedule(1, 6, engines.generate), engines, range(1, 7), skip={3})
    assert set(trained) == {1, 2, 4, 5, 6}
    # step 4 needs the weights after step 2 (= after the skipped 3); step 5 those after 3 (= after 2); step 6: 4
    assert {t: s[3] for t, s in trained.items()} == {1: 0, 2: 0, 4: 2, 5: 2, 6: 4}


def test_a_failed_background_generation_is_raised_on_the_driver_thread():
    class EngineDied(RuntimeError):
        pass

    def generate(step, pause=None):
        if step == 3:
            raise EngineDied("rollout engine 0 died generating RL step 3")
        return step

    schedule = RolloutSchedule(1, 5, generate)
    assert schedule.take(1) == 1
    schedule.settle()
    schedule.pushed(1)
    assert schedule.take(2) == 2  # starts step 3's generation, which fails
    with pytest.raises(EngineDied, match="RL step 3"):
        schedule.settle()


def test_samples_that_need_weights_already_replaced_are_refused():
    """Never asked by the run (a checkpoint holds such samples); a schedule that lost them says so."""
    schedule = RolloutSchedule(2, 8, lambda step, pause: step)
    schedule.updated = 4  # the weights after step 4 are the engines'
    with pytest.raises(RuntimeError, match="RL step 5 must come from the weights after step 2, but step 4"):
        schedule.take(5)


def test_the_schedule_is_described_with_its_correction_and_dynamic_sampling():
    """The line --dry-run prints under rollout, and the run among its first lines."""
    from rlhf.config.loader import load_config
    from rlhf.config.rl_schema import RLRunConfig

    def described(*overrides):
        return load_config(
            RLRunConfig, "grpo_tiny", ["model.path=/m", "data.train_path=/d.jsonl", *overrides]
        ).describe_schedule()

    assert (
        described() == "schedule: synchronous: each step generates its samples, then trains (rollout.max_staleness=0)"
    )
    assert described(
        "rollout.max_staleness=1", "algo.off_policy_correction=icepop", "rollout.dynamic_sampling=true"
    ) == (
        "schedule: asynchronous: step t trains on samples of the weights after step max(0, t - 2), while the engines "
        "generate step t + 1's (rollout.max_staleness=1); off-policy correction icepop: 0.5 <= rho <= 5; dynamic "
        "sampling: up to 4 more draws a step"
    )
    assert described("algo.tis_cap=1.5").endswith("; off-policy correction tis: rho <= 1.5 (algo.tis_cap)")
    assert described("rollout.max_staleness=2").endswith(
        "; no off-policy correction: stale samples are not reweighted (set algo.off_policy_correction)"
    )


def test_partial_rollouts_pause_for_the_weights_then_go_on_with_them():
    """With ``partial``, the generation running ahead samples its first part, pauses; the weight sync waits for
    that point only (settle_for_push returns while the generation is still unfinished); once pushed, the rest is
    sampled with the new weights. Generated at the start (on the driver's thread) there is no pause."""
    engines = Engines()
    parts = {}

    def generate(step, pause=None):
        first = engines.weights
        if pause is not None:
            pause()
        parts[step] = (first, engines.weights)
        return parts[step]

    schedule = RolloutSchedule(1, total_steps=3, generate=generate, partial=True)
    for step in range(1, 4):
        assert schedule.take(step) == parts[step]
        schedule.settle_for_push()  # returns at the pause point: the rest of step + 1 is not sampled yet
        if step < 3:
            assert step + 1 not in parts
        engines.weights = step
        schedule.pushed(step)
    schedule.settle()
    # step 1 on the driver's thread, whole; steps 2 and 3 begun with the weights before the step that trained
    # meanwhile and finished with that step's
    assert parts == {1: (0, 0), 2: (0, 1), 3: (1, 2)}


def test_a_paused_generation_is_never_joined_before_the_push():
    def generate(step, pause):
        if pause is not None:
            pause()
        return step

    schedule = RolloutSchedule(1, total_steps=3, generate=generate, partial=True)
    schedule.take(1)
    schedule.settle_for_push()
    with pytest.raises(RuntimeError, match="RL step 2 waits for new weights that were never pushed"):
        schedule.settle()
    schedule.pushed(1)  # the paused generation is still the schedule's: the push lets it finish
    schedule.settle()
    assert 2 in schedule.ready


class _Exiting:
    """A generation's thread caught between its last line and its exit: alive until joined (the window in which
    a finished generation has set ``paused`` but its thread has not ended yet)."""

    def __init__(self, thread: threading.Thread) -> None:
        self.thread, self.joined = thread, False

    def is_alive(self) -> bool:
        return not self.joined

    def join(self, timeout=None) -> None:
        self.thread.join(timeout)
        self.joined = True


@pytest.mark.parametrize("partial", [False, True])
def test_a_generation_that_ended_is_settled_even_while_its_thread_exits(partial):
    """Only a generation held in its pause waits for weights; one that ended (``paused`` is set then too) is
    joined, whether or not its thread has exited yet. This raised "never pushed" under load (k = 2, -n 2)."""
    schedule = RolloutSchedule(1, total_steps=3, generate=lambda step, pause=None: step, partial=partial)
    schedule.take(1)
    ahead = schedule._ahead
    assert ahead is not None and ahead.paused.wait(30)  # step 2's generation ran to its end (no pause called)
    ahead.thread.join(30)
    ahead.thread = _Exiting(ahead.thread)
    schedule.settle()
    assert schedule.ready == {2: 2} and ahead.thread.joined
