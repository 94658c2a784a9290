"""Typed settings for each service, filled from flags and environment variables (the only reader of os.environ)."""

from __future__ import annotations

import argparse
import dataclasses
import grp
import logging
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shardtrain import checksums as checksum_kinds
from shardtrain import logs, slurm
from shardtrain.errors import InvalidArgument

ENV_PREFIX = "SHARDTRAIN_"
# 1 MiB chunks: per-message costs dominate small chunks, and big ones stall grpc's flow control and raise
# peak memory (`python -m bench.transport --chunk-sweep`; docs/performance.md). Here rather than in wire.py,
# which uses it too, so that reading flags imports no torch (`shardtrain health` stays light).
DEFAULT_CHUNK_BYTES = 1 << 20

log = logging.getLogger("shardtrain.settings")


@dataclass(frozen=True)
class Security:
    """Token authentication and TLS; empty fields mean off.

    `token` is the client's (and, unless a role has a token of its own, every role's); `shard_token` and
    `reader_token` give those roles separate credentials (shardtrain/auth.py). `role` is the credential this
    process presents on the calls it makes: "client" for the SDK, "shard" for the services.
    """

    token: str = ""
    shard_token: str = ""
    reader_token: str = ""
    role: str = "client"
    tls_cert: str = ""        # PEM certificate chain of this server
    tls_key: str = ""         # PEM private key of this server
    tls_ca: str = ""          # PEM roots a client trusts; set it to talk TLS to the services
    tls_server_name: str = ""  # overrides the name checked against the server's certificate
    tls_client_auth: bool = False  # a server asks every caller for a certificate from tls_ca (mutual TLS)
    allow_unauthenticated: bool = False  # a server may listen beyond loopback, or over TLS, with no token

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata that carries this process's token: its role's, or the client token."""
        token = {"shard": self.shard_token, "reader": self.reader_token}.get(self.role) or self.token
        return (("authorization", f"Bearer {token}"),) if token else ()


@dataclass(frozen=True)
class Timeouts:
    """Deadlines, in seconds: every RPC and every wait on a peer has one."""

    rpc: float = 120.0        # one data-plane call (forward, backward, fetch, step)
    control: float = 30.0     # one control-plane call (register, deploy, describe)
    peer_wait: float = 120.0  # waiting for a residual or a residual gradient to arrive
    connect: float = 60.0     # a shard retrying registration until the coordinator answers
    heartbeat: float = 2.0    # a shard registers again this often, to say it is alive
    expiry: float = 10.0      # the coordinator forgets a shard it has not heard from for this long
    probe: float = 5.0        # a deploy's check that each shard it is about to use answers


@dataclass(frozen=True)
class ShardSettings:
    """What `shardtrain shard` needs."""

    coordinator: str
    bind: str = "127.0.0.1:0"
    advertise: str = ""       # address peers use; default: the bound host and port
    device: str = "cpu"
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_in_flight: int = 64   # steps whose autograd state a stage keeps at once
    parent_pid: int = 0       # exit when this process dies (set by Cluster.local for its children)
    threads: int = 0          # torch intra-op threads; 0 keeps torch's default (one per core)
    shared_memory: bool = True  # same-host peers exchange tensors through /dev/shm segments
    local_links: bool = True    # same-host peers carry Link items on a Unix socket (shardtrain.carrier)
    tcp_links: bool = True      # peers on other hosts carry them on a TCP socket (TLS when the services are)
    checksums: str = checksum_kinds.DEFAULT  # what tensor chunks this shard sends carry: off, crc32, crc32c
    flush_denormal: bool = False  # CPU arithmetic flushes denormal floats to zero (torch.set_flush_denormal)
    simulate_compute: float = 0.0  # seconds added to each planned forward and backward, standing for device work
    memory_bytes: int = 0     # what a stage here may use; 0: the device's memory (a GPU's, or the host's)
    virtual_stages: int = 1   # shards this process serves on its one device (the interleaved schedule)
    checkpoint_dir: str = ""  # SaveCheckpoint writes and LoadCheckpoint reads only under it; "": neither
    checkpoint_group: int = -1  # a gid that may read the checkpoints written here (files 0640); -1: none (0600)
    data_roots: tuple[str, ...] = ()  # directories and URL prefixes this shard reads training data from
    log_level: str = "info"
    log_format: str = "text"  # or "json": one JSON object a line
    metrics_port: int | None = None  # serve Prometheus metrics there (0: a port the OS picks); None: no endpoint
    security: Security = field(default_factory=lambda: Security(role="shard"))  # a service presents the shard token
    timeouts: Timeouts = field(default_factory=Timeouts)


@dataclass(frozen=True)
class CoordinatorSettings:
    """What `shardtrain coordinator` needs."""

    bind: str = "127.0.0.1:0"
    parent_pid: int = 0
    log_level: str = "info"
    log_format: str = "text"
    metrics_port: int | None = None
    security: Security = field(default_factory=lambda: Security(role="shard"))  # a service presents the shard token
    timeouts: Timeouts = field(default_factory=Timeouts)


def _env(env: Mapping[str, str], name: str, default: str = "") -> str:
    return env.get(ENV_PREFIX + name, default)


def name_variables(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Ends each flag's help line with the variable that sets its default (--tls-ca: SHARDTRAIN_TLS_CA), unless
    the line names one already; returns the parser."""
    for action in parser._actions:
        flags = [option for option in action.option_strings if option.startswith("--")]
        if not flags or action.help in (None, argparse.SUPPRESS) or flags[0] == "--help" or ENV_PREFIX in action.help:
            continue
        action.help += f" [{ENV_PREFIX}{flags[0][2:].upper().replace('-', '_')}]"
    return parser


