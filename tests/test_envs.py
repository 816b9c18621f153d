"""Every ``PAGEDLLM_*`` environment variable is read in ``pagedllm/envs.py`` and listed in
its table (read from the source with a regular expression; nothing is imported but envs)."""

from __future__ import annotations

import re
from pathlib import Path

from pagedllm import envs

ENVS = Path(envs.__file__)
ROOT = ENVS.parent
READ = re.compile(r"""os\.environ(?:\.get\(\s*|\[\s*)["'](PAGEDLLM_\w+)["'](?!\]\s*=)""")
NAME = re.compile(r"PAGEDLLM_[A-Z0-9_]+")


def test_only_envs_reads_pagedllm_variables() -> None:
    offenders = [f"{p.relative_to(ROOT.parent)}: {name}"
                 for p in sorted(ROOT.rglob("*.py")) if p != ENVS
                 for name in READ.findall(p.read_text())]
    assert not offenders, offenders


def test_every_variable_envs_reads_is_in_its_table() -> None:
    _, doc, body = ENVS.read_text().split('"""', 2)  # the module docstring, the code
    read = set(NAME.findall(body))
    listed = set(NAME.findall(doc))
    assert read == listed, (read - listed, listed - read)
