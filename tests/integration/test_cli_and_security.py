"""The `shardtrain` command, token authentication and TLS, through real processes."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from client_sdk import Cluster
from client_sdk.processes import LocalServices
from shardtrain import auth, errors, link_streams, rpc, wire
from shardtrain.settings import Security, security_env
from shardtrain.v1 import coordinator_pb2, shard_pb2
from tests.certificates import tls_security
from tests.integration.test_local_links import established_on, listening_ports
from tests.integration.training import (interrupted_script, largest_difference, regression_batches, train_locally,
                                        train_remotely)


def test_demo_trains_and_matches_one_process():
    done = subprocess.run(["shardtrain", "demo", "--steps", "20"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "where each layer runs:" in done.stdout
    assert "-> match" in done.stdout


def test_services_started_from_the_command_line_serve_a_client(tmp_path):
    coordinator = subprocess.Popen(["shardtrain", "coordinator", "--bind", "127.0.0.1:0"], stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, text=True)
    shard = None
    try:
        port = json.loads(coordinator.stdout.readline())["port"]
        shard = subprocess.Popen(["shardtrain", "shard", "--bind", "127.0.0.1:0"], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True,
                                 env={**__import__("os").environ, "MODEL_HOST": "127.0.0.1", "MODEL_PORT": str(port)})
        ready = json.loads(shard.stdout.readline())
        with Cluster.connect(f"127.0.0.1:{port}") as cluster:
            assert [s.address for s in cluster.shards()] == [ready["address"]]
            model = cluster.deploy(nn.Sequential(nn.Linear(2, 1)))
            assert train_remotely(model, regression_batches(steps=2, batch=2, features=2))
        assert coordinator.poll() is None and shard.poll() is None, "closing a connected client stopped services"
        with Cluster.connect(f"127.0.0.1:{port}") as again:  # and they still serve the next client
            assert len(again.shards()) == 1
        for address in (f"127.0.0.1:{port}", ready["address"]):  # Docker's HEALTHCHECK and compose use this
            probed = subprocess.run(["shardtrain", "health", address], capture_output=True, text=True, timeout=60)
            assert (probed.returncode, probed.stdout.strip()) == (0, f"{address}: SERVING"), probed.stderr
        for process in (shard, coordinator):  # docker stop, systemd, Kubernetes: a clean exit, not a kill
            process.send_signal(signal.SIGTERM)
            assert process.wait(10) == 0
        gone = subprocess.run(["shardtrain", "health", ready["address"], "--timeout", "2"], capture_output=True,
                              text=True, timeout=60)
        assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr, gone.stdout + gone.stderr
    finally:
        for process in (shard, coordinator):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(10)


@pytest.mark.parametrize("given", ["not an address\n", ""])
def test_a_shard_told_to_read_the_coordinator_from_stdin_refuses_what_is_not_an_address(given):
    """`--coordinator -` (how Cluster.local starts its shards alongside the coordinator): a first line that is not
    HOST:PORT, or none at all, ends the shard with a message saying what it expected."""
    shard = subprocess.run(["shardtrain", "shard", "--coordinator", "-", "--bind", "127.0.0.1:0"], input=given,
                           capture_output=True, text=True, timeout=120)
    assert shard.returncode == 1 and shard.stdout == "", shard.stdout + shard.stderr
    assert "--coordinator -: standard input's first line must be the coordinator's HOST:PORT" in shard.stderr
    assert repr(given.strip()) in shard.stderr


def test_a_shard_waiting_for_the_coordinator_on_stdin_stops_when_asked():
    shard = subprocess.Popen(["shardtrain", "shard", "--coordinator", "-", "--bind", "127.0.0.1:0"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120  # it serves before it reads the address
        while not listening_ports(shard.pid):
            assert time.monotonic() < deadline and shard.poll() is None, "the shard never listened"
            time.sleep(0.05)
        shard.send_signal(signal.SIGTERM)
        assert shard.wait(60) == 0  # no thread left blocked reading the pipe, which stays open: it would never end
    finally:
        if shard.poll() is None:
            shard.kill()
            shard.wait()


def test_wrong_or_missing_token_is_unauthenticated():
    with Cluster.local(num_shards=1, security=Security(token="s3cret")) as cluster:
        model = cluster.deploy(nn.Sequential(nn.Linear(2, 1)))
        train_remotely(model, regression_batches(steps=1, batch=2, features=2))
        for token in ("", "wrong"):
            with pytest.raises(errors.Unauthenticated, match="auth token"):
                Cluster.connect(cluster.address, security=Security(token=token))


def test_a_local_cluster_is_never_open_to_callers_without_its_token():
    with Cluster.local(num_shards=1) as cluster:
        token = cluster.security.token
        assert len(token) >= 32
        with pytest.raises(errors.Unauthenticated, match="auth token"):
            Cluster.connect(cluster.address, security=Security())
        with Cluster.connect(cluster.address, security=cluster.security) as other:
            shard = other.shards()[0].address
            assert [s.address for s in other.shards()] == cluster._services.shard_addresses
        for pid in cluster._services.pids:  # the token travels in the environment, never on a command line
            assert token not in open(f"/proc/{pid}/cmdline").read()
        stranger = subprocess.run([sys.executable, "-c", STRANGER, shard], capture_output=True, text=True,
                                  timeout=60, env=without_shardtrain_variables())
        assert stranger.returncode != 0 and "Unauthenticated" in stranger.stderr, stranger.stderr[-500:]


STRANGER = """
import asyncio, sys
from shardtrain import rpc
from shardtrain.settings import Security
from shardtrain.v1 import coordinator_pb2, shard_pb2
from shardtrain.v1 import shard_pb2