def _read_token(args: argparse.Namespace) -> str:
    if args.auth_token:
        log.warning("--auth-token puts the token where every user of this host can read it (ps, /proc); "
                    "prefer --auth-token-file or the SHARDTRAIN_AUTH_TOKEN variable")
    for token, token_file in ((args.auth_token, args.auth_token_file), (args.env_token, args.env_token_file)):
        if token:
            return token
        if token_file:
            return pathlib.Path(token_file).read_text().strip()
    return ""


def add_security_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Adds --auth-token/--auth-token-file/--tls-* with SHARDTRAIN_* environment defaults."""
    # A token flag beats a token-file flag, which beats the variables (token, then token file).
    parser.add_argument("--auth-token", default=None,
                        help="the token every caller presents (visible to every user of the host: prefer the file "
                             "or SHARDTRAIN_AUTH_TOKEN)")
    parser.add_argument("--auth-token-file", default=None,
                        help="a file holding the token (or SHARDTRAIN_AUTH_TOKEN_FILE)")
    parser.set_defaults(env_token=_env(env, "AUTH_TOKEN"), env_token_file=_env(env, "AUTH_TOKEN_FILE"))
    for role in ("shard", "reader"):  # from files or variables only: a command line is visible to the whole host
        parser.add_argument(f"--{role}-token-file", default=_env(env, f"{role.upper()}_TOKEN_FILE"),
                            help=f"a file holding the {role} role's own token (or SHARDTRAIN_{role.upper()}_TOKEN_FILE; the "
                                 f"token itself: SHARDTRAIN_{role.upper()}_TOKEN)")
    parser.set_defaults(env_shard_token=_env(env, "SHARD_TOKEN"), env_reader_token=_env(env, "READER_TOKEN"))
    parser.add_argument("--tls-cert", default=_env(env, "TLS_CERT"),
                        help="PEM certificate chain: a server serves TLS with it (and presents it as a caller)")
    parser.add_argument("--tls-key", default=_env(env, "TLS_KEY"), help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", default=_env(env, "TLS_CA"),
                        help="PEM roots: calls to other services use TLS and check their certificates against it")
    parser.add_argument("--tls-server-name", default=_env(env, "TLS_SERVER_NAME"),
                        help="the name checked against the certificates of the services called (default: the "
                             "host of their address)")
    parser.add_argument("--tls-client-auth", choices=("on", "off"), default=_env(env, "TLS_CLIENT_AUTH", "off"),
                        help="mutual TLS: every caller must present a certificate that --tls-ca signed (a client "
                             "presents --tls-cert and --tls-key); it authenticates callers without a token")
    parser.add_argument("--allow-unauthenticated", action="store_true",
                        default=_env(env, "ALLOW_UNAUTHENTICATED") in ("1", "true", "on"),
                        help="serve callers without a token on a non-loopback address or over TLS (by default a "
                             "server there refuses to start without a token: TLS alone authenticates nobody)")


def security_from(args: argparse.Namespace, role: str = "client") -> Security:
    """The Security object that add_security_flags' flags describe, presenting `role`'s token on calls it makes."""
    return Security(token=_read_token(args), shard_token=_role_token(args, "shard"),
                    reader_token=_role_token(args, "reader"), role=role, tls_cert=args.tls_cert,
                    tls_key=args.tls_key, tls_ca=args.tls_ca, tls_server_name=args.tls_server_name,
                    tls_client_auth=args.tls_client_auth == "on", allow_unauthenticated=args.allow_unauthenticated)


def _role_token(args: argparse.Namespace, role: str) -> str:
    path = getattr(args, f"{role}_token_file")
    return pathlib.Path(path).read_text().strip() if path else getattr(args, f"env_{role}_token")


def add_client_security_flags(parser: argparse.ArgumentParser) -> None:
    """The security flags for a client command, with this process's SHARDTRAIN_* variables as defaults."""
    add_security_flags(parser, os.environ)


