"""The native kernels' build: a lock left by a killed build does not make the next one wait
forever (torch's build lock is a plain file that its waiters poll)."""

from __future__ import annotations

import os
import time

from localllm.cpu import build


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, capsys):
    lock = tmp_path / "lock"
    lock.write_text("")
    build._clear_stale_lock(tmp_path)  # a build in progress right now: kept
    assert lock.exists()
    old = time.time() - build.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    build._clear_stale_lock(tmp_path)
    assert not lock.exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stale build lock" in err
    build._clear_stale_lock(tmp_path)  # no lock: nothing to do, nothing said
    assert capsys.readouterr().err == ""
