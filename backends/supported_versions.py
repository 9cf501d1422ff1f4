"""The one table of supported version pairs: which torch each backend extra installs
with which device library, on which platforms.

Read by three parties, which must agree: `pyproject.toml`'s extras (a test compares
them with `Stack.requirements()`), the CI step that resolves every extra in a fresh
venv (`.ci/resolve_extras.sh` -> `.ci/check_resolution.py`, which loads this file by
path, so it imports nothing but the standard library), and `polyrunner backends`
(`polyrunner.backends.diagnose`), which names a mismatch and the command that fixes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["Stack", "STACKS", "TORCH_TESTED", "TORCH_REQUIREMENT", "LINUX", "LINUX_X86_64",
           "LINUX_NPU_MACHINES", "CUDA_TORCH_INDEX", "CPU_TORCH_INDEX", "normalize", "release",
           "stack_for_library", "torch_for"]

TORCH_TESTED = "2.13.0"                 # the CPU torch CI runs the whole suite with
TORCH_REQUIREMENT = "torch>=2.9,<2.14"  # the core's range: 2.9 (the xla stack) .. the tested minor
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_TORCH_INDEX = "https://download.pytorch.org/whl/cu130"   # torch 2.13's default CUDA build

LINUX = "sys_platform == 'linux'"
LINUX_X86_64 = "sys_platform == 'linux' and platform_machine == 'x86_64'"
LINUX_NPU_MACHINES = "sys_platform == 'linux' and (platform_machine == 'x86_64' or platform_machine == 'aarch64')"


@dataclass(frozen=True)
class Stack:
    """What `pip install 'polyrunner[<extra>]'` installs, where (`marker`, PEP 508).

    torch: the exact torch release; library/version: the device library pinned with it
    ("" for none), installed with `library_extras`; `brings`: packages those extras pull
    in, at the versions the resolution must give; cpu_only: the resolution must hold no
    CUDA libraries (nvidia-*); torch_marker: where torch is pinned ("" = everywhere).
    """

    extra: str
    torch: str
    marker: str = ""
    library: str = ""
    version: str = ""
    library_extras: tuple[str, ...] = ()
    brings: dict[str, str] = field(default_factory=dict)
    cpu_only: bool = False
    library_marker: str = ""   # where the library is pinned when narrower than `marker`
    note: str = ""

    def requirements(self) -> list[str]:
        """The requirement strings pyproject.toml lists for this extra, in order."""
        def req(name: str, version: str, marker: str, extras: tuple[str, ...] = ()) -> str:
            text = f"{name}[{','.join(extras)}]=={version}" if extras else f"{name}=={version}"
            return f"{text}; {marker}" if marker else text
        out = [req("torch", self.torch, self.marker)]
        if self.library:
            out.append(req(self.library, self.version, self.library_marker or self.marker, self.library_extras))
        return out

    def expected(self) -> dict[str, str]:
        """Normalized distribution name -> release the resolution must give (on the stack's platforms)."""
        out = {"torch": self.torch}
        if self.library:
            out[normalize(self.library)] = self.version
        out.update({normalize(k): v for k, v in self.brings.items()})
        return out

    @property
    def install(self) -> str:
        """The command that installs this stack."""
        return f"pip install 'polyrunner[{self.extra}]'"


STACKS: dict[str, Stack] = {s.extra: s for s in (
    Stack("cpu", TORCH_TESTED, cpu_only=True,
          note=f"on Linux first: pip install torch=={TORCH_TESTED} --index-url {CPU_TORCH_INDEX}"),
    Stack("cuda", TORCH_TESTED, library="triton", version="3.7.1", library_marker=LINUX,
          note=f"on Linux x86_64 PyPI's torch is the CUDA build; elsewhere --index-url {CUDA_TORCH_INDEX}"),
    # torch_xla ships Linux x86_64 wheels only and needs the torch release it was built with
    Stack("xla", "2.9.0", LINUX_X86_64, "torch_xla", "2.9.0",
          note="the CPU PJRT device (PJRT_DEVICE=CPU) and development; add [tpu] on a TPU VM"),
    Stack("tpu", "2.9.0", LINUX_X86_64, "torch_xla", "2.9.0", ("tpu", "pallas"),
          brings={"libtpu": "0.0.21", "jax": "0.7.1", "jaxlib": "0.7.1"}),
    # torch_npu ships Linux x86_64 and aarch64 wheels; from 2.12 on it asks for the plain torch release
    Stack("npu", TORCH_TESTED, LINUX_NPU_MACHINES, "torch_npu", "2.13.0",
          note="needs the CANN toolkit (source /usr/local/Ascend/ascend-toolkit/set_env.sh)"),
)}


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of -_. as one '-'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def release(version: str) -> tuple[int, ...]:
    """(2, 13, 0) for '2.13.0+cpu', '2.13.0.post3' or '2.13.0rc1'; () when unparsable."""
    m = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


def stack_for_library(library: str) -> Stack | None:
    """The extra whose device library is `library` (the plainest: xla before tpu)."""
    return next((s for s in STACKS.values() if s.library and normalize(s.library) == normalize(library)), None)


def torch_for(library: str, version: str) -> str | None:
    """The torch release `library` at `version` needs ("2.9" for torch_xla 2.9.x = any 2.9
    patch release; "2.13.0" for a torch_npu listed in the table), None if unknown.

    The table's pairs are exact; outside them the libraries' own rules apply: torch_xla
    X.Y needs torch X.Y, torch_npu X.Y.Z needs torch X.Y.Z, triton has no torch rule.
    """
    lib = normalize(library)
    for s in STACKS.values():
        if s.library and normalize(s.library) == lib and release(s.version) == release(version):
            return s.torch
    parts = release(version)
    if lib == "torch-xla" and len(parts) >= 2:
        return ".".join(map(str, parts[:2]))
    if lib == "torch-npu" and len(parts) >= 3:
        return ".".join(map(str, parts[:3]))
    return None
