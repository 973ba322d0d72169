"""The machine the figures were measured on, in words: CPU, cores, caches, memory, OS, rustc."""

import os
import platform
import re
import subprocess

CACHE_DIR = "/sys/devices/system/cpu/cpu0/cache"


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def caches():
    """Cache levels of core 0, e.g. `L1d 48 KiB, L1i 64 KiB, L2 2 MiB per core; L3 480 MiB
    shared`, or None when the system does not say."""
    per_core, shared = [], []
    try:
        entries = sorted(os.listdir(CACHE_DIR))
    except OSError:
        return None
    for entry in entries:
        d = os.path.join(CACHE_DIR, entry)

        def read(name, d=d):
            with open(os.path.join(d, name)) as f:
                return f.read().strip()

        try:
            level, kind, size, cpus = (read("level"), read("type"), read("size"),
                                       read("shared_cpu_list"))
        except OSError:
            continue
        suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
        m = re.fullmatch(r"(\d+)K", size)
        kib = int(m.group(1)) if m else None
        human = size if kib is None else (f"{kib // 1024} MiB" if kib % 1024 == 0 and kib >= 1024
                                          else f"{kib} KiB")
        (per_core if cpus == "0" else shared).append(f"L{level}{suffix} {human}")
    if not per_core and not shared:
        return None
    parts = []
    if per_core:
        parts.append(", ".join(per_core) + " per core")
    if shared:
        parts.append(", ".join(shared) + " shared")
    return "; ".join(parts)


def memory():
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        return f"{kb / (1 << 20):.0f} GiB"
    except (OSError, ValueError, IndexError):
        return None


def operating_system():
    name = platform.system()
    try:
        with open("/etc/os-release") as f:
            fields = dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
        name = fields.get("PRETTY_NAME", name).strip('"')
    except OSError:
        pass
    try:
        with open("/etc/debian_version") as f:
            version = f.read().strip()
        # "Debian GNU/Linux 12 (bookworm)" -> "Debian GNU/Linux 12.11 (bookworm)"
        name = name.replace(f" {version.split('.')[0]} ", f" {version} ", 1)
    except OSError:
        pass
    return f"{name}, {platform.system()} {platform.release()}"


def rustc():
    """`rustc X.Y.Z`, without the commit and date `rustc --version` adds."""
    try:
        out = subprocess.run(["rustc", "--version"], capture_output=True, text=True,
                             check=False).stdout.strip()
    except OSError:
        return "rustc (unknown version)"
    return out.split(" (")[0] or "rustc (unknown version)"


def describe():
    """The `## Machine` block of docs/performance.md."""
    rows = [("CPU", f"{cpu_model()}, {os.cpu_count()} cores"),
            ("caches", caches()),
            ("memory", memory()),
            ("OS", operating_system()),
            ("compiler", f"{rustc()}, `bench` profile")]
    return "\n".join(f"- {k}: {v}" for k, v in rows if v)
