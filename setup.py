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
        target = Path(self.build_lib) / "raydp" / "shipped_policies"
        # pip builds in the source tree's build/: a policy removed from policies/ must not ship from an earlier build
        shutil.rmtree(target, ignore_errors=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns(".*"))  # no half-written .NAME.tmp copies


setup(cmdclass={"build_py": BuildWithPolicies})
