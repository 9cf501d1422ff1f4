"""`polyrunner bench` states the host it ran on (CPU model and the kernel-picking flags)."""

from __future__ import annotations

from polyrunner.tools.bench.cli import format_report
from polyrunner.tools.bench.host import format_host, host_info


def test_host_info_reads_model_and_kernel_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9R45\nflags\t\t: fpu avx2 avx512f avx512_bf16 sse4_2\n"
                    "\nprocessor\t: 1\nmodel name\t: AMD EPYC 9R45\nflags\t\t: fpu avx2\n")
    got = host_info(str(info))
    assert got["cpu"] == "AMD EPYC 9R45" and got["flags"] == ["avx512f", "avx512_bf16", "avx2"]
    assert "AMD EPYC 9R45" in format_host(got) and "avx512_bf16" in format_host(got)
    assert host_info(str(tmp_path / "missing"))["flags"] == []
    report = format_report({"host": got, "load_avg_start": (1, 1, 1), "load_avg_end": (2, 2, 2)})
    assert report.splitlines()[0].startswith("host: AMD EPYC 9R45")
