"""The tiny test models' tokenizer and prompts come from a frozen corpus (kvconnect/harness/tiny_llama.py).

They were cut from kvconnect's live sources: every commit that touched a source changed the tokenizer and every
prompt of the vLLM tests, so a test could start failing with an unrelated change (the last CI failure of
2026-12-05: two prompts of the edited-block-ids test came to differ in block count). Now they are the sources as
they were on 2026-12-06, whatever the package holds today.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import sys
from pathlib import Path

import kvconnect.harness.tiny_llama as tiny_llama
from kvconnect.harness.tiny_llama import _corpus, prompt_of

FROZEN_SHA256 = "4a569a251b117268072f5a278769816119984b66ae6e06a3539f26a0731b36fb"


def test_the_corpus_is_the_frozen_one_whatever_the_sources_are_now() -> None:
    texts = _corpus()
    assert len(texts) == 124
    assert hashlib.sha256("\n".join(texts).encode()).hexdigest() == FROZEN_SHA256


def test_a_copy_of_the_module_beside_other_sources_reads_the_same_corpus(tmp_path: Path) -> None:
    """The module copied into a package of other sources (as a commit would change them) trains on the same."""
    harness = tmp_path / "pkg" / "harness"
    shutil.copytree(Path(tiny_llama.__file__).with_name("data"), harness / "data")
    shutil.copy2(tiny_llama.__file__, harness / "tiny_llama.py")
    (tmp_path / "pkg" / "other.py").write_text("print('a source the frozen corpus never saw')\n")
    spec = importlib.util.spec_from_file_location("tiny_llama_copy", harness / "tiny_llama.py")
    assert spec is not None and spec.loader is not None
    copy = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = copy  # (its dataclasses look their module up there)
    try:
        spec.loader.exec_module(copy)
    finally:
        del sys.modules[spec.name]
    assert hashlib.sha256("\n".join(copy._corpus()).encode()).hexdigest() == FROZEN_SHA256


def test_prompts_are_cut_from_it_deterministically() -> None:
    text = "\n".join(_corpus())
    for tokens, seed in ((20, 3), (1024, 7), (4096, 11)):
        prompt = prompt_of(tokens, seed)
        assert prompt == prompt_of(tokens, seed) and prompt in text
        assert len(prompt) == int(tokens * 2.6)
