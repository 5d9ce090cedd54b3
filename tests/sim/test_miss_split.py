"""The on_miss="split" rule (moecache/sim/miss_split.py) on hand-worked steps."""

import numpy as np

from moecache.sim.miss_split import split_waits


def waits(ready, cpu, gpu_wait, n_rest=0, cpu_rest=0.0, call=0.0, hits=0.0, serial=False, wait_host=0.0):
    n = len(ready)
    return split_waits(
        np.array(ready, float), np.array(cpu, float), np.array([0.0, *gpu_wait]), n, n_rest,
        cpu_rest, call, hits, serial, wait_host,
    )  # fmt: skip


def test_no_candidate_waits_for_nothing():
    assert waits([], [], []) == 0


def test_waits_for_the_copies_that_land_before_the_cpu_would_finish():
    # three misses of 300 us on the CPU, copies landing at 330, 660, 990 (+20 us of kernel each)
    # w=0: 900; w=1: max(600, 350) = 600; w=2: max(300, 680) = 680; w=3: 1010
    assert waits([330, 660, 990], [300, 300, 300], [20, 40, 60]) == 1
    # the call cost and other misses stay on the CPU either way: w=1: max(50+300+600, 350)
    assert waits([330, 660, 990], [300, 300, 300], [20, 40, 60], n_rest=2, cpu_rest=600, call=50) == 2


def test_a_copy_landing_after_the_cpu_is_not_waited_for():
    assert waits([400], [300], [20]) == 0


def test_the_smallest_best_w_on_ties():
    # w=0: max(10, 0)=10; w=1: max(0, 10)=10 -> 0
    assert waits([9], [10], [1]) == 0


def test_serial_adds_the_halves():
    # w=0: 300 + 100; w=1: 0 + max(100, 150 + 20) = 170
    assert waits([150], [300], [20], hits=100.0, serial=True) == 1
    assert waits([400], [300], [20], hits=100.0, serial=True) == 0  # 420 > 400


def test_a_waiting_steps_host_time_is_weighed():
    # w=0: 900; w=1: max(600, 350) + host
    assert waits([330, 660, 990], [300, 300, 300], [20, 40, 60], wait_host=299.0) == 1  # 899 < 900
    assert waits([330, 660, 990], [300, 300, 300], [20, 40, 60], wait_host=300.0) == 0  # a tie: the smallest
    # the host time is paid once, whatever w: w=2 (680 + 100) against w=1 (600 + 100)
    assert waits([330, 660, 990], [300, 300, 300], [20, 40, 60], wait_host=100.0) == 1