async def describe():
    peer = rpc.Peer("shard", sys.argv[1], rpc.SHARD_SERVICE, Security(), 10)
    await peer.call("Describe", shard_pb2.DescribeRequest())

asyncio.run(describe())
"""


def without_shardtrain_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SHARDTRAIN_")}


def serve_briefly(*flags: str) -> subprocess.CompletedProcess:
    """Runs `shardtrain coordinator` with `flags` until it is ready or exits; stops it if it started."""
    process = subprocess.Popen(["shardtrain", "coordinator", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=without_shardtrain_variables())
    ready = process.stdout.readline()
    process.terminate()
    _, stderr = process.communicate(timeout=30)
    return subprocess.CompletedProcess(process.args, process.returncode, ready, stderr)


def test_a_service_without_a_token_refuses_to_listen_beyond_loopback():
    refused = serve_briefly("--bind", "0.0.0.0:0")
    assert '"ready"' not in refused.stdout and "refusing to serve 0.0.0.0:0 without a token" in refused.stderr
    assert '"ready"' in serve_briefly("--bind", "0.0.0.0:0", "--allow-unauthenticated").stdout
    assert '"ready"' in serve_briefly("--bind", "127.0.0.1:0").stdout


def test_a_token_on_the_command_line_works_and_is_warned_about():
    started = serve_briefly("--bind", "0.0.0.0:0", "--auth-token", "visible-in-ps")
    assert '"ready"' in started.stdout and "--auth-token puts the token where every user" in started.stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_end_to_end(tmp_path):
    security = tls_security(tmp_path)
    with Cluster.local(num_shards=2, security=security) as cluster:
        torch.manual_seed(0)
        model = cluster.deploy(nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1)))
        losses = train_remotely(model, regression_batches(steps=3, batch=2, features=2))
        assert len(losses) == 3
        with pytest.raises(errors.Unavailable):
            Cluster.connect(cluster.address, security=Security(token="t"))  # plaintext to a TLS port


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_with_tls_the_links_between_hosts_take_tls_sockets_and_a_plaintext_opener_is_refused(tmp_path, monkeypatch):
    """Shared memory off, so no shard proves it shares a host with another, as between machines: the Link from
    stage 0 to stage 1 takes stage 1's TCP socket, a TLS socket presenting the shard's certificate, so the token
    and every tensor byte are encrypted; a plaintext opener is closed unread."""
    monkeypatch.setenv("SHARDTRAIN_SHARED_MEMORY", "off")
    security = tls_security(tmp_path)
    certificate = ssl.PEM_cert_to_DER_cert(pathlib.Path(security.tls_cert).read_text())
    batches = regression_batches(steps=4, batch=16, features=4)
    adam = (torch.optim.Adam, {"lr": 1e-2})
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
    with Cluster.local(num_shards=2, security=security) as cluster:
        model = cluster.deploy(net, optimizer=adam, num_stages=2)
        train_remotely(model, batches[:2])
        stage_1 = next(shard for shard in cluster._services.services
                       if shard.address == model.placements[1].shard_address)
        (link_port,) = set(listening_ports(stage_1.process.pid)) - {stage_1.port}  # beside its gRPC port
        presented = ssl.get_server_certificate(("127.0.0.1", link_port))  # a TLS handshake
        assert ssl.PEM_cert_to_DER_cert(presented) == certificate
        with socket.create_connection(("127.0.0.1", link_port), timeout=15) as plaintext:
            plaintext.sendall(os.urandom(16) + bytes(64))  # a token and a frame, in clear
            answer = plaintext.recv(4096)
        assert answer == b"" or answer[0] == 0x15  # closed, or a TLS alert record: nothing of a Link
        train_remotely(model, batches[2:])
        trained = model.state_dict()
    assert largest_difference(trained, train_locally(net, batches, adam)) < 1e-5


def signed_certificates(directory: pathlib.Path) -> dict[str, str]:
    """A CA, a certificate for 127.0.0.1 it signed, another for a client, and one from a stranger's own CA."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=shardtrain-test-ca")
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "stranger.key", "-out", "stranger.pem", "-days",
        "1", "-subj", "/CN=stranger")
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
            f"/CN=shardtrain-{name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            f"{name}.pem", "-days", "1", "-extfile", "san.ext")
    return {name: str(directory / name) for name in ("ca.pem", "server.pem", "server.key", "client.pem",
                                                     "client.key", "stranger.pem", "stranger.key")}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")
