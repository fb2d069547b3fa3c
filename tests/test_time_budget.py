"""trainer.time_budget_min on a simulated clock: the plan (how many steps fit), the schedule
re-spread to end at the plan, later plans at each validation when steps slow down or speed up,
the guard that stops a run whose steps slow down between validations, a resumed run that
keeps the plan and ends with the same weights as an uninterrupted one, and the clock's start at
the process's own start."""

from __future__ import annotations

import itertools
import time

import psutil
import pytest
import torch

from tests._dummy_head import DummyHead, collate_with_ids, make_examples, make_target
from train.budget import StepCosts, finish_cost, process_started, steps_that_fit
from train.config import TrainerConfig
from train.loop import Trainer


@pytest.fixture(scope="module")
def target():
    return make_target()


class Clock:
    """Simulated seconds: a training batch costs `step_s` (when it is collated), a checkpoint-time
    evaluation `eval_s`; nothing else moves the clock."""

    def __init__(self, step_s: float = 1.0, eval_s: float = 5.0) -> None:
        self.now, self.step_s, self.eval_s, self.batches = 0.0, step_s, eval_s, 0

    def __call__(self) -> float:
        return self.now

    def collate(self, examples):
        self.batches += 1
        self.now += self.step_s(self.batches) if callable(self.step_s) else self.step_s
        return collate_with_ids(examples)

    def evaluator(self, head, target) -> dict[str, float]:
        self.now += self.eval_s
        return {"calls": 1.0}


def trainer(target, tmp_path, clock, *, minutes=1.0, callbacks=(), **overrides) -> Trainer:
    base = dict(
        lr=1e-2, batch_size=2, max_steps=100, eval_every=10, save_every=0, log_every=0,
        warmup_steps=2, progress=False, seed=0, time_budget_min=minutes,
    )  # fmt: skip
    cfg = TrainerConfig(**{**base, **overrides})
    return Trainer(
        DummyHead(), cfg, tmp_path, train_dataset=make_examples(8), collate_fn=clock.collate,
        target=target, evaluators=[clock.evaluator], callbacks=callbacks, started=0.0,
        clock=clock,
    )  # fmt: skip


def brute_force(remaining, costs, step, total, eval_every, save_every) -> int:
    fits = [
        end
        for end in range(step, total + 1)
        if finish_cost(step, end, costs, eval_every, save_every) <= remaining
    ]
    return max(fits) if fits else step


def test_steps_that_fit_is_the_longest_run_that_fits():
    cases = itertools.product(
        (0.0, 7.0, 45.0, 300.0, 5000.0),  # seconds left
        (StepCosts(1.0, 5.0, 0.0), StepCosts(2.5, 0.5, 3.0), StepCosts(0.3, 40.0, 1.0)),
        (0, 10, 64),  # the current step
        (0, 7, 25),  # eval_every
        (0, 5, 100),  # save_every
    )
    for remaining, costs, step, eval_every, save_every in cases:
        total = step + 200
        got = steps_that_fit(
            remaining, costs, step=step, total=total, eval_every=eval_every, save_every=save_every
        )
        assert got == brute_force(remaining, costs, step, total, eval_every, save_every)
    # by hand: 1 s steps, 5 s validations every 10, 45 s left at step 10 -> 30 steps and the
    # validations at 20, 30 and 40 (the one at 40 is the final one): 45 s
    assert steps_that_fit(45.0, StepCosts(1.0, 5.0), step=10, total=100, eval_every=10,
                          save_every=0) == 40  # fmt: skip


def test_the_plan_fills_the_budget_and_the_schedule_ends_there(target, tmp_path, caplog):
    clock = Clock()
    run = trainer(target, tmp_path, clock)
    with caplog.at_level("WARNING", logger="train.budget"):
        result = run.fit()
    assert "40 of 100 steps fit (1.00 s a step, 5.0 s a validation" in caplog.text
    # 60 s: steps 1-10 (10 s) and the first validation (5 s) leave 45 s: 30 more steps
    assert (result.step, result.planned_steps) == (40, 40)
    assert clock.now == pytest.approx(60.0)
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    assert result.head_dir is not None and (result.head_dir / "model.safetensors").is_file()


