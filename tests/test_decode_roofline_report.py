"""decode_roofline's summary says when the host was not quiet during the run."""
from harness.experiments.decode_roofline.report import bandwidth_reads, unsteady


def test_a_run_whose_bandwidth_moved_says_it_is_not_a_quiet_hosts():
    """Reads of 45.6 down to 29.8 GB/s (a shared host's memory got busy mid-run): the summary must say the steps are
    not comparable; within the accepted drift (a quiet host's reads vary ~10 %) it says nothing."""
    warning = unsteady([45.6, 44.0, 29.8, 41.0], 0.2)
    assert warning is not None and "moved 35 % (29.8 to 45.6 GB/s over 4 reads)" in warning
    assert "rerun" in warning
    assert unsteady([35.2, 33.0, 31.3], 0.2) is None and unsteady([29.8, 45.6], 0.2) is not None


def test_runs_stored_before_per_system_reads_keep_their_first_and_last():
    assert bandwidth_reads({"bandwidth_gbs": 35.2, "bandwidth_after_gbs": 31.3}) == [35.2, 31.3]
    assert bandwidth_reads({"bandwidth_gbs": 35.2, "bandwidth_after_gbs": 31.3,
                            "bandwidth_samples_gbs": [35.2, 33.0, 31.3]}) == [35.2, 33.0, 31.3]


def test_a_reference_that_timed_slower_at_the_end_says_so_though_the_reads_held():
    """Reads steady at 31-32 GB/s while dense's first point took 15.8 ms and 11.2 ms timed again: another tenant's
    compute, which a streaming read does not see."""
    recheck = {"system": "engine-dense", "context": 1024, "batch": 1, "first_ms": 15.8, "again_ms": 11.2}
    warning = unsteady([31.7, 30.7, 31.8], 0.2, recheck)
    assert warning is not None and "15.8 ms per step first and 11.2 ms when timed again" in warning
    assert "bandwidth moved" not in warning
    assert unsteady([31.7, 30.7, 31.8], 0.2, {**recheck, "again_ms": 14.9}) is None