def security_from_env(env: Mapping[str, str] | None = None) -> Security:
    """Security for a client (the SDK) from SHARDTRAIN_* variables alone."""
    parser = argparse.ArgumentParser(add_help=False)
    add_security_flags(parser, os.environ if env is None else env)
    return security_from(parser.parse_args([]))


def security_env(security: Security) -> dict[str, str]:
    """The SHARDTRAIN_* variables that make a child service use `security` (the inverse of the flags' defaults)."""
    fields = {"AUTH_TOKEN": security.token, "SHARD_TOKEN": security.shard_token,
              "READER_TOKEN": security.reader_token, "TLS_CERT": security.tls_cert, "TLS_KEY": security.tls_key,
              "TLS_CA": security.tls_ca, "TLS_SERVER_NAME": security.tls_server_name,
              "TLS_CLIENT_AUTH": "on" if security.tls_client_auth else ""}
    return {ENV_PREFIX + name: value for name, value in fields.items() if value}


def _coordinator_default(env: Mapping[str, str]) -> str:
    # MODEL_HOST/MODEL_PORT are the seed's names for the coordinator's address: the fallback.
    if not _env(env, "COORDINATOR") and "MODEL_HOST" in env and "MODEL_PORT" in env:
        return f"{env['MODEL_HOST']}:{env['MODEL_PORT']}"
    return _env(env, "COORDINATOR")


def add_timeout_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """--timeout-<name> SECONDS for every deadline of Timeouts, with SHARDTRAIN_TIMEOUT_<NAME> defaults."""
    for item in dataclasses.fields(Timeouts):
        flag = item.name.replace("_", "-")
        parser.add_argument(f"--timeout-{flag}", type=_seconds, dest=f"timeout_{item.name}",
                            default=_env(env, f"TIMEOUT_{item.name.upper()}", str(item.default)),
                            help=f"seconds (default {item.default:g}): {_TIMEOUT_HELP[item.name]}")


_TIMEOUT_HELP = {
    "rpc": "one data-plane call or wait (a forward's output, a backward, a step)",
    "control": "one control-plane call (register, deploy, describe)",
    "peer_wait": "waiting for a peer's item (a residual, a gradient, a micro-batch): a stopped peer is reported "
                 "after this long",
    "connect": "a shard retrying registration until the coordinator answers",
    "heartbeat": "how often a shard registers again, to say it is alive",
    "expiry": "how long the coordinator remembers a shard it has not heard from",
    "probe": "a quick check that a peer answers",
}


def timeouts_from(args: argparse.Namespace) -> Timeouts:
    """The Timeouts that add_timeout_flags' flags describe."""
    return Timeouts(**{item.name: getattr(args, f"timeout_{item.name}") for item in dataclasses.fields(Timeouts)})


def checksums_from_env(env: Mapping[str, str] | None = None) -> str:
    """The checksum the SDK's tensor chunks carry (SHARDTRAIN_CHECKSUMS, as shards' --checksums): off, crc32 or
    crc32c; InvalidArgument for another value."""
    try:
        return checksum_kinds.kind(_env(os.environ if env is None else env, "CHECKSUMS", checksum_kinds.DEFAULT))
    except ValueError as error:
        raise InvalidArgument(f"{ENV_PREFIX}CHECKSUMS: {error}") from None


