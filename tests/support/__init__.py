"""Shared, importable test helpers (``from support.specs import lpt``): the one set of LlamaPretrain builders
(``specs``) and the repository's paths (``paths``).

``tests/`` is on ``sys.path`` in every pytest run (the rootdir conftest puts it there, as for ``kmockx``) and the
bench scripts add it themselves, so ``support`` imports the same way from any test directory or subset. conftest.py
files hold fixtures and hooks only; nothing imports a conftest (tests/test_layout.py checks both)."""
