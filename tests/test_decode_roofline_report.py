"""decode_roofline's summary says when the host was not quiet during the run."""
from harness.experiments.decode_roofline.report import unsteady


def test_a_run_whose_bandwidth_moved_says_it_is_not_a_quiet_hosts():
    """Start and end bandwidth 45.6 and 29.8 GB/s (a shared host's memory got busy mid-run): the summary must say
    the steps are not comparable; within the accepted drift (a quiet host's reads vary ~10 %) it says nothing."""
    warning = unsteady(45.6, 29.8, 0.2)
    assert warning is not None and "35 %" in warning and "45.6 → 29.8 GB/s" in warning and "rerun" in warning
    assert unsteady(35.2, 31.3, 0.2) is None and unsteady(29.8, 45.6, 0.2) is not None
