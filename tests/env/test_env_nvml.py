"""The NVML probe against a fake ``pynvml``: healthy devices, and every way NVML says no.

The fake mirrors nvidia-ml-py's surface (function names, return shapes, an
``NVMLError`` carrying ``.value``), so the probe is exercised the way it runs
on a real machine, without one.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from convcheck.env import audit, collect
from convcheck.env.nvml import probe

# NVML return codes (nvml.h)
NOT_SUPPORTED, NO_PERMISSION, DRIVER_NOT_LOADED = 3, 4, 9
LIBRARY_NOT_FOUND, FUNCTION_NOT_FOUND, RM_MISMATCH = 12, 13, 18
A100_UUID = "GPU-9e2f6a1b-3c4d-5e6f-7a8b-9c0d1e2f3a4b"


class FakeNVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self):
        return {3: "Not Supported", 4: "Insufficient Permissions", 13: "Function Not Found"}.get(
            self.value, f"Unknown Error {self.value}")


A100 = dict(name=b"NVIDIA A100-SXM4-80GB", uuid=A100_UUID, cc=(8, 0), total=85899345920, ecc=[1, 1],
            ecc_counts={(0, 0): 0, (1, 0): 0, (0, 1): 3, (1, 1): 0}, retired={0: [], 1: []}, retired_pending=0,
            remapped=(0, 0, 0, 0), reasons=0x1, temp=34, slowdown=87, power=61234, limit=400000,
            gen=(4, 4), width=(16, 16), mig=[0, 0], persistence=1, bus=b"00000000:07:00.0")
RTX = dict(A100, name="NVIDIA GeForce RTX 3090", uuid="GPU-5b8e8f3a-1c6d-4b7e-9f0a-2d3c4b5a6e7f", cc=(8, 6),
           ecc=None, remapped=None, mig=None)


def fake_nvml(gpus=(A100,), fail=None, missing=(), init_error=None, driver=b"535.183.01", cuda=12020):
    """A stand-in ``pynvml``: ``fail`` maps a function name to the NVML error it raises,
    ``missing`` lists functions this 'binding' does not have, a ``None`` device value
    means NotSupported."""
    fail = dict(fail or {})
    calls = []

    def fn(name, result):
        def call(*args):
            calls.append(name)
            if name in fail:
                code = fail[name]
                raise code if isinstance(code, Exception) else FakeNVMLError(code)
            value = result(*args)
            if value is None and name.startswith("nvmlDevice"):
                raise FakeNVMLError(NOT_SUPPORTED)
            return value
        return call

    def dev(key):
        return lambda h, *rest: gpus[h][key]

    table = {
        "nvmlInit": lambda: (_ for _ in ()).throw(FakeNVMLError(init_error)) if init_error else None,
        "nvmlShutdown": lambda: None,
        "nvmlSystemGetDriverVersion": lambda: driver,
        "nvmlSystemGetCudaDriverVersion": lambda: cuda,
        "nvmlDeviceGetCount": lambda: len(gpus),
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetName": dev("name"),
        "nvmlDeviceGetUUID": dev("uuid"),
        "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(busId=gpus[h]["bus"]),
        "nvmlDeviceGetCudaComputeCapability": dev("cc"),
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=gpus[h]["total"], used=0, free=gpus[h]["total"]),
        "nvmlDeviceGetEccMode": dev("ecc"),
        "nvmlDeviceGetTotalEccErrors": lambda h, etype, counter: (
            gpus[h]["ecc_counts"][(etype, counter)] if gpus[h]["ecc"] else None),
        "nvmlDeviceGetRetiredPages": lambda h, cause: gpus[h]["retired"][cause] if gpus[h]["ecc"] else None,
        "nvmlDeviceGetRetiredPagesPendingStatus": lambda h: gpus[h]["retired_pending"] if gpus[h]["ecc"] else None,
        "nvmlDeviceGetRemappedRows": dev("remapped"),
        "nvmlDeviceGetCurrentClocksEventReasons": dev("reasons"),
        "nvmlDeviceGetCurrentClocksThrottleReasons": dev("reasons"),
        "nvmlDeviceGetTemperature": lambda h, sensor: gpus[h]["temp"],
        "nvmlDeviceGetTemperatureThreshold": lambda h, kind: gpus[h]["slowdown"],
        "nvmlDeviceGetPowerUsage": dev("power"),
        "nvmlDeviceGetEnforcedPowerLimit": dev("limit"),
        "nvmlDeviceGetCurrPcieLinkGeneration": lambda h: gpus[h]["gen"][0],
        "nvmlDeviceGetMaxPcieLinkGeneration": lambda h: gpus[h]["gen"][1],
        "nvmlDeviceGetCurrPcieLinkWidth": lambda h: gpus[h]["width"][0],
        "nvmlDeviceGetMaxPcieLinkWidth": lambda h: gpus[h]["width"][1],
        "nvmlDeviceGetMigMode": dev("mig"),
        "nvmlDeviceGetPersistenceMode": dev("persistence"),
    }
    module = SimpleNamespace(
        NVMLError=FakeNVMLError,
        NVML_ERROR_NOT_SUPPORTED=NOT_SUPPORTED, NVML_ERROR_NO_PERMISSION=NO_PERMISSION,
        NVML_ERROR_DRIVER_NOT_LOADED=DRIVER_NOT_LOADED, NVML_ERROR_LIBRARY_NOT_FOUND=LIBRARY_NOT_FOUND,
        NVML_ERROR_FUNCTION_NOT_FOUND=FUNCTION_NOT_FOUND, NVML_ERROR_LIB_RM_VERSION_MISMATCH=RM_MISMATCH,
        NVML_MEMORY_ERROR_TYPE_CORRECTED=0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0, NVML_AGGREGATE_ECC=1, NVML_TEMPERATURE_GPU=0,
        NVML_TEMPERATURE_THRESHOLD_SLOWDOWN=1,
        NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS=0,
        NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR=1,
        calls=calls,
    )
    for name, result in table.items():
        if name not in missing:
            setattr(module, name, fn(name, result))
    return module


def test_healthy_a100_is_read_completely():
    nvml = fake_nvml()
    driver, gpus = probe(nvml)
    assert driver.version == "535.183.01" and driver.cuda_version == "12.2" and driver.nvml_error is None
    (g,) = gpus
    assert g.name == "NVIDIA A100-SXM4-80GB" and g.capability == (8, 0) and g.capability_source == "nvml"
    assert g.memory_total_mib == 81920 and g.pci_bus_id == "00000000:07:00.0"
    assert g.ecc_enabled is True and g.ecc_volatile_uncorrected == 0 and g.ecc_aggregate_corrected == 3
    assert g.retired_pages_sbe == 0 and g.retired_pages_pending is False
    assert (g.remapped_rows_correctable, g.remap_pending, g.remap_failed) == (0, False, False)
    assert g.clock_event_reasons == 0x1 and g.temperature_c == 34 and g.temperature_slowdown_c == 87
    assert g.power_w == 61.2 and g.power_limit_w == 400.0
    assert (g.pcie_gen, g.pcie_gen_max, g.pcie_width, g.pcie_width_max) == (4, 4, 16, 16)
    assert g.mig_enabled is False and g.persistence_enabled is True and g.unreadable == ()
    assert "nvmlShutdown" in nvml.calls


def test_uuid_never_leaves_the_probe():
    _, (g,) = probe(fake_nvml())
    assert g.uuid_hash.startswith("uuid:") and len(g.uuid_hash) == len("uuid:") + 8
    assert "9e2f6a1b" not in json.dumps([g.uuid_hash, g.name])


def test_not_supported_is_silent():
    """A consumer card has no ECC and no row remapping: values are None, nothing is 'unreadable'."""
    _, (g,) = probe(fake_nvml(gpus=(RTX,)))
    assert g.ecc_enabled is None and g.ecc_volatile_uncorrected is None and g.remapped_rows_correctable is None
    assert g.mig_enabled is None
    assert g.unreadable == ()
    assert g.capability == (8, 6)


def test_no_permission_is_recorded_and_reported():
    _, (g,) = probe(fake_nvml(fail={"nvmlDeviceGetTotalEccErrors": NO_PERMISSION}))
    assert g.ecc_enabled is True and g.ecc_volatile_uncorrected is None
    assert any("no permission" in u for u in g.unreadable)


def test_function_not_found_is_recorded():
    _, (g,) = probe(fake_nvml(fail={"nvmlDeviceGetRemappedRows": FUNCTION_NOT_FOUND}))
    assert g.remapped_rows_correctable is None and g.remap_failed is None
    assert any("remapped rows" in u and "function not found" in u for u in g.unreadable)


def test_old_binding_falls_back_to_throttle_reasons():
    _, (g,) = probe(fake_nvml(missing={"nvmlDeviceGetCurrentClocksEventReasons"}))
    assert g.clock_event_reasons == 0x1 and g.unreadable == ()


def test_function_missing_from_binding_is_recorded():
    _, (g,) = probe(fake_nvml(missing={"nvmlDeviceGetRemappedRows"}))
    assert g.remap_pending is None and any("not in this nvidia-ml-py" in u for u in g.unreadable)


def test_unexpected_exception_becomes_none():
    _, (g,) = probe(fake_nvml(fail={"nvmlDeviceGetTemperature": RuntimeError("boom")}))
    assert g.temperature_c is None and any("boom" in u for u in g.unreadable)


def test_handle_refused_gives_an_empty_gpu_not_a_crash():
    _, (g,) = probe(fake_nvml(fail={"nvmlDeviceGetHandleByIndex": NO_PERMISSION}))
    assert g.index == 0 and g.name is None and g.unreadable


@pytest.mark.parametrize("code,text", [
    (LIBRARY_NOT_FOUND, "library not found"),
    (DRIVER_NOT_LOADED, "driver not loaded"),
    (NO_PERMISSION, "no permission"),
])
def test_init_failure_means_no_gpus(code, text):
    driver, gpus = probe(fake_nvml(init_error=code))
    assert gpus == () and driver.version is None and text in driver.nvml_error.lower()
    assert driver.rm_mismatch is False


def test_rm_version_mismatch_is_flagged():
    driver, gpus = probe(fake_nvml(init_error=RM_MISMATCH))
    assert driver.rm_mismatch is True and "reboot" in driver.nvml_error


def test_missing_pynvml_module(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pynvml(name, *args, **kwargs):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    driver, gpus = probe(None)
    assert gpus == () and "not installed" in driver.nvml_error


def test_hardware_rules_fire_from_probed_counters():
    bad = dict(A100, ecc_counts={(0, 0): 0, (1, 0): 2, (0, 1): 7, (1, 1): 2}, remapped=(1, 2, 1, 0),
               reasons=0x40, width=(8, 16))
    import torch

    fp = collect(nvml=fake_nvml(gpus=(bad,)), torch_module=torch, environ={})
    ids = {f.id: f.severity for f in audit(fp)}
    assert ids["ECC002"] == "critical" and ids["MEM001"] == "warn"
    assert ids["THR001"] == "warn" and ids["PCI001"] == "warn"
    # this torch is a CPU-only build, and the fake machine has a GPU
    assert ids["CUDA001"] == "critical"


def test_probe_denied_counters_feed_probe001():
    import torch

    fp = collect(nvml=fake_nvml(fail={"nvmlDeviceGetEccMode": NO_PERMISSION}), torch_module=torch, environ={})
    probe_findings = [f for f in audit(fp) if f.id == "PROBE001"]
    assert probe_findings and "ECC mode: no permission" in probe_findings[0].message
