"""The memory probe of the soak: `python -m picker_lab.bench.memory_probe SERVE-ARGS` runs `picker serve` with a
SIGUSR1 handler that reports what glibc malloc, pymalloc, the collector and the memory map hold (bench/soak.py
asks at every cycle's end), so a run tells retention from growth. The picker's own code is untouched."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

MIB = 2**20


def rss_mb(pid: int) -> float:
    return status_kb(pid, "VmRSS") / 1024


def status_kb(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return float(line.split()[1])
    return 0.0

# ---------------------------------------------------------------------------------------------------------------
# The probe: runs inside the picker process, never in the driver.


def _probe_report(libc: Any, directory: Path, label: str, trim: bool) -> dict[str, Any]:
    """What the allocators and the collector hold right now; gc.collect() and malloc_trim(0) first when `trim`."""
    import gc
    import tracemalloc

    report: dict[str, Any] = {"label": label, "time": time.time(), "rss_before_mb": rss_mb(os.getpid())}
    if trim:  # what the process could give back: its cyclic garbage first, then the allocator's free memory
        report["gc_collected"] = gc.collect()
        report["rss_after_collect_mb"] = rss_mb(os.getpid())
        report["malloc_trim_returned"] = int(libc.malloc_trim(0))
        report["rss_after_trim_mb"] = rss_mb(os.getpid())
    report["mallinfo2"] = _mallinfo2(libc)
    xml_path = directory / f"malloc-info-{label}.xml"
    stream = libc.fopen(str(xml_path).encode(), b"w")
    if stream:
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        report["malloc_info"] = _parse_malloc_info(xml_path.read_text())
    report["pymalloc"] = _pymalloc_stats(directory / f"pymalloc-{label}.txt")
    report["smaps"] = _smaps_summary()
    objects = gc.get_objects()
    report["gc_objects"] = len(objects)
    report["gc_top_types"] = Counter(type(o).__name__ for o in objects).most_common(30)
    del objects
    report["allocated_blocks"] = sys.getallocatedblocks()
    with contextlib.suppress(RuntimeError):
        report["asyncio_tasks"] = len(asyncio.all_tasks(asyncio.get_running_loop()))
    if tracemalloc.is_tracing():
        snapshot = tracemalloc.take_snapshot()
        snapshot.dump(str(directory / f"tracemalloc-{label}.pickle"))
        report["tracemalloc_traced_mb"] = round(tracemalloc.get_traced_memory()[0] / MIB, 2)
    return report


def _mallinfo2(libc: Any) -> dict[str, int]:
    import ctypes

    names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
             "keepcost")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in names]

    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return {name: int(getattr(info, name)) for name in names}


def _parse_malloc_info(xml: str) -> dict[str, Any]:
    """Per arena: bytes taken from the system and bytes free inside it (what glibc keeps instead of returning)."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(xml)
    heaps = []
    for heap in root.findall("heap"):
        system = {s.get("type"): int(s.get("size", "0")) for s in heap.findall("system")}
        free = sum(int(t.get("size", "0")) for t in heap.findall("total") if t.get("type") in ("fast", "rest"))
        heaps.append({"nr": int(heap.get("nr", "0")), "system_current": system.get("current", 0),
                      "system_max": system.get("max", 0), "free": free})
    totals = {f"{t.get('type')}": int(t.get("size", "0")) for t in root.findall("total")}
    system = {s.get("type"): int(s.get("size", "0")) for s in root.findall("system")}
    return {"arenas": len(heaps), "heaps": heaps, "totals": totals, "system_current": system.get("current", 0),
            "system_max": system.get("max", 0)}


