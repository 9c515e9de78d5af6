"""The served steps' timing that teaches the step costs: from the later of a step's dispatch and the previous
step's readback to its own readback; mixed steps only are observed."""

from jaxserve.core.buckets import DecodeBucket, MixedBucket
from jaxserve.core.cost_model import StepCosts
from jaxserve.runner.step_costs import FIRST_TABLE_AT, ServedStepTimer

MIXED = MixedBucket(8, 4, 16)


def test_a_step_is_timed_from_the_later_of_its_dispatch_and_the_previous_readback():
    costs = StepCosts()
    timer = ServedStepTimer(costs, [8], [4])
    assert timer.ready(MIXED, dispatched=1.0, now=1.5) == 0.5  # alone: dispatch to readback
    assert timer.ready(MIXED, dispatched=1.25, now=2.25) == 0.75  # dispatched while the one before ran
    assert timer.ready(DecodeBucket(4, 16), dispatched=2.0, now=2.5) == 0.25  # timed, not observed
    assert timer.ready(MIXED, dispatched=10.0, now=10.25) == 0.25  # after an idle gap: from its dispatch
    assert costs.num_observed == 3 and costs.measured() == {(8, 4): 0.5}


def test_the_learned_table_is_logged_after_the_first_steps_and_then_at_four_times_as_many(monkeypatch):
    logged = []
    timer = ServedStepTimer(StepCosts(), [8], [4])
    monkeypatch.setattr("jaxserve.runner.step_costs.logger.info", lambda msg, *args: logged.append(msg % args))
    for i in range(4 * FIRST_TABLE_AT):
        timer.ready(MIXED, dispatched=float(i), now=i + 0.5)
    assert logged == [
        f"mixed step costs learned so far ({n} steps; ~: estimated from the measured shapes):\n"
        "mixed step cost (ms) | 4 rows\n8 tokens | 500.0" for n in (FIRST_TABLE_AT, 4 * FIRST_TABLE_AT)
    ]
