"""Ships sgl_entropic_cpu.pth (the sgl_kernel stand-in's finder, sgl_entropic/cpu.py) at the top of
site-packages and in the install's RECORD, so that `pip uninstall sgl-entropic` removes it too.
An editable install (scripts/setup.sh) cannot ship it: there `python -m sgl_entropic.cpu install` writes it."""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

sys.path.insert(0, str(Path(__file__).parent))
from sgl_entropic.cpu import PTH_LINE, PTH_NAME  # noqa: E402  (stdlib only)


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        (Path(self.build_lib) / PTH_NAME).write_text(PTH_LINE)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / PTH_NAME)]


setup(cmdclass={"build_py": BuildPyWithPth})
