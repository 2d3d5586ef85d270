"""Where pruning starts: the shortest timed context from which sparse decode beats dense by the
margin at every longer one (a noisy win below a loss does not count)."""

from sgl_entropic.crossover import Timing, crossover, plain_step_seconds


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

    timings = measure(step, [256, 512], others=lambda: 0.0)  # a quiet machine: an untimed pass, three timed
    assert [x.context for x in timings] == [256, 512]
    assert calls == [(256, False), (256, True), (512, False), (512, True)] * 4
    assert all(x.dense_s < 0.05 and x.sparse_s < 0.05 for x in timings)  # a mean would be 0.067


def test_passes_while_other_processes_load_the_machine_do_not_count():
    """At start-up SGLang's other processes load beside the scheduler for seconds, slowing every call of several
    passes: only passes the others left alone are kept, three of them."""
    import time

    from sgl_entropic.crossover import fastest

    passes, used = [], [0.0]

    def first():
        passes.append(None)
        loaded = len(passes) <= 4  # the untimed pass and three timed ones
        used[0] += 1.0 if loaded else 0.0  # the others' CPU seconds meanwhile
        time.sleep(0.02 if loaded else 0.001)

    def second():
        time.sleep(0.02 if len(passes) <= 4 else 0.001)

    best = fastest([first, second], others=lambda: used[0])
    assert max(best) < 0.01 and len(passes) == 4 + 3
    # a machine never quiet: the fastest of every pass, after at most `most` of them
    passes.clear()
    used[0] = 0.0
    assert len(fastest([first], others=lambda: len(passes), most=4)) == 1 and len(passes) == 5


def test_a_plain_step_is_priced_by_the_regime_it_runs_at_each_context():
    kernel = [Timing(256, 1.0, 2.0), Timing(1024, 4.0, 3.0), Timing(4096, 16.0, 9.0)]  # loop / ours over every page
    pruned = [Timing(256, 1.0, 5.0), Timing(1024, 4.0, 4.0), Timing(4096, 16.0, 6.0)]
    assert plain_step_seconds(kernel, pruned, 1024, 4096) == [(256, 1.0), (1024, 3.0), (4096, 6.0)]
    assert plain_step_seconds(kernel, pruned, None, None) == [(256, 1.0), (1024, 4.0), (4096, 16.0)]
    # a given crossover leaves a regime untimed: no price rather than a wrong one
    assert plain_step_seconds(kernel, [], 1024, 4096) is None
    assert plain_step_seconds([], pruned, 1024, None) is None
