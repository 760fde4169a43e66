"""The NVML probe: driver and per-GPU health through NVIDIA's ``pynvml`` binding.

``probe(nvml)`` takes the module to use, so tests feed a fake one; with
``None`` it imports ``pynvml`` (from the ``nvidia-ml-py`` package) lazily. It
never raises: a value NVML cannot give is ``None``. "Not supported" (a
consumer card without ECC) is silent; "no permission", "function not found"
(driver older than the binding) and other errors are listed per GPU in
``GPU.unreadable`` so the report can say which counters are unknown.
"""

from __future__ import annotations

from convcheck.env.fingerprint import GPU, Driver, anonymise_uuid

# NVML return codes (nvml.h); read from the module when it has them.
_NOT_SUPPORTED = 3
_NO_PERMISSION = 4
_DRIVER_NOT_LOADED = 9
_LIBRARY_NOT_FOUND = 12
_FUNCTION_NOT_FOUND = 13
_RM_VERSION_MISMATCH = 18


def probe(nvml=None) -> tuple[Driver, tuple[GPU, ...]]:
    if nvml is None:
        try:
            import pynvml as nvml  # nvidia-ml-py
        except Exception:  # noqa: BLE001 - a missing or broken binding is "no NVML"
            return Driver(nvml_error="nvidia-ml-py (pynvml) is not installed"), ()
    try:
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - probes never raise
        return _init_failure(nvml, exc), ()
    try:
        calls = _Calls(nvml)
        version = _text(calls("driver version", "nvmlSystemGetDriverVersion"))
        cuda = calls("CUDA driver version", "nvmlSystemGetCudaDriverVersion")
        count = calls("device count", "nvmlDeviceGetCount") or 0
        gpus = tuple(_probe_gpu(nvml, i) for i in range(int(count)))
        driver = Driver(version=version, cuda_version=_cuda_text(cuda))
        return driver, gpus
    except Exception as exc:  # noqa: BLE001
        return Driver(nvml_error=f"NVML failed: {_describe(nvml, exc)}"), ()
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


class _Calls:
    """Calls NVML functions by name; failures become None plus a note in ``refused``."""

    def __init__(self, nvml):
        self.nvml = nvml
        self.refused: list[str] = []

    def __call__(self, label: str, names: str | tuple[str, ...], *args):
        """Call the first of ``names`` this binding has (newer name first) with ``args``."""
        names = (names,) if isinstance(names, str) else names
        fn = next((getattr(self.nvml, n) for n in names if hasattr(self.nvml, n)), None)
        if fn is None:
            self.refused.append(f"{label}: not in this nvidia-ml-py")
            return None
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001
            if _code(exc) == _const(self.nvml, "NVML_ERROR_NOT_SUPPORTED", _NOT_SUPPORTED):
                return None
            self.refused.append(f"{label}: {_describe(self.nvml, exc)}")
            return None


