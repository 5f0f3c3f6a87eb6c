"""Only here to ship the pre-trained policies: ``policies/`` (outside the package, where the project keeps
them) is copied into the wheel as ``raydp/shipped_policies``, where :func:`raydp.control.store.resolve_policy`
finds them from any working directory. Everything else is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithPolicies(build_py):
    def run(self):
        super().run()
        source = Path(__file__).resolve().parent / "policies"
        if source.is_dir():
            shutil.copytree(source, Path(self.build_lib) / "raydp" / "shipped_policies", dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildWithPolicies})