def _pymalloc_stats(path: Path) -> dict[str, int]:
    """sys._debugmallocstats() writes to C stderr: point fd 2 at a file for the call, then read the totals."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "wb") as handle:
            os.dup2(handle.fileno(), 2)
            try:
                sys._debugmallocstats()
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)
    wanted = {"arenas allocated total": "arenas_allocated_total", "arenas reclaimed": "arenas_reclaimed",
              "arenas highwater mark": "arenas_highwater", "arenas allocated current": "arenas_current",
              "bytes in allocated blocks": "bytes_allocated_blocks", "bytes in available blocks": "bytes_available",
              "bytes lost to pool headers": "bytes_pool_headers", "bytes lost to quantization": "bytes_quantization",
              "bytes lost to arena alignment": "bytes_alignment", "Total": "total"}
    out: dict[str, int] = {}
    for line in path.read_text(errors="replace").splitlines():
        key, _, value = line.partition("=")
        key = key.strip().removeprefix("# ")
        if key in wanted and wanted[key] not in out and value.strip().replace(",", "").isdigit():
            out[wanted[key]] = int(value.strip().replace(",", ""))
        match = re.match(r"(\d+) unused pools \* \d+ bytes", line.strip())
        if match:
            out["unused_pools"] = int(match.group(1))
    return out


def _smaps_summary() -> dict[str, Any]:
    """Resident memory by kind of mapping: files (code, libraries), the brk heap (glibc's main arena), anonymous
    mappings (other glibc arenas, pymalloc arenas, thread stacks, mmapped large blocks)."""
    kinds: Counter[str] = Counter()
    anon: list[tuple[int, int]] = []
    size = name = ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(None, 5)
        if first and "-" in first[0] and len(first) >= 5 and ":" not in first[0]:
            start, end = (int(x, 16) for x in first[0].split("-"))
            size, name = str(end - start), first[5] if len(first) > 5 else ""
        elif line.startswith("Rss:"):
            rss = int(line.split()[1]) * 1024
            kind = "anonymous" if not name else "files" if name.startswith("/") else name
            kinds[kind] += rss
            if not name:
                anon.append((rss, int(size)))
    anon.sort(reverse=True)
    return {"rss_by_kind_mb": {k: round(v / MIB, 1) for k, v in kinds.most_common()},
            "anonymous_mappings": len(anon),
            "largest_anonymous_mb": [[round(r / MIB, 1), round(z / MIB, 1)] for r, z in anon[:10]]}


def probe_serve(argv: list[str]) -> int:
    """`picker serve ARGV` with a SIGUSR1 handler that writes a probe report (SOAK_PROBE_DIR/command.json says
    which label, and whether to malloc_trim first). The picker's own code is untouched."""
    import ctypes
    import ctypes.util

    directory = Path(os.environ["SOAK_PROBE_DIR"])
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]

    def on_signal(signum: int, frame: object) -> None:
        command = json.loads((directory / "command.json").read_text())
        label = str(command["label"])
        try:
            report = _probe_report(libc, directory, label, bool(command.get("trim")))
        except Exception as exc:  # a probe must never take the picker down
            report = {"label": label, "error": repr(exc)}
        partial = directory / f"probe-{label}.json.part"
        partial.write_text(json.dumps(report, indent=1))
        partial.rename(directory / f"probe-{label}.json")

    signal.signal(signal.SIGUSR1, on_signal)
    from picker.cli import main as picker_main

    return picker_main(["serve", *argv])


def allocator_row(label: str, report: dict[str, Any]) -> dict[str, Any]:
    """One line per probe: where the RSS sits (MB) and what is in use vs merely kept."""
    info, py = report.get("mallinfo2", {}), report.get("pymalloc", {})
    smaps = report.get("smaps", {}).get("rss_by_kind_mb", {})
    return {"probe": label, "rss_mb": round(report.get("rss_after_trim_mb") or report.get("rss_before_mb", 0), 1),
            "glibc_in_use_mb": round(info.get("uordblks", 0) / MIB, 1),
            "glibc_free_kept_mb": round(info.get("fordblks", 0) / MIB, 1),
            "glibc_arenas": report.get("malloc_info", {}).get("arenas"),
            "pymalloc_arenas_mb": round(py.get("total", 0) / MIB, 1),
            "pymalloc_blocks_mb": round(py.get("bytes_allocated_blocks", 0) / MIB, 1),
            "python_blocks": report.get("allocated_blocks"), "gc_objects": report.get("gc_objects"),
            "rss_heap_mb": smaps.get("[heap]"), "rss_anonymous_mb": smaps.get("anonymous"),
            "rss_files_mb": smaps.get("files")}


def tracemalloc_diff(directory: Path, old: str, new: str) -> list[str]:
    import tracemalloc

    try:
        before = tracemalloc.Snapshot.load(str(directory / f"tracemalloc-{old}.pickle"))
        after = tracemalloc.Snapshot.load(str(directory / f"tracemalloc-{new}.pickle"))
    except OSError:
        return []
    return [str(stat) for stat in after.compare_to(before, "lineno")[:25]]


if __name__ == "__main__":
    sys.exit(probe_serve(sys.argv[1:]))
