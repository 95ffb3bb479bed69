"""A torch JIT build lock left by a killed process is removed before DeepSpeed's CPU ops load; a live one is kept."""

import os

from posttrain.distributed.build_locks import STALE_BUILD_LOCK_SECONDS, clear_stale_build_locks


def op_dir(root, name, age_s, now, with_lock=True):
    d = root / name
    d.mkdir()
    files = [d / "build.ninja"] + ([d / "lock"] if with_lock else [])
    for f in files:
        f.write_text("")
        os.utime(f, (now - age_s, now - age_s))
    return d


def test_stale_lock_removed_live_and_recent_ones_kept(tmp_path, capsys):
    now = 1_000_000.0
    stale = op_dir(tmp_path, "deepspeed_shm_comm", STALE_BUILD_LOCK_SECONDS + 60, now)
    fresh = op_dir(tmp_path, "cpu_adam", 30, now)  # a build that started 30 s ago
    busy = op_dir(tmp_path, "other_op", STALE_BUILD_LOCK_SECONDS + 60, now)
    (busy / "x.o").write_text("")  # an old lock, but the build is still writing
    os.utime(busy / "x.o", (now - 5, now - 5))
    done = op_dir(tmp_path, "finished", STALE_BUILD_LOCK_SECONDS + 60, now, with_lock=False)

    removed = clear_stale_build_locks(str(tmp_path), now=now)

    assert removed == [stale / "lock"]
    assert not (stale / "lock").exists() and (stale / "build.ninja").exists()
    assert (fresh / "lock").exists() and (busy / "lock").exists() and (done / "build.ninja").exists()
    assert "deepspeed_shm_comm/lock" in capsys.readouterr().err
    assert clear_stale_build_locks(str(tmp_path), now=now) == []  # nothing left to do


def test_a_line_before_deepspeed_compiles_unbuilt_cpu_ops(tmp_path, capsys, monkeypatch):
    from posttrain.distributed.build_locks import announce_cpu_op_builds

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")
    assert announce_cpu_op_builds(False, str(tmp_path)) == []
    assert capsys.readouterr().err == ""
    assert announce_cpu_op_builds(True, str(tmp_path)) == ["cpu_adam"]
    assert "DeepSpeed compiles its CPU ops on first use (cpu_adam not built yet" in capsys.readouterr().err
    (tmp_path / "py311_cpu" / "cpu_adam").mkdir(parents=True)
    (tmp_path / "py311_cpu" / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    assert announce_cpu_op_builds(True, str(tmp_path)) == []
    assert capsys.readouterr().err == ""
