"""Docs a newcomer follows literally: the collator signature in docs/data.md is the real one, the README's
development commands work without an activated venv, and the LoRA parity commands compare non-zero gradients."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_data_doc_collator_signature_lists_every_parameter():
    import hf_blockdiag_cp as bd

    doc = (ROOT / "docs" / "data.md").read_text()
    block = re.search(r"hf_blockdiag_cp\.PackingCollator\((.*?)\)\n", doc, re.S)
    assert block, "docs/data.md has no PackingCollator(...) signature"
    documented = set(re.findall(r"(\w+)(?:=|,|$)", block.group(1).replace("*", "").replace("\n", " ")))
    real = set(inspect.signature(bd.PackingCollator.__init__).parameters) - {"self"}
    assert real <= documented, f"missing from docs/data.md: {sorted(real - documented)}"
    assert "[r*L, (r+1)*L)" not in doc.split("`\"contiguous\"`")[0], "the default placement is balanced"


def test_readme_development_commands_name_the_venv():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Development"):]
    commands = re.findall(r"^(\S*python -m pytest.*)$", section, re.M)
    assert commands and all(c.startswith(".venv/bin/python") for c in commands), commands
    assert "~10 minutes" not in readme


def test_lora_parity_commands_use_random_adapter_init():
    doc = (ROOT / "docs" / "trl_peft.md").read_text()
    lines = [line for line in doc.splitlines() if "--lora" in line and "--check-parity" in line and "launch" in line]
    assert lines and all("--lora-init random" in line for line in lines), lines


def test_kernels_doc_does_not_say_softcap_raises_on_cpu():
    doc = (ROOT / "docs" / "kernels_and_exchange.md").read_text()
    assert "softcap on CPU training) raises" not in doc
    assert "softcap" in (ROOT / "hf_blockdiag_cp" / "kernels" / "sdpa_doc.py").read_text()
