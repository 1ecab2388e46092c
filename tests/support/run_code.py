"""``python -m tests.support.run_code FILE``: run a test's probe script as ``__main__``, in a process forked from the
tests' warm parent (:func:`support.warm.run_code`), where ``python -c`` would start a cold interpreter."""

import runpy
import sys

path = sys.argv[1]
sys.argv = [path]
runpy.run_path(path, run_name="__main__")
