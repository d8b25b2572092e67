"""The metadata prober where NIXL is the ``nixl`` meta package (vLLM's venv, ``pip install nixl``).

The meta package's ``import nixl`` imports torch to find the CUDA version (kvgeom_nixl/probe.py,
:func:`~kvgeom_nixl.probe.nixl_module`). The prober's child imports the flavour module its parent
loaded instead, so it starts without torch: checked here by whether ``libtorch`` is mapped into the
child, with the meta package's path (``nixl_module=""``) as the control that maps it. Each child
then probes the parent's own agent metadata: the flavour module loads the same blobs.
"""

from __future__ import annotations

from vllm_env import run_in_vllm

SCRIPT = """
import json, time
import nixl._api  # the meta package, as vLLM's NixlConnector imports it
from kvgeom_nixl.probe import MetadataProber, nixl_module

def torch_mapped(pid):
    with open(f"/proc/{pid}/maps") as f:
        return any("libtorch" in line for line in f)

agent = nixl._api.nixl_agent("prober-venv-check", nixl._api.nixl_agent_config(backends=["UCX"],
                                                                              enable_prog_thread=False))
blob = agent.get_agent_metadata()
out = {"parent_module": nixl_module(), "parent_torch": torch_mapped("self")}
for label, module in (("default", None), ("meta", "")):
    prober = MetadataProber(nixl_module=module)
    started = time.monotonic()
    prober.warm()
    out[label] = {"start_s": time.monotonic() - started, "torch": torch_mapped(prober._proc.pid),
                  "probed": prober.probe(blob)}
    prober.close()
print(json.dumps(out))
"""


def test_the_prober_child_starts_without_torch_under_the_meta_package() -> None:
    got = run_in_vllm(SCRIPT, timeout_s=300)
    assert got["parent_module"] in ("nixl_cu13._api", "nixl_cu12._api")
    assert got["parent_torch"]  # the meta package's import did bring torch into the parent
    assert got["meta"]["torch"], "control: the meta package's import maps libtorch into the child"
    assert not got["default"]["torch"], got
    assert got["default"]["probed"] == got["meta"]["probed"] == "prober-venv-check"
    print(f"prober start: {got['default']['start_s']:.2f} s with {got['parent_module']}, "
          f"{got['meta']['start_s']:.2f} s through the meta package")