def timeouts_env(timeouts: Timeouts) -> dict[str, str]:
    """The SHARDTRAIN_TIMEOUT_* variables that give a child service `timeouts`."""
    return {f"{ENV_PREFIX}TIMEOUT_{item.name.upper()}": repr(getattr(timeouts, item.name))
            for item in dataclasses.fields(Timeouts) if getattr(timeouts, item.name) != item.default}


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"{text!r}: a deadline is more than 0 and at most 86400 seconds")
    return value


def add_log_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """--log-level, --log-format and --metrics-port, shared by the services."""
    parser.add_argument("--metrics-port", type=_port, default=_env(env, "METRICS_PORT") or None,
                        help="serve Prometheus metrics on this port of the bind host, at /metrics (0 picks one; "
                             "HTTPS with the service's TLS certificate; default: no endpoint)")
    parser.add_argument("--log-level", choices=logs.LEVELS, default=_env(env, "LOG_LEVEL", "info"),
                        help="the least severe records logged (default info; every refused request is an info line)")
    parser.add_argument("--log-format", choices=logs.FORMATS, default=_env(env, "LOG_FORMAT", "text"),
                        help="text lines, or json: one object a line with time, level, logger and message")


def _port(text: str) -> int:
    """A TCP port number, 0 to 65535."""
    if not text.strip().isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port; give a number from 0 to 65535")
    return int(text)


_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _size(text: str) -> int:
    """Bytes from "12G", "512M", "1.5G" or a plain count."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; give bytes or a number with K, M, G or T")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def shard_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    """The flags of `shardtrain shard`, with `env`'s SHARDTRAIN_* variables as defaults."""
    parser = argparse.ArgumentParser(prog="shardtrain shard", description="Run one shard server.")
    parser.add_argument("--coordinator", default=_coordinator_default(env),
                        help="host:port of the coordinator (or SHARDTRAIN_COORDINATOR, or MODEL_HOST+MODEL_PORT); "
                             "- reads it from standard input's first line once the shard serves (a launcher that "
                             "starts the coordinator at the same time writes it there)")
    parser.add_argument("--bind", default=_env(env, "BIND", "127.0.0.1:0"),
                        help="host:port to serve on (default 127.0.0.1:0: loopback, a port the OS picks)")
    parser.add_argument("--advertise", default=_env(env, "ADVERTISE"),
                        help="host:port peers and clients use to reach this shard (default: the bound one; port 0 "
                             "stands for the bound port)")
    parser.add_argument("--device", default=_env(env, "DEVICE", "cpu"), help="cpu, cuda or cuda:N")
    # String defaults: argparse converts them with `type`, so a bad variable is reported like a bad flag.
    parser.add_argument("--chunk-bytes", type=int, default=_env(env, "CHUNK_BYTES", str(DEFAULT_CHUNK_BYTES)),
                        help=f"bytes of tensor data per message this shard sends (default {DEFAULT_CHUNK_BYTES})")
    parser.add_argument("--threads", type=int, default=_env(env, "THREADS", "0"),
                        help="torch intra-op threads (0: torch's default); set 1 when shards share a host's cores")
    parser.add_argument("--parent-pid", type=int, default=_env(env, "PARENT_PID", "0"),
                        help="exit when this process dies")
    parser.add_argument("--shared-memory", choices=("on", "off"), default=_env(env, "SHARED_MEMORY", "on"),
                        help="same-host peers exchange tensors through /dev/shm (default on; off: always stream)")
    parser.add_argument("--local-links", choices=("on", "off"), default=_env(env, "LOCAL_LINKS", "on"),
                        help="Links with same-host peers carry their items on a Unix socket instead of "
                             "the gRPC stream (default on)")
    parser.add_argument("--tcp-links", choices=("on", "off"), default=_env(env, "TCP_LINKS", "on"),
                        help="Links with peers on other hosts carry their items on a TCP socket instead of the "
                             "gRPC stream (default on; over TLS when the shard serves TLS)")
    parser.add_argument("--checksums", choices=("on", *checksum_kinds.KINDS),
                        default=_env(env, "CHECKSUMS", checksum_kinds.DEFAULT),
                        help="what each tensor chunk this shard sends carries of its data, which the receiver checks: "
                             "crc32c (CRC-32C, in hardware where the CPU has it), crc32 (zlib's), or off; on: the "
                             f"strongest here (default {checksum_kinds.DEFAULT})")
    parser.add_argument("--flush-denormal", choices=("on", "off"), default=_env(env, "FLUSH_DENORMAL", "off"),
                        help="CPU arithmetic treats denormal floats as zero, as torch.set_flush_denormal(True) "
                             "does in one process: long CPU runs whose optimizer state decays toward zero "
                             "stay fast; results may differ in the smallest values (default off)")
    parser.add_argument("--simulate-compute-ms", type=float, default=_env(env, "SIMULATE_COMPUTE_MS", "0"),
                        help="add this much time to each pipelined forward and backward "
                             "(benchmarks: it stands for GPU work)")
    parser.add_argument("--memory", type=_size, default=_env(env, "MEMORY", "0"),
                        help="bytes a stage on this shard may use, e.g. 12G or 512M (default: the device's memory, "
                             "a GPU's or the host's); deploy refuses a split that does not fit")
    parser.add_argument("--virtual-stages", type=_virtual_stages, default=_env(env, "VIRTUAL_STAGES", "1"),
                        help="serve this many shards on one device, each holding a stage (the interleaved "
                             "schedule's stages per device); with a fixed --bind port they take it and the ports "
                             "after it (default 1)")
    parser.add_argument("--checkpoint-dir", default=_env(env, "CHECKPOINT_DIR"),
                        help="the directory (a shared filesystem, for several hosts) under which this shard writes "
                             "and reads its stage's checkpoint files itself, all stages at once (default: none; "
                             "the SDK then gathers a checkpoint and writes it where the script runs)")
    parser.add_argument("--checkpoint-group", type=_group, default=_env(env, "CHECKPOINT_GROUP", "-1"),
                        metavar="GROUP", help="a group (name or id) whose members may read the checkpoints this "
                                              "shard writes: files 0640 and directories 0750 of that group "
                                              "(default: none, files 0600 and directories 0700)")
    parser.add_argument("--data-root", action="append", dest="data_roots", metavar="DIR_OR_URL",
                        default=[root for root in _env(env, "DATA_ROOTS").split(",") if root],
                        help="a directory or URL prefix (s3://bucket/train/) under which this shard reads training "
                             "data itself when a client names rows of it (DataSource); repeat for several "
                             "(SHARDTRAIN_DATA_ROOTS: comma-separated). Default: none, every such read is refused")
    add_slurm_flags(parser, env)
    add_log_flags(parser, env)
    add_security_flags(parser, env)
    add_timeout_flags(parser, env)
    return name_variables(parser)


