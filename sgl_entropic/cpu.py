"""CPU compatibility: the `sgl_kernel` stand-in and the environment SGLang needs on CPU.

The stand-in is served by a finder appended to the END of `sys.meta_path`, so it is used only
when no normal finder locates a real `sgl_kernel` (a GPU machine's wins). The finder is
installed at interpreter start by a `.pth` file in site-packages, because SGLang spawns its
scheduler and detokenizer processes and imports `sgl_kernel` in them before plugins load. A wheel
install ships the .pth and `pip uninstall` removes it (setup.py); an editable install cannot ship it:

    python -m sgl_entropic.cpu install    # write the .pth (scripts/setup.sh's editable install does this)
    python -m sgl_entropic.cpu jit        # compile NGRAM's n-gram trie once (scripts/setup.sh does this)
    python -m sgl_entropic.cpu kernels    # compile the signal's CPU kernels for this machine, if not yet (setup.sh)
    python -m sgl_entropic.cpu check      # say which sgl_kernel this interpreter gets
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path

PTH_NAME = "sgl_entropic_cpu.pth"
# One line, executed by site.py at every interpreter start; silent if the package is gone.
PTH_LINE = (
    "import importlib.util as _u; "
    "_u.find_spec('sgl_entropic') and __import__('sgl_entropic._sgl_kernel_finder')"
    "._sgl_kernel_finder.install()\n"
)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), for what is measured once per machine; empty where unknown."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")


def pth_path() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def install_pth() -> Path:
    path = pth_path()
    if not path.is_file() or path.read_text() != PTH_LINE:
        path.write_text(PTH_LINE)
    return path


def sgl_kernel_origin() -> str:
    """'real' or 'stand-in', for the sgl_kernel this interpreter would import."""
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None:
        return "missing"
    return "stand-in" if spec.origin and spec.origin.endswith("_sgl_kernel_cpu/__init__.py") else "real"


THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def threads_bind(cpus: list[int], ranks: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `ranks` schedulers: the CPUs split into contiguous equal groups."""
    cpus = sorted(cpus)
    if ranks > len(cpus):
        raise ValueError(
            f"{ranks} ranks (dp_size * tp_size * pp_size) need at least {ranks} CPUs; this process may use {len(cpus)}"
        )
    per = len(cpus) // ranks
    groups = [cpus[r * per : (r + 1) * per] for r in range(ranks)]
    return "|".join(_cpu_list(g) for g in groups)


def _cpu_list(cpus: list[int]) -> str:
    if len(cpus) == 1:
        return str(cpus[0])
    return f"{cpus[0]}-{cpus[-1]}" if cpus[-1] - cpus[0] == len(cpus) - 1 else ",".join(map(str, cpus))


def numa_nodes() -> int:
    return max(1, len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))))


def apply_cpu_environment(device: str) -> None:
    """SGLang on CPU needs its CPU engine (else the rotary embedding imports vllm). SGLang's JIT builds (NGRAM's
    trie) run `ninja` from PATH: the venv's own (requirements/cpu.txt) when no other is on it."""
    if device == "cpu":
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    venv_bin = Path(sys.executable).parent
    if shutil.which("ninja") is None and (venv_bin / "ninja").exists():
        os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"


def bind_rank_threads(device: str, ranks: int) -> None:
    """With more ranks than NUMA nodes SGLang on CPU refuses to start unless told which cores each
    rank owns (SGLANG_CPU_OMP_THREADS_BIND): unless the user said, split this process's CPUs evenly."""
    if device == "cpu" and ranks > numa_nodes() and THREADS_BIND_ENV not in os.environ:
        os.environ[THREADS_BIND_ENV] = threads_bind(list(os.sched_getaffinity(0)), ranks)


def main(argv: list[str]) -> int:
    if argv == ["install"]:
        print(f"installed {install_pth()}")
        return 0
    if argv == ["jit"]:  # SGLang's JIT-built host code the plugin serves: NGRAM's n-gram trie
        apply_cpu_environment("cpu")
        from sglang.kernels.ops.speculative.ngram_corpus import get_ngram_corpus_cls

        print(f"compiled {get_ngram_corpus_cls().__name__}")
        return 0
    if argv == ["kernels"]:
        from sgl_entropic.kernels import entropy_cpu

        print(f"the signal's CPU kernels: {entropy_cpu.build()}")
        return 0
    if argv == ["check"]:
        print(f"sgl_kernel: {sgl_kernel_origin()} (finder .pth: {'present' if pth_path().is_file() else 'absent'})")
        return 0
    print("usage: python -m sgl_entropic.cpu {install|jit|kernels|check}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