def test_mutual_tls_admits_callers_with_a_certificate_from_the_ca_and_no_token(tmp_path, monkeypatch):
    """--tls-client-auth on: the services ask every caller for a certificate the CA signed, and it authenticates
    them without a token (a server refuses TLS without a token otherwise). Links between hosts check it too."""
    monkeypatch.setenv("SHARDTRAIN_SHARED_MEMORY", "off")  # the links between stages take their TLS sockets
    files = signed_certificates(tmp_path)
    services = Security(tls_cert=files["server.pem"], tls_key=files["server.key"], tls_ca=files["ca.pem"],
                        tls_client_auth=True)
    refused = subprocess.run(["shardtrain", "coordinator", "--bind", "127.0.0.1:0"], capture_output=True, text=True,
                             env={**without_shardtrain_variables(), **security_env(services),
                                  "SHARDTRAIN_TLS_CLIENT_AUTH": "off"}, timeout=60)
    assert "TLS without a token authenticates nobody" in refused.stderr
    local = LocalServices(2, env=security_env(services))
    try:
        client = Security(tls_cert=files["client.pem"], tls_key=files["client.key"], tls_ca=files["ca.pem"])
        with Cluster.connect(local.coordinator_address, security=client) as cluster:
            cluster.wait_for_shards(2)
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))
            batches = regression_batches(steps=3, batch=4, features=2)
            model = cluster.deploy(net, num_stages=2)
            train_remotely(model, batches)
            stage_1 = next(shard for shard in local.services if shard.address == model.placements[1].shard_address)
            (link_port,) = set(listening_ports(stage_1.process.pid)) - {stage_1.port}
            assert established_on(stage_1.process.pid, link_port) == 1  # stage 0's link: its TLS handshake passed
            assert largest_difference(model.state_dict(),
                                      train_locally(net, batches, (torch.optim.SGD, {"lr": 0.01}))) < 1e-6
        for caller in (Security(tls_ca=files["ca.pem"]),  # no certificate
                       Security(tls_cert=files["stranger.pem"], tls_key=files["stranger.key"], tls_ca=files["ca.pem"])):
            with pytest.raises(errors.Unavailable):
                Cluster.connect(local.coordinator_address, security=caller)
    finally:
        local.stop()


