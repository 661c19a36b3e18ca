"""Where ``call_watching_peers`` runs a rendezvous (creating a group).

c10d's state may belong to a thread: under torch's threaded process group (what FSDP2's own
tests run on) the threads of one process are the ranks, and a helper thread sees no default
group, so ``new_group`` there raises "Default process group has not been initialized". With
no member known to be another process there is no death to watch for, and the call runs on
the calling thread; a member that is another process is still watched (its death is named).
"""

from __future__ import annotations

import subprocess
import threading

import pytest

from mfsdp_collectives import PeerDiedError, call_watching_peers
from mfsdp_collectives.safety import liveness
from mfsdp_collectives.safety.liveness import ProcessIdentity


@pytest.fixture(autouse=True)
def _no_known_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(liveness, "_known", {})


def test_a_rendezvous_among_threads_of_this_process_sees_the_calling_threads_state() -> None:
    this = ProcessIdentity.of_this_process()
    liveness.record_identities({0: this, 1: this})  # threads as ranks
    state = threading.local()
    state.world = "the calling thread's"
    seen = call_watching_peers(lambda: getattr(state, "world", None), [0, 1], "a test")
    assert seen == "the calling thread's"


def test_a_rendezvous_with_another_process_is_still_watched() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    this = ProcessIdentity.of_this_process()
    liveness.record_identities({0: this, 1: ProcessIdentity(this.host, gone.pid, 0)})
    release = threading.Event()
    try:
        with pytest.raises(PeerDiedError, match=r"rank 1 \(pid"):
            call_watching_peers(lambda: release.wait(10), [0, 1], "a test")
    finally:
        release.set()
