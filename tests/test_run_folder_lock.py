"""run_folder/lock.py: one writer per run folder; a lock that holds within one node only is named.
"""
from pathlib import Path

import run_folder
import run_folder.lock


# ==================================================================================================
# run_folder/lock.py: Lock, node_local_flock
# ==================================================================================================
def test_lock_on_a_node_local_flock_mount_says_so(tmp_path, monkeypatch, capsys):
    """NFS mounted with local_lock=flock (or =all) and Lustre with localflock grant flock on every
    node: the lock warns in one line naming the mount option and what to do. (Two nodes could both
    hold it without a word.)"""
    mounts = (f"/dev/vda / ext4 rw,relatime 0 0\n"
              f"server:/export {tmp_path} nfs4 rw,vers=4.2,local_lock=flock,addr=10.0.0.1 0 0\n"
              f"mds@tcp:/fs {tmp_path / 'lustre'} lustre rw,localflock 0 0\n"
              f"mds@tcp:/fs2 {tmp_path / 'lustre' / 'ok'} lustre rw,flock 0 0\n"
              # a space is written \040
              f"server:/b {tmp_path}/with\\040space nfs rw,local_lock=none 0 0\n")
    local = run_folder.node_local_flock
    assert local(tmp_path / "run", mounts) == "nfs4 with local_lock=flock"
    assert local(tmp_path / "lustre" / "run", mounts) == "lustre with localflock"
    assert local(tmp_path / "lustre" / "ok" / "run", mounts) is None and \
        local(Path("/home"), mounts) is None
    assert local(tmp_path / "with space" / "run", mounts) is None
    (tmp_path / "mounts").write_text(mounts)
    monkeypatch.setattr(run_folder.lock, "MOUNTS", tmp_path / "mounts")
    run_folder.Lock(tmp_path / "run").release()
    assert capsys.readouterr().err.strip().splitlines() == [
        f"train.py: warning: {tmp_path / 'run'} is on nfs4 with local_lock=flock: its lock holds "
        f"within this node only, so a run on another node would not be detected; remount without "
        f"it (NFS: local_lock=none; Lustre: -o flock) or start one job per folder"]