def _probe_gpu(nvml, index: int) -> GPU:
    calls = _Calls(nvml)
    h = calls("handle", "nvmlDeviceGetHandleByIndex", index)
    if h is None:
        return GPU(index=index, unreadable=tuple(calls.refused))

    cc = calls("compute capability", "nvmlDeviceGetCudaComputeCapability", h)
    mem = calls("memory", "nvmlDeviceGetMemoryInfo", h)
    pci = calls("PCI info", "nvmlDeviceGetPciInfo", h)
    ecc = calls("ECC mode", "nvmlDeviceGetEccMode", h)

    values = _ecc_values(nvml, calls, h) if ecc is not None else {}
    values.update(_remap_values(calls, h))

    reasons = calls("clock event reasons",
                    ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"), h)
    power = calls("power", "nvmlDeviceGetPowerUsage", h)
    limit = calls("power limit", "nvmlDeviceGetEnforcedPowerLimit", h)
    mig = calls("MIG mode", "nvmlDeviceGetMigMode", h)
    uuid = _text(calls("UUID", "nvmlDeviceGetUUID", h))

    return GPU(
        index=index,
        name=_text(calls("name", "nvmlDeviceGetName", h)),
        uuid_hash=anonymise_uuid(uuid),
        pci_bus_id=_text(getattr(pci, "busId", None)) if pci is not None else None,
        capability=(int(cc[0]), int(cc[1])) if cc is not None else None,
        capability_source="nvml" if cc is not None else None,
        memory_total_mib=int(mem.total) // 2**20 if getattr(mem, "total", None) is not None else None,
        ecc_enabled=_bool(ecc[0]) if ecc is not None else None,
        ecc_pending=_bool(ecc[1]) if ecc is not None else None,
        clock_event_reasons=_int(reasons),
        temperature_c=_int(calls("temperature", "nvmlDeviceGetTemperature", h,
                                 _const(nvml, "NVML_TEMPERATURE_GPU", 0))),
        temperature_slowdown_c=_int(calls("slowdown temperature", "nvmlDeviceGetTemperatureThreshold", h,
                                          _const(nvml, "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN", 1))),
        power_w=None if power is None else round(power / 1000.0, 1),
        power_limit_w=None if limit is None else round(limit / 1000.0, 1),
        pcie_gen=_int(calls("PCIe generation", "nvmlDeviceGetCurrPcieLinkGeneration", h)),
        pcie_gen_max=_int(calls("PCIe max generation", "nvmlDeviceGetMaxPcieLinkGeneration", h)),
        pcie_width=_int(calls("PCIe width", "nvmlDeviceGetCurrPcieLinkWidth", h)),
        pcie_width_max=_int(calls("PCIe max width", "nvmlDeviceGetMaxPcieLinkWidth", h)),
        mig_enabled=_bool(mig[0]) if mig is not None else None,
        persistence_enabled=_bool(calls("persistence mode", "nvmlDeviceGetPersistenceMode", h)),
        unreadable=tuple(calls.refused),
        **values,
    )


def _ecc_values(nvml, calls: _Calls, h) -> dict:
    """ECC error counters and retired pages, as ``GPU`` fields (asked only when ECC mode is readable)."""
    values: dict = {}
    corrected = _const(nvml, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
    uncorrected = _const(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
    volatile = _const(nvml, "NVML_VOLATILE_ECC", 0)
    aggregate = _const(nvml, "NVML_AGGREGATE_ECC", 1)
    for key, etype, counter in (
        ("ecc_volatile_corrected", corrected, volatile),
        ("ecc_volatile_uncorrected", uncorrected, volatile),
        ("ecc_aggregate_corrected", corrected, aggregate),
        ("ecc_aggregate_uncorrected", uncorrected, aggregate),
    ):
        values[key] = _int(calls(key.replace("_", " "), "nvmlDeviceGetTotalEccErrors", h, etype, counter))
    sbe = calls("retired pages (SBE)", "nvmlDeviceGetRetiredPages", h,
                _const(nvml, "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", 0))
    dbe = calls("retired pages (DBE)", "nvmlDeviceGetRetiredPages", h,
                _const(nvml, "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1))
    values["retired_pages_sbe"] = None if sbe is None else len(sbe)
    values["retired_pages_dbe"] = None if dbe is None else len(dbe)
    values["retired_pages_pending"] = _bool(
        calls("retired pages pending", "nvmlDeviceGetRetiredPagesPendingStatus", h))
    return values


def _remap_values(calls: _Calls, h) -> dict:
    """Row remapping state (Ampere and later), as ``GPU`` fields; empty when NVML has none."""
    rows = calls("remapped rows", "nvmlDeviceGetRemappedRows", h)
    if rows is None:
        return {}
    corr, unc, pending, failed = rows
    return dict(remapped_rows_correctable=int(corr), remapped_rows_uncorrectable=int(unc),
                remap_pending=bool(pending), remap_failed=bool(failed))


def _init_failure(nvml, exc) -> Driver:
    code = _code(exc)
    if code == _const(nvml, "NVML_ERROR_LIB_RM_VERSION_MISMATCH", _RM_VERSION_MISMATCH):
        return Driver(
            nvml_error="NVML/driver version mismatch (error 18): the driver was upgraded without a reboot",
            rm_mismatch=True,
        )
    if code == _const(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", _LIBRARY_NOT_FOUND):
        return Driver(nvml_error="NVML library not found: no NVIDIA driver installed")
    if code == _const(nvml, "NVML_ERROR_DRIVER_NOT_LOADED", _DRIVER_NOT_LOADED):
        return Driver(nvml_error="NVIDIA driver not loaded")
    return Driver(nvml_error=f"NVML could not start: {_describe(nvml, exc)}")


def _describe(nvml, exc) -> str:
    code = _code(exc)
    if code == _const(nvml, "NVML_ERROR_NO_PERMISSION", _NO_PERMISSION):
        return "no permission"
    if code == _const(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", _FUNCTION_NOT_FOUND):
        return "function not found (driver older than nvidia-ml-py)"
    text = str(exc).strip()
    return text or type(exc).__name__


def _code(exc):
    return getattr(exc, "value", None)


def _const(nvml, name: str, default: int) -> int:
    value = getattr(nvml, name, default)
    return value if isinstance(value, int) else default


def _text(v) -> str | None:
    if v is None:
        return None
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    return str(v).strip() or None


def _int(v) -> int | None:
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None


def _bool(v) -> bool | None:
    return None if v is None else bool(v)


def _cuda_text(v) -> str | None:
    v = _int(v)
    if not v:
        return None
    return f"{v // 1000}.{(v % 1000) // 10}"