def add_slurm_flags(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """--from-slurm and the ports it uses: a shard started by srun finds its place in SLURM's environment."""
    parser.add_argument("--from-slurm", action="store_true",
                        default=_env(env, "FROM_SLURM") in ("1", "true", "on"),
                        help="take --bind, --advertise and --device from SLURM's environment, for a shard started "
                             "by srun: listen on every interface, advertise SLURMD_NODENAME, compute on "
                             "cuda:SLURM_LOCALID (cpu without CUDA), serve metrics at --metrics-port + SLURM_LOCALID; "
                             "and, unless given, --coordinator: the first node of SLURM_JOB_NODELIST at "
                             "--coordinator-port (or SHARDTRAIN_FROM_SLURM=1)")
    parser.add_argument("--coordinator-port", type=_port, default=_env(env, "COORDINATOR_PORT", "50051"),
                        help="with --from-slurm: the coordinator's port on the job's first node (default 50051)")
    parser.add_argument("--port", type=_port, default=_env(env, "PORT", "50052"),
                        help="with --from-slurm: the port of a node's first shard; the shard with SLURM_LOCALID n "
                             "takes the port n after it (default 50052; 0: a port the OS picks for each, advertised "
                             "as bound)")


def _group(text: str) -> int:
    """A group's id from its name or id ("-1": none); one this process cannot give its files is refused."""
    if text.strip() == "-1":
        return -1
    try:
        gid = int(text) if text.strip().isdigit() else grp.getgrnam(text.strip()).gr_gid
    except KeyError:
        raise argparse.ArgumentTypeError(f"no group is called {text!r}") from None
    if os.geteuid() != 0 and gid not in {os.getegid(), *os.getgroups()}:
        raise argparse.ArgumentTypeError(f"this user is not in group {text!r}, so cannot give it its files")
    return gid


def _virtual_stages(text: str) -> int:
    if not text.strip().isdigit() or not 1 <= int(text) <= 16:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count of stages per device from 1 to 16")
    return int(text)


def _checksums(parser: argparse.ArgumentParser, value: str) -> str:
    """--checksums' kind; the parser's error for a value it does not name, or crc32c without its package."""
    try:
        return checksum_kinds.kind(value)
    except ValueError as error:
        parser.error(f"--checksums: {error}")


def shard_settings(argv: Sequence[str], env: Mapping[str, str] | None = None) -> ShardSettings:
    """Parses `shardtrain shard` flags, with environment variables as defaults."""
    parser = shard_parser(os.environ if env is None else env)
    args = parser.parse_args(list(argv))
    if args.from_slurm:
        _place_from_slurm(parser, args, os.environ if env is None else env)
    if not args.coordinator:
        parser.error("the coordinator's address is required: --coordinator HOST:PORT")
    from shardtrain.data_files import normalized_root  # imports fsspec: only for the shard's own flags
    for root in args.data_roots:
        try:
            normalized_root(root)
        except InvalidArgument as error:
            parser.error(str(error))
    return ShardSettings(coordinator=args.coordinator, bind=args.bind, advertise=args.advertise,
                         device=args.device, chunk_bytes=args.chunk_bytes, threads=args.threads,
                         parent_pid=args.parent_pid, shared_memory=args.shared_memory == "on",
                         local_links=args.local_links == "on", tcp_links=args.tcp_links == "on",
                         checksums=_checksums(parser, args.checksums),
                         flush_denormal=args.flush_denormal == "on",
                         simulate_compute=args.simulate_compute_ms / 1e3, memory_bytes=args.memory,
                         virtual_stages=args.virtual_stages,
                         checkpoint_dir=os.path.abspath(args.checkpoint_dir) if args.checkpoint_dir else "",
                         checkpoint_group=args.checkpoint_group,
                         data_roots=tuple(args.data_roots),
                         log_level=args.log_level, log_format=args.log_format,
                         metrics_port=args.metrics_port, security=security_from(args, role="shard"),
                         timeouts=timeouts_from(args))


def _place_from_slurm(parser: argparse.ArgumentParser, args: argparse.Namespace, env: Mapping[str, str]) -> None:
    """Fills the shard's coordinator, bind, advertise and device flags from SLURM's variables (--from-slurm)."""
    import torch  # here only: the other commands that parse flags need no torch

    try:
        place = slurm.shard_place(env, args.coordinator_port, args.port, torch.cuda.device_count(),
                                  ports_per_shard=args.virtual_stages, metrics_port=args.metrics_port)
    except slurm.SlurmEnvironmentError as error:
        parser.error(f"--from-slurm: {error}")
    args.coordinator = args.coordinator or place.coordinator
    args.bind, args.advertise, args.device = place.bind, place.advertise, place.device
    args.metrics_port = place.metrics_port


def coordinator_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    """The flags of `shardtrain coordinator`, with `env`'s SHARDTRAIN_* variables as defaults."""
    parser = argparse.ArgumentParser(prog="shardtrain coordinator", description="Run the coordinator.")
    parser.add_argument("--bind", default=_env(env, "BIND", "127.0.0.1:0"),
                        help="host:port to serve on (default 127.0.0.1:0: loopback, a port the OS picks)")
    parser.add_argument("--parent-pid", type=int, default=_env(env, "PARENT_PID", "0"),
                        help="exit when this process dies")
    add_log_flags(parser, env)
    add_security_flags(parser, env)
    add_timeout_flags(parser, env)
    return name_variables(parser)


def coordinator_settings(argv: Sequence[str], env: Mapping[str, str] | None = None) -> CoordinatorSettings:
    """Parses `shardtrain coordinator` flags, with environment variables as defaults."""
    parser = coordinator_parser(os.environ if env is None else env)
    args = parser.parse_args(list(argv))
    return CoordinatorSettings(bind=args.bind, parent_pid=args.parent_pid, log_level=args.log_level,
                               log_format=args.log_format, metrics_port=args.metrics_port,
                               security=security_from(args, role="shard"),
                               timeouts=timeouts_from(args))

