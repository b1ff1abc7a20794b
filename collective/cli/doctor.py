"""``collective doctor [--chief HOST:PORT]``: a pre-flight check, one verdict per check.

Local checks (always; information only): Python, grpcio, numpy, mpi4py and ``mpiexec`` (the MPI
transport), the cluster environment (what ``collective.clusterenv.resolve_placement`` finds: rank, world
size, local rank, node, chief address, the engine and the variables it read)
and TLS. With a chief address: resolve the host, open a TCP connection to the port (showing the
local address and interface the connection leaves from), ask the standard gRPC health service
(served without a token), then call the Collective ``Status`` RPC with the token to tell whether
the token is accepted. A check that cannot run because an earlier one failed is shown as
skipped. The overall verdict fails when any check fails; information never fails it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import TextIO

from collective.config import parse_address
from collective.errors import AuthError, ChiefUnreachableError, CollectiveError, UsageError


@dataclass(frozen=True)
class Check:
    """One line of the report. ``ok``: True (OK), False (FAIL), None (INFO; SKIP when the
    detail starts with ``skipped:``, a check an earlier failure made pointless)."""

    name: str
    ok: bool | None
    detail: str

    @property
    def verdict(self) -> str:
        if self.ok is None:
            return "SKIP" if self.detail.startswith("skipped:") else "INFO"
        return "OK" if self.ok else "FAIL"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def local_checks(environ: Mapping[str, str] | None = None, tls=None) -> list[Check]:
    """What this machine brings: versions, the MPI launcher, the cluster environment, TLS."""
    environ = os.environ if environ is None else environ
    v = sys.version_info
    checks = [Check("python", None, f"{v.major}.{v.minor}.{v.micro} ({sys.executable})")]
    grpc_v, health_v = _version("grpcio"), _version("grpcio-health-checking")
    checks.append(Check(
        "grpc", None if grpc_v else False,
        f"grpcio {grpc_v}, grpcio-health-checking {health_v or 'not installed'}" if grpc_v else "grpcio is not installed",
    ))
    np_v = _version("numpy")
    checks.append(Check("numpy", None if np_v else False, np_v or "numpy is not installed"))
    mpi_v = _version("mpi4py")
    checks.append(Check("mpi4py", None, mpi_v or "not installed (needed only for --transport mpi)"))
    beside = shutil.which("mpiexec", path=str(Path(sys.executable).parent))
    on_path = shutil.which("mpiexec")
    if beside:
        where = f"{beside} (beside {Path(sys.executable).name})"
    elif on_path:
        where = f"{on_path} (on PATH)"
    else:
        where = "not found beside python or on PATH (needed only for --transport mpi)"
    checks.append(Check("mpiexec", None, where))
    checks.append(_cluster_env_check(environ))
    checks.append(_tls_check(tls))
    return checks


def _tls_check(tls) -> Check:
    from collective.transport.grpc import channel_credentials

    if tls is None or not tls.enabled:
        return Check("tls", None, "TLS: not configured (plaintext); use --tls-ca (and --tls-cert/--tls-key) for a TLS chief")
    try:
        channel_credentials(tls)
    except UsageError as exc:
        return Check("tls", False, str(exc))
    mode = "mutual TLS (client certificate " + tls.cert + ")" if tls.cert else "TLS (server verified with " + tls.ca + ")"
    return Check("tls", True, mode + (f", server name {tls.server_name}" if tls.server_name else ""))


def _cluster_env_check(environ: Mapping[str, str]) -> Check:
    """What ``collective.sync`` would resolve here, and from which engine and variables."""
    from collective.clusterenv import SINGLE, resolve_placement

    try:
        placement = resolve_placement(env=environ)
    except UsageError as exc:
        return Check("cluster env", False, str(exc))
    detail = placement.report()
    if placement.source == SINGLE:
        detail += ("; looked for COLLECTIVE_RANK/COLLECTIVE_WORLD_SIZE, TF_CONFIG, torchrun (MASTER_ADDR, MASTER_PORT, "
                   "RANK, WORLD_SIZE), PET_* (Trainer v2 / JobSet), Kubeflow PyTorchJob, an srun step (SLURM_PROCID, "
                   "SLURM_NTASKS, SLURM_STEP_NODELIST) and MPI (OMPI_COMM_WORLD_RANK, PMI_RANK, PMIX_RANK)")
    return Check("cluster env", None, detail)


def run_doctor(chief: str | None, *, token: str | None, timeout: float = 3.0, tls=None) -> tuple[list[Check], bool]:
    """Run every check; returns the checks and the overall verdict (True: nothing failed).

    Raises ``UsageError`` when ``chief`` is not ``HOST:PORT``.
    """
    checks = local_checks(tls=tls)
    if chief is not None:
        checks += chief_checks(chief, token=token, timeout=timeout, tls=tls)
    else:
        checks.append(Check("chief", None, "skipped: no --chief HOST:PORT (or COLLECTIVE_CHIEF) given; only local checks ran"))
    return checks, all(c.ok is not False for c in checks)


def chief_checks(chief: str, *, token: str | None, timeout: float = 3.0, tls=None) -> list[Check]:
    host, port = parse_address(chief, what="--chief")
    if port == 0:
        raise UsageError(f"--chief {chief!r} has port 0; give the port the chief listens on")
    checks: list[Check] = []

    resolve = _resolve(host, port)
    checks.append(resolve.check)
    if not resolve.addresses:
        return checks + _skipped(["connect", "grpc health", "token"], "the host does not resolve")

    connect = _connect(resolve.addresses, timeout)
    checks.append(connect)
    if not connect.ok:
        return checks + _skipped(["grpc health", "token"], "no TCP connection")

    address = _show((host, port))
    health = _health(address, timeout, tls)
    checks.append(health)
    if health.ok is False and "NOT_SERVING" not in health.detail:
        return checks + _skipped(["token"], "no gRPC answer from a collective chief")
    checks.append(_token(address, token, timeout, tls))
    return checks


def _skipped(names: Sequence[str], why: str) -> list[Check]:
    return [Check(n, None, f"skipped: {why}") for n in names]


@dataclass
class _Resolved:
    check: Check
    addresses: list[tuple[int, tuple]]


def _resolve(host: str, port: int) -> _Resolved:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) and exc.strerror else str(exc)
        return _Resolved(Check("resolve", False, f"{host} does not resolve: {reason}"), [])
    addresses = list(dict.fromkeys((family, sockaddr) for family, _t, _p, _c, sockaddr in infos))
    shown = ", ".join(dict.fromkeys(sa[0] for _f, sa in addresses))
    return _Resolved(Check("resolve", True, f"{host} -> {shown}"), addresses)


def _connect(addresses: list[tuple[int, tuple]], timeout: float) -> Check:
    failures = []
    for family, sockaddr in addresses:
        target = _show(sockaddr)
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect(sockaddr)
                local = s.getsockname()
        except ConnectionRefusedError:
            failures.append(f"{target}: connection refused (nothing listens there, or a firewall rejects it)")
            continue
        except TimeoutError:
            failures.append(f"{target}: no answer within {timeout:g} s (a firewall may drop the packets, or the host is down)")
            continue
        except OSError as exc:
            failures.append(f"{target}: {exc.strerror or exc}")
            continue
        iface = interface_of(local[0])
        return Check("connect", True, f"{target} reachable from {_show(local)} (interface {iface})")
    return Check("connect", False, "; ".join(failures))


def _show(sockaddr: tuple) -> str:
    """``host:port``, or ``[v6]:port``."""
    host, port = sockaddr[0], sockaddr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def interface_of(address: str) -> str:
    """The name of the local interface holding ``address`` (Linux), or ``unknown``.

    Best effort: ``ip -o addr`` output, then /proc/net/if_inet6 (IPv6) or the SIOCGIFADDR ioctl
    (IPv4) over every interface.
    """
    address = address.split("%", 1)[0]
    try:
        out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=2, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        parts = line.split()
        # "2: eth0    inet 10.0.0.5/24 brd ... scope global eth0\  valid_lft ..."
        if len(parts) >= 4 and parts[2] in ("inet", "inet6") and parts[3].split("/", 1)[0] == address:
            return parts[1].split("@", 1)[0]
    if ":" in address:
        return _if_inet6(address)
    return _ioctl_ipv4(address)


def _if_inet6(address: str) -> str:
    try:
        packed = socket.inet_pton(socket.AF_INET6, address).hex()
        with open("/proc/net/if_inet6") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 6 and parts[0] == packed:
                    return parts[5]
    except OSError:
        pass
    return "unknown"


def _ioctl_ipv4(address: str) -> str:
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _index, name in socket.if_nameindex():
                try:
                    req = struct.pack("256s", name.encode()[:15])
                    got = fcntl.ioctl(s.fileno(), 0x8915, req)  # SIOCGIFADDR
                except OSError:
                    continue
                if socket.inet_ntoa(got[20:24]) == address:
                    return name
    except (ImportError, OSError, AttributeError):
        pass
    return "unknown"


def _health(address: str, timeout: float, tls=None) -> Check:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from collective.transport.grpc import SERVICE, channel_credentials

    if tls is not None and tls.enabled:
        options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
        channel = grpc.secure_channel(address, channel_credentials(tls), options=options)
    else:
        channel = grpc.insecure_channel(address)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=timeout
        )
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.NOT_FOUND:
            why = f"the server does not serve {SERVICE}: not a collective chief?"
        elif code == grpc.StatusCode.UNIMPLEMENTED:
            why = "the server has no gRPC health service: not a collective chief?"
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
            why = f"no gRPC answer within {timeout:g} s: does the port speak gRPC?"
        else:
            why = f"{code.name}: {details}"
        return Check("grpc health", False, why)
    finally:
        channel.close()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return Check("grpc health", True, f"{SERVICE}: SERVING")
    return Check("grpc health", False, f"{SERVICE}: {status} (the chief is stopping: its round is over)")


def _token(address: str, token: str | None, timeout: float, tls=None) -> Check:
    from collective.transport.grpc import GrpcChiefLink

    link = GrpcChiefLink(address, token=token, tls=tls)
    try:
        st = link.status(timeout)
    except AuthError:
        if token:
            return Check("token", False, "token refused (UNAUTHENTICATED): pass the chief's token with --token or COLLECTIVE_TOKEN")
        return Check("token", False, "no token set, and the chief requires one (UNAUTHENTICATED): set COLLECTIVE_TOKEN or pass --token")
    except ChiefUnreachableError as exc:
        return Check("token", False, f"the Status RPC could not reach the chief: {exc}")
    except CollectiveError as exc:
        return Check("token", False, f"Status RPC failed: {exc}")
    finally:
        link.close()
    state = f"chief phase {st.phase or '-'}, {st.joined}/{st.expected} workers joined"
    if st.error:
        state += f", error: {st.error}"
    if token:
        return Check("token", True, f"token accepted; {state}")
    return Check("token", True, f"no token set; the chief accepts requests without one; {state}")


def format_checks(checks: Sequence[Check]) -> str:
    """One aligned line per check (``OK``/``FAIL``/``INFO``), then the overall verdict line."""
    width = max((len(c.name) for c in checks), default=0)
    lines = [f"{c.verdict:<4}  {c.name:<{width}}  {c.detail}" for c in checks]
    failed = [c.name for c in checks if c.ok is False]
    if failed:
        lines.append(f"verdict: FAIL ({len(failed)} of {len(checks)} checks failed: {', '.join(failed)})")
    elif any(c.ok is True for c in checks):
        lines.append(f"verdict: OK ({sum(c.ok is True for c in checks)} checks passed, none failed)")
    else:
        lines.append("verdict: OK (local information only; give --chief HOST:PORT to check a chief)")
    return "\n".join(lines)


def doctor_command(
    chief: str | None,
    *,
    token: str | None,
    timeout: float = 3.0,
    as_json: bool = False,
    out: TextIO | None = None,
    tls=None,
) -> int:
    """What ``collective doctor`` does: print the checks; exit 0 when nothing failed, else 1.

    Without ``chief``, the chief address a cluster engine (``TF_CONFIG``, torchrun, PyTorchJob,
    ``PET_*``, Slurm) names is checked.
    """
    out = out or sys.stdout
    if not chief:
        from collective.clusterenv import from_environment

        try:
            env = from_environment(os.environ)
        except UsageError:
            env = None  # reported by the cluster env check
        chief = env.chief_address if env is not None else None
    checks, ok = run_doctor(chief, token=token, timeout=timeout, tls=tls)
    if as_json:
        print(json.dumps({"ok": ok, "chief": chief, "checks": [
            {**asdict(c), "verdict": c.verdict} for c in checks
        ]}), file=out)
    else:
        print(format_checks(checks), file=out)
    return 0 if ok else 1


def command(args: argparse.Namespace) -> int:
    """``collective doctor``."""
    from collective.config import tls_from_args

    return doctor_command(args.chief, token=args.token, timeout=args.timeout, as_json=args.json,
                          tls=tls_from_args(args))
