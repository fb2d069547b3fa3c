"""A wall-clock budget for a whole training run (`trainer.time_budget_min`).

A recipe that promises "20 minutes on 2 cores" cannot promise a step count: the data, the
feature cache and each step take what the machine gives (a CPU without AVX512-BF16 trains in
fp32, 2-3x slower per step; llama-server's generation rate varied 3x between our machines). With
a budget, the run keeps the recipe's `max_steps` where it fits and otherwise trains fewer steps
over a cosine schedule that still ends at its minimum:

1. The budget counts from the start of the run: train.py's process start (`process_started`:
   the interpreter's imports take a few seconds), so data generation and the feature cache
   spend it too.
2. Plan: once the loop has timed its steps and, where the run validates periodically, its first
   validation, it computes the longest run (up to the recipe's length) whose remaining steps,
   periodic validations, checkpoints and final validation fit in what is left
   (`steps_that_fit`), and re-spreads the learning-rate schedule over it
   (`train.optim.replan_scheduler`). It plans again at each later validation, on the mean of the
   steps since the last plan: step times drift (on a 2-core Xeon the first 100 steps of
   `eagle3_llama` averaged 1.29 s and the 373 after them about 1.03 s, so a single plan left
   1.5 of its 20 minutes unused), and a later plan lengthens or shortens the run. The plan is
   decided on the main process, is the same on every process, and is recorded in each later
   checkpoint, so a resumed run finishes the schedule it resumed with (a resumed process does
   not plan again: its clock started late and cannot tell what the first one spent).
3. Guard: after the plan, when the next step would leave no room for the final validation and
   save, the run stops there and ends normally (final validation, checkpoint, head), with a
   warning. Before the plan nothing stops it: a machine whose data preparation spent the whole
   budget still trains to the first validation (or 10 steps) and says by how much it overran.

Without periodic validation (eval_every=0), the final validation's cost is not known when the
plan is made: it is taken as one step's.

The loop meets the budget as a callback (`BudgetKeeper`, or `NoBudget` when
`trainer.time_budget_min` is 0) at named points: `on_resume`, `on_step_end`, `on_validation`,
`on_checkpoint` and `decide`; `decide` returns what the loop should do next (`BudgetDecision`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

log = logging.getLogger(__name__)


def process_started(clock: Callable[[], float] = time.monotonic) -> float:
    """The `clock` reading at which this process started, from its age as the OS reports it
    (psutil); the reading now where the OS will not say."""
    try:
        age = time.time() - psutil.Process().create_time()
    except psutil.Error:  # psutil's own errors (access denied and the like), not OSError
        age = 0.0
    return clock() - max(0.0, age)


@dataclass(frozen=True)
class StepCosts:
    """Measured wall seconds: one optimizer step (mean), one validation (with the checkpoint-time
    evaluators), one checkpoint write."""

    step_s: float
    eval_s: float = 0.0
    save_s: float = 0.0

    def describe(self) -> str:
        return (
            f"{self.step_s:.2f} s a step, {self.eval_s:.1f} s a validation, "
            f"{self.save_s:.1f} s a checkpoint"
        )


def events_between(start: int, end: int, every: int) -> int:
    """How many multiples of `every` lie in (start, end]; 0 when `every` is 0."""
    return end // every - start // every if every > 0 else 0


def finish_cost(step: int, end: int, costs: StepCosts, eval_every: int, save_every: int) -> float:
    """Wall seconds from `step` to the end of a run that stops at `end`: its steps, the periodic
    validations and checkpoints in (step, end], the final validation and checkpoint where the
    last step is not already one, and the head's save (costed as a checkpoint)."""
    cost = (end - step) * costs.step_s
    cost += events_between(step, end, eval_every) * costs.eval_s
    if not (eval_every and end % eval_every == 0):
        cost += costs.eval_s  # the final validation
    if save_every > 0:
        cost += events_between(step, end, save_every) * costs.save_s
        if end % save_every:
            cost += costs.save_s  # the final checkpoint
    return cost + costs.save_s  # the head


def steps_that_fit(
    remaining_s: float,
    costs: StepCosts,
    *,
    step: int,
    total: int,
    eval_every: int,
    save_every: int,
) -> int:
    """The largest run length in [step, total] whose finish (`finish_cost`) fits in
    `remaining_s`; `step` (stop now) when not even one more step does."""
    if finish_cost(step, total, costs, eval_every, save_every) <= remaining_s:
        return total
    lo, hi = step, total  # cost rises with the end step: bisect for the last that fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if finish_cost(step, mid, costs, eval_every, save_every) <= remaining_s:
            lo = mid
        else:
            hi = mid
    return lo


