"""The test harness's own: a process it reaps leaves nothing behind and nothing in its stderr, and one that does not
exit in time is reported with where it waits."""

import os
import sys

import pytest

from tests.harness.swarm import Proc, shm_managers, wait_until

# a tensor shared as hivemind shares them (file_system: torch_shm_manager holds a socket in TMPDIR), and a helper
# process that outlives the main one by a moment, as a peer's averager and DHT processes do when it leaves
SHARES_AND_LINGERS = """
import os, time, torch, torch.multiprocessing as mp
torch.multiprocessing.set_sharing_strategy("file_system")
shared = torch.zeros(8).share_memory_()
mp.set_start_method("fork")
mp.Process(target=time.sleep, args=(1.0,)).start()
os._exit(0)
"""


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_reaped_process_temp_dir_outlives_its_shared_memory_manager(tmp_path):
    """torch_shm_manager runs in a session of its own and leaves a few seconds after its last client. Its temp
    dir removed under it, it exited printing ``terminate called after throwing an instance of 'std::system_error'``
    into the stderr of every peer a benchmark stopped. ``wait`` removes the dir only after the manager is gone."""
    proc = Proc([sys.executable, "-c", SHARES_AND_LINGERS], tmp_path, "sharer")
    managers = wait_until(lambda: shm_managers(proc.tmp), 60, "the process's torch_shm_manager")
    assert proc.wait(60) == 0, proc.stderr
    wait_until(lambda: all(gone(pid) for pid in managers), 30, "torch_shm_manager to exit")
    assert not os.path.exists(proc.tmp)
    assert "terminate called" not in proc.stderr, proc.stderr


def test_a_process_that_does_not_exit_in_time_is_reported_with_where_its_threads_wait(tmp_path):
    """A hang in CI is read from the failure alone: which function of the process waited, not only its stderr."""
    stuck = "import threading\ndef stuck_here():\n    threading.Event().wait()\nstuck_here()"
    proc = Proc([sys.executable, "-c", stuck], tmp_path, "stuck")
    with pytest.raises(AssertionError, match="(?s)stuck did not exit within 1s.*line 3 in stuck_here"):
        proc.wait(1)
    assert not proc.alive()
    proc.kill_group()  # (its temp dir)
