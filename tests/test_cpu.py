"""The sgl_kernel stand-in: served only when no real sgl_kernel exists, correct where it is used."""

import os
import subprocess
import sys

import importlib.machinery

import pytest
import torch

from sgl_entropic._sgl_kernel_cpu import assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu

# Where a real sgl_kernel is installed (a GPU machine), the stand-in is never served: nothing to test.
pytestmark = pytest.mark.skipif(
    importlib.machinery.PathFinder.find_spec("sgl_kernel") is not None,
    reason="a real sgl_kernel is installed; the stand-in is not used",
)


def _run(code: str, extra_path: str | None = None) -> str:
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = extra_path
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_stand_in_is_served_in_a_fresh_interpreter():
    # A fresh interpreter, like SGLang's spawned scheduler: the .pth installs the finder.
    assert _run("import sgl_kernel; print(sgl_kernel.__file__)").endswith("_sgl_kernel_cpu/__init__.py")


def test_real_sgl_kernel_wins(tmp_path):
    (tmp_path / "sgl_kernel").mkdir()
    (tmp_path / "sgl_kernel" / "__init__.py").write_text("REAL = True\n")
    assert _run("import sgl_kernel; print(sgl_kernel.REAL)", extra_path=str(tmp_path)) == "True"


def test_other_names_do_not_exist_so_sglang_s_fallbacks_run():
    out = _run(
        "import sgl_kernel\n"
        "print(hasattr(sgl_kernel, 'rotate_input_ids_cpu'), hasattr(sgl_kernel, 'assign_req_to_token_pool_cpu'))\n"
        "try:\n    from sgl_kernel import rotate_input_ids_cpu\nexcept ImportError as e:\n    print('ImportError')"
    )
    assert out.split("\n") == ["False True", "ImportError"]


def test_a_wheel_ships_the_pth_and_uninstalling_the_project_removes_it(tmp_path):
    """`pip install` of the project's wheel puts the stand-in's .pth in site-packages, listed in RECORD, so
    that `pip uninstall` removes it (a .pth written beside the install would outlive it)."""
    from pathlib import Path

    from sgl_entropic.cpu import PTH_LINE, PTH_NAME

    import shutil

    root, src = Path(__file__).resolve().parent.parent, tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):  # a copy: no stale build/ of the checkout
        shutil.copy(root / name, src)
    for name in ("sgl_entropic", "kernels"):
        shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(src), "-w", str(tmp_path)], check=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    subprocess.run([*pip, "--python", python, "install", "--no-deps", *map(str, tmp_path.glob("*.whl"))], check=True)
    assert (site / PTH_NAME).read_text() == PTH_LINE
    subprocess.run([*pip, "--python", python, "uninstall", "-y", "sgl-entropic"], check=True)
    assert not (site / PTH_NAME).exists() and not (site / "sgl_entropic").exists()


def test_assign_req_to_token_pool_matches_reference():
    req_to_token = torch.zeros(4, 10, dtype=torch.int32)
    req_pool_indices = torch.tensor([2, 0])
    start, end = torch.tensor([3, 0]), torch.tensor([6, 2])
    out_cache_loc = torch.tensor([11, 12, 13, 21, 22])
    assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start, end, out_cache_loc, 10)
    expected = torch.zeros(4, 10, dtype=torch.int32)
    expected[2, 3:6] = torch.tensor([11, 12, 13], dtype=torch.int32)
    expected[0, 0:2] = torch.tensor([21, 22], dtype=torch.int32)
    assert torch.equal(req_to_token, expected)


def test_copy_all_layer_kv_cache_moves_every_buffer_s_slots_reading_sources_first():
    # as SGLang's KV pool hands them over: each layer's K and V buffer by address, with its slot stride in bytes
    buffers = [torch.randn(12, 3, 4, dtype=dtype) for dtype in (torch.float32, torch.bfloat16) for _ in range(2)]
    pointers = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b[0].nbytes for b in buffers])
    tgt, src = torch.tensor([3, 4, 5]), torch.tensor([4, 9, 3])  # 4 is both a source and a target
    expected = [b.clone() for b in buffers]
    for b in expected:
        b[tgt] = b[src].clone()
    copy_all_layer_kv_cache_cpu(pointers, strides, tgt, src)
    assert all(torch.equal(b, e) for b, e in zip(buffers, expected))


def test_ranks_get_disjoint_equal_core_groups_in_sglang_s_bind_syntax():
    from sgl_entropic.cpu import threads_bind

    assert threads_bind([1, 0], 2) == "0|1"
    assert threads_bind(list(range(8)), 2) == "0-3|4-7"
    assert threads_bind([0, 2, 4, 6, 7], 2) == "0,2|4,6"  # a gappy affinity set: explicit lists
    with pytest.raises(ValueError, match="need at least 3 CPUs"):
        threads_bind([0, 1], 3)
