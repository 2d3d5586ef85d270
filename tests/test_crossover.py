"""Where pruning starts: the shortest timed context from which sparse decode beats dense by the
margin at every longer one (a noisy win below a loss does not count)."""

from sgl_entropic.crossover import Timing, crossover


def t(context, dense, sparse):
    return Timing(context, dense, sparse)


def test_pruning_starts_at_the_first_context_from_which_sparse_always_wins():
    timings = [t(256, 7.0, 11.8), t(512, 14.2, 20.2), t(1024, 29.2, 25.6), t(2048, 60.8, 36.6), t(4096, 136, 65)]
    assert crossover(timings) == 1024
    assert crossover(list(reversed(timings))) == 1024  # order of the measurements does not matter


def test_a_win_inside_the_margin_or_below_a_loss_does_not_count():
    assert crossover([t(512, 10.0, 9.5), t(1024, 20.0, 17.0)]) == 1024  # 5 % faster is inside the 10 % margin
    assert crossover([t(512, 10.0, 5.0), t(1024, 20.0, 21.0), t(2048, 40.0, 20.0)]) == 2048


def test_no_crossover_when_sparse_never_pays():
    assert crossover([t(512, 10.0, 12.0), t(1024, 20.0, 30.0)]) is None
    assert crossover([t(512, 10.0, 5.0), t(1024, 20.0, 30.0)]) is None  # loses at the longest context
    assert crossover([]) is None


def test_measure_alternates_dense_and_sparse_and_keeps_each_ones_fastest_call():
    import time

    from sgl_entropic.crossover import measure

    calls = []

    def step(n, sparse):
        def run():
            calls.append((n, sparse))
            # a burst of load during the first timed dense call only: the fastest call must not see it
            time.sleep(0.2 if (n, sparse) == (512, False) and calls.count((n, sparse)) == 2 else 0.001)

        return run

    timings = measure(step, [256, 512], repeats=3)
    assert [x.context for x in timings] == [256, 512]
    # one warm-up each, then dense and sparse in turn
    assert calls[:8] == [(256, False), (256, True)] * 4 and calls[8:] == [(512, False), (512, True)] * 4
    assert all(x.dense_s < 0.05 and x.sparse_s < 0.05 for x in timings)  # a mean would be 0.067
