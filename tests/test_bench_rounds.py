"""The benchmark scripts' rounds: every configuration runs once per round, each takes
every place in turn, and ratios pair runs of the same round."""

from pagedllm.bench.rounds import median_ratio, median_record, rotation


def test_each_config_runs_once_per_round_and_takes_every_place():
    configs = ["off", "host", "disk"]
    orders = [rotation(configs, r) for r in range(3)]
    assert all(sorted(order) == sorted(configs) for order in orders)
    for place in range(3):
        assert sorted(order[place] for order in orders) == sorted(configs)


def test_ratios_pair_the_runs_of_one_round():
    base = [{"t": 1.0}, {"t": 10.0}, {"t": 2.0}]
    rows = [{"t": 2.0}, {"t": 20.0}, {"t": 4.0}]
    assert median_ratio(rows, base, "t") == 2.0
    assert median_record(rows) == {"t": 4.0}
    shuffled = [rows[1], rows[2], rows[0]]
    assert median_ratio(shuffled, base, "t") != 2.0
