"""``python -m pdkv.probe``: one probe run in its own process, for ``pdkv serve``'s start-up check.

Reads a JSON request on stdin -- {"nics": [...], "host_bytes": N, "what": "...", "backend": "auto",
"gpu_ordinal": null | N, "gpudirect_required": false} -- and prints the result as JSON
(ProbeResult.to_dict plus "failures"). Its own process keeps the probe's verbs objects, pyverbs,
the loopback device's fault counters and the GPU allocation out of the server.
"""

import json
import sys

from pdkv.probe.gpu import cuda_memory
from pdkv.probe.run import ProbeUnavailable, run_probe


def main() -> int:
    req = json.load(sys.stdin)
    gpu, why = (None, "")
    if req.get("gpu_ordinal") is not None:
        gpu, why = cuda_memory(int(req["gpu_ordinal"]))
    try:
        r = run_probe(req["nics"], int(req["host_bytes"]), req["what"], req.get("backend", "auto"), gpu,
                      f"GPUDirect not checked: {why}" if why else "", bool(req.get("gpudirect_required")))
        out = {**r.to_dict(), "failures": r.failures()}
    except (ProbeUnavailable, ValueError) as e:
        out = {"ok": False, "failures": [str(e)]}
    finally:
        if gpu is not None:
            gpu.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
