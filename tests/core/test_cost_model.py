"""Step costs learned from served steps: windowed low medians per shape, a fit for the shapes never run."""

import pytest

from jaxserve.core.cost_model import MAX_AGE_STEPS, MIN_SAMPLES, WINDOW, StepCosts


def ms(costs: StepCosts, num_tokens: int, batch_size: int) -> float:
    return round(1e3 * costs.of(num_tokens, batch_size), 6)


def observed(samples: dict[tuple[int, int], list[float]]) -> StepCosts:
    """Costs that observed each shape's samples (milliseconds) in order."""
    costs = StepCosts()
    for shape, values in samples.items():
        for value in values:
            costs.observe(*shape, value / 1e3)
    return costs


def test_a_shape_is_measured_after_min_samples_and_then_costs_their_low_median():
    costs = observed({(8, 4): [12.0, 10.0]})
    assert MIN_SAMPLES == 3 and not costs.is_ready and not costs.is_measured(8, 4)
    with pytest.raises(ValueError, match="no mixed step shape is measured yet"):
        costs.of(8, 4)
    costs.observe(8, 4, 0.011)
    assert costs.is_ready and costs.is_measured(8, 4) and ms(costs, 8, 4) == 11.0
    costs.observe(8, 4, 0.013)  # four samples: the lower of the two middle ones
    assert ms(costs, 8, 4) == 11.0


@pytest.mark.parametrize("before", [[10.0] * 5, [10.0, 10.0], [10.0] * 15])
def test_one_sample_ten_times_the_others_does_not_move_the_cost(before):
    costs = observed({(8, 4): [*before, 100.0]})
    assert ms(costs, 8, 4) == 10.0


def test_a_busy_start_is_corrected_once_half_the_window_saw_the_quiet_machine():
    costs = observed({(8, 4): [20.0] * WINDOW + [10.0] * (WINDOW // 2 - 1)})
    assert ms(costs, 8, 4) == 20.0
    costs.observe(8, 4, 0.010)
    assert ms(costs, 8, 4) == 10.0


def test_a_machine_that_turns_busy_raises_the_cost_once_most_of_the_window_saw_it():
    costs = observed({(8, 4): [10.0] * WINDOW + [20.0] * (WINDOW // 2)})
    assert ms(costs, 8, 4) == 10.0  # half the window slow: as likely noise as a change
    costs.observe(8, 4, 0.020)
    assert ms(costs, 8, 4) == 20.0


def test_samples_older_than_max_age_are_forgotten():
    costs = observed({(8, 4): [30.0] * MIN_SAMPLES, (16, 4): [20.0] * (MAX_AGE_STEPS - MIN_SAMPLES)})
    assert costs.is_measured(8, 4)
    costs.observe(16, 4, 0.020)  # the first (8, 4) sample is now MAX_AGE_STEPS + 1 observations old
    assert not costs.is_measured(8, 4)
    assert ms(costs, 8, 4) == 10.0  # estimated from (16, 4), proportional to tokens: no slope is known


def test_unmeasured_shapes_share_one_slope_with_a_fixed_part_per_rows_column():
    # column 4: 10 ms + 1 ms per token; column 8 has one shape, 17 ms + the same slope
    costs = observed({(8, 4): [18.0] * 3, (16, 4): [26.0] * 3, (8, 8): [25.0] * 3})
    assert [ms(costs, t, 4) for t in (32, 64)] == [42.0, 74.0]
    assert [ms(costs, t, 8) for t in (16, 32, 64)] == [33.0, 49.0, 81.0]
    assert ms(costs, 64, 16) == 81.0  # no 16-row shape measured: the nearest column, 8 rows
    assert ms(costs, 64, 6) == 81.0  # 4 and 8 rows are as near: the one with more rows


def test_the_slope_pools_the_columns_each_centred_on_its_own_means():
    # column 4: 1 ms per token; column 8: 2 ms per token, on the same token counts: 1.5 between them
    costs = observed({(8, 4): [18.0] * 3, (16, 4): [26.0] * 3, (8, 8): [20.0] * 3, (16, 8): [36.0] * 3})
    assert ms(costs, 32, 4) == 22.0 + 1.5 * (32 - 12)  # through the column's means: 12 tokens, 22 ms
    assert ms(costs, 32, 8) == 28.0 + 1.5 * (32 - 12)


def test_without_a_slope_the_cost_is_proportional_to_tokens_from_the_nearest_measured_shape():
    costs = observed({(16, 4): [32.0] * 3, (32, 8): [40.0] * 3})  # one token count per column
    assert [ms(costs, t, 4) for t in (8, 32)] == [16.0, 64.0]
    assert ms(costs, 64, 8) == 80.0


def test_an_estimate_stays_between_the_measured_neighbours_in_its_column():
    # the line through these undershoots 32 tokens (27.8 ms): never below the 16-token shape's 30 ms
    costs = observed({(8, 4): [10.0] * 3, (16, 4): [30.0] * 3, (64, 4): [40.0] * 3})
    assert ms(costs, 32, 4) == 30.0
    # a falling line (noise) has slope 0: 32 tokens cost at least the 8-token shape
    costs = observed({(8, 4): [20.0] * 3, (16, 4): [10.0] * 3})
    assert ms(costs, 32, 4) == 20.0


def test_the_table_marks_the_estimates():
    costs = observed({(8, 4): [18.0] * 3, (16, 4): [26.0] * 3, (16, 8): [30.5, 99.0]})
    assert costs.format_table([8, 16, 32], [4, 8]) == (
        "mixed step cost (ms) | 4 rows | 8 rows\n"
        "8 tokens | 18.0 | ~18.0\n"
        "16 tokens | 26.0 | ~26.0\n"
        "32 tokens | ~42.0 | ~42.0"
    )
    assert StepCosts().format_table([8], [4]) == "mixed step cost (ms) | 4 rows\n8 tokens | -"


def test_from_seconds_measures_every_shape_given():
    costs = StepCosts.from_seconds({(8, 4): 0.5, (16, 8): 0.25})
    assert costs.measured() == {(8, 4): 0.5, (16, 8): 0.25} and costs.num_observed == 2 * MIN_SAMPLES