class TimeBudget:
    """`minutes` of wall time from `started` (a `clock()` reading), and the step timings the
    plan reads. `clock` is injectable so tests can run on a simulated clock."""

    def __init__(
        self, minutes: float, started: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.minutes, self.clock = minutes, clock
        self.deadline = started + minutes * 60.0
        self.step_total_s, self.steps, self.last_step_s = 0.0, 0, 0.0
        self.window_s, self.window_steps = 0.0, 0  # the steps since the last plan
        self.eval_s: float | None = None
        self.save_s = 0.0

    def remaining(self) -> float:
        return self.deadline - self.clock()

    def add_step(self, seconds: float) -> None:
        self.step_total_s += seconds
        self.steps += 1
        self.last_step_s = seconds
        self.window_s += seconds
        self.window_steps += 1

    def costs(self) -> StepCosts:
        """A step costs the mean of the steps since the last plan (of all, before the first
        plan or when fewer than 5 ran since): the first steps of a run are often slower."""
        if self.window_steps >= 5:
            step_s = self.window_s / self.window_steps
        else:
            step_s = self.step_total_s / max(self.steps, 1)
        eval_s = step_s if self.eval_s is None else self.eval_s
        return StepCosts(step_s=step_s, eval_s=eval_s, save_s=self.save_s)

    def ready_to_plan(self, evaluated_now: bool, eval_every: int, total: int) -> bool:
        """Plan after a validation when the run validates periodically before its end, else
        after 10 timed steps."""
        if 0 < eval_every < total:
            return evaluated_now and self.steps > 0
        return self.steps >= 10

    def plan(self, step: int, total: int, eval_every: int, save_every: int) -> int:
        """The longest run in [step, total] that fits what is left; starts a new step window."""
        fits = steps_that_fit(
            self.remaining(),
            self.costs(),
            step=step,
            total=total,
            eval_every=eval_every,
            save_every=save_every,
        )
        self.window_s, self.window_steps = 0.0, 0
        return fits

    def must_stop(self, step: int, eval_every: int, save_every: int) -> bool:
        """True when one more step and the finish after it would overrun the deadline; a step
        is costed at the larger of the mean and the last (steps that slow down are caught)."""
        costs = self.costs()
        costs = StepCosts(max(costs.step_s, self.last_step_s), costs.eval_s, costs.save_s)
        return finish_cost(step, step + 1, costs, eval_every, save_every) > self.remaining()


@dataclass(frozen=True)
class BudgetDecision:
    """Run `end` steps in all. `replan`: a new plan, so the schedule is re-spread to end there
    and the plan is recorded; otherwise the run just stops at `end` (the guard)."""

    end: int
    replan: bool


class NoBudget:
    """The callback of a run without a time budget: it times nothing and never decides."""

    def on_resume(self, planned: int, total: int) -> BudgetDecision | None:
        return None

    def on_step_end(self, seconds: float) -> None:
        pass

    def on_validation(self, seconds: float) -> None:
        pass

    def on_checkpoint(self, seconds: float) -> None:
        pass

    def decide(
        self, step: int, end: int, planned: int, evaluated_now: bool
    ) -> BudgetDecision | None:
        return None


class BudgetKeeper:
    """A `TimeBudget` as the loop's callback: it is told what each step, validation and
    checkpoint cost, and after each step `decide`s whether the run plans, stops or goes on
    (see the module docs). `recipe_steps` is the run length the recipe asks for; `share(value)`
    returns the main process's value on every process (the main process decides)."""

    def __init__(
        self,
        budget: TimeBudget,
        recipe_steps: int,
        eval_every: int,
        save_every: int,
        share: Callable[[Any], Any] = lambda value: value,
    ) -> None:
        self.budget, self.recipe_steps, self.share = budget, recipe_steps, share
        self.eval_every, self.save_every = eval_every, save_every
        self.replans = True

    def on_resume(self, planned: int, total: int) -> BudgetDecision | None:
        """A resumed run keeps the plan it recorded (so the schedule holds), unless max_steps
        was lowered since; this process's clock started late, so it never plans again."""
        if not planned:
            return None
        self.replans = False
        return BudgetDecision(min(planned, total), replan=True)

    def on_step_end(self, seconds: float) -> None:
        self.budget.add_step(seconds)

    def on_validation(self, seconds: float) -> None:
        self.budget.eval_s = seconds

    def on_checkpoint(self, seconds: float) -> None:
        self.budget.save_s = seconds

    def decide(
        self, step: int, end: int, planned: int, evaluated_now: bool
    ) -> BudgetDecision | None:
        """After step `step` of a run now ending at `end` (`planned`: the recorded plan, 0 when
        none): plan at the first validation and again at each later one; after a plan, stop when
        the next step would overrun. Before the first plan nothing stops the run."""
        budget = self.budget
        if not planned and budget.ready_to_plan(evaluated_now, self.eval_every, self.recipe_steps):
            return self._plan(step, end, planned)
        if planned and evaluated_now and self.replans and step < end:
            return self._plan(step, end, planned)
        if planned and step < end:
            if self.share(budget.must_stop(step, self.eval_every, self.save_every)):
                log.warning(
                    "time budget %.1f min: stopping at step %d of %d (%.0f s left)",
                    budget.minutes, step, end, budget.remaining(),
                )  # fmt: skip
                return BudgetDecision(step, replan=False)
        return None

    def _plan(self, step: int, end: int, planned: int) -> BudgetDecision | None:
        budget, costs = self.budget, self.budget.costs()
        fits = budget.plan(step, self.recipe_steps, self.eval_every, self.save_every)
        fits = max(self.share(fits), step)
        if fits == end and planned:
            return None
        log.log(
            logging.WARNING if fits < self.recipe_steps else logging.INFO,
            "time budget %.1f min: %d of %d steps fit (%s; %.0f s left at step %d)%s",
            budget.minutes, fits, self.recipe_steps, costs.describe(), budget.remaining(), step,
            f", was {end}" if planned else "",
        )  # fmt: skip
        return BudgetDecision(fits, replan=True)


def budget_callback(
    minutes: float,
    started: float,
    clock: Callable[[], float],
    *,
    recipe_steps: int,
    eval_every: int,
    save_every: int,
    share: Callable[[Any], Any],
) -> BudgetKeeper | NoBudget:
    """The loop's budget callback: a BudgetKeeper for `minutes` > 0, else a NoBudget."""
    if minutes <= 0:
        return NoBudget()
    budget = TimeBudget(minutes, started, clock)
    return BudgetKeeper(budget, recipe_steps, eval_every, save_every, share)
