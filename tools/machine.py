"""Facts about the machine a benchmark ran on, printed beside its ratios (absolute times move between
machines; the ratios are what carries over)."""


def cpu_facts() -> str:
    """The CPU model, its logical CPUs and whether it has native bf16 (AMX or AVX512-BF16), from
    /proc/cpuinfo (Linux)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return "CPU: unknown (no /proc/cpuinfo)"
    model = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?"
    )
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    bf16 = sorted(flags & {"amx_bf16", "avx512_bf16"})
    cpus = text.count("\nprocessor") + text.startswith("processor")
    return f"CPU: {model}, {cpus} logical CPUs; native bf16: {', '.join(bf16) if bf16 else 'no'}"