def test_refused_requests_are_logged_once_with_the_code_and_the_caller_as_json_lines():
    env = {**without_shardtrain_variables(), "SHARDTRAIN_AUTH_TOKEN": "t"}
    process = subprocess.Popen(["shardtrain", "coordinator", "--bind", "127.0.0.1:0", "--log-format", "json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        address = f"127.0.0.1:{json.loads(process.stdout.readline())['port']}"

        async def refused_calls() -> None:
            for token in ("t", "wrong"):
                coordinator = rpc.Peer("coordinator", address, rpc.COORDINATOR_SERVICE, Security(token=token), 10)
                try:
                    with pytest.raises((errors.InvalidArgument, errors.Unauthenticated)):
                        await coordinator.call("Deploy", coordinator_pb2.DeployRequest())
                finally:
                    await coordinator.close()
        asyncio.run(refused_calls())
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    lines = [json.loads(line) for line in stderr.splitlines()]
    assert {"time", "level", "logger", "message"} <= set(lines[0])
    refusals = [line for line in lines if line["message"].startswith("refused")]
    assert len(refusals) == 2
    assert refusals[0]["level"] == "INFO" and "Deploy from ipv4:127.0.0.1" in refusals[0]["message"]
    assert "INVALID_ARGUMENT coordinator 127.0.0.1" in refusals[0]["message"]
    assert refusals[0]["message"].endswith("a deploy needs at least one layer")
    assert "CoordinatorService/Deploy: UNAUTHENTICATED (a wrong token)" in refusals[1]["message"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", lines[0]["time"])  # RFC 3339, UTC
    assert refusals[0]["method"] == "Deploy" and refusals[0]["code"] == "INVALID_ARGUMENT"
    assert refusals[0]["peer"].startswith("ipv4:127.0.0.1")
    assert refusals[1]["method"] == "Deploy" and refusals[1]["code"] == "UNAUTHENTICATED"


def test_a_deploy_a_recovery_and_a_stop_are_one_json_line_each_with_their_fields(tmp_path):
    logs = {name: open(tmp_path / f"{name}.log", "w+") for name in ("coordinator", "shard")}
    flags = ["--bind", "127.0.0.1:0", "--log-format", "json"]
    coordinator = subprocess.Popen(["shardtrain", "coordinator", *flags], stdout=subprocess.PIPE,
                                   stderr=logs["coordinator"], text=True, env=without_shardtrain_variables())
    shard = None
    try:
        address = f"127.0.0.1:{json.loads(coordinator.stdout.readline())['port']}"
        shard = subprocess.Popen(["shardtrain", "shard", *flags, "--coordinator", address], stdout=subprocess.PIPE,
                                 stderr=logs["shard"], text=True, env=without_shardtrain_variables())
        json.loads(shard.stdout.readline())
        with Cluster.connect(address) as cluster:
            model = cluster.deploy(nn.Sequential(nn.Linear(2, 1)))
            train_remotely(model, regression_batches(steps=2, batch=2, features=2))
            stage, deployment = model._clients.stages[0], model._clients.deployment_id
            cluster._io.run(stage.call("Snapshot", shard_pb2.SnapshotRequest(deployment_id=deployment, name="s")))
            cluster._io.run(stage.call("RestoreStage", shard_pb2.RestoreStageRequest(
                deployment_id=deployment, snapshot="s", source_deployment_secret=model._clients.secret)))
        for process in (shard, coordinator):
            process.send_signal(signal.SIGTERM)
            assert process.wait(30) == 0
    finally:
        for process in (shard, coordinator):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(10)
    lines = {}
    for name, log in logs.items():
        log.seek(0)
        lines[name] = [json.loads(line) for line in log.read().splitlines()]
        log.close()

    def one(service: str, start: str) -> dict:
        found = [line for line in lines[service] if line["message"].startswith(start)]
        assert len(found) == 1 and found[0]["level"] == "INFO", (service, start, lines[service])
        return found[0]
    assert one("coordinator", "deployed ")["deployment"] == deployment
    loaded = one("shard", "loaded stage 0 ")
    assert (loaded["deployment"], loaded["stage"], loaded["logger"]) == (deployment, 0, "shardtrain.shard")
    restored = one("shard", "restored stage 0 ")
    assert (restored["deployment"], restored["stage"], restored["step"]) == (deployment, 0, 2)
    for service in ("coordinator", "shard"):
        assert one(service, "stopped")["message"] == "stopped: SIGTERM"
        assert lines[service][-1]["message"] == "stopped: SIGTERM", "the last line says why it stopped"


def test_entry_point_lists_its_commands_and_its_version():
    version = subprocess.run(["shardtrain", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("shardtrain 0.")
    done = subprocess.run([sys.executable, "-m", "shardtrain.cli"], capture_output=True, text=True)
    assert done.returncode == 2
    assert all(name in done.stderr for name in ("coordinator", "shard", "demo"))


ORPHAN_SCRIPT = """
import json, sys
from client_sdk import Cluster
cluster = Cluster.local(num_shards=2)
print(json.dumps([cluster._services.pids, str(cluster._services.log_dir)]), flush=True)
sys.stdin.read()
"""


def test_services_die_with_the_client_that_started_them(tmp_path):
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN_SCRIPT)
    client = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    pids, logs = json.loads(client.stdout.readline())
    client.kill()  # no chance to clean up (its logs stay; removed below)
    client.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.2)
    shutil.rmtree(logs, ignore_errors=True)
    assert not [pid for pid in pids if alive(pid)], "services outlived the client that started them"


INTERRUPTED_SCRIPT = """
import json
import torch
from torch import nn
from client_sdk import Cluster
with Cluster.local(num_shards=2) as cluster:
    torch.manual_seed(0)
    model = cluster.deploy(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)))
    x, y = torch.randn(256, 64), torch.randn(256, 1)
    print("training", flush=True)
    steps = 0
    try:
        while True:  # until Ctrl-C
            nn.functional.mse_loss(model(x), y).backward()
            model.step()
            model.zero_grad()
            steps += 1
    except KeyboardInterrupt:
        pass
    state = model.state_dict()  # the services outlived the interrupt, weights and all
    nn.functional.mse_loss(model(x), y).backward()
    model.step()
    print(json.dumps({"steps": steps, "keys": sorted(state), "pids": cluster._services.pids}), flush=True)
"""


def test_ctrl_c_interrupts_the_call_and_leaves_the_local_services_and_their_weights(tmp_path):
    """Ctrl-C in a terminal (and a notebook's interrupt) signals the script's whole process group."""
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED_SCRIPT)
    result = json.loads(interrupted_script(script).strip().splitlines()[-1])
    assert result["steps"] > 0 and result["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
    deadline = time.monotonic() + 30  # and they still end with the script
    while time.monotonic() < deadline and any(alive(pid) for pid in result["pids"]):
        time.sleep(0.2)
    assert not [pid for pid in result["pids"] if alive(pid)]


def alive(pid: int) -> bool:
    """True while `pid` runs (zombies count as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_role_tokens_keep_clients_shards_and_readers_to_their_own_calls():
    roles = Security(token="client-token", shard_token="shard-token", reader_token="reader-token")
    with Cluster.local(num_shards=2, security=roles) as cluster:
        torch.manual_seed(0)
        model = cluster.deploy(nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1)))  # shards load stages
        assert len(train_remotely(model, regression_batches(steps=2, batch=2, features=2))) == 2
        with pytest.raises(errors.PermissionDenied, match="RegisterShard: the client token may not call this"):
            rogue = coordinator_pb2.RegisterShardRequest(address="127.0.0.1:1", device="cpu")
            cluster._io.run(cluster._coordinator.call("RegisterShard", rogue))
        with Cluster.connect(cluster.address, security=Security(token="reader-token", role="reader")) as reader:
            assert len(reader.shards()) == 2
            with pytest.raises(errors.PermissionDenied, match="Deploy: the reader token may not call this"):
                reader.deploy(nn.Sequential(nn.Linear(2, 1)))
        with Cluster.connect(cluster.address, security=Security(token="shard-token", role="shard")) as posing:
            with pytest.raises(errors.PermissionDenied, match="Deploy: the shard token may not call this"):
                posing.deploy(nn.Sequential(nn.Linear(2, 1)))
        assert len(train_remotely(model, regression_batches(steps=1, batch=2, features=2))) == 1
        broken = model._io.run(open_stage_link(model.placements[1].shard_address, model.deployment_id, roles))
        assert isinstance(broken, errors.PermissionDenied) and "takes the shard role's token" in str(broken)
        with Cluster.connect(cluster.address, security=roles) as other:  # the client token, not the deployment's
            for take_over in (False, True):  # the operator's way out needs the shard role, which the client's lacks
                with pytest.raises(errors.PermissionDenied, match="whose client is still attached"):
                    other.deploy(nn.Sequential(nn.Linear(2, 1)), take_over=take_over)
        tied = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
        tied[2].weight = tied[0].weight  # the stages swap its gradients on a link of their own, as shards
        model = cluster.deploy(tied, num_stages=2)
        train_remotely(model, regression_batches(steps=2, batch=2, features=2, outputs=2))
        state = model.state_dict()
        assert torch.equal(state["0.weight"], state["2.weight"])


def test_only_the_owner_replaces_a_deployment_its_client_still_uses_or_an_operator_who_takes_it_over(own_cluster):
    net = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
    owner = own_cluster.deploy(net, num_stages=2)
    batches = regression_batches(steps=2, batch=4, features=2)
    assert len(train_remotely(owner, batches)) == 2  # its links are open: the client is attached
    with Cluster.connect(own_cluster.address, own_cluster.security) as other:
        with pytest.raises(errors.PermissionDenied, match=r"shard-\d at 127.0.0.1:\d+ holds deployment "
                                                          rf"{owner.deployment_id}, whose client is still attached"):
            other.deploy(nn.Sequential(nn.Linear(2, 1)))
        with pytest.raises(errors.PermissionDenied, match="whose client is still attached"):  # before measuring
            other.deploy(nn.Sequential(nn.Linear(2, 1), nn.Linear(1, 1)), balance="time")
        assert len(train_remotely(owner, batches)) == 2  # untouched
        owner = own_cluster.deploy(net, num_stages=2)  # its own client replaces it, with its secret
        assert len(train_remotely(owner, batches)) == 2
        taken = other.deploy(nn.Sequential(nn.Linear(2, 1)), take_over=True)  # one token: every role, the operator's
        assert len(train_remotely(taken, batches)) == 2
        with pytest.raises(errors.PermissionDenied, match=f"holds deployment {taken.deployment_id}, whose client"):
            own_cluster.deploy(net, num_stages=2)
    # The other client closed, and its links with it: its deployment is free to replace.
    again = own_cluster.deploy(net, num_stages=2)
    assert len(train_remotely(again, batches)) == 2


async def open_stage_link(address: str, deployment_id: str, security: Security,
                          role: int = shard_pb2.LINK_ROLE_NEXT) -> Exception:
    """What a client hears when it opens a link into a stage: posing as stage 0 (a NEXT link), or as the SDK."""
    peer = rpc.Peer("stage", address, rpc.SHARD_SERVICE, security, timeout=10)
    ended = asyncio.get_running_loop().create_future()
    opening = shard_pb2.LinkOpen(deployment_id=deployment_id, role=role,
                                 from_stage=0 if role == shard_pb2.LINK_ROLE_NEXT else -1)
    client = link_streams.ClientLink(peer, opening, lambda *item: None,
                                     lambda _, error: ended.done() or ended.set_result(error))
    try:
        return await asyncio.wait_for(ended, 10)
    finally:
        await client.close()
        await peer.close()


def test_a_deployment_is_its_owners_even_for_holders_of_the_same_token(cluster4):
    """Another client with the cluster's token, but not the deployment's secret, can neither read nor change the
    weights nor open a link into it; the owner trains on unharmed."""
    torch.manual_seed(0)
    model = cluster4.deploy(nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1)), num_stages=2)
    before = model.state_dict()

    async def intrude(address: str) -> list:
        peer = rpc.Peer("stage 0", address, rpc.SHARD_SERVICE, cluster4.security, timeout=10)
        read = shard_pb2.ReadStateRequest(deployment_id=model.deployment_id)
        header = shard_pb2.LoadStateHeader(deployment_id=model.deployment_id)
        zeros = {key: torch.zeros_like(value) for key, value in before.items() if key.startswith("0.")}
        # A stage of its own under the owner's deployment id (then its zeros would load), or a measurement:
        # only the coordinator the shard registered with may ask either, whatever token the caller holds.
        replace = shard_pb2.LoadStageRequest(deployment_id=model.deployment_id, deployment_secret="mine",
                                             plan=shard_pb2.StagePlan(stage=0, num_stages=1),
                                             optimizer=shard_pb2.OptimizerSpec(name="SGD"))
        outcomes = []
        for attempt in (lambda: wire.collect(peer.stream("ReadState", read)),
                        lambda: peer.call("LoadState", wire.framed(shard_pb2.LoadStateRequest, header, zeros)),
                        lambda: peer.call("LoadStage", replace),
                        lambda: peer.call("ProfileLayers", shard_pb2.ProfileLayersRequest()),
                        lambda: peer.call("LoadState", wire.framed(shard_pb2.LoadStateRequest, header, zeros),
                                          metadata=auth.with_deployment(peer.metadata, "mine"))):
            try:
                await attempt()
                outcomes.append(None)
            except errors.ShardtrainError as error:
                outcomes.append(error)
        await peer.close()
        return outcomes

    outcomes = model._io.run(intrude(model.placements[0].shard_address))
    assert all(isinstance(error, errors.PermissionDenied) for error in outcomes), outcomes
    assert ["shardtrain-deployment" in str(error) for error in outcomes] == [True, True, False, False, True]
    assert all("comes only from the coordinator this shard registered with" in str(error) for error in outcomes[2:4])
    opened = model._io.run(open_stage_link(model.placements[0].shard_address, model.deployment_id, cluster4.security,
                                           shard_pb2.LINK_ROLE_INPUT))
    assert isinstance(opened, errors.PermissionDenied), opened
    assert largest_difference(model.state_dict(), before) == 0
    assert len(train_remotely(model, regression_batches(steps=2, batch=4, features=2))) == 2