def test_without_a_budget_or_with_room_the_recipe_length_stands(target, tmp_path):
    for minutes, tag in ((0.0, "none"), (10.0, "room")):
        result = trainer(target, tmp_path / tag, Clock(), minutes=minutes).fit()
        assert result.step == 100
        assert result.planned_steps == (100 if minutes else 0)


def test_steps_that_slow_down_shorten_the_plan_at_the_next_validation(target, tmp_path, caplog):
    clock = Clock(step_s=lambda n: 1.0 if n <= 10 else 3.0)
    run = trainer(target, tmp_path, clock)
    with caplog.at_level("INFO", logger="train.budget"):
        result = run.fit()
    # planned 40 on the fast steps; at step 20 (t = 50 s) the 3 s steps leave room for one more
    # step and the final validation: 21, and the schedule still ends at its minimum
    assert "40 of 100 steps fit" in caplog.text and "21 of 100 steps fit" in caplog.text
    assert "was 40" in caplog.text
    assert (result.step, result.planned_steps) == (21, 21)
    assert clock.now == pytest.approx(58.0) and clock.now <= 60.0
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    assert result.head_dir is not None and not result.stopped_early


def test_steps_that_speed_up_lengthen_the_plan_at_the_next_validation(target, tmp_path, caplog):
    clock = Clock(step_s=lambda n: 2.0 if n <= 10 else 1.0)
    run = trainer(target, tmp_path, clock)
    with caplog.at_level("INFO", logger="train.budget"):
        result = run.fit()
    # step 10 at 25 s (validation included): 2 s steps fit 22 in the 35 s left; at step 20
    # (40 s) the 1 s steps since then fit 30: its validation at 55 s ends the run
    assert "22 of 100 steps fit (2.00 s a step" in caplog.text
    assert "30 of 100 steps fit (1.00 s a step" in caplog.text
    assert (result.step, result.planned_steps) == (30, 30)
    assert clock.now == pytest.approx(55.0)
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


def test_steps_that_slow_down_between_validations_are_stopped_in_time(target, tmp_path):
    clock = Clock(step_s=lambda n: 1.0 if n <= 25 else 5.0)
    result = trainer(target, tmp_path, clock).fit()
    # 40 planned at step 10 and again at 20; from step 26 a step takes 5 s, and after step 29
    # (55 s) one more step and the validation at 30 would end at 65 s: the guard stops there
    assert (result.step, result.planned_steps) == (29, 40)
    assert clock.now == pytest.approx(60.0)  # the final validation of step 29 included
    assert result.head_dir is not None and not result.stopped_early


def test_a_budget_too_small_for_one_more_step_stops_at_the_plan(target, tmp_path):
    clock = Clock()
    result = trainer(target, tmp_path, clock, minutes=14.0 / 60).fit()
    assert result.step == result.planned_steps == 10
    assert result.head_dir is not None


def test_a_resumed_run_keeps_the_plan_and_the_weights(target, tmp_path):
    whole = trainer(target, tmp_path / "whole", Clock(), save_every=5)
    whole.fit()

    stop_at_25 = [lambda state: state.step == 25]
    first = trainer(target, tmp_path / "parts", Clock(), save_every=5, callbacks=stop_at_25)
    assert first.fit().stopped_early
    # a new process: the clock starts over, and a budget that would allow all 100 steps
    second = trainer(target, tmp_path / "parts", Clock(), minutes=10.0, save_every=5)
    result = second.fit()
    assert (result.step, result.planned_steps) == (40, 40)
    for (name, a), (_, b) in zip(
        whole.head.state_dict().items(), second.head.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="time_budget_min=-1"):
        TrainerConfig(time_budget_min=-1)


def test_a_spent_budget_still_trains_to_the_first_validation(target, tmp_path):
    clock = Clock()
    clock.now = 120.0  # the data took two minutes of a one-minute budget
    result = trainer(target, tmp_path, clock).fit()
    assert result.step == result.planned_steps == 10
    assert result.head_dir is not None


def test_the_budget_counts_from_the_process_start():
    """train.py starts the budget's clock when its process started, so the interpreter's imports
    are spent from it too: the start lies the process's age before now, on any clock."""
    age = time.time() - psutil.Process().create_time()
    now = time.monotonic()
    started = process_started()
    assert started <= now
    assert now - started == pytest.approx(age, abs=1.0)
    assert process_started(lambda: 5000.0) == pytest.approx(5000.0 - age, abs=1.0)
