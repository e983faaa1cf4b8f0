"""The link figure behind the bound of `herring-jax bench`: measured with
fi_pingpong on loopback, or the shaped rates of the simulated network."""

from __future__ import annotations

import re
import shutil
import subprocess
import time

from herring_jax._src.launch import free_port


def pingpong_gbps(provider: str) -> tuple[float | None, str]:
    """Best one-way bandwidth of fi_pingpong (RDM, 1-16 MiB) between two local processes."""
    tool = shutil.which("fi_pingpong")
    if tool is None:
        return None, "fi_pingpong not found (apt-get install libfabric-bin)"
    best = None
    for mib in (1, 4, 16):
        port = free_port()
        common = [tool, "-p", provider, "-e", "rdm", "-I", "20", "-S", str(mib << 20)]
        server = subprocess.Popen(common + ["-B", str(port)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.3)  # the server must listen before the client connects
            out = subprocess.run(common + ["-P", str(port), "127.0.0.1"], capture_output=True,
                                 text=True, timeout=60).stdout
            server.wait(timeout=10)
        except (OSError, subprocess.SubprocessError):
            out = ""
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        # Columns: bytes #sent #ack total time MB/sec usec/xfer ...; MB/sec is
        # 1e6 bytes per second, one way (a message's half round trip).
        m = re.search(rf"^\s*{mib}m\s+\d+\s+=\d+\s+\S+\s+\S+\s+([\d.]+)", out, re.M)
        if m:
            best = max(best or 0.0, float(m.group(1)) / 1e3)
    if best is None:
        return None, f"fi_pingpong -p '{provider}' failed"
    return best, f"fi_pingpong -p '{provider}' -e rdm, best of 1/4/16 MiB, same host"


def shaped_gbps(args) -> tuple[float, str]:
    """What one host can send to all others at once in the simulated network, GB/s."""
    from herring_jax._src.netns import parse_rate
    n = args.num_processes
    host = parse_rate(args.host_rate)
    flow = parse_rate(args.flow_rate) if args.flow_rate else host
    egress = min(host, max(1, n - 1) * flow)
    flows = f"{n - 1} flow{'' if n == 2 else 's'}"
    return egress / 8e9, (f"shaped: min(host {args.host_rate}, {flows} x "
                          f"{args.flow_rate or args.host_rate})")
