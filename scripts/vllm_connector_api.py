"""Write tests/data/vllm_VERSION_connector_api.json: the names vLLM VERSION's KV-connector base class defines.

    python scripts/vllm_connector_api.py 0.26.0

Downloads that release's wheel (no dependencies, no install), reads its
`vllm/distributed/kv_transfer/kv_connector/v1/base.py` as text through `kvconnect.vllm.compat.hooks_of_source`
and writes the names; `tests/test_vllm_compat.py` checks the plug-in's hooks against the file.
"""

from __future__ import annotations

import glob
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvconnect.vllm.compat import hooks_of_source

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"


def main(version: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                "3.12",
                "--platform",
                "manylinux_2_31_x86_64",
                "-d",
                tmp,
                f"vllm=={version}",
            ],
            check=True,
        )
        (wheel,) = glob.glob(f"{tmp}/vllm-{version}-*.whl")
        with zipfile.ZipFile(wheel) as z:
            source = z.read(BASE).decode()
    names, hooks = hooks_of_source(source)
    out = Path(__file__).resolve().parent.parent / "tests" / "data" / f"vllm_{version}_connector_api.json"
    out.write_text(
        json.dumps(
            {"vllm": version, "module_names": sorted(names), "hooks": dict(sorted(hooks.items()))},
            indent=1,
            sort_keys=True,
        )
    )
    print(f"{out}: {len(hooks)} hooks")


if __name__ == "__main__":
    main(sys.argv[1])
